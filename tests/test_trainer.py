"""Trainer internals on CPU, in-process: config, mask, fused loss, data, replicas and reproducibility."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.config import ConfigError, build_config, tap_layers
from trainer.data import build_source
from trainer.flops import flops_per_sample
from trainer.metrics import MetricLog
from trainer.model import BlockLayout, FusedHeadCrossEntropy, dense_mask
from trainer.pipeline import EXIT_OK, ThreadedRun


def test_taps_spread_over_one_to_l_minus_three():
    assert tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert tap_layers(6, 2) == [1, 3]


def test_presets_have_the_documented_shapes():
    qwen = build_config("qwen3-8b-shape", [])
    assert (qwen.target.layers, qwen.target.hidden, qwen.target.intermediate) == (36, 4096, 12288)
    assert (qwen.target.heads, qwen.target.kv_heads, qwen.target.vocab_size) == (32, 8, 151936)
    assert qwen.drafter.layers == 5 and qwen.run.dtype == "bf16"
    assert qwen.drafter.loss_chunk == 4096  # the head's 2 x 7,680 rows in 4 chunks (issue 16, ~2% of the head)
    # counted like docs/design.md, "Throughput facts": ~100 TFLOP a 2048-token sample (34 of 36 target layers run)
    assert 95e12 < flops_per_sample(qwen)["total"] < 101e12


@pytest.mark.parametrize(
    "assignment, words",
    [("run.steps=ten", ["run.steps", "an integer"]), ("drafter.attention=fast", ["drafter.attention", "flex"]),
     ("run.nosuch=1", ["run.nosuch", "unknown key"]), ("steps=5", ["section.key=value"]),
     ("run.compile=turbo", ["run.compile", "nographs"])],
)
def test_bad_override_names_key_and_expected_form(assignment, words):
    with pytest.raises(ConfigError) as err:
        build_config("tiny-cpu", [assignment])
    assert all(word in str(err.value) for word in words)


@pytest.mark.parametrize("preset", ["tiny-cpu", "h200-small", "qwen3-8b-shape", "h200-8x"])
def test_procsplit_runs_one_drafter_rank_per_gpu_unless_told(preset):
    threads = build_config(preset, [])
    procsplit = build_config(preset, ["run.topology=procsplit"])
    assert procsplit.run.drafter_devices == list(dict.fromkeys(threads.run.drafter_devices))
    assert len(set(procsplit.run.drafter_devices)) == len(procsplit.run.drafter_devices)
    # asked for explicitly, two ranks on one device stay two
    assert build_config(preset, ["run.topology=procsplit", "run.drafters=cpu,cpu"]).run.drafters == "cpu,cpu"
    assert build_config("h200-small", []).run.drafters == "cuda:0,cuda:0"  # threads keep the preset's replicas


def test_config_hash_ignores_run_length_but_not_the_model():
    base = build_config("tiny-cpu", []).hash()
    assert build_config("tiny-cpu", ["run.steps=999"]).hash() == base
    assert build_config("tiny-cpu", ["drafter.layers=3"]).hash() != base
    # the head's row chunking is not the model: a qwen3-8b-shape checkpoint from before its loss_chunk 4096
    # (written at 1024, config 1a4c23fee716) resumes under the preset
    assert build_config("tiny-cpu", ["drafter.loss_chunk=4096"]).hash() == base
    qwen = build_config("qwen3-8b-shape", [])
    assert qwen.hash() == build_config("qwen3-8b-shape", ["drafter.loss_chunk=1024"]).hash() == "1a4c23fee716"


def test_block_sees_context_before_its_anchor_and_its_own_block_only():
    layout = BlockLayout(torch.tensor([[3, 10]]), block_size=4, context_len=16)
    mask = dense_mask(layout)[0, 0]  # (A*B, T+A*B)
    first_block_query, second_block_query = mask[1], mask[4]
    assert first_block_query[:16].nonzero().flatten().tolist() == [0, 1, 2]
    assert first_block_query[16:].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert second_block_query[:16].nonzero().flatten().tolist() == list(range(10))
    assert second_block_query[16:].nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_fused_head_loss_matches_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    weight, labels = torch.randn(20, 8, dtype=torch.float64), torch.randint(0, 20, (10,))
    row_weights = torch.rand(10, dtype=torch.float64)
    row_weights = row_weights / row_weights.sum()
    loss, argmax = FusedHeadCrossEntropy.apply(hidden, weight, labels, row_weights, 3)
    logits = hidden @ weight.t()
    reference = (F.cross_entropy(logits, labels, reduction="none") * row_weights).sum()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.equal(argmax, logits.argmax(-1))
    (grad,) = torch.autograd.grad(loss, hidden)
    (grad_ref,) = torch.autograd.grad(reference, hidden)
    assert torch.allclose(grad, grad_ref, atol=1e-6)


def test_fused_head_loss_in_bf16_keeps_the_gradient_close_to_the_exact_one():
    """The trainer runs the head in bf16: its input gradient must stay close to the exact (fp64) one, the
    label's -1 included (a row whose label holds most of the probability is where an error in that term
    would show). The probabilities go into the matmul in bf16 (8 significant bits), as they always did: on
    these shapes that alone puts the largest error at 0.5-4.6% of the largest gradient entry (seeds 0-4),
    with the label's term subtracted inside the probabilities or after the matmul alike."""
    torch.manual_seed(1)
    hidden = torch.randn(64, 32, dtype=torch.float64)
    weight, labels = torch.randn(500, 32, dtype=torch.float64), torch.randint(0, 500, (64,))
    weight[labels[:8]] += 3 * hidden[:8]  # rows whose label is the confident prediction
    row_weights = torch.rand(64, dtype=torch.float64)
    row_weights = row_weights / row_weights.sum()
    hidden_bf16, weight_bf16 = hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16)
    loss, _ = FusedHeadCrossEntropy.apply(hidden_bf16, weight_bf16, labels, row_weights.float(), 16)
    (grad,) = torch.autograd.grad(loss, hidden_bf16)
    exact = hidden_bf16.detach().double().requires_grad_()
    reference = (F.cross_entropy(exact @ weight_bf16.double().t(), labels, reduction="none") * row_weights).sum()
    (grad_ref,) = torch.autograd.grad(reference, exact)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-3)
    error = (grad.double() - grad_ref).abs().max() / grad_ref.abs().max()
    assert error < 0.05


def test_synthetic_data_is_a_function_of_seed_step_and_stream():
    cfg = build_config("tiny-cpu", [])
    source = build_source(cfg)
    tokens, anchors = source.batch(5, 1)
    assert torch.equal(tokens, source.batch(5, 1)[0]) and not torch.equal(tokens, source.batch(6, 1)[0])
    assert tokens.max() < cfg.target.vocab_size - 1  # the last id is MASK
    assert (anchors.diff(dim=1) > 0).all() and anchors.max() <= cfg.data.seq_len - cfg.drafter.block_size


def test_bin_source_reads_windows_of_a_uint16_token_file(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).__mod__(50).astype(np.uint16).tofile(path)
    cfg = build_config("tiny-cpu", ["data.source=bin", f"data.path={path}"])
    tokens, _ = build_source(cfg).batch(0, 0)
    assert tokens.shape == (1, cfg.data.seq_len)
    assert ((tokens[0, 1:] - tokens[0, :-1]) % 50 == 1).all()  # consecutive file contents


def train_in_process(tmp_path, *overrides: str) -> ThreadedRun:
    cfg = build_config("tiny-cpu", ["run.drafters=cpu,cpu", "run.steps=12", "run.log_every=4", *overrides])
    run = ThreadedRun(cfg, build_source(cfg), MetricLog(io.StringIO()), tmp_path, resume=False)
    run.start()
    assert run.wait() == EXIT_OK
    return run


def weights(run: ThreadedRun, replica: int) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.replicas[replica].drafter.parameters()]


def test_two_drafter_threads_stay_bit_identical(tmp_path):
    run = train_in_process(tmp_path)
    first, second = weights(run, 0), weights(run, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    initial = train_in_process(tmp_path / "short", "run.steps=1")
    assert not all(torch.equal(a, b) for a, b in zip(first, weights(initial, 0)))  # they did train


def test_seeded_runs_reproduce_and_seeds_differ(tmp_path):
    first = weights(train_in_process(tmp_path / "a"), 0)
    again = weights(train_in_process(tmp_path / "b"), 0)
    other = weights(train_in_process(tmp_path / "c", "run.seed=7"), 0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_a_local_hugging_face_target_gives_the_tapped_features(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainer.model import build_target

    hf_config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "llama")
    cfg = build_config("tiny-cpu", [f"target.hf_path={tmp_path / 'llama'}"])
    features = build_target(cfg).features(torch.zeros(1, 16, dtype=torch.int64))
    assert features.shape == (1, 16, cfg.drafter.taps * 64)
    with pytest.raises(ConfigError, match="target.vocab_size: expected 64"):
        build_target(build_config("tiny-cpu", [f"target.hf_path={tmp_path / 'llama'}", "target.vocab_size=100"]))


def test_jsonl_text_is_tokenized_with_a_local_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "the", "cat", "sat", "on", "mat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(tmp_path / "tok")
    (tmp_path / "text.jsonl").write_text("\n".join('{"text": "the cat sat on the mat"}' for _ in range(40)))
    cfg = build_config("tiny-cpu", ["data.source=jsonl", f"data.path={tmp_path / 'text.jsonl'}",
                                    f"data.tokenizer={tmp_path / 'tok'}", "data.seq_len=70", "drafter.anchors=8"])
    tokens, _ = build_source(cfg).batch(0, 0)
    text = [words[i] for i in tokens[0].tolist()]
    start = text.index("<eos>") + 1
    assert text[start : start + 7] == ["the", "cat", "sat", "on", "the", "mat", "<eos>"]

"""Regional compilation on CPU: drafter.compile_scope=layers and target.compile=layers compute what the
uncompiled model computes, compile identical layers once (the point: the compile time of one layer, not
of all of them), and are named on the run's start line."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from trainer.compile import compile_target
from trainer.config import ConfigError, apply_override, preset
from trainer.data import build_source
from trainer.model import build_target
from trainer.replica import build_replica, forward_backward, seeded_drafter
from trainer_helpers import run_trainer


def tiny(*overrides: str):
    cfg = preset("tiny-cpu")
    for assignment in ("drafter.layers=3", *overrides):
        apply_override(cfg, assignment)
    return cfg.validate()


def one_step(cfg) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one training forward/backward on a fixed batch."""
    target = build_target(cfg)
    tokens, anchors = build_source(cfg).batch(0, 0)
    replica = build_replica(cfg, 0, "cpu", seeded_drafter(cfg, "cpu"), target.embed, target.lm_head)
    forward_backward(cfg, replica, tokens, target.features(tokens), anchors)
    grads = {name: p.grad.clone() for name, p in replica.drafter.named_parameters()}
    return float(replica.stats[0]), grads


def compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graphs_of_one_step(*overrides: str) -> tuple[int, float, dict[str, torch.Tensor]]:
    """The graphs one training step compiles from scratch, and that step's loss and gradients."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loss, grads = one_step(tiny(*overrides))
    return compiled_graphs(), loss, grads


def assert_matches_eager(loss: float, grads: dict[str, torch.Tensor], *overrides: str) -> None:
    """`loss` and `grads` are those of the uncompiled model of `overrides` (one step, same batch)."""
    eager_loss, eager_grads = one_step(tiny("run.compile=eager", *overrides))
    assert loss == pytest.approx(eager_loss, rel=1e-4)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


# Each test compares with eager the step of the compile whose graphs it counts (five drafter layers): a third
# compile for the comparison alone cost ~3.5 s of CPU a test (issue 30).
def test_layers_scope_matches_eager_and_compiles_one_graph_per_kind_of_region():
    # the layers share their graphs (the first layer's input needs no gradient: a second graph), so the
    # count does not grow with the layers
    two, *_ = graphs_of_one_step("run.compile=nographs", "drafter.compile_scope=layers", "drafter.layers=2")
    five, loss, grads = graphs_of_one_step("run.compile=nographs", "drafter.compile_scope=layers", "drafter.layers=5")
    assert two == five == 3
    assert_matches_eager(loss, grads, "drafter.layers=5")


def test_layers_scope_without_trees_gives_each_layer_a_graph_of_its_own():
    """CUDA graphs without trees replay with the parameters they were recorded with: layers sharing one
    graph failed on the H200 (`assert dst.data_ptr() == src.data_ptr()` at the second layer), so under
    notrees each region gets its own graph (on CPU the graphs are compiled, not captured)."""
    two, *_ = graphs_of_one_step("run.compile=notrees", "drafter.compile_scope=layers", "drafter.layers=2")
    five, loss, grads = graphs_of_one_step("run.compile=notrees", "drafter.compile_scope=layers", "drafter.layers=5")
    assert (two, five) == (3, 6)  # one per layer, and the head loss
    assert_matches_eager(loss, grads, "drafter.layers=5")


def test_target_layers_compile_matches_eager_features_with_one_graph():
    cfg = tiny("target.compile=layers")
    tokens, _ = build_source(cfg).batch(0, 0)
    target = build_target(cfg)
    expected = target.features(tokens)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_target(cfg.target.compile, target)
    torch.testing.assert_close(target.features(tokens), expected, rtol=1e-4, atol=1e-5)
    assert compiled_graphs() == 1  # every target layer runs the one compiled graph


def test_unknown_scope_names_the_choices():
    with pytest.raises(ConfigError, match=r"drafter.compile_scope: expected whole\|layers"):
        tiny("drafter.compile_scope=regional")
    with pytest.raises(ConfigError, match=r"target.compile: expected off\|layers"):
        tiny("target.compile=on")


@pytest.mark.slow
@pytest.mark.parametrize("topology,variant", [("threads", "nographs"), ("procsplit", "nographs"),
                                              ("threads", "notrees")])
def test_run_with_both_scopes_trains_and_says_so_on_its_start_line(tmp_path, topology, variant):
    """Two replicas: in-process averaging (threads) or DistributedDataParallel over gloo (procsplit) around
    layers compiled as regions (under notrees, each fed from buffers of its own); the replicas end
    bit-identical."""
    result = run_trainer(tmp_path, "regional", "--variant", variant, "--topology", topology, "--steps", "40",
                         "--log-every", "10", "--set", "run.drafters=cpu,cpu", "--set", "drafter.compile_scope=layers",
                         "--set", "target.compile=layers", timeout=300)
    assert result.code == 0, result.stderr[-2000:]
    settings = result.events("start")[0].fields["compile_settings"]
    assert "scope=layers" in settings and "target.compile=layers" in settings
    losses = [s.loss for s in result.steps]
    assert losses[-1] < 0.5 * losses[0]
    assert result.events("done")[0].fields["replicas"] == "identical"

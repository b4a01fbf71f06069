"""Trainer configuration: one dataclass per concern, the presets, `--set key=value` overrides and the hash.

Every field has a docstring; cross-field checks live in `__post_init__`/`Config.validate`. A bad value
raises ConfigError whose message names the dotted key and the expected form (the CLI turns it into exit 2).
This module imports no torch, so `python -m trainer --help` and config errors stay fast.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field

COMPILE_STRATEGIES = ("eager", "nographs", "notrees", "trees", "localtls")
TOPOLOGIES = ("threads", "procsplit")


class ConfigError(ValueError):
    """A config value the trainer cannot use; the message names the key and the expected form."""


@dataclass
class TargetConfig:
    """The frozen target LM (built-in Llama-style decoder unless `hf_path` is set)."""

    vocab_size: int = 64
    """Vocabulary size (also the drafter's output size, since the drafter reuses the target's lm_head)."""
    hidden: int = 64
    """Model width H."""
    layers: int = 6
    """Number of decoder layers L."""
    intermediate: int = 192
    """SwiGLU inner width."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (GQA: heads must be a multiple)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (Qwen3 style)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    init_std: float = 0.02
    """Std of the seeded random init of the built-in target's embedding and lm_head (other weights 0.02)."""
    hf_path: str = ""
    """Local path of a Hugging Face causal LM to use instead of the built-in target (no hub downloads)."""
    compile: str = "off"
    """off | layers: torch.compile (no CUDA graphs) on each built-in target layer; identical layers share
    one compiled graph. Not applied to a Hugging Face target."""

    def __post_init__(self) -> None:
        _require(self.heads % self.kv_heads == 0, "target.kv_heads", "a divisor of target.heads")
        _require(self.hidden % self.heads == 0, "target.heads", "a divisor of target.hidden")
        _require(self.layers >= 4, "target.layers", "an integer >= 4")
        _require(self.compile in ("off", "layers"), "target.compile", "off|layers")


@dataclass
class DrafterConfig:
    """The DFlash-style block drafter."""

    layers: int = 2
    """Number of drafter decoder layers."""
    taps: int = 2
    """K: number of target layers whose hidden states feed the drafter (spread over 1..L-3)."""
    block_size: int = 16
    """B: tokens per block (anchor + B-1 predicted positions)."""
    anchors: int = 32
    """Blocks trained per sequence in one pass."""
    gamma: float = 7.0
    """Loss weight of position k is exp(-(k-1)/gamma)."""
    attention: str = "auto"
    """auto (flex when compiled on CUDA, else sdpa) | flex (FlexAttention BlockMask) | sdpa (dense mask)."""
    loss_chunk: int = 1024
    """Rows of the vocab head computed at once in the fused head + cross-entropy (bounds fp32 logits)."""
    compile_scope: str = "whole"
    """What run.compile compiles: whole (the training forward in one graph, the mask built inside it) |
    layers (each drafter layer and the head loss on their own; identical layers share one compiled graph,
    and the mask is built outside them)."""

    def __post_init__(self) -> None:
        _require(self.block_size >= 2, "drafter.block_size", "an integer >= 2")
        _require(self.attention in ("auto", "flex", "sdpa"), "drafter.attention", "auto|flex|sdpa")
        _require(self.gamma > 0, "drafter.gamma", "a positive number")
        _require(self.compile_scope in ("whole", "layers"), "drafter.compile_scope", "whole|layers")


@dataclass
class DataConfig:
    """Where token sequences come from."""

    source: str = "synthetic"
    """synthetic (seeded learnable Markov chain) | bin (nanoGPT-style uint16 token file) | jsonl (text)."""
    path: str = ""
    """Token file (.bin) or jsonl file for source bin/jsonl."""
    tokenizer: str = ""
    """Local tokenizer directory (transformers AutoTokenizer) for source jsonl."""
    text_key: str = "text"
    """jsonl field holding the text."""
    seq_len: int = 128
    """Tokens per sample T."""
    batch: int = 1
    """Samples per drafter per step."""
    markov_stay: float = 1.0
    """Synthetic source: probability that the next token follows the chain's fixed successor."""
    markov_tokens: int = 0
    """Synthetic source: how many distinct ids the chain visits, a seeded random subset of [0, V-1) (0 = all
    of them). Over a whole 32k-152k vocabulary a sample never revisits an id, so only memorising V random
    successors predicts a block and the drafter's loss stays at ln V (issue 16); over 128 ids (the GPU
    presets) a sample repeats itself within 128 tokens. The head still scores every id (same compute)."""

    def __post_init__(self) -> None:
        _require(self.source in ("synthetic", "bin", "jsonl"), "data.source", "synthetic|bin|jsonl")
        _require(0.0 <= self.markov_stay <= 1.0, "data.markov_stay", "a number in [0, 1]")
        _require(self.markov_tokens >= 0, "data.markov_tokens", "an integer >= 0 (0 = every id)")


@dataclass
class OptimConfig:
    """AdamW on the drafter."""

    lr: float = 1e-2
    """Peak learning rate."""
    warmup_steps: int = 20
    """Linear learning-rate warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (0 = off)."""


@dataclass
class RunConfig:
    """Devices, topology, compile strategy, schedule and outputs."""

    steps: int = 200
    """Optimizer steps in total (resume continues up to this count)."""
    seed: int = 0
    """Seeds model init, data and anchor sampling."""
    dtype: str = "fp32"
    """fp32 | bf16 (bf16: target weights bf16, drafter trained under autocast with fp32 master weights)."""
    compile: str = "eager"
    """Compile strategy of the drafters: eager | nographs | notrees | trees | localtls."""
    localtls_mode: str = "share"
    """localtls only: share (hand the importing thread's tree state to workers) | fresh (new state per thread)."""
    topology: str = "threads"
    """threads (one process, worker threads) | procsplit (a process per drafter and per target)."""
    targets: str = "cpu"
    """Target devices, comma-separated: cpu | cuda:0 | cuda:0,cuda:1."""
    drafters: str = "cpu"
    """Drafter devices, comma-separated; a device may repeat (two replicas on cuda:0)."""
    queue_depth: int = 4
    """Bounded queue size between a target producer and each drafter."""
    log_every: int = 10
    """Steps between event=step lines."""
    warmup_log_steps: int = 5
    """Steps reported as phase=warmup (compilation, graph capture) and left out of steady throughput."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0 = only at the end and on SIGTERM)."""
    out: str = "runs"
    """Output directory; the run's files go to OUT/RUN_NAME/."""
    step_timeout_s: float = 600.0
    """A worker waiting longer than this for its peers or its queue stops the run (first steps compile)."""
    nnodes: int = 1
    """Nodes (hosts or containers) of one procsplit run; each node starts `python -m trainer` with its own
    node_rank and the same config. Env: NNODES."""
    node_rank: int = 0
    """This node's index, 0..nnodes-1; global rank = node_rank * (drafters per node) + local rank. Env: NODE_RANK."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host (nnodes > 1): node 0's address as the other nodes reach it. Env: MASTER_ADDR."""
    master_port: int = 29500
    """Rendezvous TCP port on master_addr (nnodes > 1): node 0's rank 0 listens on it. Env: MASTER_PORT."""
    rendezvous_timeout_s: float = 120.0
    """Every rank must have joined within this many seconds (a node that never comes, a port taken): else the
    run ends with exit 1 and an `event=error` naming the rendezvous."""

    def __post_init__(self) -> None:
        _require(self.compile in COMPILE_STRATEGIES, "run.compile", "|".join(COMPILE_STRATEGIES))
        _require(self.topology in TOPOLOGIES, "run.topology", "|".join(TOPOLOGIES))
        _require(self.dtype in ("fp32", "bf16"), "run.dtype", "fp32|bf16")
        _require(self.localtls_mode in ("share", "fresh"), "run.localtls_mode", "share|fresh")
        _require(self.queue_depth >= 1, "run.queue_depth", "an integer >= 1")
        _require(self.log_every >= 1, "run.log_every", "an integer >= 1")
        _require(self.nnodes >= 1, "run.nnodes", "an integer >= 1")
        _require(0 <= self.node_rank < self.nnodes, "run.node_rank", f"an integer in 0..{self.nnodes - 1} (run.nnodes)")
        _require(self.nnodes == 1 or self.topology == "procsplit", "run.nnodes",
                 "1 unless run.topology=procsplit (threads run on one node)")
        _require(1 <= self.master_port <= 65535, "run.master_port", "a TCP port, 1..65535")
        _require(bool(self.master_addr.strip()), "run.master_addr", "node 0's address, e.g. 10.1.2.6")
        _require(self.rendezvous_timeout_s > 0, "run.rendezvous_timeout_s", "a positive number")

    @property
    def target_devices(self) -> list[str]:
        return _device_list(self.targets)

    @property
    def drafter_devices(self) -> list[str]:
        return _device_list(self.drafters)


@dataclass
class DebugConfig:
    """Fault injection for tests (not for real runs)."""

    fail_at_step: int = -1
    """Raise RuntimeError in drafter `fail_drafter` when it starts this step (-1 = never)."""
    fail_drafter: int = 0
    """Which drafter fails at fail_at_step."""
    step_sleep_s: float = 0.0
    """Sleep this long in every drafter step (makes signal tests deterministic)."""
    fail_idle_s: float = 0.0
    """Before it raises, the failing drafter stops working for this many seconds: its GPU goes idle first
    (procsplit: the other ranks spin in the all_reduce) so a watcher can tell which GPU stopped."""


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def validate(self) -> Config:
        """Re-run every section's checks plus the cross-section ones; returns self."""
        for section in dataclasses.fields(self):
            check = getattr(getattr(self, section.name), "__post_init__", None)
            if check is not None:
                check()
        _require(self.drafter.taps <= self.target.layers - 3, "drafter.taps", "at most target.layers - 3")
        _require(
            self.data.seq_len > self.drafter.block_size, "data.seq_len", "an integer > drafter.block_size"
        )
        _require(
            self.drafter.anchors <= self.data.seq_len - self.drafter.block_size,
            "drafter.anchors",
            "at most data.seq_len - drafter.block_size",
        )
        _require(self.data.markov_tokens < self.target.vocab_size, "data.markov_tokens",
                 f"at most target.vocab_size - 1 = {self.target.vocab_size - 1} (the last id is MASK)")
        return self

    def to_dict(self) -> dict[str, typing.Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Short hash of everything that changes what is trained (not run name, output dir or logging)."""
        content = self.to_dict()
        for volatile in ("out", "log_every", "steps", "step_timeout_s", "checkpoint_every", "node_rank",
                         "master_addr", "master_port", "rendezvous_timeout_s"):
            content["run"].pop(volatile)
        if content["run"]["nnodes"] == 1:  # single-node hashes stay those written before multi-node runs
            content["run"].pop("nnodes")
        if content["data"]["markov_tokens"] == 0:  # so are those written before data.markov_tokens existed
            content["data"].pop("markov_tokens")
        content.pop("debug")
        # drafter.loss_chunk only groups the head's rows (the same loss to float rounding): hashed as its default,
        # so a checkpoint resumes across it (qwen3-8b-shape's went 1024 -> 4096, issue 16) and hashes stay
        content["drafter"]["loss_chunk"] = DrafterConfig.loss_chunk
        blob = json.dumps(content, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _require(ok: bool, key: str, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {expected}")


def _device_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def tap_layers(layers: int, taps: int) -> list[int]:
    """K layer indices spread evenly over 1..L-3 (36 layers, K=5 -> [1, 9, 17, 25, 33])."""
    first, last = 1, layers - 3
    if taps == 1:
        return [last]
    return [round(first + i * (last - first) / (taps - 1)) for i in range(taps)]


# The GPU presets' synthetic chain visits this many ids of their 32k/152k vocabularies (tiny-cpu's 64-id
# vocabulary is small enough as it is): over the whole vocabulary the drafter learnt nothing (issue 16).
LEARNABLE_CHAIN = 128


def _tiny_cpu() -> Config:
    return Config(target=TargetConfig(init_std=1.0))


def _h200_small() -> Config:
    return Config(
        target=TargetConfig(vocab_size=32000, hidden=1024, layers=12, intermediate=2816, heads=16, kv_heads=4),
        drafter=DrafterConfig(layers=1, taps=3, anchors=64),
        data=DataConfig(seq_len=512, batch=1, markov_tokens=LEARNABLE_CHAIN),
        optim=OptimConfig(lr=6e-4, warmup_steps=50),
        run=RunConfig(dtype="bf16", targets="cuda:0", drafters="cuda:0,cuda:0", log_every=20,
                      warmup_log_steps=20),
    )


def _qwen3_8b_shape() -> Config:
    return Config(
        target=TargetConfig(vocab_size=151936, hidden=4096, layers=36, intermediate=12288, heads=32,
                            kv_heads=8, qk_norm=True, rope_theta=1000000.0, compile="layers"),
        # loss_chunk 4096: the head loss of 2 x 7,680 rows in 4 chunks instead of 15, 61.1 against 62.2 ms on the
        # H200 and less memory (5.8 against 6.7 GB: fewer buffers); 8192 is no faster (60.9) and takes 7.0 GB
        # (bench/gpu_probe.py --part head-variants)
        drafter=DrafterConfig(layers=5, taps=5, anchors=512, compile_scope="layers", loss_chunk=4096),
        # two samples a step: the optimizer step (~12 ms on 1.05 B fp32 parameters) and, across GPUs, the
        # gradient all_reduce are paid once per two samples (docs/benchmarks-archive.md: 1 -> 2 GPUs 1.86x -> 1.93x)
        data=DataConfig(seq_len=2048, batch=2, markov_tokens=LEARNABLE_CHAIN),
        optim=OptimConfig(lr=6e-4, warmup_steps=50),
        run=RunConfig(dtype="bf16", targets="cuda:0", drafters="cuda:0", log_every=5, warmup_log_steps=5),
    )


def _h200_8x() -> Config:
    """qwen3-8b-shape on an 8-GPU host: targets on cuda:0-1, one drafter replica on each of cuda:2-7."""
    config = _qwen3_8b_shape()
    config.run.targets = "cuda:0,cuda:1"
    config.run.drafters = ",".join(f"cuda:{i}" for i in range(2, 8))
    return config


PRESETS: dict[str, typing.Callable[[], Config]] = {
    "tiny-cpu": _tiny_cpu,
    "h200-small": _h200_small,
    "qwen3-8b-shape": _qwen3_8b_shape,
    "h200-8x": _h200_8x,
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"--preset: expected one of {'|'.join(PRESETS)}, got {name!r}")
    return PRESETS[name]()


def apply_override(config: Config, assignment: str) -> None:
    """Apply one `section.key=value` in place; the value is parsed by the field's type."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or key.count(".") != 1:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value, e.g. run.steps=100")
    section_name, field_name = key.split(".")
    section = getattr(config, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        raise ConfigError(f"{key}: unknown section {section_name!r} (expected one of {_section_names()})")
    hints = typing.get_type_hints(type(section))
    if field_name not in hints:
        raise ConfigError(f"{key}: unknown key (expected one of {', '.join(sorted(hints))})")
    setattr(section, field_name, _parse(key, raw.strip(), hints[field_name]))


RUN_FLAGS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "compile")
"""Every run.* key is also a flag of `python -m trainer` (`--log-every 5` = `--set run.log_every=5`: what dfo
variants pass as undotted `args:`); run.compile is --variant/--compile."""


def override_keys() -> tuple[str, ...]:
    """Every key a dfo variant's `args:` (or `dfo launch --set`) may name for this trainer: the run.* flags
    undotted, and each `section.key` of the config. Read by dfo on the workstation before a launch (this
    module imports no torch)."""
    dotted = tuple(f"{section.name}.{name}" for section in dataclasses.fields(Config)
                   for name in typing.get_type_hints(section.default_factory))
    return RUN_FLAGS + dotted


def _section_names() -> str:
    return ", ".join(f.name for f in dataclasses.fields(Config))


def _parse(key: str, raw: str, kind: type) -> typing.Any:
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if kind is int:
            return int(raw)
        if kind is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(raw)
            return value
        return raw
    except ValueError:
        form = {bool: "true|false", int: "an integer", float: "a number"}[kind]
        raise ConfigError(f"{key}={raw}: expected {form}") from None


# torch.distributed's conventional variables (torchrun sets MASTER_ADDR/PORT, NODE_RANK; NNODES is ours)
NODE_ENV = {"NNODES": "run.nnodes", "NODE_RANK": "run.node_rank", "MASTER_ADDR": "run.master_addr",
            "MASTER_PORT": "run.master_port"}


def env_assignments(environ: typing.Mapping[str, str]) -> list[str]:
    """`--set` assignments from the multi-node environment variables (flags and --set given after win)."""
    return [f"{key}={environ[name]}" for name, key in NODE_ENV.items() if environ.get(name, "").strip()]


def check_world_size(config: Config, environ: typing.Mapping[str, str]) -> None:
    """WORLD_SIZE, where set, is torch's total rank count: it must be nnodes x drafters per node."""
    raw = environ.get("WORLD_SIZE", "").strip()
    if not raw:
        return
    world = config.run.nnodes * len(config.run.drafter_devices)
    if raw != str(world):
        raise ConfigError(f"WORLD_SIZE={raw}: expected {world} (run.nnodes={config.run.nnodes} x "
                          f"{len(config.run.drafter_devices)} drafters per node), or unset it")


def build_config(preset_name: str, assignments: list[str]) -> Config:
    """A preset, then each `--set`, then all checks.

    Under procsplit a preset's drafter list keeps one rank per device unless `run.drafters` is given: two
    ranks of one GPU average their gradients through gloo on the host, which halved h200-small's
    throughput on an H200 (~32k against ~60k tok/s with one rank); threads share one process, so they keep
    the preset's replicas."""
    config = copy.deepcopy(preset(preset_name))
    for assignment in assignments:
        apply_override(config, assignment)
    drafters_given = any(a.partition("=")[0].strip() == "run.drafters" for a in assignments)
    if config.run.topology == "procsplit" and not drafters_given:
        config.run.drafters = ",".join(dict.fromkeys(config.run.drafter_devices))
    return config.validate()

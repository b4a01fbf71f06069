"""The experiments file of `dfo batch`: its schema, its checks against the inventory, its expansion into cells.

    experiments file (YAML) --load_experiments--> Plan (Experiments + [Cell], deterministic ids)

A cell is one (target, variant, settings, GPU count, repeat); its id is stable across runs of the same file,
so the scheduler (batch.py) can skip finished cells. Pure: reads the file, never the store or a machine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union


from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from . import runs
from .errors import InventoryError
from .agent.protocol import read_number
from .inventory import WEEK_S, Inventory, Number, _name_problem, chain_problems, describe_validation_error
from .words import counted
from .yamlfile import load_mapping, read_yaml_file

SLUG_MAX = 40

Scalar = Union[bool, int, float, str]
MAX_GPUS = 1024  # GPUs of one target: beyond any machine
MAX_CELLS = 100_000  # runs of one batch
GpuCount = Number(ge=1, le=MAX_GPUS, integer=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StopWhen(_Strict):
    """When a cell's run has told us enough: `steady` (the watcher's verdict), after N steps, or M minutes."""

    kind: Literal["steady", "steps", "minutes"] = "steady"
    value: Optional[float] = None

    def describe(self) -> str:
        return "steady" if self.kind == "steady" else f"{self.value:g} {self.kind}"


MAX_STOP_STEPS = 10**12
MAX_STOP_MINUTES = WEEK_S / 60


def _stop_when(value: Any) -> Any:
    if isinstance(value, StopWhen) or value == "steady":
        return StopWhen() if value == "steady" else value
    if isinstance(value, dict) and len(value) == 1:
        (kind, amount), = value.items()
        steps = read_number(amount, 1, MAX_STOP_STEPS, integer=True) if kind == "steps" else None
        minutes = read_number(amount, 0, MAX_STOP_MINUTES) if kind == "minutes" else None
        if steps is not None:
            return StopWhen(kind="steps", value=steps)
        if minutes:
            return StopWhen(kind="minutes", value=minutes)
    raise ValueError(f"expected steady, {{steps: N}} or {{minutes: M}} (N an integer from 1 to {MAX_STOP_STEPS:,}, "
                     f"M a number above 0 and at most {MAX_STOP_MINUTES:g}), got {value!r:.80}")


def _fallback(value: Any) -> Any:
    return [] if value is False else value  # `fallback: false` = no fallback at all


class Concurrency(_Strict):
    per_target: Number(ge=1, le=MAX_GPUS, integer=True) = 1  # runs at once on one target (they never share a GPU)
    total: Optional[Number(ge=1, le=MAX_CELLS, integer=True)] = None  # runs at once over the whole batch (null: no cap)


class Matrix(_Strict):
    variant: list[str] = Field(min_length=1)
    set: list[dict[str, Scalar]] = Field([{}], min_length=1)  # one settings mapping per column of the matrix
    args: dict[str, list[Scalar]] = {}  # crossed: {batch_size: [4, 8], lr: [1e-3, 3e-4]} gives 4 settings
    gpus: list[GpuCount] = []  # GPU counts to cross (empty: the file's `gpus`)


class Experiments(_Strict):
    batch: str
    targets: list[str] = Field(min_length=1)  # target names, `host:NAME` (its containers) or `all`
    matrix: Matrix
    repeats: Number(ge=1, le=1000, integer=True) = 1
    concurrency: Concurrency = Concurrency()
    stop_when: Annotated[StopWhen, BeforeValidator(_stop_when)] = StopWhen()
    fallback: Annotated[Optional[list[str]], BeforeValidator(_fallback)] = None  # null: the inventory's chain
    gpus: Optional[GpuCount] = None  # GPUs per cell (null: the whole target)


@dataclass(frozen=True)
class Cell:
    """One point of the matrix on one target. `sets` are trainer arguments (sorted key/value pairs)."""

    id: str
    position: int
    target: str
    variant: str
    sets: tuple[tuple[str, Any], ...]
    gpus: Optional[int]
    repeat: int

    def run_name(self, batch: str) -> str:
        return f"{batch}.{self.id}"

    def config(self) -> str:
        """What varies apart from target and repeat: `trees batch_size=8 gpus=2`."""
        parts = [self.variant, *(f"{k}={v}" for k, v in self.sets)]
        return " ".join(parts + ([f"gpus={self.gpus}"] if self.gpus else []))


@dataclass(frozen=True)
class Plan:
    """An experiments file checked against an inventory: its cells and the chain its runs fall back along."""

    experiments: Experiments
    source: str
    cells: tuple[Cell, ...]
    chain: tuple[str, ...]
    target_gpus: Mapping[str, tuple[int, ...]]
    topologies: Mapping[str, str] = field(default_factory=dict)  # variant -> threaded|procsplit

    @property
    def batch(self) -> str:
        return self.experiments.batch


# ---------------------------------------------------------------------------------------------- loading

def load_experiments(path: Path, inventory: Inventory) -> Plan:
    """Read, validate and expand an experiments file; InventoryError carries one `FILE: key.path: ...` per problem."""
    text = read_yaml_file(path, missing="pass an existing experiments file", unreadable="pass an existing experiments file")
    return parse_experiments(text, inventory, source=str(path))


def parse_experiments(text: str, inventory: Inventory, *, source: str = "<memory>") -> Plan:
    data = load_mapping(text, source, expected="batch:, targets: and matrix:")
    try:
        experiments = Experiments.model_validate(data)
    except ValidationError as exc:
        raise InventoryError([f"{source}: {line}" for line in describe_validation_error(exc, Experiments)]) from None
    targets, target_problems = resolve_targets(experiments.targets, inventory)
    problems = _name_problem("batch", experiments.batch, "batch name") + target_problems
    problems += _cross_checks(experiments, inventory, targets)
    if problems:
        raise InventoryError([f"{source}: {line}" for line in problems])
    chain = tuple(inventory.fallback if experiments.fallback is None else experiments.fallback)
    target_gpus = {name: inventory.target(name).gpus for name in targets}
    topologies = {name: variant.topology for name, variant in inventory.variants.items()}
    return Plan(experiments, source, tuple(expand(experiments, targets)), chain, target_gpus, topologies)


def resolve_targets(selectors: list[str], inventory: Inventory) -> tuple[list[str], list[str]]:
    """Target names for `ct200`, `host:pve1` and `all`, and the problems (Inventory.select_targets)."""
    return inventory.select_targets(selectors)


def _cross_checks(experiments: Experiments, inventory: Inventory, targets: list[str]) -> list[str]:
    """What pydantic cannot see alone: variants, settings keys and GPU counts against the inventory."""
    problems = []
    matrix = experiments.matrix
    for index, name in enumerate(matrix.variant):
        if name not in inventory.variants:
            problems.append(f"matrix.variant.{index}: unknown variant {name!r}; known variants: {', '.join(inventory.variants) or 'none'}")
        elif inventory.variants[name].command is not None and (any(matrix.set) or matrix.args):
            problems.append(f"matrix.variant.{index}: variant {name!r} runs its own command; set/args apply to built-in trainer variants")
    problems += chain_problems(experiments.fallback or [], inventory.variants)
    for index, settings in enumerate(matrix.set):
        problems += [f"matrix.set.{index}: argument name {key!r} must be letters, digits, '_', '.', '-'"
                     for key in settings if not runs.SET_KEY_RE.fullmatch(key)]
        problems += [f"matrix.set.{index}: {key!r} is also a matrix.args axis; give it in one place"
                     for key in settings if key in matrix.args]
    problems += [f"matrix.args.{key}: expected a non-empty list of values" for key, values in matrix.args.items() if not values]
    problems += [f"matrix.args.{key}: argument name must be letters, digits, '_', '.', '-'"
                 for key in matrix.args if not runs.SET_KEY_RE.fullmatch(key)]
    return problems + _gpu_problems(experiments, inventory, targets)


def _gpu_problems(experiments: Experiments, inventory: Inventory, targets: list[str]) -> list[str]:
    asked = max([*experiments.matrix.gpus, experiments.gpus or 0])
    if not asked:
        return []
    key = "matrix.gpus" if experiments.matrix.gpus else "gpus"
    problems = []
    for name in targets:
        listed = inventory.target(name).gpus
        if len(listed) < asked:
            have = f"lists {len(listed)}" if listed else "lists none (give the container's `gpus:` in the inventory)"
            problems.append(f"{key}: a cell asks for {counted(asked, 'GPU')} but target {name} {have}")
    return problems


# ---------------------------------------------------------------------------------------------- expansion

def expand(experiments: Experiments, targets: list[str]) -> list[Cell]:
    """Every cell, repeats outermost, then variant, settings, GPU count, target. Ids depend only on content."""
    matrix = experiments.matrix
    axes = list(matrix.args)
    combos = [dict(zip(axes, values)) for values in itertools.product(*(matrix.args[a] for a in axes))]
    settings = list(dict.fromkeys(tuple(sorted({**entry, **combo}.items())) for entry in matrix.set for combo in combos))
    readable = [_slug(sets) for sets in settings]
    hashed = {sets for sets, slug in zip(settings, readable) if readable.count(slug) > 1}  # e.g. {a: 1} and {a: "1"}
    gpu_counts = list(dict.fromkeys(matrix.gpus or [experiments.gpus]))
    cells: list[Cell] = []
    for repeat, variant, sets, gpus, target in itertools.product(
        range(1, experiments.repeats + 1), list(dict.fromkeys(matrix.variant)), settings, gpu_counts, targets
    ):
        cell_id = cell_id_for(target, variant, sets, gpus, repeat, hashed=sets in hashed)
        cells.append(Cell(cell_id, len(cells), target, variant, sets, gpus, repeat))
    return cells


def _slug(sets: tuple[tuple[str, Any], ...]) -> str:
    return "_".join(f"{key}-{value}" for key, value in sets)


def cell_id_for(target: str, variant: str, sets: tuple[tuple[str, Any], ...], gpus: Optional[int], repeat: int, *,
                hashed: bool = False) -> str:
    """`trees.ct200.batch_size-8.g2.r1`: readable when the settings are short and plain, else a hash of them."""
    parts = [variant, target]
    if sets:
        slug = _slug(sets)
        if hashed or len(slug) > SLUG_MAX or not re.fullmatch(r"[A-Za-z0-9_.-]+", slug) or ".." in slug:
            slug = "s" + hashlib.sha1(json.dumps(sets).encode()).hexdigest()[:10]
        parts.append(slug)
    if gpus:
        parts.append(f"g{gpus}")
    return ".".join([*parts, f"r{repeat}"])

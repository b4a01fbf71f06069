"""What a watch reports: one frozen dataclass per event kind, one serialisation.

The Watcher creates these; `dfo watch --json` prints `to_json()` (one object a line, `kind` first, then
`at`, then who it is about, then the kind's own fields); the registry keeps the same keys less kind/at/run
(`stored_data()`). A field marked `optional()` is left out of the JSON when it is None (never `null`), so
the lines are what they were when events were dicts.

Two families: RunEvent (about one followed run: `run` and its chain's root `chain`) and TargetEvent (about a
container's channel: `target`). `stored` says whether the registry keeps the kind (steps and GPU samples have
their own tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from .gpu import failure_kind

if TYPE_CHECKING:  # the type only: decide/ is imported by the modules that make a Final
    from .decide import Decision


def optional() -> Any:
    """A field left out of the JSON when it is None."""
    return field(default=None, metadata={"omit_if_none": True})


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = ""
    stored: ClassVar[bool] = True  # kept in the registry's events table

    at: str

    def to_json(self) -> dict[str, Any]:
        """The event as one JSON object: `kind` first, then the fields in declaration order."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = value
        return out

    def stored_data(self) -> dict[str, Any]:
        """What the registry's events row holds besides kind, time and run."""
        return {k: v for k, v in self.to_json().items() if k not in ("kind", "at", "run")}

    @property
    def subject(self) -> str:
        """Who the event is about: the run, or the target for a channel event."""
        raise NotImplementedError


@dataclass(frozen=True)
class RunEvent(Event):
    run: str
    chain: str

    @property
    def subject(self) -> str:
        return self.run


@dataclass(frozen=True)
class TargetEvent(Event):
    target: str

    @property
    def subject(self) -> str:
        return self.target


@dataclass(frozen=True)
class Final:
    """`dfo watch`'s last word on a chain once the watch ends (commands/watch.py finals): the decision of its current
    run, typed (decide.Decision), and how that run ended as the registry has it (`{state, exit_code}`, None while it
    runs). Its JSON line is the decision's JSON with `kind` and `chain`; `ended` is the registry's `{state,
    exit_code}`, and the decision's own `ended` (exited | stopped | crashed as its log said, or None) is kept beside it
    as `decision_ended`: one name each, neither overwrites the other (docs/design.md). Never stored."""

    kind: ClassVar[str] = "final"

    chain: str
    decision: "Decision"
    ended: Optional[dict]

    def to_json(self) -> dict[str, Any]:
        decision = self.decision.to_json()
        decision["decision_ended"] = decision.pop("ended")
        return {"kind": self.kind, **decision, "chain": self.chain, "ended": self.ended}


# ---------------------------------------------------------------------------------------------- about a run

@dataclass(frozen=True)
class Attached(RunEvent):
    kind: ClassVar[str] = "attached"
    target: str
    variant: str
    offset: Optional[int]
    steps_stored: int
    owner: bool
    claimed_by: Optional[str] = optional()  # host:pid of the watcher holding the chain's lease


@dataclass(frozen=True)
class Stopping(RunEvent):
    kind: ClassVar[str] = "stopping"
    reason: str


@dataclass(frozen=True)
class ActionError(RunEvent):
    kind: ClassVar[str] = "action_error"
    error: str


@dataclass(frozen=True)
class TookOver(RunEvent):
    kind: ClassVar[str] = "took_over"
    steps_stored: int


@dataclass(frozen=True)
class Truncated(RunEvent):
    kind: ClassVar[str] = "truncated"
    size: Optional[int]
    why: Optional[str]
    was: Optional[int]


@dataclass(frozen=True)
class RunError(RunEvent):
    kind: ClassVar[str] = "error"
    text: Optional[str]


@dataclass(frozen=True)
class Step(RunEvent):
    kind: ClassVar[str] = "step"
    stored: ClassVar[bool] = False  # the samples table holds them
    step: int
    tok_s: Optional[float]
    loss: Optional[float]
    phase: Optional[str]


@dataclass(frozen=True)
class Malformed(RunEvent):
    kind: ClassVar[str] = "malformed"
    reason: str
    count: int


@dataclass(frozen=True)
class Wandb(RunEvent):
    kind: ClassVar[str] = "wandb"
    mode: Optional[str] = optional()
    url: Optional[str] = optional()
    dir: Optional[str] = optional()


@dataclass(frozen=True)
class Ended(RunEvent):
    kind: ClassVar[str] = "ended"
    exit_code: Optional[int]
    state: str
    why: str


@dataclass(frozen=True)
class Gpu(RunEvent):
    kind: ClassVar[str] = "gpu"
    stored: ClassVar[bool] = False  # the GPU samples table holds them
    gpus: list[dict]


@dataclass(frozen=True)
class GpuIdle(RunEvent):
    kind: ClassVar[str] = "gpu_idle"
    gpu: int
    idle_since: str
    flagged_at: str
    busy_gpus: list[int]
    text: str


@dataclass(frozen=True)
class Unreachable(RunEvent):
    kind: ClassVar[str] = "unreachable"
    target: str
    duration_s: float
    reason: Optional[str]


@dataclass(frozen=True)
class DecisionMade(RunEvent):
    kind: ClassVar[str] = "decision"
    decision: dict  # decide.Decision.to_json()


@dataclass(frozen=True)
class LevelShift(RunEvent):
    """A level shift of a steady run (decide/judge.py `level_shifts()`): the verdict re-opened, both levels.
    `declared` true: the new level holds and is declared (`declared_*`); false: seen, not declared yet (then a
    second event, declared, follows once it is). A shift seen already declared (the common case: the detector
    waits until the new level has held the minimum evidence) is one event. Never repeated, re-attaches too."""

    kind: ClassVar[str] = "level_shift"
    at_step: int  # where the level moved (the change point)
    detected_step: int
    detected_at: str
    from_tok_s: float
    from_interval: Optional[list[float]]  # the interval of the steady verdict the shift re-opened
    to_tok_s: float
    declared: bool
    precision: float
    declared_tok_s: Optional[float] = optional()
    declared_interval: Optional[list[float]] = optional()
    declared_step: Optional[int] = optional()
    declared_at: Optional[str] = optional()
    shape: Optional[str] = optional()  # step | decline (decide/judge.py level_shifts(); absent in older events: step)
    rel_per_min: Optional[float] = optional()  # a decline's fall per minute (relative)

    @staticmethod
    def fields_of(shift: dict, declared: bool) -> dict[str, Any]:
        """The event's own fields from one of the decision's `level_shifts` (the declared ones only if `declared`)."""
        return {k: v for k, v in {**shift, "declared": declared}.items()
                if k in LEVEL_SHIFT_FIELDS and (declared or not k.startswith("declared_"))}

    @classmethod
    def describe(cls, shift: dict) -> str:
        """The line of the last event the watch sends for one of a decision's `level_shifts` (replay, runs)."""
        return cls(at="", run="", chain="", **cls.fields_of(shift, shift.get("declared_tok_s") is not None)).text

    @property
    def text(self) -> str:
        """One line: `level shift at step 1861: 56,754 -> 40,296 tok/s, verdict re-opened at step 2700, ...`; a
        decline: `decline (-6.9% per minute) over the steps from 246: steady at 65,238 -> 60,831 tok/s, ...`."""
        head = f"level shift at step {self.at_step}: {self.from_tok_s:,.0f} -> "
        if self.shape == "decline":  # a steady fall after the declaration (decide/steady.py _declined)
            per_min = f" ({self.rel_per_min:+.1%} per minute)" if self.rel_per_min is not None else ""
            head = f"decline{per_min} over the steps from {self.at_step}: steady at {self.from_tok_s:,.0f} -> "
        if not self.declared:
            return (f"{head}{self.to_tok_s:,.0f} tok/s, verdict re-opened at step {self.detected_step} "
                    f"(new level not declared yet; precision {self.precision:.0%})")
        lo_hi = self.declared_interval
        interval = f" (95% {lo_hi[0]:,.0f}..{lo_hi[1]:,.0f})" if lo_hi else ""
        return (f"{head}{self.declared_tok_s:,.0f} tok/s, verdict re-opened at step {self.detected_step}, "
                f"new level declared at step {self.declared_step}{interval}")


LEVEL_SHIFT_FIELDS = frozenset(f.name for f in fields(LevelShift)) - {"at", "run", "chain"}


@dataclass(frozen=True)
class Acting(RunEvent):
    kind: ClassVar[str] = "acting"
    action: str
    next_variant: Optional[str]


@dataclass(frozen=True)
class Stopped(RunEvent):
    kind: ClassVar[str] = "stopped"
    signal: Optional[str]
    reason: Optional[str]


@dataclass(frozen=True)
class NotSignalled(RunEvent):
    kind: ClassVar[str] = "not_signalled"
    why: str


@dataclass(frozen=True)
class LeftToBatch(RunEvent):
    """A verdict `dfo watch` does not act on: the run is a batch cell's, whose fallback or stop `dfo batch` carries
    out (it keeps the cell's GPUs in its bookkeeping); `command` is the one that does."""

    kind: ClassVar[str] = "left_to_batch"
    batch: str
    command: str

    @property
    def text(self) -> str:
        return f"a run of batch {self.batch}: its fallback is left to `{self.command}` (it keeps the cell's GPUs)"


@dataclass(frozen=True)
class LeaseHeld(RunEvent):
    """The run's chain is held by a dfo of another workstation (its claim: `host`, `pid`, `since`): this watch only
    shows it, and takes it over once that dfo gives the lease back or stops renewing it (`lease_s` after it
    ends: a process on another workstation cannot be looked at from here). Said once per holder."""

    kind: ClassVar[str] = "lease_held"
    stored: ClassVar[bool] = False  # this watch's own waiting, not the run's history
    host: Optional[str]
    pid: Optional[int]
    since: Optional[str]
    lease_s: float

    @property
    def text(self) -> str:
        return lease_held_text(self.host, self.pid, self.since, self.lease_s)


def lease_held_text(host: str | None, pid: int | None, since: str | None, lease_s: float, *, what: str = "chain",
                    by: str = "watch", here: bool = False) -> str:
    """What a dfo waiting on a lease another dfo holds says (`dfo watch` of a chain, `dfo batch` of a cell): who holds
    it (pid on host), since when (`since`, RFC 3339), what this dfo does meanwhile, and how to take it over. `here`:
    the holder is a dfo of this workstation, taken over as soon as it ends (chains.Claims looks at its pid); one of
    another workstation is taken over once its lease (`lease_s`) runs out after it ended."""
    since_text = f" since {since[:10]} {since[11:19]} UTC" if since else ""
    when = (f"as soon as that dfo ends: end it (Ctrl-C, or kill {pid})" if here else
            f"once that dfo ends (its lease runs out {lease_s:g} s later): end it on {host} (Ctrl-C, or kill {pid})")
    return (f"its {what} is held by dfo pid {pid} on {host}{since_text}: this {by} shows it and stores or acts on "
            f"nothing while that dfo renews its lease; it takes the {what} over {when} to take over")


@dataclass(frozen=True)
class FellBack(RunEvent):
    """A fallback carried out: `run` was followed by `next_run` (of `variant`). A multi-node run's also says on
    which nodes (`nodes`), which node failed first (`first_failed`) and the chain left after it (`rest`): one
    kind, one shape, whoever carried it out (the Watcher, multinode.finish_fallback)."""

    kind: ClassVar[str] = "fell_back"
    next_run: str
    variant: str
    nodes: Optional[list[str]] = optional()
    first_failed: Optional[str] = optional()
    rest: Optional[list[str]] = optional()


@dataclass(frozen=True)
class MultinodeFellBack(RunEvent):
    """`dfo watch`'s line once a multi-node run's fallback is done (by the watch's lifecycle while it goes on, or one
    a dfo that died left open, before the watch): the successor and its nodes. Kept in the registry as its
    fell_back event (FellBack)."""

    kind: ClassVar[str] = "multinode_fell_back"
    stored: ClassVar[bool] = False
    next_run: str
    nodes: list[str]

    @property
    def text(self) -> str:
        return f"fell back on all {len(self.nodes)} nodes to {self.next_run}"


@dataclass(frozen=True)
class MultinodeSummary(RunEvent):
    """`dfo watch --json`'s line after the watch, one per multi-node run it followed: its nodes' runs (`nodes`),
    the node whose failure came first (`first_failed`, null when none failed) and the one-line `summary` the
    text view prints. `chain` is the run itself (a multi-node run's chain is followed as one)."""

    kind: ClassVar[str] = "multinode"
    stored: ClassVar[bool] = False
    nodes: list[str]
    first_failed: Optional[str]
    summary: str


# ---------------------------------------------------------------------------------------------- a run's record

@dataclass(frozen=True)
class RunRecord(Event):
    """What the registry keeps of a run besides its watch: written by launch, look, resume and notify (never on a
    watch's --json). No `chain`: the row's shape is what it always was."""

    run: str

    @property
    def subject(self) -> str:
        return self.run


@dataclass(frozen=True)
class Launched(RunRecord):
    """A run's process started: its PID and what it was launched with (a fallback's successor takes these:
    chains.first_launch). Kind `started` (it was `launched`, the kind of `dfo launch --json`'s line, LaunchAnswer,
    whose shape is another: store migration 11 renamed the old rows)."""

    kind: ClassVar[str] = "started"
    pid: int
    target: str
    variant: Optional[str]
    sets: dict
    env: dict
    wandb: Optional[str]


@dataclass(frozen=True)
class LaunchAnswer(Event):
    """`dfo launch --json`'s line (the first of `dfo launch --watch --json`): one shape whether the run has one
    node or several. `nodes`: each process started (`run`, `target`, `pid`, `log`, `exit`), one for a single-node
    run; `target`, `pid`, `log` and `exit` are that one's, null for a multi-node run (its processes are its
    nodes); `rendezvous` (host:port) is a multi-node run's, null otherwise; `pushed`: a trainer package was copied
    to a target. Never stored: the registry keeps a `launched` record (Launched) of each process instead."""

    kind: ClassVar[str] = "launched"
    stored: ClassVar[bool] = False
    run: str
    target: Optional[str]
    pid: Optional[int]
    log: Optional[str]
    exit: Optional[str]
    trainer_hash: Optional[str]
    pushed: bool
    rendezvous: Optional[str]
    nodes: list[dict]
    next: str

    @property
    def subject(self) -> str:
        return self.run


@dataclass(frozen=True)
class LaunchFailed(RunRecord):
    kind: ClassVar[str] = "launch_failed"
    error: str


@dataclass(frozen=True)
class LaunchResolved(RunRecord):
    """A launch whose start was never seen answered, found by a look: its process (`pid`), or its end (None)."""

    kind: ClassVar[str] = "launch_resolved"
    pid: Optional[int]
    how: str


@dataclass(frozen=True)
class Resumed(RunRecord):
    """`run` continues `from_run` from its checkpoint (`dfo resume`; a multi-node one names no single file). Kind
    `resumed_from` (it was `resumed`, the kind of `dfo resume --json`'s line, ResumeAnswer, whose shape is another:
    store migration 12 renamed the old rows)."""

    kind: ClassVar[str] = "resumed_from"
    from_run: str
    checkpoint: Optional[str] = optional()


@dataclass(frozen=True)
class ResumeAnswer(Event):
    """`dfo resume --json`'s line: the new run (`run`) that continues `resumed_from`, one shape whether it has one
    node or several, as LaunchAnswer: `nodes`, each process started (`run`, `target`, `pid`, `log`); `target`,
    `pid` and `log` are the one node's, null for a multi-node run. Never stored: the registry keeps a
    `resumed_from` record (Resumed) instead."""

    kind: ClassVar[str] = "resumed"
    stored: ClassVar[bool] = False
    run: str
    resumed_from: str
    target: Optional[str]
    pid: Optional[int]
    log: Optional[str]
    nodes: list[dict]
    next: str

    @property
    def subject(self) -> str:
        return self.run


@dataclass(frozen=True)
class NotifyFailed(RunRecord):
    kind: ClassVar[str] = "notify_failed"
    channel: str
    key: str
    error: str


def record(store: Any, event: Event) -> None:
    """Keep `event` in the registry's events table (its stored_data, at its time): the one way a row is written."""
    store.add_event(event.subject if not isinstance(event, TargetEvent) else None, event.kind, event.stored_data(),
                    at=event.at)


# ---------------------------------------------------------------------------------------------- about a target

@dataclass(frozen=True)
class Disconnected(TargetEvent):
    kind: ClassVar[str] = "disconnected"
    reason: Optional[str]


@dataclass(frozen=True)
class Gap(TargetEvent):
    kind: ClassVar[str] = "gap"
    duration_s: Optional[float]


@dataclass(frozen=True)
class GpuError(TargetEvent):
    kind: ClassVar[str] = "gpu_error"
    text: Optional[str]
    code: Optional[int]

    @property
    def no_nvidia_smi(self) -> bool:
        """nvidia-smi is not installed there: a CPU-only target, not a failing driver."""
        return failure_kind(self.code) == "missing"


@dataclass(frozen=True)
class TargetError(TargetEvent):
    kind: ClassVar[str] = "target_error"
    text: Optional[str]


def event_classes() -> list[type[Event]]:
    """Every concrete event class (those with a kind)."""
    found, todo = [], [Event]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.kind:
            found.append(cls)
    return found

"""RunJudge: the state machine that turns one run's observations into a Decision.

    undecided (waiting for the first step / warming up) --> steady (or, after max_undecided_s, drifting)
         |        |                                           |        a steady (drifting) verdict stays the
         |        +--> exited (exit 0) | stopped              |        run's verdict when it ends: `ended`
         +--> crash | stall | too_slow  <---------------------+        and `exit_code` say how
                                                                       (crash, stall, too_slow are final)

Crash: a fatal catalogue signature, a worker-thread traceback (even while the PID lives), a bare traceback
that ends the run (non-zero exit, or the log ends after it), a non-zero exit, a NaN/inf loss, event=error.
Stall: judged on the caller's clock (TickObs): no first step within `first_step_grace_s` of the start, or no
new step for max(stall_factor x median gap between step lines, stall_floor_s); GPU samples go into the
evidence. Too slow: only once steady, when the interval's upper bound < (1 - tolerance) x baseline.
Stopped: after a StopRequested observation (dfo or the user asked), whatever follows (exit 75, 143, 137, a
traceback on the way out, silence) is a stop; without one, exit 75 or 143 after `event=done reason=sigterm`
(someone else sent SIGTERM and the trainer honoured it) is a stop too. A run that exits 0 or is stopped while
undecided gets the final answer its data allow at its end (steady.SteadyDetector.conclude: steady, noisy,
`decided_by: run_ended`), else it is `exited` / `stopped` before a steady state.
Pure: no I/O, no clock; `feed` is cheap except once per block of steps (see steady.py).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import MISSING, asdict, dataclass, field, fields
from statistics import median
from typing import Any, Mapping, Sequence

from ..logfmt import format_ts
from ..states import Action, Verdict
from .config import DecideConfig
from .gpus import IdleGpuDetector
from .memory import MemoryWatch
from .observations import EventObs, ExitObs, GpuObs, LineObs, Observation, StepObs, StopRequested, TickObs
from .policy import action_for, next_variant
from .signatures import PSEUDO, Catalogue, Match, MatchTracker, Signature
from .steady import SteadyDetector, seconds_against

GAP_HISTORY = 50  # the stall threshold follows the median of the last 50 gaps between step lines
EARLY_STEP_LINES = 10  # for the first 10 step lines, the stall limit is at least the time the first step took
DECLINE_FIELDS = ("change_rel", "change_rel_95", "rel_per_min", "over_s")  # a decline's record (steady.py _declined)
SIGTERM_EXITS = frozenset({75, 143})
GIB = 2**30  # memory is compared in GiB: nvidia-smi's MiB / 1024, the trainer's mem_gb (1e9 bytes) / GIB  # the trainer's checkpointed stop (75), or the default SIGTERM death


@dataclass
class Decision:
    """docs/design.md's decision JSON plus `reason`, `evidence`, `next_variant`, `ended` and `exit_code`.

    `next_run` stays None here: the caller names the next run after `next_variant`. `ended` says how the
    run ended (exited | stopped | crashed, None while it runs) beside the verdict it holds: a run steady at
    5,344 tok/s that then exits 0 reads decision=steady, ended=exited, exit_code=0."""

    decision: Verdict  # steady | drifting | crash | stall | too_slow | stopped | exited | undecided
    run: str
    at_step: int | None
    at_ts: str | None
    signature: str | None
    steady_tok_s: float | None
    warmup_end_step: int | None
    action: Action  # keep | fallback | stop | none
    next_run: str | None
    interval: list[float] | None
    reason: str
    evidence: dict = field(default_factory=dict)
    next_variant: str | None = None
    noise_rel: float | None = None  # IQR / median of the interval throughputs after the warm-up (reported)
    noisy: bool = False  # noise_rel above watch.noisy_rel, or a steady answer by max_undecided_s or out of reach
    ended: str | None = None  # exited | stopped | crashed; None while the run goes on
    exit_code: int | None = None
    level_shifts: list[dict] = field(default_factory=list)  # RunJudge.level_shifts(): each shift, both levels
    shift_suspected: dict | None = None  # steady, but a level shift being confirmed: RunJudge.shift_suspected()
    degrading: dict | None = None  # memory climbing since steady (RunJudge.degrading()): what, how fast, full when
    degrading_at_end: dict | None = None  # degrading's measure when the run ended or got a crash/stall/too_slow verdict
    rate: str | None = None  # what steady_tok_s is the rate of: "train" (marked phases and unmarked pauses left out)

    def __post_init__(self) -> None:
        self.decision, self.action = Verdict.of(self.decision), Action.of(self.action)  # text from the registry too

    @classmethod
    def from_json(cls, data: Mapping) -> "Decision":
        """A decision as to_json() wrote it (the registry's runs.decision, a `decision` event); keys it does not
        know are left out, missing optional ones take their defaults."""
        known = {f.name: f for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for name, f in known.items():
            if name not in values and f.default is MISSING and f.default_factory is MISSING:
                values[name] = "" if name == "reason" else None
        return cls(**values)

    @classmethod
    def read(cls, data: Any) -> "Decision":
        """A stored decision (the registry's runs.decision, a cell's outcome, a `decision` event) as the typed
        Decision: the one reader of stored decisions. ValueError, saying why in words, when it is not the shape
        to_json() writes (an old dfo's, or a damaged row): its readers would fail on it, or show it wrong."""
        if not isinstance(data, Mapping):
            raise ValueError("is not a JSON object")
        if "decision" not in data:
            raise ValueError("has no `decision` (not the shape this dfo writes)")
        if data["decision"] not in tuple(Verdict):
            raise ValueError(f"has a verdict this dfo does not know ({str(data['decision'])[:40]!r})")
        if data.get("action") is not None and data["action"] not in tuple(Action):
            raise ValueError(f"has an action this dfo does not know ({str(data['action'])[:40]!r})")
        for key, kind in STORED_TYPES.items():
            if not _is(data.get(key), kind):
                raise ValueError(f"has a `{key}` that is not {_KIND_WORDS[kind]}")
        interval = data.get("interval")
        if interval is not None and not (isinstance(interval, list) and len(interval) == 2
                                         and all(_is(end, float) and end is not None for end in interval)):
            raise ValueError("has an interval that is not two numbers")
        for shift in data.get("level_shifts") or ():
            if not isinstance(shift, Mapping) or not all(_is(shift.get(key), float) and shift.get(key) is not None
                                                         for key in SHIFT_NUMBERS):
                raise ValueError("has a level shift without its steps and levels")
        return cls.from_json(data)

    @property
    def verdict(self) -> Verdict:
        return self.decision

    @property
    def final(self) -> bool:
        """True once the watcher has nothing more to wait for on this run."""
        return self.decision != Verdict.UNDECIDED

    def to_json(self) -> dict:
        """docs/design.md's decision JSON (verdict and action as their strings) plus the fields above."""
        return {**asdict(self), "decision": str(self.decision), "action": str(self.action)}


def read_stored(data: Any) -> tuple[Decision | None, str | None]:
    """A stored decision (runs.decision, a cell's outcome, a `decision` event's) through Decision.read: (the
    Decision, None); (None, None) when there is none; (None, why it cannot be read) when it is not the shape this
    dfo writes, which its readers show as unreadable, never a traceback."""
    if data is None or data == {}:
        return None, None
    try:
        return Decision.read(data), None
    except ValueError as exc:
        return None, f"the stored decision {exc}"


# The type of each field of a stored decision (Decision.read; None is always allowed): float means any number.
STORED_TYPES = {"run": str, "at_step": int, "at_ts": str, "signature": str, "steady_tok_s": float,
                "warmup_end_step": int, "next_run": str, "reason": str, "evidence": dict, "next_variant": str,
                "noise_rel": float, "noisy": bool, "ended": str, "exit_code": int, "level_shifts": list,
                "shift_suspected": dict, "degrading": dict, "degrading_at_end": dict}
SHIFT_NUMBERS = ("at_step", "detected_step", "from_tok_s", "to_tok_s")  # what a level shift's line is made of
_KIND_WORDS = {str: "text", int: "a whole number", float: "a number", bool: "true or false", dict: "a JSON object",
               list: "a JSON list"}


def _is(value: Any, kind: type) -> bool:
    """Whether a stored field's value is of `kind` (None is; a bool is no number; a whole float is an int)."""
    if value is None:
        return True
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    if kind is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, kind)


def describe_gpus(samples: Sequence[GpuObs]) -> str | None:
    """One line on what the GPUs did while the log was silent (idle, busy without progress, released)."""
    if not samples:
        return None
    latest = samples[-1].gpus
    if not latest:
        return None
    utils = [g.get("util_pct") for g in latest if g.get("util_pct") is not None]
    mems = [g.get("mem_used_mib") for g in latest if g.get("mem_used_mib") is not None]
    if mems and max(mems) < 1024:
        return "GPU memory is back near zero: the process has likely gone"
    if utils and min(utils) >= 95:
        return f"GPUs at {min(utils):.0f}%+ utilisation with no progress: likely a hung collective"
    if utils and max(utils) <= 5:
        return "GPUs idle with memory still held: the process hangs outside GPU work"
    return f"GPUs partly busy (utilisation {', '.join(f'{u:.0f}%' for u in utils)})" if utils else None


def rounded(interval: tuple[float, float] | None) -> list[float] | None:
    return [round(interval[0], 1), round(interval[1], 1)] if interval else None


def climb_text(climb: dict) -> str:
    """`GPU 0 memory 30.5 -> 33.6 GiB since 2026-...Z (+2.34 GiB/min)`: a `degrading` measure in words."""
    what = f"GPU {climb['gpu']} memory" if climb["what"] == "gpu_memory" else "the trainer's peak memory (mem_gb)"
    return (f"{what} {climb['from_gib']:,.1f} -> {climb['now_gib']:,.1f} GiB since {climb['since_at']} "
            f"({climb['gib_per_min']:+,.2f} GiB/min)")


class RunJudge:
    """Feed observations of one run in time order; each `feed` returns the current Decision."""

    def __init__(
        self,
        config: DecideConfig | None = None,
        baseline_tok_s: float | None = None,
        *,
        run: str = "",
        variant: str | None = None,
        chain: Sequence[str] = (),
        fallback: bool = True,
        catalogue: Catalogue | None = None,
        started_ts: float | None = None,
        topologies: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config or DecideConfig()
        self.topologies = dict(topologies or {})  # variant -> threaded|procsplit, for the fallback choice
        self.baseline = baseline_tok_s
        self.run, self.variant, self.chain, self.fallback = run, variant, tuple(chain), fallback
        self.catalogue = catalogue or Catalogue()
        self.steady = SteadyDetector(self.config)
        self.tracker = MatchTracker(self.catalogue)
        self.start_ts = started_ts
        self.now: float | None = None
        self.last_step: int | None = None
        self.last_step_ts: float | None = None
        self.gaps: deque[float] = deque(maxlen=GAP_HISTORY)
        self._typical_gap: float | None = None
        self.gpu_samples: deque[GpuObs] = deque(maxlen=30)
        self.idle_gpus = IdleGpuDetector()  # which GPU went idle first: named in a crash or stall verdict
        self.memory = MemoryWatch(hold_s=self.config.shift_hold_s)  # climbing after steady: degrading
        self.warnings: Counter[str] = Counter()
        self.pending_traceback: Match | None = None
        self.pending_since: float | None = None
        self.survived_tracebacks = 0
        self.exit_code: int | None = None
        self.step_lines = 0
        self.first_step_s: float | None = None  # start -> first step line: what a slow start costs
        self.done_reason: str | None = None  # the trainer's `event=done reason=...`
        self.stop_requested_at: float | None = None
        self.stop_by: str | None = None
        self.ignored_after_stop = 0  # crash evidence seen after a stop request (a stop is not a crash)
        self.first_steady: tuple[int | None, float | None] | None = None
        self._shift_notes: list[dict] = []  # per detector shift: when it was seen, the intervals of both levels
        self._declared_step: int | None = None  # the steady level declared last: at this step,
        self._declared_interval: list[float] | None = None  # with this interval (a shift's level before)
        self._final: Decision | None = None
        self._ended: tuple[str, int, float] | None = None  # (exited | stopped | crashed, exit code, ts)

    # ---- feeding -------------------------------------------------------------------------------
    def feed(self, obs: Observation) -> Decision:
        self.observe(obs)
        return self.decision()

    @property
    def settled(self) -> bool:
        """True once a crash, stall or too-slow verdict is held: nothing later can change it."""
        return self._final is not None

    def observe(self, obs: Observation) -> None:
        """Take one observation without building a Decision (the cheap path for bulk replays)."""
        ts = obs.now if isinstance(obs, TickObs) else obs.ts
        self.now = ts if self.now is None else max(self.now, ts)
        if self.start_ts is None:
            self.start_ts = ts
        handler = {
            StepObs: self._on_step,
            LineObs: self._on_line,
            EventObs: self._on_event,
            ExitObs: self._on_exit,
            StopRequested: self._on_stop,
            GpuObs: self._on_gpus,
            TickObs: self._on_tick,
        }[type(obs)]
        handler(obs)

    def end_of_log(self) -> Decision:
        """The log has ended (replay): a bare traceback with no step after it ended the run."""
        if self._ended is None:
            self._settle_pending_traceback(self.now, run_went_on=False)
        return self.decision()

    def _settle_pending_traceback(self, ts: float | None, *, run_went_on: bool) -> None:
        """A traceback with no signature: a worker thread's kills the run even if steps go on (the other
        threads carry on without it); a main-thread one is harmless if the run went on, fatal if not."""
        match, self.pending_traceback = self.pending_traceback, None
        if match is None:
            return
        if match.thread is not None:
            self._crash(PSEUDO["python_exception"], match, ts, f"worker thread {match.thread} died")
        elif run_went_on:
            self.survived_tracebacks += 1
        else:
            self._crash(PSEUDO["python_exception"], match, ts, "the log ends with an uncaught traceback")

    def _on_step(self, obs: StepObs) -> None:
        if self.last_step is not None and obs.step <= self.last_step:
            return
        if self.last_step_ts is not None:
            self.gaps.append(max(obs.ts - self.last_step_ts, 0.0))
            self._typical_gap = None
        elif self.start_ts is not None:
            self.first_step_s = max(obs.ts - self.start_ts, 0.0)
        self.step_lines += 1
        self.last_step, self.last_step_ts = obs.step, obs.ts
        self._settle_pending_traceback(obs.ts, run_went_on=True)
        if obs.loss_is_bad:
            match = Match(PSEUDO["nan_loss"], f"step={obs.step} loss={obs.loss}")
            self._crash(match.signature, match, obs.ts, f"loss is {obs.loss} at step {obs.step}")
            return
        if obs.mem_gb is not None and self.first_steady is not None:
            self.memory.feed(obs.ts, "log", obs.mem_gb * 1e9 / GIB)
        known = len(self.steady.shifts)
        if self.steady.feed(obs):
            self._note_shifts(known, obs)
            if self.steady.estimate.steady and self.first_steady is None:
                self.first_steady = (self.steady.estimate.declared_step, self.steady.estimate.declared_ts)
            self._check_too_slow(obs)

    def _note_shifts(self, known: int, obs: StepObs) -> None:
        """What the detector's shift records leave out: the step and time a shift was seen, the interval the
        level before it was declared with, and the new level's interval and time once declared."""
        estimate = self.steady.estimate
        for _ in self.steady.shifts[known:]:
            self._shift_notes.append({
                "detected_step": obs.step,
                "detected_at": format_ts(obs.ts),
                "from_interval": self._declared_interval,
            })
        if not estimate.steady or estimate.declared_step == self._declared_step:
            return
        self._declared_step, self._declared_interval = estimate.declared_step, rounded(estimate.interval)
        if self._shift_notes and "declared_at" not in self._shift_notes[-1]:
            self._shift_notes[-1].update(declared_at=format_ts(obs.ts), declared_interval=self._declared_interval)

    def level_shifts(self) -> list[dict]:
        """Each level shift so far, oldest first: where the level moved (`at_step`), when it was seen
        (`detected_step`, `detected_at`), the level before (`from_tok_s`; `from_interval`: the interval it was
        declared with), the new level as first seen (`to_tok_s`) and as declared once it holds (`declared_tok_s`,
        `declared_interval`, `declared_step`, `declared_at`; null until then), and the precision it was judged at.
        `shape`: `step` (the level moved at `at_step`) or `decline` (it fell steadily after steady was declared:
        `at_step` begins the window it fell over, `over_s` long, by `change_rel` (95% `change_rel_95`),
        `rel_per_min`; `from_tok_s` is the figure declared, `to_tok_s` the level of the newest blocks)."""
        shifts = []
        for shift, note in zip(self.steady.shifts, self._shift_notes):
            shifts.append({
                "shape": shift["shape"],
                "at_step": shift["at_step"],
                "detected_step": note["detected_step"],
                "detected_at": note["detected_at"],
                "from_tok_s": shift["from_tok_s"],
                "from_interval": note["from_interval"],
                "to_tok_s": shift["to_tok_s"],
                "declared_tok_s": shift["declared_tok_s"],
                "declared_interval": note.get("declared_interval"),
                "declared_step": shift["declared_step"],
                "declared_at": note.get("declared_at"),
                "precision": self.config.precision,
                **{key: shift[key] for key in DECLINE_FIELDS if key in shift},  # a decline's own measure
            })
        return shifts

    def shift_suspected(self) -> dict | None:
        """While steady: a level shift that began (`since_step`, `since_at`) but has not held the minimum
        evidence yet. The figure stays the level before it (`from_tok_s`); `to_tok_s` is the new level so far.
        None when no shift is suspected (or once it is confirmed: then the verdict re-opens, `level_shifts`)."""
        suspected = self.steady.estimate.shift_suspected if self.steady.estimate.steady else None
        if suspected is None:
            return None
        return {"since_step": suspected["since_step"], "since_at": format_ts(suspected["since_ts"]),
                "from_tok_s": suspected["from_tok_s"], "to_tok_s": suspected["to_tok_s"],
                "precision": self.config.precision}

    def _on_gpus(self, obs: GpuObs) -> None:
        self.gpu_samples.append(obs)
        if self._final is None and self._ended is None:  # after the verdict, GPUs say nothing new
            self.idle_gpus.feed(obs)
            if self.first_steady is not None:  # memory grows in a warm-up; after the declaration it should not
                for gpu in obs.gpus:
                    used, total = gpu.get("mem_used_mib"), gpu.get("mem_total_mib")
                    if gpu.get("index") is not None and isinstance(used, (int, float)):
                        self.memory.feed(obs.ts, f"gpu{gpu['index']}", used / 1024,
                                         total / 1024 if isinstance(total, (int, float)) and total > 0 else None)

    def degrading(self) -> dict | None:
        """Memory climbing since the run was declared steady (decide/memory.py), while it runs: `what`
        (gpu_memory: a GPU's memory.used, `gpu` its index; memory_peak: the trainer's mem_gb), `since_at`,
        `from_gib`, `now_gib`, `total_gib` (null for mem_gb), `gib_per_min`, `full_in_s` (at this rate; null
        without a total). None when nothing climbs, and once the run ended or got a final verdict (then the
        decision's `degrading_at_end` keeps the measure of that moment: memory is followed no further)."""
        return self._climb() if self._final is None and self._ended is None else None

    def _climb(self) -> dict | None:
        state = self.memory.state()
        if state is None:
            return None
        source, climb = state
        where = {"what": "memory_peak", "gpu": None} if source == "log" else {"what": "gpu_memory", "gpu": int(source[3:])}
        return {**where, "since_at": format_ts(climb["since_ts"]),
                **{k: climb[k] for k in ("from_gib", "now_gib", "total_gib", "gib_per_min", "full_in_s")}}

    def _with_degrading(self, reason: str) -> str:
        degrading = self.degrading()
        if degrading is None:
            return reason
        text = f"degrading: {climb_text(degrading)}"
        if degrading["full_in_s"] is not None:
            text += (f", full ({degrading['total_gib']:,.1f} GiB) in ~{degrading['full_in_s'] / 60:,.0f} min at this "
                     f"rate: an out-of-memory crash is likely")
        return f"{reason}; {text}"

    def _on_line(self, obs: LineObs) -> None:
        for match in self.tracker.feed(obs.text):
            self._on_match(match, obs.ts)

    def _on_match(self, match: Match, ts: float) -> None:
        if match.signature is not None and not match.signature.fatal:
            self.warnings[match.signature.id] += 1
        elif match.signature is not None:
            self._crash(match.signature, match, ts, match.signature.meaning)
        else:  # judged once it is clear that no signature follows (a chained traceback may bring one)
            self.pending_traceback, self.pending_since = match, ts

    def _on_event(self, obs: EventObs) -> None:
        if obs.event == "done":
            self.done_reason = obs.fields.get("reason")
        if obs.event != "error":
            return
        text = " ".join(f"{k}={v}" for k, v in obs.fields.items())
        signature = self.catalogue.match_line(text)
        if signature is not None and signature.fatal:
            self._crash(signature, Match(signature, text), obs.ts, signature.meaning)
        elif self.pending_traceback is not None:  # the trainer's last word after the traceback that ended it
            self._settle_pending_traceback(obs.ts, run_went_on=False)
        else:
            self._crash(PSEUDO["trainer_error"], Match(PSEUDO["trainer_error"], text), obs.ts, text)

    def _on_stop(self, obs: StopRequested) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at, self.stop_by = obs.ts, obs.by
            self.pending_traceback = None  # a traceback on the way out of a stop is part of the stop

    def _stopping(self) -> bool:
        return self.stop_requested_at is not None

    def _on_exit(self, obs: ExitObs) -> None:
        if obs.stop_requested:  # the watcher's short form: the registry held a stop request for this run
            self._on_stop(StopRequested(obs.ts, by="request"))
        self.exit_code = obs.code
        if self.pending_traceback is not None and self.pending_traceback.thread and not self._stopping():
            self._settle_pending_traceback(obs.ts, run_went_on=True)
        if self._ended is not None:
            return
        if self._final is not None:
            self._ended = ("crashed" if obs.code else "exited", obs.code, obs.ts)
            self._final.ended, self._final.exit_code = self._ended[0], obs.code
            return
        if self._stopping() or (self.done_reason == "sigterm" and obs.code in SIGTERM_EXITS):
            self._ended = ("stopped", obs.code, obs.ts)
        elif obs.code == 0:
            self._ended = ("exited", 0, obs.ts)
        if self._ended is not None:  # no more steps: the final answer the data allow (steady.conclude)
            if self.steady.conclude() and self.first_steady is None:
                self.first_steady = (self.steady.estimate.declared_step, self.steady.estimate.declared_ts)
        elif self.pending_traceback is not None:
            self._crash(PSEUDO["python_exception"], self.pending_traceback, obs.ts, f"exited {obs.code}")
        else:
            match = Match(PSEUDO["exit_nonzero"], f"exit status {obs.code}")
            self._crash(match.signature, match, obs.ts, f"exited {obs.code} with no traceback in the log")

    def _on_tick(self, obs: TickObs) -> None:
        if self._final is not None or self._ended is not None or self._stopping():
            return  # silence after a stop request is the stop working
        if self.pending_traceback is not None and self.pending_traceback.thread and obs.now - self.pending_since >= 2:
            self._settle_pending_traceback(obs.now, run_went_on=True)
        silent_since, limit, what = self._silence_rule()
        if silent_since is not None and obs.now - silent_since > limit:
            evidence = {"silent_s": round(obs.now - silent_since, 1), "limit_s": round(limit, 1)}
            gpus = describe_gpus([s for s in self.gpu_samples if s.ts >= silent_since])
            if gpus:
                evidence["gpus"] = gpus
            silent, most = seconds_against(obs.now - silent_since, limit)  # never "120 s (limit 120 s)"
            reason = f"{what} for {silent} s (limit {most} s)" + (f"; {gpus}" if gpus else "")
            self._final = self._verdict(Verdict.STALL, self.last_step, obs.now, None, reason, evidence)

    def _silence_rule(self) -> tuple[float | None, float, str]:
        if self.last_step_ts is None:
            return self.start_ts, self.config.first_step_grace_s, "no first step"
        if self._typical_gap is None:
            self._typical_gap = median(self.gaps) if self.gaps else 0.0
        limit = max(self.config.stall_factor * self._typical_gap, self.config.stall_floor_s)
        if self.step_lines <= EARLY_STEP_LINES:  # a slow start: the next steps may recompile as long
            limit = max(limit, self.first_step_s or 0.0, max(self.gaps, default=0.0))
        return self.last_step_ts, limit, f"no new step after step {self.last_step}"

    # ---- verdicts --------------------------------------------------------------------------------
    def _check_too_slow(self, obs: StepObs) -> None:
        estimate = self.steady.estimate
        if not estimate.steady or self.baseline is None or self._final is not None:
            return
        threshold = (1 - self.config.too_slow_tolerance) * self.baseline
        if estimate.interval[1] < threshold:
            reason = (
                f"steady at {estimate.tok_s:,.0f} tok/s, upper bound {estimate.interval[1]:,.0f} is below "
                f"{threshold:,.0f} ({1 - self.config.too_slow_tolerance:.0%} of baseline {self.baseline:,.0f})"
            )
            evidence = {"baseline_tok_s": self.baseline, "threshold_tok_s": threshold}
            self._final = self._verdict(Verdict.TOO_SLOW, obs.step, obs.ts, None, reason, evidence)

    def _crash(self, signature: Signature, match: Match, ts: float | None, why: str) -> None:
        if self._final is not None:
            return
        if self._stopping():
            self.ignored_after_stop += 1
            return
        evidence = {"line": match.line[:500], "meaning": signature.meaning}
        if match.thread:
            evidence["thread"] = match.thread
        if match.traceback:
            evidence["traceback_tail"] = match.traceback.splitlines()[-8:]
        if self.exit_code is not None:
            evidence["exit_code"] = self.exit_code
        reason = f"{signature.id}: {why}" + (f" (thread {match.thread}, process may still run)" if match.thread else "")
        self._final = self._verdict(Verdict.CRASH, self.last_step, ts, signature, reason, evidence)

    def _verdict(
        self, verdict: Verdict, step: int | None, ts: float | None, signature: Signature | None, reason: str, evidence: dict
    ) -> Decision:
        estimate = self.steady.estimate
        idle = self.idle_gpus.first() if verdict in (Verdict.CRASH, Verdict.STALL) else None
        if idle is not None:
            reason, evidence = f"{reason}; {idle.describe()}", {**evidence, "gpu_idle_first": idle.to_json()}
        climbed = self._climb() if verdict.falls_back() or self._ended is not None else None  # at its end (or crash)
        if climbed is not None:
            reason = f"{reason}; memory was climbing: {climb_text(climbed)}"
        nxt = next_variant(self.chain, self.variant, signature, self.topologies) if verdict.falls_back() else None
        action = action_for(verdict, nxt, fallback_enabled=self.fallback)
        ended, code = (self._ended[0], self._ended[1]) if self._ended else (None, self.exit_code)
        return Decision(
            decision=verdict,
            run=self.run,
            at_step=step,
            at_ts=format_ts(ts),
            signature=signature.id if signature else None,
            steady_tok_s=estimate.tok_s if estimate.steady else None,
            warmup_end_step=estimate.warmup_end_step if estimate.steady else None,
            action=action,
            next_run=None,
            interval=list(estimate.interval) if estimate.steady else None,
            reason=reason,
            evidence={**evidence, **self._common_evidence()},
            next_variant=nxt if action is Action.FALLBACK else None,
            noise_rel=estimate.noise_rel if estimate.steady else None,
            noisy=estimate.noisy if estimate.steady else False,
            ended=ended,
            exit_code=code,
            level_shifts=self.level_shifts(),
            shift_suspected=self.shift_suspected() if verdict == Verdict.STEADY else None,
            degrading=self.degrading() if verdict in (Verdict.STEADY, Verdict.UNDECIDED) else None,
            degrading_at_end=climbed,
            rate="train" if estimate.steady else None,
        )

    def _common_evidence(self) -> dict:
        estimate = self.steady.estimate
        common = {"last_step": self.last_step, "steady": estimate.evidence}
        if estimate.steady or estimate.drifting:
            common["steady_declared_step"] = estimate.declared_step
            common["steady_declared_at"] = format_ts(estimate.declared_ts)
        if estimate.steady:  # the warm-up cut then; warmup_end_step is the cut now (it only moves later)
            common["steady_declared_warmup_end_step"] = estimate.declared_warmup_end_step
        if self.first_steady is not None and self.first_steady[0] != estimate.declared_step:
            common["first_steady_declared_step"] = self.first_steady[0]
            common["first_steady_declared_at"] = format_ts(self.first_steady[1])
        if self.warnings:
            common["known_warnings"] = dict(self.warnings)
        if self.survived_tracebacks:
            common["tracebacks_survived"] = self.survived_tracebacks
        if self.stop_requested_at is not None:
            common["stop_requested_at"] = format_ts(self.stop_requested_at)
            common["stop_requested_by"] = self.stop_by
        if self.ignored_after_stop:
            common["crash_evidence_ignored_after_stop"] = self.ignored_after_stop
        return common

    def decision(self) -> Decision:
        """The verdict held now: crash/stall/too_slow; else steady or drifting (with how the run ended, if it
        did); else stopped or exited once the run ended; else undecided."""
        if self._final is not None:
            return self._final
        estimate = self.steady.estimate
        if estimate.steady:
            return self._verdict(Verdict.STEADY, estimate.declared_step, estimate.declared_ts, None,
                                 self._with_degrading(self._with_ending(estimate.reason)), {})
        if estimate.drifting:
            return self._verdict(Verdict.DRIFTING, estimate.declared_step, estimate.declared_ts, None,
                                 self._with_ending(estimate.reason), {})
        if self._ended is not None:
            how, code, ts = self._ended
            verdict = Verdict.STOPPED if how == "stopped" else Verdict.EXITED
            if self.last_step is None:
                before = " before its first step"
            elif self.first_steady is not None:  # declared steady, then re-opened by a level shift or a decline
                before = f" with the steady verdict of step {self.first_steady[0]} re-opened ({estimate.reason})"
            else:
                before = f" before a steady state was reached ({estimate.reason})"
            return self._verdict(verdict, self.last_step, ts, None, self._ending_text() + before, {"exit_code": code})
        reason = self._with_degrading(estimate.reason) if self.last_step is not None else "waiting for the first step"
        return self._verdict(Verdict.UNDECIDED, self.last_step, self.last_step_ts or self.now, None, reason, {})

    def _ending_text(self) -> str:
        how, code, _ = self._ended
        if how == "stopped":
            who = f"by {self.stop_by}" if self.stop_by else "by a SIGTERM it honoured (event=done reason=sigterm)"
            return f"stopped {who}, exit status {code}"
        return f"exited {code}"

    def _with_ending(self, reason: str) -> str:
        return reason if self._ended is None else f"{reason}; then {self._ending_text()}"

"""Parse one log line of a training run into a typed record.

Two extractors produce the same records:
- the logfmt contract of docs/design.md (`ts=2026-11-29T11:40:03.123Z event=step step=120 tok_s=153200.5 ...`,
  quoted values allowed), and
- a user-supplied regex with named groups (`step`, `tok_s`, optionally `ts`, `loss`, `acc`, `lr`, ...)
  for trainers that print their own format.
Anything else is free text (warnings, tracebacks) and comes back as such.

Parsed fields are validated here, at the parsing boundary: a metric line whose `ts`, `step` or `tok_s` is
out of range (`ts=1e20`, a step too large for the registry, a negative or infinite tok/s) comes back as a
MalformedLine carrying the reason, for the caller to count and show; nothing downstream (time conversion,
SQLite, the statistics) ever sees such a value. Optional figures (loss, acc, ...) may be NaN or infinite:
a NaN loss is something the judge must see.

This module must not raise on a line's content, whatever the bytes were (the caller decodes with
errors="replace"), and must not read a clock: a line without its own timestamp takes `received_ts`,
the time the watcher received it, passed in by the caller.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .agent.protocol import read_number
from .errors import UsageError
from .words import plural

PAIR_RE = re.compile(r'([A-Za-z_][\w.\-/]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)')
UNESCAPE_RE = re.compile(r"\\(.)")
ESCAPES = {"n": "\n", "t": "\t"}
PHASES = frozenset({"warmup", "train", "eval", "checkpoint"})
FLOAT_FIELDS = ("loss", "acc", "lr", "q_fill", "mem_gb")
KNOWN_KEYS = frozenset({"ts", "event", "step", "tok_s", "phase", "active", *FLOAT_FIELDS})
MIN_TS = 0.0
MAX_TS = 253402300799.0  # 9999-12-31T23:59:59Z, the last second datetime can show
MAX_STEP = 2**63 - 1  # SQLite's INTEGER
MAX_TOK_S = 1e12  # a trillion tokens per second: beyond any machine, so a garbled figure
EVENT_COUNTS = ("steps",)  # numeric fields of other events (start's steps=): checked as a step is


@dataclass(frozen=True)
class StepRecord:
    """One `event=step` metric line: throughput and the optional training figures."""

    ts: float  # epoch seconds (from the line, else the time it was received)
    step: int
    tok_s: float
    loss: float | None = None
    acc: float | None = None
    lr: float | None = None
    q_fill: float | None = None
    active: str | None = None  # "7/8": drafter threads still working
    mem_gb: float | None = None
    phase: str = "train"
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EventRecord:
    """A logfmt line with another event (start, compile, eval, checkpoint, done, error)."""

    ts: float
    event: str
    fields: dict[str, str]

    def count(self, name: str) -> int | None:
        """One of EVENT_COUNTS (start's `steps`) as an int; None when the line has none (parse_logfmt made a
        line whose count is out of range a MalformedLine)."""
        return read_number(self.fields.get(name), 0, MAX_STEP, integer=True)


@dataclass(frozen=True)
class TextLine:
    """Anything that is not a metric line: warnings, tracebacks, prints."""

    ts: float | None
    text: str


@dataclass(frozen=True)
class MalformedLine(TextLine):
    """A metric line (logfmt `event=...`, or a match of the user's regex) with a field out of range: shown and
    counted like free text, never stored or judged as a step. `reason` says which field and why."""

    reason: str = ""


Record = StepRecord | EventRecord | TextLine


def step_problem(step: object, ts: object, tok_s: object) -> str | None:
    """Why these step fields cannot be a sample (None when they can): the one range check, applied to parsed
    lines and to samples an older dfo stored."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return f"step={step} is not an integer in 0..{MAX_STEP}"
    if isinstance(tok_s, bool) or not isinstance(tok_s, (int, float)) or not 0 <= tok_s <= MAX_TOK_S:
        return f"tok_s={tok_s} is not a number in 0..{MAX_TOK_S:g}"
    return ts_problem(ts)


def ts_problem(ts: object) -> str | None:
    """Why `ts` (epoch seconds) is no usable time, or None."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not MIN_TS <= ts <= MAX_TS:
        return f"ts={ts} is not a time between 1970 and 9999"
    return None


def parse_ts(value: str) -> float | None:
    """RFC 3339 / ISO 8601 (naive means UTC) or epoch seconds -> epoch seconds; None if unreadable or outside
    1970..9999."""
    value = value.strip()
    if not value or not value.isascii():
        return None
    number = read_number(value, MIN_TS, MAX_TS)
    if number is None:
        try:
            moment = datetime.fromisoformat(value.replace(",", "."))
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            number = moment.timestamp()
        except (ValueError, OverflowError):
            return None
    return number if number is not None and ts_problem(number) is None else None


def format_ts(epoch: float | None) -> str | None:
    """Epoch seconds -> `2026-11-29T11:40:03.123Z` (the contract's own form)."""
    if epoch is None or ts_problem(epoch) is not None:
        return None
    moment = datetime.fromtimestamp(epoch, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def logfmt_pairs(text: str) -> dict[str, str]:
    """All `key=value` pairs of a line, quotes removed and `\\"` unescaped. Later keys win."""
    pairs: dict[str, str] = {}
    for key, raw in PAIR_RE.findall(text):
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = UNESCAPE_RE.sub(lambda m: ESCAPES.get(m.group(1), m.group(1)), raw[1:-1])
        pairs[key] = raw
    return pairs


NONFINITE = frozenset({"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"})


def _float(value: str | None) -> float | None:
    """An optional figure (loss, acc, ...): a finite number through read_number, or NaN/Infinity written as such
    (a NaN loss is something the judge must see); None when absent or unreadable."""
    if value is None:
        return None
    if value.strip().lower() in NONFINITE:
        return float(value)
    return read_number(value, -math.inf, math.inf)


def step_from_fields(fields: dict[str, str], received_ts: float | None) -> StepRecord | str | None:
    """A StepRecord from already-extracted fields; None when step/tok_s/a time are missing; the reason (text)
    when one of them is there but unreadable or out of range."""
    if fields.get("step") is None or fields.get("tok_s") is None:
        return None
    step, tok_s = read_number(fields["step"], 0, MAX_STEP, integer=True), read_number(fields["tok_s"], 0, MAX_TOK_S)
    if fields.get("ts"):
        ts = parse_ts(fields["ts"])
        if ts is None:
            return f"ts={fields['ts'][:40]} is not a time between 1970 and 9999"
    else:
        ts = received_ts
    if ts is None:
        return None
    problem = step_problem(step if step is not None else fields["step"][:40],
                           ts, tok_s if tok_s is not None else fields["tok_s"][:40])
    if problem:
        return problem
    phase = fields.get("phase") or "train"
    return StepRecord(
        ts=ts,
        step=step,
        tok_s=tok_s,
        phase=phase if phase in PHASES else "train",
        active=fields.get("active"),
        extra={k: v for k, v in fields.items() if k not in KNOWN_KEYS},
        **{name: _float(fields.get(name)) for name in FLOAT_FIELDS},
    )


def parse_logfmt(text: str, received_ts: float | None = None) -> Record:
    """One line of the logfmt contract -> StepRecord / EventRecord; anything else -> TextLine."""
    line = text.rstrip("\r\n")
    if "event=" not in line:
        return TextLine(received_ts, line)
    fields = logfmt_pairs(line)
    event = fields.get("event", "")
    if not event or not line.lstrip().startswith(("ts=", "event=")):
        return TextLine(received_ts, line)
    if event == "step":
        return _step_or_text(step_from_fields(fields, received_ts), line, received_ts)
    if fields.get("ts"):
        ts = parse_ts(fields["ts"])
        if ts is None:
            return MalformedLine(received_ts, line, f"ts={fields['ts'][:40]} is not a time between 1970 and 9999")
    else:
        ts = received_ts
    if ts is None:
        return TextLine(received_ts, line)
    for name in EVENT_COUNTS:
        if name in fields and EventRecord(ts, event, fields).count(name) is None:
            return MalformedLine(received_ts, line, f"{name}={fields[name][:40]} is not an integer in 0..{MAX_STEP}")
    return EventRecord(ts=ts, event=event, fields=fields)


def _step_or_text(record: StepRecord | str | None, line: str, received_ts: float | None) -> Record:
    if isinstance(record, StepRecord):
        return record
    if isinstance(record, str):
        return MalformedLine(received_ts, line, record)
    return TextLine(received_ts, line)


METRIC_GROUPS = ("step", "tok_s")
"""The named groups a `metrics:` regex must have: without both, no line of it can be a step."""


def metrics_regex_problem(pattern: str) -> str | None:
    """What is wrong with a `metrics:` regex (it does not compile, or lacks a required group), or None. The one
    check, made by the inventory when it loads and by RegexExtractor."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        return f"{pattern!r} does not compile: {exc} (fix the regex)"
    missing = [group for group in METRIC_GROUPS if group not in regex.groupindex]
    if missing:
        return (f"{pattern!r} lacks the named {plural(len(missing), 'group')} {', '.join(missing)} "
                "(add e.g. (?P<step>\\d+) and (?P<tok_s>[\\d.]+))")
    return None


class RegexExtractor:
    """A user's own metric format: a regex with named groups `step` and `tok_s` (and optionally `ts`,
    `loss`, `acc`, `lr`, `q_fill`, `mem_gb`, `phase`, `active`). Lines it does not match go through
    the logfmt parser, so a user trainer that also prints contract lines still works."""

    def __init__(self, pattern: str) -> None:
        problem = metrics_regex_problem(pattern)
        if problem:
            raise UsageError(f"metrics regex {problem}")
        self.regex = re.compile(pattern)

    def __call__(self, text: str, received_ts: float | None = None) -> Record:
        line = text.rstrip("\r\n")
        match = self.regex.search(line)
        if match is None:
            return parse_logfmt(line, received_ts)
        fields = {k: v for k, v in match.groupdict().items() if v is not None}
        return _step_or_text(step_from_fields(fields, received_ts), line, received_ts)


def make_parser(regex: str | None = None):
    """The line parser to use: `parse_logfmt`, or a RegexExtractor when the variant gives `metrics:`."""
    return RegexExtractor(regex) if regex else parse_logfmt

"""Parse one log line of a training run into a typed record.

Two extractors produce the same records:
- the logfmt contract of DESIGN.md (`ts=2026-11-29T11:40:03.123Z event=step step=120 tok_s=153200.5 ...`,
  quoted values allowed), and
- a user-supplied regex with named groups (`step`, `tok_s`, optionally `ts`, `loss`, `acc`, `lr`, ...)
  for trainers that print their own format.
Anything else is free text (warnings, tracebacks) and comes back as such.

This module must not raise on a line's content, whatever the bytes were (the caller decodes with
errors="replace"), and must not read a clock: a line without its own timestamp takes `received_ts`,
the time the watcher received it, passed in by the caller.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .errors import UsageError

PAIR_RE = re.compile(r'([A-Za-z_][\w.\-/]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)')
UNESCAPE_RE = re.compile(r"\\(.)")
ESCAPES = {"n": "\n", "t": "\t"}
PHASES = frozenset({"warmup", "train", "eval", "checkpoint"})
FLOAT_FIELDS = ("loss", "acc", "lr", "q_fill", "mem_gb")
KNOWN_KEYS = frozenset({"ts", "event", "step", "tok_s", "phase", "active", *FLOAT_FIELDS})


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


@dataclass(frozen=True)
class TextLine:
    """Anything that is not a metric line: warnings, tracebacks, prints."""

    ts: float | None
    text: str


Record = StepRecord | EventRecord | TextLine


def parse_ts(value: str) -> float | None:
    """RFC 3339 / ISO 8601 (naive means UTC) or epoch seconds -> epoch seconds; None if unreadable."""
    value = value.strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        return number if math.isfinite(number) else None
    try:
        moment = datetime.fromisoformat(value.replace(",", "."))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def format_ts(epoch: float | None) -> str | None:
    """Epoch seconds -> `2026-11-29T11:40:03.123Z` (the contract's own form)."""
    if epoch is None:
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


def _float(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)  # "nan" and "inf" stay: a NaN loss is something the judge must see
    except ValueError:
        return None


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        number = _float(value)
        return int(number) if number is not None and number.is_integer() else None


def step_from_fields(fields: dict[str, str], received_ts: float | None) -> StepRecord | None:
    """A StepRecord from already-extracted fields, or None when step/tok_s/a time are missing or bad."""
    step = _int(fields.get("step"))
    tok_s = _float(fields.get("tok_s"))
    ts = parse_ts(fields["ts"]) if fields.get("ts") else None
    ts = ts if ts is not None else received_ts
    if step is None or tok_s is None or ts is None:
        return None
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
        record = step_from_fields(fields, received_ts)
        return record if record is not None else TextLine(received_ts, line)
    ts = parse_ts(fields.get("ts", "")) if fields.get("ts") else None
    ts = ts if ts is not None else received_ts
    if ts is None:
        return TextLine(received_ts, line)
    return EventRecord(ts=ts, event=event, fields=fields)


class RegexExtractor:
    """A user's own metric format: a regex with named groups `step` and `tok_s` (and optionally `ts`,
    `loss`, `acc`, `lr`, `q_fill`, `mem_gb`, `phase`, `active`). Lines it does not match go through
    the logfmt parser, so a user trainer that also prints contract lines still works."""

    def __init__(self, pattern: str) -> None:
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise UsageError(f"metrics regex {pattern!r} does not compile: {exc}", hint="fix the regex") from exc
        missing = {"step", "tok_s"} - set(self.regex.groupindex)
        if missing:
            raise UsageError(
                f"metrics regex {pattern!r} lacks the named group(s) {', '.join(sorted(missing))}",
                hint="add e.g. (?P<step>\\d+) and (?P<tok_s>[\\d.]+)",
            )

    def __call__(self, text: str, received_ts: float | None = None) -> Record:
        line = text.rstrip("\r\n")
        match = self.regex.search(line)
        if match is None:
            return parse_logfmt(line, received_ts)
        fields = {k: v for k, v in match.groupdict().items() if v is not None}
        record = step_from_fields(fields, received_ts)
        return record if record is not None else TextLine(received_ts, line)


def make_parser(regex: str | None = None):
    """The line parser to use: `parse_logfmt`, or a RegexExtractor when the variant gives `metrics:`."""
    return RegexExtractor(regex) if regex else parse_logfmt

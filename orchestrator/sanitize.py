"""Remote text made safe to show: the one display boundary for what runs, containers and hosts print.

A run's log, a crash line, nvidia-smi's or pct's words, a remote command's stderr: all of it is untrusted
(docs/security.md). Shown to a person it must neither drive the terminal nor style itself:
- control characters (C0 but newline where a caller keeps it, DEL, C1, and the bidirectional overrides of
  "Trojan source") are made visible as `\\x1b`-style escapes, never written raw: `ESC]52;c;...` cannot
  reach the clipboard, `ESC[2J` cannot clear the screen;
- rich markup in it is never parsed: `[/x]` cannot raise MarkupError, `[bold red]` styles nothing.

`visible()` is the text rule; `text()` and `markup()` give it to rich as a Text or as escaped markup;
`SafeConsole` applies `visible()` to every segment it renders, so a site that forgot still cannot emit a raw
control character (rich's own styling travels outside the segment text and is kept). `json_line()` is the
same boundary for --json: strict RFC 8259 JSON (a NaN loss becomes null plus a `nonfinite` note), with
controls escaped by JSON itself.

What it must not do: change text that is safe (printable text, newlines where kept), or read anything.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable
from urllib.parse import urlsplit

from rich.console import Console, ConsoleOptions, RenderableType
from rich.markup import escape
from rich.segment import Segment
from rich.text import Text

BIDI_CONTROLS = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
UNSAFE = re.compile(f"[\x00-\x09\x0b-\x1f\x7f-\x9f{BIDI_CONTROLS}]")
UNSAFE_WITH_NEWLINE = re.compile(f"[\x00-\x1f\x7f-\x9f{BIDI_CONTROLS}]")


def _escape_char(match: re.Match) -> str:
    code = ord(match.group())
    if code == 0x09:
        return " "  # a tab moves the cursor, nothing worse: a space keeps the text readable
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(value: object, *, keep_newlines: bool = False) -> str:
    """`value` as text with every control character written as an escape (`\\x1b`, `\\x07`, `\\u202e`; a
    tab becomes a space).
    A newline is escaped too unless `keep_newlines` (multi-line text such as a traceback)."""
    text = value if isinstance(value, str) else str(value)
    return (UNSAFE if keep_newlines else UNSAFE_WITH_NEWLINE).sub(_escape_char, text)


def is_visible(text: str, *, keep_newlines: bool = True) -> bool:
    """Whether `text` holds no raw control character (newlines allowed unless `keep_newlines` is False)."""
    return (UNSAFE if keep_newlines else UNSAFE_WITH_NEWLINE).search(text) is None


def text(value: object, style: str = "", **kwargs) -> Text:
    """Remote text as a rich Text: controls made visible, markup never parsed."""
    return Text(visible(value), style=style, **kwargs)


def markup(value: object) -> str:
    """Remote text to embed in a rich markup string: controls made visible, brackets escaped."""
    return escape(visible(value))


class SafeConsole(Console):
    """A rich Console that writes no raw control character from content, whatever a caller passes it.

    Rich keeps its own terminal codes (styles, cursor moves of a Live display) out of the segment text, in
    styles and control segments; only content text passes through `visible()`. Newlines are kept (rich
    itself breaks lines with them)."""

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control or is_visible(segment.text):
                yield segment
            else:
                yield Segment(visible(segment.text, keep_newlines=True), segment.style)


def url_origin(url: str) -> str:
    """A URL as it may be shown or stored: `scheme://host[:port]` only. A webhook's path and query are its
    secret (Slack's /services/T/B/KEY), and `user:password@` is a credential; neither is ever shown."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "?", parts.port
    except ValueError:  # an unreadable port or host: nothing of it is shown
        return "(an unreadable URL)"
    host = f"[{host}]" if ":" in host else host
    return visible(f"{parts.scheme}://{host}" + (f":{port}" if port is not None else ""))


def finite_json(value: Any) -> Any:
    """`value` with every NaN/Infinity float replaced by null, which RFC 8259 JSON can carry: a dict that held
    one gains `"nonfinite": {key: "NaN" | "Infinity" | "-Infinity"}` (for a list: the list of those, null
    for the finite items), so the value is not lost. docs/watch.md describes it."""
    return _finite(value)[0]


def _finite(value: Any) -> tuple[Any, Any]:
    if isinstance(value, float) and not math.isfinite(value):
        return None, "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        clean, marks = {}, {}
        for key, item in value.items():
            clean[key], mark = _finite(item)
            if mark is not None:
                marks[key] = mark
        if marks:
            clean["nonfinite"] = {**clean.get("nonfinite", {}), **marks} if isinstance(clean.get("nonfinite"), dict) else marks
        return clean, None
    if isinstance(value, (list, tuple)):
        pairs = [_finite(item) for item in value]
        marks = [mark for _, mark in pairs]
        return [item for item, _ in pairs], (marks if any(mark is not None for mark in marks) else None)
    return value, None


def json_line(value: Any) -> str:
    """One line of strict JSON (no NaN/Infinity; see finite_json); objects it cannot encode become strings."""
    return json.dumps(finite_json(value), default=str, allow_nan=False)

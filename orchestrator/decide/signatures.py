"""The crash catalogue (docs/design.md, "Crash signatures") as data, and a matcher over a run's free-text lines.

A Signature is {id, pattern, meaning, next, fatal, scope}: `scope="line"` patterns are searched in each
line; `scope="traceback"` patterns are searched in the text of one whole traceback (from `Traceback (most
recent call last):` through its exception line), so multi-line shapes such as cudagraph_tls (an assertion
in cudagraph_trees.py get_obj ending in a BARE AssertionError) are recognised. `next` names the variants
to prefer after this crash (() = the next one in the chain, None = no automatic fallback: stop).
Non-fatal entries (known warnings) are recognised and reported, never judged a crash.

Tracebacks: `Exception in thread NAME:` before one makes it a worker-thread crash (the PID lives on, the
run is broken). A traceback matching no signature is `python_exception` only once it ends the run (a
non-zero exit, or no step after it by the end of the log): the MatchTracker leaves that call to the judge.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UsageError

TRACEBACK_START = "Traceback (most recent call last):"
THREAD_HEADER_RE = re.compile(r"^Exception in thread (?P<name>.+?):?\s*$")
CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
WINDOW_LINES = 400  # longest traceback kept whole


@dataclass(frozen=True)
class Signature:
    id: str
    pattern: str
    meaning: str
    next: tuple[str, ...] | None = ()  # () -> next in chain; None -> stop; names -> first of them in the chain
    fatal: bool = True
    scope: str = "line"  # "line" | "traceback"
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flags = re.MULTILINE if self.scope == "traceback" else 0
        object.__setattr__(self, "regex", re.compile(self.pattern, flags))


BUILTIN = (
    Signature(
        "cudagraph_tls",
        r'cudagraph_trees\.py", line \d+, in get_obj\n\s*assert torch\._C\._is_key_in_tls\([^\n]*\n'
        r"(?:\s*[\^~]+\s*\n)?AssertionError\s*\Z",
        "CUDAGraph Trees used from a non-main thread: their thread-local state exists only in the importing "
        "thread (pytorch/pytorch#123177)",
        ("notrees", "nographs"),
        scope="traceback",
    ),
    Signature(
        "cuda_capture_unsupported",
        r"operation not permitted when stream is capturing|cudaErrorStreamCaptureUnsupported"
        r"|operation failed due to a previous error during capture|cudaErrorStreamCaptureInvalidated",
        "another thread synchronised while this one was capturing a CUDA graph",
        ("nographs",),
    ),
    Signature(
        "cudagraph_pool_untracked",
        r"Detected \d+ tensor\(s\) in the cudagraph pool not tracked as outputs",
        "threads share one CUDAGraph tree manager and memory pool, which is not thread-safe",
        ("nographs",),
    ),
    Signature(
        "cudagraph_static_ptr",
        r"static input data pointer changed",
        "an input tensor was rebound instead of copied into the CUDA graph's static buffer",
        ("nographs",),
    ),
    Signature(
        "cudagraph_static_ptr",
        r"assert dst\.data_ptr\(\) == src\.data_ptr\(\)[^\n]*\n(?:\s*[\^~]+\s*\n)?AssertionError\s*\Z",
        "an input tensor was rebound instead of copied into the CUDA graph's static buffer",
        ("nographs",),
        scope="traceback",
    ),
    Signature(
        "cudagraph_overwritten",
        r"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run",
        "the output of a CUDA graph replay was kept across the next replay",
        ("nographs",),
    ),
    Signature(
        "cuda_oom",
        r"(?:torch\.(?:cuda\.)?OutOfMemoryError: )?CUDA out of memory\. Tried to allocate",
        "CUDA out of memory: a smaller batch, or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    ),
    Signature(
        "peer_lost",
        r"cause=peer_lost|PeerLost: ",
        "a collective failed because a rank on another node ended or became unreachable: a consequence of "
        "that node's failure (a multi-node run names the node that failed first)",
        None,
    ),
    Signature(
        "rendezvous",
        r"cause=rendezvous",
        "the nodes of a multi-node run did not meet: the rendezvous port was taken, or a node never came or "
        "could not reach node 0 (docs/multinode.md)",
        None,
    ),
    Signature(
        "nccl",
        r"NCCL error|Watchdog caught collective operation timeout",
        "a rank died or hung in a collective: stop the whole run",
        None,
    ),
    Signature(
        "online_softmax_warning",
        r"Online softmax is disabled on the fly",
        "Inductor split a reduction; harmless",
        fatal=False,
    ),
    Signature("skipping_cudagraphs", r"skipping cudagraphs due to", "Inductor ran a graph without CUDA graphs; harmless", fatal=False),
)

# Crashes the judge names itself (no pattern of their own); listed so that `next` is data here too.
PSEUDO = {
    "python_exception": Signature("python_exception", r"(?!)", "an uncaught Python exception ended the run", None),
    "nan_loss": Signature("nan_loss", r"(?!)", "the loss became NaN or infinite"),
    "exit_nonzero": Signature("exit_nonzero", r"(?!)", "the process exited with a non-zero status"),
    "trainer_error": Signature("trainer_error", r"(?!)", "the trainer reported event=error", None),
}


def signature_from_entry(entry: dict) -> Signature:
    """An inventory entry {id, pattern, meaning, next, fatal?, scope?} -> Signature (UsageError if bad).

    `next`: absent -> the next variant of the chain; "stop" -> no fallback; "a or b" / [a, b] -> preferences."""
    try:
        nxt = entry.get("next")
        if nxt in (None, ""):
            nxt = ()  # no preference: the next variant of the chain
        elif nxt == "stop":
            nxt = None
        elif isinstance(nxt, str):
            nxt = tuple(name for name in re.split(r"[,\s]+|\bor\b", nxt) if name.strip())
        else:
            nxt = tuple(nxt)
        return Signature(
            id=str(entry["id"]),
            pattern=str(entry["pattern"]),
            meaning=str(entry.get("meaning", "")),
            next=nxt,
            fatal=bool(entry.get("fatal", True)),
            scope=str(entry.get("scope", "line")),
        )
    except KeyError as exc:
        raise UsageError(f"crash signature entry {entry!r} lacks {exc.args[0]!r}", hint="give id and pattern") from exc
    except re.error as exc:
        raise UsageError(f"crash signature {entry.get('id')!r}: pattern does not compile: {exc}") from exc


class Catalogue:
    """An ordered list of signatures; inventory entries come first and replace built-ins of the same id."""

    def __init__(self, signatures: tuple[Signature, ...] = BUILTIN) -> None:
        self.signatures = tuple(signatures)

    def extended(self, entries: list[dict] | None) -> "Catalogue":
        extra = tuple(signature_from_entry(entry) for entry in entries or ())
        replaced = {sig.id for sig in extra}
        return Catalogue(extra + tuple(sig for sig in self.signatures if sig.id not in replaced))

    def by_id(self, signature_id: str) -> Signature | None:
        found = next((sig for sig in self.signatures if sig.id == signature_id), None)
        return found or PSEUDO.get(signature_id)

    def match_line(self, text: str) -> Signature | None:
        """The first line-scope signature found in `text`; a known warning wins over everything."""
        hits = [sig for sig in self.signatures if sig.scope == "line" and sig.regex.search(text)]
        benign = [sig for sig in hits if not sig.fatal]
        return benign[0] if benign else (hits[0] if hits else None)

    def match_traceback(self, text: str) -> Signature | None:
        """A traceback-scope signature of the whole text, else a fatal line-scope one in any of its lines."""
        whole = next((sig for sig in self.signatures if sig.scope == "traceback" and sig.regex.search(text)), None)
        if whole is not None:
            return whole
        in_lines = (self.match_line(line) for line in text.splitlines())
        return next((sig for sig in in_lines if sig is not None and sig.fatal), None)


@dataclass(frozen=True)
class Match:
    """What the tracker saw: a signature (or a bare traceback when `signature` is None)."""

    signature: Signature | None
    line: str  # the line that completed the match (an exception line, or the matching line)
    thread: str | None = None  # set when the traceback came from `Exception in thread NAME`
    traceback: str | None = None


class MatchTracker:
    """Feeds on free-text lines; returns a Match when a signature line or a complete traceback appears."""

    def __init__(self, catalogue: Catalogue) -> None:
        self.catalogue = catalogue
        self._traceback: list[str] | None = None
        self._thread: str | None = None
        self._pending_thread: str | None = None

    def feed(self, text: str) -> list[Match]:
        line = text.rstrip("\r\n")
        matches: list[Match] = []
        if self._traceback is not None:
            completed = self._extend_traceback(line)
            if completed is not None:
                matches.append(completed)
        elif line.startswith(TRACEBACK_START):
            self._start_traceback(line)
        elif line in CHAIN_LINES:
            self._pending_thread = self._thread  # a chained traceback belongs to the same thread
        header = THREAD_HEADER_RE.match(line)
        if header:
            self._pending_thread = header.group("name")
        signature = self.catalogue.match_line(line)
        if signature is not None and not any(m.signature and m.signature.id == signature.id for m in matches):
            matches.append(Match(signature, line, self._thread))
        return matches

    def _start_traceback(self, line: str) -> None:
        self._traceback = [line]
        self._thread, self._pending_thread = self._pending_thread, None

    def _extend_traceback(self, line: str) -> Match | None:
        if (line.startswith((" ", "\t")) or not line.strip()) and len(self._traceback) < WINDOW_LINES:
            self._traceback.append(line)
            return None
        if line.startswith(TRACEBACK_START) or line in CHAIN_LINES:
            self._traceback.append(line)
            return None
        self._traceback.append(line)
        text = "\n".join(self._traceback)
        self._traceback = None
        return Match(self.catalogue.match_traceback(text), line, self._thread, text)

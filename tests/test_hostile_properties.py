"""Property tests (hypothesis) for hostile input (issue 13): generated hostile lines, byte strings, binary and
large files, and truncations interleaved with writes, thrown at the log parser, the agent protocol, the agent's
log follower, `dfo replay` and the watcher's store path. Whatever arrives: no exception escapes, no raw
control character reaches what a person sees, and every well-formed step line is stored exactly once.

The default run is bounded for CI (6 s here, under load): HYPOTHESIS_EXAMPLES raises the example count."""

from __future__ import annotations

import io
import os
import random
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from harness import write_inventory
from orchestrator.agent.agent import Agent, Follow
from orchestrator.agent.protocol import FrameDecoder, ProtocolError, encode_record
from orchestrator.cli import app
from orchestrator.connections import Connections
from orchestrator.inventory import load_inventory
from orchestrator.logfmt import MAX_STEP, EventRecord, MalformedLine, StepRecord, format_ts, make_parser, parse_logfmt
from orchestrator.observe import Observation, RunTracker, FollowSpec
from orchestrator.store import Run, Store
from orchestrator.view import render
from orchestrator.watch import Watcher

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "60"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RAW_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

# ------------------------------------------------------------------ what an attacker (or a broken trainer) prints

CONTROL = st.sampled_from(["\x1b]52;c;aGk=\x07", "\x1b[2J", "\x1b[31m", "\x9b1;1H", "\x07", "\x08", "\r", "\x00",
                           "\u202e", "\x1bP+q\x1b\\", "\t"])
MARKUP = st.sampled_from(["[/x]", "[bold red]", "[/]", "[link=file:///etc/passwd]x[/link]", "[", "]", "\\["])
NUMBER = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["1e20", "-1e308", "1e309", "nan", "inf", "-inf", "0x10", "", "99999999999999999999999",
                     "9" * 500, "1_000", "١٢٣"]),
)
TS = st.one_of(NUMBER, st.sampled_from(["2026-11-29T11:40:03.123Z", "9999-12-31T23:59:59-23:59",
                                        "0001-01-01T00:00:00+23:59", "2026-13-45T99:99:99Z", "now"]))
FIELD = st.sampled_from(["step", "tok_s", "loss", "ts", "event", "phase", "active", "acc", "lr", "q_fill", "mem_gb", "x"])
VALUE = st.one_of(NUMBER, TS, st.text(max_size=20), CONTROL, MARKUP, st.just('"quoted \\" value"'))
LOGFMT = st.lists(st.tuples(FIELD, VALUE), max_size=8).map(lambda pairs: " ".join(f"{k}={v}" for k, v in pairs))
PREFIX = st.sampled_from(["", "ts=1e20 event=step ", "event=step ", "ts=2026-11-29T11:40:03Z event=step ",
                          "ts=2026-11-29T11:40:03Z event=done "])
STEP_FIELDS = st.builds(lambda ts, step, tok_s, loss: f"ts={ts} event=step step={step} tok_s={tok_s} loss={loss}",
                        TS, NUMBER, NUMBER, NUMBER)
FREE_TEXT = st.lists(st.one_of(st.text(max_size=30), CONTROL, MARKUP), max_size=8).map("".join)
CRASH_LINE = FREE_TEXT.map(lambda text: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB " + text)
HOSTILE_LINE = st.one_of(
    STEP_FIELDS,
    CRASH_LINE,
    st.builds(lambda p, body: p + body, PREFIX, LOGFMT),
    FREE_TEXT,
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")),
)


def step_line(step: int, ts: float, tok_s: float) -> str:
    return f"ts={format_ts(ts)} event=step step={step} tok_s={tok_s:.1f} loss=2.0 phase=train"


def assert_visible(text: str) -> None:
    found = RAW_CONTROLS.search(text.replace("\x1b[", "").replace("\n", ""))  # rich's own SGR codes start with ESC[
    assert found is None, f"raw control {found.group()!r} in {text[max(0, found.start() - 40):found.end() + 40]!r}"


# ------------------------------------------------------------------ the log parser


@FAST
@given(line=HOSTILE_LINE, received=st.one_of(st.none(), st.floats(min_value=0, max_value=4e9)))
@example(line="ts=1e20 event=step step=5 tok_s=100.0", received=None)
@example(line="ts=1e20 event=eval acc=0.5", received=1.8e9)
def test_the_parser_never_raises_and_lets_no_out_of_range_field_through(line, received):
    for parse in (parse_logfmt, make_parser(r"step (?P<step>\S+) .*?(?P<tok_s>\S+) tok/s(?: at (?P<ts>\S+))?")):
        record = parse(line, received)
        if isinstance(record, StepRecord):
            assert 0 <= record.step <= MAX_STEP and 0 <= record.tok_s <= 1e12
            assert format_ts(record.ts) is not None  # the time converts (no OverflowError downstream)
        elif isinstance(record, EventRecord):
            assert format_ts(record.ts) is not None
        else:
            assert isinstance(record.text, str)
            if isinstance(record, MalformedLine):
                assert record.reason


# ------------------------------------------------------------------ the agent protocol


@FAST
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=6))
def test_the_frame_decoder_raises_only_protocol_errors_on_any_bytes(data, cuts):
    decoder = FrameDecoder()
    try:
        for piece in split(data, cuts):
            for record in decoder.feed(piece):
                assert isinstance(record.header, dict) and "t" in record.header
    except ProtocolError:
        pass


@FAST
@given(payloads=st.lists(st.binary(max_size=3000), min_size=1, max_size=6),
       cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=10))
def test_framed_log_records_survive_any_split_byte_for_byte(payloads, cuts):
    stream = b"".join(encode_record({"t": "log", "run": "r", "off": i}, p) for i, p in enumerate(payloads))
    decoder = FrameDecoder()
    records = [r for piece in split(stream, cuts) for r in decoder.feed(piece)]
    assert [r.payload for r in records] == payloads and decoder.pending == 0


@FAST
@given(line=st.one_of(st.binary(max_size=300), st.builds(lambda s: s.encode(), LOGFMT)))
def test_the_agent_answers_any_command_line_with_nothing_or_an_error_record(line):
    agent = Agent(0, io.BytesIO())
    answer = agent.apply(line)
    if answer is not None:
        [record] = FrameDecoder().feed(answer)
        assert record.type == "error"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


# ------------------------------------------------------------------ the log follower: writes and truncations


OPERATION = st.one_of(
    st.tuples(st.just("append"), st.binary(max_size=3000)),
    st.tuples(st.just("truncate"), st.binary(max_size=6000)),  # copytruncate, then the trainer writes on
    st.tuples(st.just("rotate"), st.binary(max_size=6000)),  # renamed away, a new file in its place
    st.tuples(st.just("reattach"), st.just(b"")),  # the watch ends; the next one resumes from the stored state
)


@FAST
@given(operations=st.lists(OPERATION, min_size=1, max_size=12))
def test_interleaved_writes_truncations_and_rotations_lose_no_byte(operations, tmp_path_factory):
    """After every operation, what the follower delivered since its last `truncated` is exactly the file."""
    directory = tmp_path_factory.mktemp("follow")
    log = directory / "run.log"
    log.write_bytes(b"")
    follow = Follow({"run": "r", "log": str(log), "offset": 0})
    delivered = b""
    for generation, (kind, data) in enumerate(operations):
        if kind == "append":
            with open(log, "ab") as f:
                f.write(data)
        elif kind == "reattach":
            follow = Follow({"run": "r", "log": str(log), "offset": follow.offset, "ident": follow.ident})
        else:
            if kind == "rotate":
                log.rename(directory / f"run.log.{generation}")
            with open(log, "wb") as f:  # a new life of the log: its first line is its own (a timestamp, in life)
                f.write(b"generation %d\n" % generation + data)
        records = FrameDecoder().feed(b"".join(follow.log_records(1 << 24)))
        for record in records:
            if record.type == "truncated":
                delivered = b""
            elif record.type == "log":
                assert record.header["off"] == len(delivered)
                delivered += record.payload
        assert delivered == log.read_bytes()


@FAST
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), size=st.integers(min_value=0, max_value=3_000_000))
@example(seed=7, size=3_000_000)
def test_binary_and_large_files_arrive_whole_through_follower_and_tracker(seed, size, tmp_path_factory):
    data = random.Random(seed).randbytes(size)
    log = tmp_path_factory.mktemp("binary") / "run.log"
    log.write_bytes(data)
    follow = Follow({"run": "r", "log": str(log), "offset": 0})
    tracker = RunTracker(FollowSpec("r", str(log)), 0)
    lines = []
    for _ in range(8):
        for record in FrameDecoder().feed(b"".join(follow.log_records(1 << 20))):
            if record.type == "log":
                got, complaint = tracker.take(record.header["off"], record.payload)
                assert complaint is None
                lines += got
    assert follow.offset == size
    assert tracker.consumed + len(tracker.partial) == size
    assert sum(len(line.encode("utf-8", "surrogateescape")) >= 0 for line in lines) == len(lines)


# ------------------------------------------------------------------ dfo replay


KNOWN_ATTACKS = [  # issue 13's findings, always tried besides the generated ones
    "ts=1e20 event=step step=5 tok_s=100.0",
    "ts=2026-11-29T11:40:03Z event=step step=99999999999999999999999 tok_s=100.0",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB [/x] \x1b]52;c;aGk=\x07 \x1b[2J [bold red]X[/]",
]


@FAST
@given(hostile=st.lists(HOSTILE_LINE, max_size=12), good=st.integers(min_value=0, max_value=30), seed=st.integers(0, 9))
@example(hostile=KNOWN_ATTACKS, good=20, seed=3)
def test_replay_of_any_log_ends_with_a_verdict_and_shows_no_raw_control(hostile, good, seed, tmp_path_factory):
    rng = random.Random(seed)
    lines = [step_line(step, 1.8e9 + step, 1000.0) for step in range(1, good + 1)]
    for line in hostile:
        lines.insert(rng.randint(0, len(lines)), line)
    log = tmp_path_factory.mktemp("replay") / "run.log"
    log.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    result = CliRunner().invoke(app, ["replay", str(log)])
    assert result.exit_code in (0, 1), (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert_visible(result.output)


@settings(max_examples=max(3, EXAMPLES // 12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), size=st.integers(min_value=0, max_value=1_000_000))
@example(seed=13, size=1_000_000)
def test_replay_of_a_binary_file_ends_with_a_verdict_and_shows_no_raw_control(seed, size, tmp_path_factory):
    log = tmp_path_factory.mktemp("replaybin") / "run.log"
    good = "".join(step_line(step, 1.8e9 + step, 1000.0) + "\n" for step in range(1, 50)).encode()
    log.write_bytes(good + random.Random(seed).randbytes(size))
    result = CliRunner().invoke(app, ["replay", str(log)])
    assert result.exit_code in (0, 1) and (result.exception is None or isinstance(result.exception, SystemExit)), \
        (result.output, result.exception)
    assert_visible(result.output)


# ------------------------------------------------------------------ the watcher's store path


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """One Watcher on the local target (its observer follows logs that never appear) and its registry: each
    example registers a run and feeds it lines through the watcher's own queue."""
    base = tmp_path_factory.mktemp("storepath")
    inventory = load_inventory(write_inventory(base, {
        "defaults": {"workspace": str(base / "ws")},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"v": {"command": "true"}},
        "fallback": [],
    }))
    with Connections(inventory) as connections, Store(base / "dfo.db") as store:
        watcher = Watcher(inventory, connections, store, fallback=False)
        yield watcher, store, base
        watcher.close()


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(hostile=st.lists(HOSTILE_LINE, max_size=15), steps=st.lists(st.integers(1, 10**6), max_size=40, unique=True),
       repeats=st.integers(0, 3), cuts=st.lists(st.integers(0, 80), max_size=5), seed=st.integers(0, 99),
       truncations=st.lists(st.integers(0, 5), max_size=3))
@example(hostile=KNOWN_ATTACKS, steps=list(range(1, 30)), repeats=2, cuts=[5, 17], seed=1, truncations=[1])
def test_the_watcher_stores_every_well_formed_step_once_whatever_surrounds_it(store_path, hostile, steps, repeats,
                                                                              cuts, seed, truncations):
    watcher, store, base = store_path
    rng = random.Random(seed)
    steps = sorted(steps)
    good = [step_line(step, 1.8e9 + i, 500.0 + i) for i, step in enumerate(steps)]
    lines = list(good) + good[:repeats]  # lines repeated after a resend are not counted twice
    for line in hostile:
        lines.insert(rng.randint(0, len(lines)), line)
    name = f"p{len(store.list_runs())}"
    store.add_run(Run(name=name, target="here", variant="v", state="running", log_path=str(base / f"{name}.log")))
    watcher.attach(name)
    for index, chunk in enumerate(split_list(lines, cuts)):
        if index in truncations:  # the log was truncated or rotated between two chunks (the agent said so)
            watcher.queue.put(Observation("here", "truncated", name, data={"size": 0, "why": "rewritten", "was": 9},
                                          at=1.8e9))
        watcher.queue.put(Observation("here", "lines", name, lines=tuple(chunk), offset=100 + index,
                                      data={"ident": {"dev": 1, "ino": index}}, at=1.8e9))
    watcher.step(0.01)
    expected = [int(line.split(" step=")[1].split()[0]) for line in good]
    for line in hostile:  # a generated line may itself be a valid step, stored if it comes in order
        record = parse_logfmt(line, 1.8e9)
        if isinstance(record, StepRecord):
            expected = None
    stored = [s["step"] for s in store.samples(name)]
    assert stored == sorted(set(stored))  # never twice
    if expected is not None:
        assert stored == expected
    run = store.get_run(name)  # the offset and the file it is in, stored together with the samples
    assert (run.log_offset, run.log_ident) == (100 + index, {"dev": 1, "ino": index})
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=160).print(render(watcher))
    assert_visible(out.getvalue())


def split_list(items: list, cuts: list[int]) -> list[list]:
    points = sorted({min(c, len(items)) for c in cuts})
    return [items[a:b] for a, b in zip([0, *points], [*points, len(items)])]

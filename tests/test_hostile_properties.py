"""Property tests (hypothesis) for hostile input (issues 13 and 29): generated hostile lines, byte strings, binary
and large files, and truncations interleaved with writes, thrown at the log parser, the agent protocol, the agent's
log follower, `dfo replay` and the watcher's store path; nvidia-smi's output at the agent's sampler, dfo's reading
of its records and preflight's parser; trainer-shaped logs with hostile start/step/done figures at the judge and a
watch; any text at the YAML loader, and any value at any key of the inventory. Whatever arrives: no exception
escapes, no raw control character reaches what a person sees, every well-formed step line is stored exactly once,
every figure kept is finite and in range, and every refusal is one line naming where.

Deterministic (derandomize: the same examples on every run, in CI too) and bounded (the whole file 91 s with -n 2
on 2 cores under a load average of 9, the watcher and replay properties the longest): HYPOTHESIS_EXAMPLES raises
the example count."""

from __future__ import annotations

import io
import json
import math
import os
import random
import re

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from harness import write_inventory
from orchestrator.agent.agent import GPU_RANGES, Agent, Follow, GpuSampler, gpu_sample, parse_gpu_line
from orchestrator.agent.protocol import FrameDecoder, ProtocolError, encode_record
from orchestrator.cli import app
from orchestrator.connections import Connections
from orchestrator.decide.config import DecideConfig
from orchestrator.decide.judge import Verdict
from orchestrator.decide.replay import replay
from orchestrator.gpu import NvidiaSmiError, parse_gpus
from orchestrator import yamlfile
from orchestrator.errors import InventoryError
from orchestrator.inventory import load_inventory, parse_inventory
from orchestrator.logfmt import MAX_STEP, MAX_TOK_S, EventRecord, MalformedLine, StepRecord, format_ts, make_parser, parse_logfmt
from orchestrator.observe import Observation, RunTracker, FollowSpec
from orchestrator.store import Run, Store
from orchestrator.view import render
from orchestrator.watch import Watcher
from orchestrator.yamlfile import load_mapping

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "60"))
FAST = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FEWER = settings(FAST, max_examples=max(10, EXAMPLES // 3))  # for properties whose examples cost tenths of a second
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


@settings(FAST, max_examples=max(3, EXAMPLES // 12))
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


@settings(FAST, max_examples=max(10, EXAMPLES // 3),
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


# ------------------------------------------------------------------ nvidia-smi's output, in the agent and in dfo


GPU_FIELD = st.one_of(
    NUMBER,
    st.integers(min_value=-5, max_value=2000).map(str),
    st.sampled_from(["[N/A]", "[Not Supported]", "[Unknown Error]", " 37 ", "", "-0", "100.0", "101", "1e3", "1.5",
                     "+7", "0x1f", "٣", "²", "1\u00a0000", "NaN", "Infinity", "9" * 400, "-" + "9" * 400]),
    st.text(max_size=8),
)
GPU_LINE = st.one_of(
    st.lists(GPU_FIELD, max_size=6).map(", ".join),
    st.lists(GPU_FIELD, min_size=4, max_size=4).map(",".join),  # the sampler's four fields, however bad
    st.text(max_size=60),
    st.binary(max_size=80).map(lambda b: b.decode("utf-8", "replace")),
)
ASCII_INT = re.compile(r"\s*\+?[0-9]{1,12}(\.0*)?\s*")


def in_range_gpu(gpu: dict) -> None:
    """A sample as the agent sends it and dfo stores it: the index an int in range, every figure None or an int
    in its range (never inf, nan, a float or a 400-digit number)."""
    assert set(gpu) == set(GPU_RANGES)
    assert isinstance(gpu["index"], int) and 0 <= gpu["index"] <= GPU_RANGES["index"]
    for key, high in GPU_RANGES.items():
        assert gpu[key] is None or (type(gpu[key]) is int and 0 <= gpu[key] <= high), (key, gpu)


@FAST
@given(lines=st.lists(GPU_LINE, min_size=1, max_size=20))
@example(lines=["0, inf, 143771, 37", "0, 1024, 143771, 37", "1, nan, -5, ²", "9" * 400 + ", 1, 2, 3", "2, 3"])
def test_the_agents_nvidia_smi_sampler_survives_any_output_and_sends_only_in_range_samples(lines):
    """`inf` from the container's nvidia-smi killed the agent (only ValueError was caught): no GPU samples, no
    stall verdict. Each line is a sample (its unreadable figures unknown) or kept for the gpu_error report."""
    sampler, now, records = GpuSampler(), 1000.0, []
    for line in lines:
        records += sampler.on_line(line, now)
        now += 0.1
        records += sampler.on_tick(now)
    records += [sampler.flush()] if sampler.group else []
    samples = [gpu for record in FrameDecoder().feed(b"".join(records)) for gpu in record.header["gpus"]]
    for gpu in samples:
        in_range_gpu(gpu)
    good = [line for line in lines if parse_gpu_line(line) is not None]
    assert len(samples) == len(good)  # no sample lost, none made up
    bad = [line.strip()[:200] for line in lines if line.strip() and parse_gpu_line(line) is None]
    assert sampler.junk == bad[-5:]  # what gpu_error will quote
    for line in lines:  # a line of four plain integers in range is always a sample, with exactly those figures
        fields = line.split(",")
        if len(fields) == 4 and all(ASCII_INT.fullmatch(f) and 0 <= float(f) <= high
                                    for f, high in zip(fields, GPU_RANGES.values())):
            assert [int(float(f)) for f in fields] in [list(gpu.values()) for gpu in samples]


JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**400), max_value=10**400),
                       st.floats(), st.text(max_size=10), NUMBER, st.lists(st.integers(), max_size=2))


@FAST
@given(values=st.lists(JSON_VALUE, max_size=6))
def test_a_gpu_record_with_any_json_values_gives_an_in_range_sample_or_none(values):
    """What dfo reads from the agent's `gpu` records (JSON, which Python reads with Infinity and NaN)."""
    gpu = gpu_sample(values)
    if gpu is not None:
        in_range_gpu(gpu)
        assert len(values) == 4


@FAST
@given(lines=st.lists(st.one_of(st.lists(GPU_FIELD, min_size=5, max_size=5).map(", ".join), GPU_LINE), max_size=8))
@example(lines=["0, NVIDIA H200, inf, 143771, 37"])
def test_preflights_nvidia_smi_parser_gives_in_range_gpus_or_one_unparsable_error(lines):
    """Preflight said `ssh: OverflowError` for an `inf` figure."""
    try:
        gpus = parse_gpus("\n".join(lines), where="ct200")
    except NvidiaSmiError as exc:
        assert exc.kind == "unparsable" and "\n" not in str(exc)
        return
    for found in gpus:
        for value, high in ((found.index, 2**40), (found.mem_used_mib, 2**40), (found.mem_total_mib, 2**40),
                            (found.util_pct, 2**40)):
            assert value is None or (type(value) is int and 0 <= value <= high)


# ------------------------------------------------------------------ the trainer's start and step lines, judged


def field_or_hostile(good: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(good), NUMBER, st.sampled_from(["", "²", "\u0661\u0662", "1_000", "9" * 5000]))


@st.composite
def trainer_log(draw) -> list[str]:
    """A log as the built-in trainer writes it (docs/design.md's contract): a start line, step lines with every
    field it prints, compile and done lines, any of whose figures may be hostile; crash text between them."""
    t0 = 1.8e9
    lines = [f"ts={format_ts(t0)} event=start run=r variant=eager topology=threads steps={draw(field_or_hostile('3000'))} "
             f"config=1a4c23fee716 dtype=bf16 pid={draw(field_or_hostile('532'))}"]
    for i in range(1, draw(st.integers(0, 25)) + 1):
        fields = {"step": str(5 * i), "tok_s": f"{7700 + i % 7:.1f}", "loss": "2.5", "acc": "0.02", "accept_len": "1.01",
                  "lr": "0.00012", "q_fill": "1.00", "active": "1/1", "mem_gb": "57.6", "phase": "train"}
        hostile = draw(st.sets(st.sampled_from([*fields, "ts"]), max_size=2)) if draw(st.booleans()) else set()
        ts = draw(TS) if "ts" in hostile else format_ts(t0 + 2.5 * i)
        body = " ".join(f"{k}={draw(field_or_hostile(v)) if k in hostile else v}" for k, v in fields.items())
        lines.append(f"ts={ts} event=step {body}")
        if draw(st.integers(0, 15)) == 0:
            lines.append(draw(st.one_of(CRASH_LINE, FREE_TEXT, st.builds(
                lambda s: f"ts={format_ts(t0 + 2.5 * i)} event=compile drafter=0 seconds={s}", NUMBER))))
    lines.append(f"ts={format_ts(t0 + 200)} event=done step={draw(field_or_hostile('200'))} reason=steps "
                 f"exit={draw(field_or_hostile('0'))}")
    return lines


@FEWER
@given(lines=trainer_log(), exit_code=st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)))
@example(lines=["event=start steps=²", f"event=start steps={'9' * 5000}", f"event=start steps={'9' * 400}",
                f"ts={format_ts(1.8e9)} event=step step=5 tok_s=inf loss=nan"], exit_code=1)
@example(lines=[*(f"ts={format_ts(1.8e9 + 2.5 * i)} event=step step={5 * i} tok_s=7700.0" for i in range(1, 26)),
                "ts=1e20 event=step step=200 tok_s=7700.0", f"ts={format_ts(1.8e9 + 70)} event=step step=201 tok_s=1e300",
                f"ts={format_ts(1.8e9 + 71)} event=step step=202 tok_s=-1e300"], exit_code=None)
def test_the_judge_gives_a_verdict_on_any_trainer_log_and_its_decision_is_json(lines, exit_code):
    quick = DecideConfig(min_steady_steps=5, min_steady_seconds=5)  # a verdict within the log's 25 steps
    decision = replay(lines, run="r", config=quick, exit_code=exit_code, end_ts=1.8e9 + 400, tick_s=60)  # a hostile ts jumps years:
    # replay ticks through such a gap (at most 100,000 ticks), the watch does not (its clock is the real one)
    assert isinstance(decision.verdict, Verdict)
    json.dumps(decision.to_json())  # what the registry stores and notify sends
    figures = [decision.steady_tok_s, *(decision.interval or [])]  # what a user reads and a batch compares
    assert all(f is None or 0 <= f <= MAX_TOK_S for f in figures), figures
    assert decision.at_step is None or 0 <= decision.at_step <= MAX_STEP


@settings(FAST, max_examples=max(5, EXAMPLES // 6),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=trainer_log())
@example(lines=["event=start steps=100", "event=start steps=²", f"event=start steps={'9' * 5000}",
                f"event=start steps={'9' * 400}", f"ts={format_ts(1.8e9)} event=step step=5 tok_s=1000.0"])
def test_a_watch_takes_any_trainer_log_counts_each_malformed_line_and_shows_its_progress(store_path, lines):
    """`event=start steps=²` or 5,000 digits killed `dfo watch` at the same offset on every restart; 400 digits
    killed the live view's ETA."""
    watcher, store, base = store_path
    name = f"t{len(store.list_runs())}"
    store.add_run(Run(name=name, target="here", variant="v", state="running", log_path=str(base / f"{name}.log")))
    watcher.attach(name)
    watcher.queue.put(Observation("here", "lines", name, lines=tuple(lines), offset=1,
                                  data={"ident": {"dev": 1, "ino": 1}}, at=1.8e9))
    watcher.step(0.01)
    records = [parse_logfmt(line, 1.8e9) for line in lines]
    watched = watcher.watched[name]
    assert watched.malformed == sum(isinstance(record, MalformedLine) for record in records)
    counts = [r.count("steps") for r in records if isinstance(r, EventRecord) and r.event == "start"]
    assert watched.steps_total == next((c for c in reversed(counts) if c is not None), None)
    assert isinstance(watched.judge.decision().verdict, Verdict)
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=160).print(render(watcher))
    assert_visible(out.getvalue())


# ------------------------------------------------------------------ the YAML loader and the inventory's models


YAML_TOKEN = st.sampled_from(["a:", "b: ", " ", "\n", "\n  ", "- ", "&x ", "*x", "&y ", "*y", "<<: ", "{", "}", "[",
                              "]", ", ", "'", '"', "!!python/object/apply:os.system ", "!!binary ", "!!set ", "? ",
                              "| ", "> ", "%YAML 1.1\n", "---\n", "...\n", "1e400", ".inf", ".nan", "~", "@", "`", "\t",
                              "# c", "200", "0o17", "yes", "on", "\\", "\x00", "\x1b[2J", "\u202e", "\ufeff"])
YAML_TEXT = st.lists(st.one_of(YAML_TOKEN, st.text(max_size=4)), max_size=40).map("".join)


def one_clean_line(problems: list[str], source: str) -> None:
    """What `dfo` prints for an InventoryError: each problem one line naming the file, never a traceback."""
    assert problems
    for problem in problems:
        assert problem.startswith(f"{source}: ") and "\n" not in problem and "Traceback" not in problem
        assert "validation error" not in problem and "errors.pydantic.dev" not in problem


@FAST
@given(text=YAML_TEXT)
@example(text="a: &a [*a]\n")  # an alias of itself: a list that holds itself
@example(text="? [a]\n: 1\n")  # a key that cannot be a dict key
@example(text="a: !!python/object/apply:os.system [true]\n")
def test_the_yaml_loader_gives_a_mapping_or_one_line_for_any_text(text):
    try:
        data = load_mapping(text, "f.yaml", expected="at least 'hosts:'")
    except InventoryError as exc:
        one_clean_line(exc.problems, "f.yaml")
        assert len(exc.problems) == 1
        return
    assert isinstance(data, dict)


KEY = st.from_regex(r"k[a-z0-9_]{0,6}", fullmatch=True)
SCALAR = st.one_of(st.integers(-1000, 1000), st.text(alphabet="abcxyz ", max_size=6).map(str.strip).filter(bool))


def flow(mapping: dict) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in mapping.items()) + "}"


@FAST
@given(mapping=st.dictionaries(KEY, SCALAR, min_size=1, max_size=6), data=st.data(), nested=st.booleans(),
       block=st.booleans())
def test_a_key_given_twice_is_refused_with_its_line_wherever_it_is(mapping, data, nested, block):
    key = data.draw(st.sampled_from(sorted(mapping)))
    pairs = [f"{k}: {json.dumps(v)}" for k, v in mapping.items()]
    pairs.insert(data.draw(st.integers(0, len(pairs))), f"{key}: {json.dumps(data.draw(SCALAR))}")
    body = "".join(f"  {pair}\n" for pair in pairs) if block else "  {" + ", ".join(pairs) + "}\n"
    text = f"hosts: {{}}\nouter:\n  inner:\n  {body.replace(chr(10), chr(10) + '  ')}" if nested else f"m:\n{body}"
    with pytest.raises(InventoryError) as info:
        load_mapping(text, "f.yaml", expected="x")
    [problem] = info.value.problems
    assert re.match(r"f\.yaml: line \d+, column \d+: YAML syntax error: duplicate key ", problem), problem
    assert repr(key) in problem


@FAST
@given(first=st.dictionaries(KEY, SCALAR, max_size=5), second=st.dictionaries(KEY, SCALAR, max_size=5),
       beside=st.dictionaries(KEY, SCALAR, max_size=5), both=st.booleans())
def test_merge_keys_merge_as_yaml_says_and_a_key_beside_them_wins(first, second, beside, both):
    merges = "[*a, *b]" if both else "*a"
    text = f"a: &a {flow(first)}\nb: &b {flow(second)}\nm: {flow({'<<': 0, **beside}).replace('<<: 0', '<<: ' + merges)}\n"
    data = load_mapping(text, "f.yaml", expected="x")
    assert data["m"] == ({**second, **first, **beside} if both else {**first, **beside})  # the first merged wins


@FAST
@given(fan_out=st.integers(2, 12), levels=st.integers(1, 9), where=st.sampled_from(["mapping", "list"]))
def test_an_alias_bomb_is_refused_in_one_line_exactly_when_it_expands_past_the_bound(fan_out, levels, where):
    names = [f"l{i}" for i in range(levels + 1)]
    lines = [f"  {names[0]}: &{names[0]} [{', '.join(['x'] * fan_out)}]"]
    lines += [f"  {name}: &{name} [{', '.join(['*' + before] * fan_out)}]" for before, name in zip(names, names[1:])]
    text = "hosts: {}\nbomb:\n" + "\n".join(lines) + "\n"
    if where == "list":
        text = "hosts: {}\nbomb:\n" + "\n".join("  - " + line.strip().split(": ", 1)[1] for line in lines) + "\n"
    values = sum(fan_out ** (level + 1) + sum(fan_out ** k for k in range(1, level + 1)) for level in range(levels + 1))
    try:
        data = load_mapping(text, "f.yaml", expected="x")
    except InventoryError as exc:
        [problem] = exc.problems
        assert "more than 100,000 values once its aliases are expanded" in problem, problem
        assert values > yamlfile.MAX_VALUES
        return
    assert values <= yamlfile.MAX_VALUES * 2 and "bomb" in data  # counted, not built: the bound is about right


@FAST
@given(depth=st.integers(1, 200), kind=st.sampled_from(["[", "{a: "]))
@example(depth=63, kind="[")  # the deepest allowed
@example(depth=64, kind="{a: ")  # the first refused
def test_nesting_is_refused_in_one_line_exactly_past_64_levels(depth, kind):
    close = "]" if kind == "[" else "}"
    text = "x: " + kind * depth + "1" + close * depth + "\n"
    if depth + 1 > yamlfile.MAX_DEPTH:  # the top-level mapping is a level
        with pytest.raises(InventoryError) as info:
            load_mapping(text, "f.yaml", expected="x")
        [problem] = info.value.problems
        assert problem.startswith("f.yaml: line 1, column ") and problem.endswith("nested deeper than 64 levels (flatten it)")
    else:
        assert "x" in load_mapping(text, "f.yaml", expected="x")


def _model_paths() -> list[tuple[str, ...]]:
    """Every key of the inventory's models, as a path into a file that has one host, container and variant."""
    from orchestrator import inventory as inv

    where = {(): inv.Inventory, ("defaults",): inv.Defaults, ("defaults", "gpu_idle"): inv.GpuIdle,
             ("hosts", "pve1"): inv.Host, ("hosts", "pve1", "containers", "ct200"): inv.Container,
             ("variants", "v"): inv.Variant, ("variants", "v", "notify"): inv.Notify, ("notify",): inv.Notify,
             ("watch",): inv.Watch}
    return [(*prefix, key) for prefix, model in where.items() for key in model.model_fields] + [("watch", "nope")]


MODEL_PATHS = _model_paths()
ANY_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30), st.floats(),
              st.text(max_size=12), NUMBER, CONTROL, MARKUP),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)),
    max_leaves=8,
)


@FAST
@given(settings_=st.lists(st.tuples(st.sampled_from(MODEL_PATHS), ANY_VALUE), min_size=1, max_size=4))
@example(settings_=[(("variants", "v", "baseline_tok_s"), float("inf"))])
@example(settings_=[(("hosts", "pve1", "port"), True), (("watch", "precision"), float("nan"))])
def test_an_inventory_with_any_value_at_any_key_loads_or_says_each_problem_in_one_line_naming_its_key(settings_):
    document = {"hosts": {"pve1": {"address": "10.0.0.1", "containers": {"ct200": {"ctid": 200}}}},
                "variants": {"v": {"compile": "trees"}}}
    for path, value in settings_:
        node = document
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[path[-1]] = value
    try:
        text = yaml.safe_dump(document, allow_unicode=True)
    except yaml.YAMLError:
        return  # not a document PyYAML can write
    try:
        inventory = parse_inventory(text, source="lab.yaml")
    except InventoryError as exc:
        one_clean_line(exc.problems, "lab.yaml")
        for problem in exc.problems:  # each names the key it is about: a dotted path the file has, or where
            where = problem.removeprefix("lab.yaml: ").split(": ")[0]
            assert where.startswith("line ") or where == "(top level)" or where.split(".")[0] in document, problem
        return
    assert all(math.isfinite(n) for n in numbers(inventory.model_dump(exclude={"variants": {"__all__": {"args"}}})))


def numbers(value: object) -> list[float]:
    """Every number in a dumped model (bools are not numbers)."""
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers(item)]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _experiments_paths() -> list[tuple[str, ...]]:
    from orchestrator import experiments as exp

    where = {(): exp.Experiments, ("matrix",): exp.Matrix, ("concurrency",): exp.Concurrency}
    return [(*prefix, key) for prefix, model in where.items() for key in model.model_fields] + [("stop_when", "steps"),
                                                                                                 ("stop_when", "minutes")]


EXPERIMENTS_PATHS = _experiments_paths()


@FAST
@given(settings_=st.lists(st.tuples(st.sampled_from(EXPERIMENTS_PATHS), ANY_VALUE), min_size=1, max_size=3))
@example(settings_=[(("repeats",), 1e9)])  # parse_experiments ran out of memory expanding the cells
@example(settings_=[(("stop_when", "minutes"), float("inf"))])
def test_an_experiments_file_with_any_value_at_any_key_plans_or_says_each_problem_in_one_line(settings_):
    from orchestrator.experiments import parse_experiments

    inventory = parse_inventory("hosts: {pve1: {address: 10.0.0.1, containers: {ct200: {ctid: 200}}}}\n"
                                "variants: {trees: {compile: trees}}\n")
    document: dict = {"batch": "s", "targets": ["ct200"], "matrix": {"variant": ["trees"]}}
    for path, value in settings_:
        node = document
        for part in path[:-1]:
            node[part] = node[part] if isinstance(node.get(part), dict) else {}
            node = node[part]
        node[path[-1]] = value
    try:
        text = yaml.safe_dump(document, allow_unicode=True)
    except yaml.YAMLError:
        return
    try:
        plan = parse_experiments(text, inventory, source="sweep.yaml")
    except InventoryError as exc:
        one_clean_line(exc.problems, "sweep.yaml")
        return
    assert all(math.isfinite(n) for n in numbers(plan.experiments.model_dump()))

"""The metric-line parser: the logfmt contract, a user's regex, and garbage that must never raise."""

import math
import random

import pytest

from orchestrator.errors import UsageError
from orchestrator.logfmt import EventRecord, RegexExtractor, StepRecord, TextLine, format_ts, parse_logfmt, parse_ts

CONTRACT_LINE = (
    "ts=2026-11-29T11:40:03.123Z event=step step=120 tok_s=153200.5 loss=2.3100 acc=0.412 q_fill=0.94 "
    "active=7/8 phase=train"
)


def test_contract_line_becomes_a_typed_step_record():
    record = parse_logfmt(CONTRACT_LINE)
    assert isinstance(record, StepRecord)
    assert record.step == 120 and isinstance(record.step, int)
    assert record.tok_s == 153200.5
    assert record.ts == pytest.approx(parse_ts("2026-11-29T11:40:03.123+00:00"))
    assert (record.loss, record.acc, record.q_fill, record.active, record.phase) == (2.31, 0.412, 0.94, "7/8", "train")
    assert format_ts(record.ts) == "2026-11-29T11:40:03.123Z"


def test_quoted_values_and_unknown_keys_are_kept():
    record = parse_logfmt('ts=2026-11-29T11:40:03Z event=step step=3 tok_s=10 note="warm \\"cache\\" hit" gpu=3')
    assert record.extra == {"note": 'warm "cache" hit', "gpu": "3"}


def test_the_trainers_escapes_round_trip():
    record = parse_logfmt('ts=2026-11-29T11:40:03Z event=error reason="line one\\nsaid \\"x=1\\" in C:\\\\tmp"')
    assert record.fields["reason"] == 'line one\nsaid "x=1" in C:\\tmp'


def test_nan_loss_is_parsed_not_dropped():
    record = parse_logfmt("ts=2026-11-29T11:40:03Z event=step step=3 tok_s=10 loss=nan")
    assert math.isnan(record.loss)


def test_other_events_and_free_text():
    event = parse_logfmt('ts=2026-11-29T11:40:03Z event=error msg="worker 2 died"')
    assert isinstance(event, EventRecord) and event.event == "error" and event.fields["msg"] == "worker 2 died"
    text = parse_logfmt("UserWarning: Online softmax is disabled", received_ts=5.0)
    assert text == TextLine(5.0, "UserWarning: Online softmax is disabled")
    assert isinstance(parse_logfmt("a print mentioning event=step step=1 tok_s=2"), TextLine)


def test_step_line_without_required_fields_is_free_text():
    assert isinstance(parse_logfmt("ts=2026-11-29T11:40:03Z event=step step=3"), TextLine)
    assert isinstance(parse_logfmt("ts=2026-11-29T11:40:03Z event=step step=x tok_s=1"), TextLine)


def test_step_line_with_a_bad_time_takes_the_received_time():
    line = "ts=yesterday event=step step=3 tok_s=10"
    assert isinstance(parse_logfmt(line), TextLine)
    assert parse_logfmt(line, received_ts=42.0).ts == 42.0


def test_garbage_never_raises():
    rng = random.Random(7)
    alphabet = 'ts=event=step tok_s"\\ \t\ufffd\x00é0123456789.:-TZnaninf'
    for _ in range(3000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        parse_logfmt(line)
        parse_logfmt(line, received_ts=1.0)
    parse_logfmt("x" * 1_000_000)


def test_user_regex_extracts_steps_with_their_own_time():
    extract = RegexExtractor(r"\[(?P<ts>[\d\- :.]+)\] it (?P<step>\d+) \| (?P<tok_s>[\d.]+) tok/s")
    record = extract("[2026-11-29 11:40:03.5] it 120 | 153200.5 tok/s", received_ts=1.0)
    assert (record.step, record.tok_s, format_ts(record.ts)) == (120, 153200.5, "2026-11-29T11:40:03.500Z")


def test_user_regex_without_time_takes_the_received_time_and_falls_back_to_logfmt():
    extract = RegexExtractor(r"step (?P<step>\d+) .* (?P<tok_s>[\d.]+) tok/s")
    assert extract("step 7 loss 2.1 at 900.0 tok/s", received_ts=99.0) == StepRecord(99.0, 7, 900.0)
    assert isinstance(extract(CONTRACT_LINE), StepRecord)
    assert isinstance(extract("Traceback (most recent call last):", received_ts=1.0), TextLine)


@pytest.mark.parametrize("pattern", [r"step (?P<step>\d+", r"step (?P<step>\d+) (\d+)"])
def test_bad_user_regex_is_a_usage_error(pattern):
    with pytest.raises(UsageError):
        RegexExtractor(pattern)


def test_the_trainers_own_step_lines_parse_back_to_what_it_wrote():
    from trainer.metrics import format_line  # the writer side of the contract

    fields = {"step": 120, "tok_s": 153200.5, "loss": 2.31, "acc": 0.412, "lr": 0.0003, "q_fill": 0.94,
              "active": "7/8", "mem_gb": 61.25, "phase": "warmup", "accept_len": 3.25}
    record = parse_logfmt(format_line("step", fields, ts="2026-11-29T11:40:03.123Z"))
    assert (record.step, record.tok_s, record.loss, record.lr, record.active, record.phase) == (
        120, 153200.5, 2.31, 0.0003, "7/8", "warmup"
    )
    assert record.extra == {"accept_len": "3.250"}

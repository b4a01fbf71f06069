"""The agent's record framing: what the agent writes, dfo reads back, however the bytes are split."""

from __future__ import annotations

import pytest

from orchestrator.agent.protocol import FrameDecoder, ProtocolError, Record, encode_record

RECORDS = [
    ({"t": "hello", "version": 1, "pid": 42}, None),
    ({"t": "log", "run": "r1", "off": 0}, b"step 1\nstep 2\n\xff\xfe partial"),
    ({"t": "log", "run": "r1", "off": 27}, b"{\"t\": \"hb\"}\n"),  # a payload that looks like a header
    ({"t": "hb", "ts": 1.5}, None),
    ({"t": "log", "run": "r2", "off": 7}, b""),
]


def encoded_stream() -> bytes:
    return b"".join(encode_record(header, payload) for header, payload in RECORDS)


def expected_records() -> list[Record]:
    return [Record(dict(h, len=len(p)) if p is not None else h, p) for h, p in RECORDS]


def test_records_round_trip_when_split_at_every_byte():
    data = encoded_stream()
    for cut in range(1, len(data)):
        decoder = FrameDecoder()
        assert decoder.feed(data[:cut]) + decoder.feed(data[cut:]) == expected_records(), cut
        assert decoder.pending == 0


def test_records_round_trip_fed_one_byte_at_a_time():
    decoder = FrameDecoder()
    got = [record for byte in encoded_stream() for record in decoder.feed(bytes([byte]))]
    assert got == expected_records()


def test_a_payload_is_held_until_all_its_bytes_arrived():
    decoder = FrameDecoder()
    data = encode_record({"t": "log", "run": "r", "off": 0}, b"0123456789")
    assert decoder.feed(data[:-1]) == []
    assert decoder.feed(data[-1:]) == [Record({"t": "log", "run": "r", "off": 0, "len": 10}, b"0123456789")]


@pytest.mark.parametrize(
    "garbage, why",
    [
        (b"Welcome to Ubuntu 22.04\n", "not an agent record"),
        (b"[1, 2, 3]\n", "not an agent record"),
        (b'{"t": "bogus"}\n', "not an agent record"),
        (b'{"t": "log", "len": -4}\n', "bad payload length"),
        (b'{"t": "log", "len": "12"}\n', "bad payload length"),
        (b"x" * 70000, "no record header"),
    ],
)
def test_garbage_on_the_channel_is_rejected_with_a_clear_error(garbage, why):
    with pytest.raises(ProtocolError, match=why):
        FrameDecoder().feed(garbage)

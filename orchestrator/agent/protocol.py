"""The agent's record framing, for both sides: encode (agent) and decode (dfo).

One record is a header line of JSON ending in `\\n`, then exactly `len` raw payload bytes when the header
has `"len"`. Record types (`"t"`) are listed in RECORD_TYPES; docs/architecture.md ("Agent protocol") is
the contract. The encoder is defined in agent.py, because the agent ships into containers as one file, and
re-exported here so that dfo imports framing from one place; so are the one numeric check of outside figures
(`read_number`) and the GPU sample's (`gpu_sample`), which the log parser and nvidia-smi's parser share.

This module is stdlib only, does no I/O and keeps no clock: it turns bytes into records and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from orchestrator.agent.agent import AGENT_VERSION, MAX_LOG_CHUNK, MAX_OFFSET, encode_record, gpu_sample, read_number

__all__ = [
    "AGENT_VERSION", "MAX_LOG_CHUNK", "MAX_OFFSET", "RECORD_TYPES", "FrameDecoder", "ProtocolError", "Record",
    "encode_record", "gpu_sample", "read_number",
]

RECORD_TYPES = frozenset({"hello", "log", "truncated", "gpu", "gpu_error", "proc", "hb", "error"})
MAX_HEADER = 64 * 1024  # a header line longer than this is garbage, not a record still arriving
MAX_PAYLOAD = 16 * MAX_LOG_CHUNK


class ProtocolError(ValueError):
    """The byte stream is not agent records (wrong program on the channel, or corruption)."""


@dataclass(frozen=True)
class Record:
    """One decoded record: its JSON header (with "t") and its payload bytes (None if it had none)."""

    header: dict
    payload: bytes | None = None

    @property
    def type(self) -> str:
        return self.header["t"]


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, split anywhere, and get whole records back."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._header: dict | None = None  # a header whose payload has not fully arrived yet

    def feed(self, data: bytes) -> list[Record]:
        """The records completed by `data`. Raises ProtocolError on bytes that cannot be a record."""
        self._buffer += data
        records = []
        while True:
            record = self._next_record()
            if record is None:
                return records
            records.append(record)

    @property
    def pending(self) -> int:
        """Bytes held for a record not yet complete (0 at a record boundary)."""
        return len(self._buffer)

    def _next_record(self) -> Record | None:
        if self._header is None:
            self._header = self._next_header()
            if self._header is None:
                return None
        size = self._header.get("len")
        if size is None:
            header, self._header = self._header, None
            return Record(header)
        if len(self._buffer) < size:
            return None
        payload = bytes(self._buffer[:size])
        del self._buffer[:size]
        header, self._header = self._header, None
        return Record(header, payload)

    def _next_header(self) -> dict | None:
        end = self._buffer.find(b"\n")
        if end < 0:
            if len(self._buffer) > MAX_HEADER:
                raise ProtocolError(f"no record header in {len(self._buffer)} bytes: {self._preview()}")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return parse_header(line)

    def _preview(self) -> str:
        return repr(bytes(self._buffer[:60]))


def parse_header(line: bytes) -> dict:
    """A header line as a dict, checked: a JSON object with a known "t" and a sane "len"."""
    try:
        header = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not an agent record header: {line[:60]!r}") from None
    if not isinstance(header, dict) or header.get("t") not in RECORD_TYPES:
        raise ProtocolError(f"not an agent record header: {line[:60]!r}")
    size = header.get("len")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PAYLOAD):
        raise ProtocolError(f"bad payload length {size!r} in record header {line[:60]!r}")
    return header

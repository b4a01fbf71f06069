"""Metric lines and sinks: logfmt lines on stdout (the contract in docs/design.md) and W&B.

`MetricLog.emit(event, **fields)` writes one line `ts=<RFC 3339 UTC> event=<event> key=value ...`, flushed
at once, serialised across threads. Values with spaces, quotes or `=` are double-quoted. W&B is imported
lazily and only when asked for. This module computes nothing about training; it only formats and ships.
"""

from __future__ import annotations

import datetime as dt
import netrc
import os
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, TextIO
from urllib.parse import urlsplit

from trainer.config import ConfigError

FLOAT_DIGITS = {"tok_s": 1, "loss": 4, "acc": 4, "accept_len": 3, "q_fill": 2, "mem_gb": 2, "lr": 6,
                "seconds": 2, "samples_s": 3}


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def format_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:.{FLOAT_DIGITS.get(key, 4)}f}"
    else:
        text = str(value)
    if text == "" or any(c in text for c in ' "=\\\n\t'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    return text


def format_line(event: str, fields: dict[str, Any], ts: str | None = None) -> str:
    parts = [f"ts={ts or utc_now()}", f"event={event}"]
    parts += [f"{key}={format_value(key, value)}" for key, value in fields.items() if value is not None]
    return " ".join(parts)


class MetricLog:
    """Thread-safe logfmt writer; also forwards numeric step/eval fields to an optional sink."""

    def __init__(self, stream: TextIO | None = None, sink: WandbSink | None = None) -> None:
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self._sink = None
        self.sink = sink

    @property
    def sink(self) -> WandbSink | None:
        return self._sink

    @sink.setter
    def sink(self, sink: WandbSink | None) -> None:
        """Attach a sink; a W&B one is announced on its own line (`event=wandb mode=... url=...|dir=...`), so
        the watcher can keep where the run's W&B record is."""
        self._sink = sink
        if sink is not None:
            self.emit("wandb", **sink.where())

    def emit(self, event: str, **fields: Any) -> None:
        line = format_line(event, fields)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()
        if self.sink is not None and event in ("step", "eval") and "step" in fields:
            numeric = {f"{event}/{k}": v for k, v in fields.items() if isinstance(v, (int, float))}
            self.sink.log(numeric, fields["step"])

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def wandb_login_present(environ: Mapping[str, str] | None = None) -> bool:
    """True when W&B's own client would find a key: WANDB_API_KEY, or a `wandb login` entry in the netrc file
    ($NETRC, else ~/.netrc) for the W&B host (WANDB_BASE_URL, default api.wandb.ai)."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(environ["NETRC"]) if environ.get("NETRC") else Path(environ.get("HOME") or Path.home()) / ".netrc"
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(mode: str, environ: Mapping[str, str] | None = None) -> str:
    """`auto` -> online with a W&B key at hand, else offline; other modes as given."""
    if mode != "auto":
        return mode
    return "online" if wandb_login_present(environ) else "offline"


class WandbSink:
    """Weights & Biases run named after --run-name; `auto` is online when a key is there (WANDB_API_KEY or a
    `wandb login` netrc entry), else offline. Group, job type and tags come from W&B's own variables
    (WANDB_RUN_GROUP, WANDB_JOB_TYPE, WANDB_TAGS), which dfo sets: the batch, the variant, the inventory's tags."""

    def __init__(self, mode: str, run_name: str, config: dict[str, Any], out_dir: str) -> None:
        import wandb  # lazy: optional dependency

        mode = resolve_mode(mode)
        self.mode = mode
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dfo-trainer"), name=run_name,
                              config=config, mode=mode, dir=out_dir)

    def where(self) -> dict[str, Any]:
        """The run's W&B URL (online) or its offline directory (`wandb sync DIR` uploads it later)."""
        url = getattr(self.run, "url", None)
        if url:
            return {"mode": self.mode, "url": url}
        return {"mode": self.mode, "dir": str(self.run.settings.sync_dir)}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sink(mode: str, run_name: str, config: dict[str, Any], out_dir: str) -> WandbSink | None:
    """None for `off`; for `auto` also None (with a note on stderr) when wandb is not installed."""
    if mode == "off":
        return None
    try:
        return WandbSink(mode, run_name, config, out_dir)
    except ImportError:
        if mode == "auto":
            print("note: wandb is not installed; metrics go to stdout only (--wandb off to silence)",
                  file=sys.stderr, flush=True)
            return None
        raise ConfigError(f"--wandb {mode}: wandb is not installed (pip install wandb, or --wandb off)")

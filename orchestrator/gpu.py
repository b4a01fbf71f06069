"""The one place dfo talks nvidia-smi: the query fields, the parsers, its error texts and exit codes.

Every call is bounded twice: `timeout N nvidia-smi ...` on the target (a wedged driver can hang nvidia-smi
forever, and the process must not outlive dfo's patience) and the target's own client-side timeout.
Failures come back as NvidiaSmiError with a `kind` and a message naming the fix, never a traceback.

This module must not decide whether a GPU is "busy enough" to refuse a run; preflight and watch do that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .agent.protocol import read_number
from .errors import CommandTimeout, RemoteError
from .remote.base import Target

QUERY_FIELDS = ("index", "name", "memory.used", "memory.total", "utilization.gpu")
SAMPLER_FIELDS = ("index", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
FORMAT = "--format=csv,noheader,nounits"
MISSING_VALUES = ("[N/A]", "[Not Supported]", "N/A", "[Unknown Error]")
EXIT_TIMEOUT = 124  # coreutils timeout(1)
CLIENT_GRACE_S = 5.0

# exit code -> (kind, what it means and how to fix it)
KNOWN_FAILURES = {
    127: ("missing", "nvidia-smi not found (no NVIDIA driver here; install it, or pass the GPU through to the container)"),
    6: ("no_devices", "nvidia-smi found no GPU (check the container's GPU passthrough, or `nvidia-smi` on the host)"),
    9: ("no_driver", "nvidia-smi cannot talk to the NVIDIA driver (load the kernel module, or reboot after a driver update)"),
    18: ("mismatch", "NVIDIA driver/library version mismatch (the container's userland must match the host driver; reboot after an upgrade)"),
}


def failure_kind(exit_code: int | None) -> str:
    """The kind of an nvidia-smi exit status (KNOWN_FAILURES; `failed` for any other)."""
    return KNOWN_FAILURES[exit_code][0] if exit_code in KNOWN_FAILURES else "failed"


class NvidiaSmiError(RemoteError):
    """nvidia-smi failed. `kind`: missing | no_devices | no_driver | mismatch | timeout | failed | unparsable."""

    def __init__(self, kind: str, message: str, *, where: str | None = None) -> None:
        self.kind = kind
        super().__init__(message, where=where)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    mem_used_mib: Optional[int]
    mem_total_mib: Optional[int]
    util_pct: Optional[int]


@dataclass(frozen=True)
class ComputeApp:
    gpu_uuid: str
    pid: Optional[int]
    process_name: str
    used_memory_mib: Optional[int]


def query_argv(fields: tuple[str, ...], *, timeout: float, apps: bool = False) -> list[str]:
    """`timeout N nvidia-smi --query-...=FIELDS --format=csv,noheader,nounits`."""
    option = "--query-compute-apps" if apps else "--query-gpu"
    return ["timeout", "-k", "2", f"{max(1, int(timeout))}", "nvidia-smi", f"{option}={','.join(fields)}", FORMAT]


def sampler_argv(interval_ms: int = 1000) -> list[str]:
    """The watch agent's one long-lived sampler: a line per GPU every `interval_ms`."""
    return ["nvidia-smi", f"--query-gpu={','.join(SAMPLER_FIELDS)}", FORMAT, "-lms", str(int(interval_ms))]


def query_gpus(target: Target, timeout: float = 15.0) -> list[Gpu]:
    """Every GPU the target sees; NvidiaSmiError when nvidia-smi is missing, failing or hung."""
    return parse_gpus(_run(target, query_argv(QUERY_FIELDS, timeout=timeout), timeout), where=target.name)


def query_compute_apps(target: Target, timeout: float = 15.0) -> list[ComputeApp]:
    """Compute processes on the target's GPUs. Inside a container the list may be empty or hold host PIDs."""
    return parse_compute_apps(_run(target, query_argv(APP_FIELDS, timeout=timeout, apps=True), timeout), where=target.name)


def _run(target: Target, argv: list[str], timeout: float) -> str:
    try:
        result = target.run(argv, timeout=timeout + CLIENT_GRACE_S)
    except CommandTimeout:
        raise timeout_error(timeout, target.name) from None
    if result.exit_code != 0:
        raise error_for(result.exit_code, result.stdout + result.stderr, where=target.name, timeout=timeout)
    return result.stdout


def timeout_error(timeout: float, where: str | None) -> NvidiaSmiError:
    return NvidiaSmiError(
        "timeout",
        f"nvidia-smi did not answer within {timeout:g}s (a wedged driver: check `dmesg` for Xid errors; a reboot may be needed)",
        where=where,
    )


def error_for(exit_code: int, output: str, *, where: str | None = None, timeout: float = 0) -> NvidiaSmiError:
    """The NvidiaSmiError for a failed nvidia-smi (its errors go to stdout)."""
    if exit_code in (EXIT_TIMEOUT, 137):
        return timeout_error(timeout, where)
    if exit_code in KNOWN_FAILURES:
        kind, message = KNOWN_FAILURES[exit_code]
        return NvidiaSmiError(kind, message, where=where)
    first_line = next((line.strip() for line in output.splitlines() if line.strip()), "no output")
    return NvidiaSmiError("failed", f"nvidia-smi exited {exit_code}: {first_line}", where=where)


def parse_value(text: str) -> Optional[str]:
    text = text.strip()
    return None if text in MISSING_VALUES else text


MAX_VALUE = 2**40  # MiB, %, PIDs, indices: no real figure comes near


def parse_int(text: str) -> Optional[int]:
    """A figure of nvidia-smi's csv (through read_number: ASCII digits, finite, 0..MAX_VALUE); None when it says
    [N/A]; ValueError for anything else (`inf`, `1e999`, garbage), which the parsers report as unparsable."""
    value = parse_value(text)
    if value is None:
        return None
    number = read_number(value, 0, MAX_VALUE)
    if number is None:
        raise ValueError(f"{value[:40]!r} is not a number in 0..{MAX_VALUE}")
    return int(number)


def _index(text: str) -> int:
    index = parse_int(text)
    if index is None:
        raise ValueError(f"{text[:40]!r} is not a GPU index")
    return index


def split_rows(output: str, width: int, *, where: str | None = None) -> list[list[str]]:
    """Rows of `width` ", "-separated cells; NvidiaSmiError('unparsable') for anything else."""
    rows = []
    for line in output.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != width:
            raise NvidiaSmiError("unparsable", f"unexpected nvidia-smi line {line.strip()!r}", where=where)
        rows.append(cells)
    return rows


def parse_gpus(output: str, *, where: str | None = None) -> list[Gpu]:
    """Parse `index, name, memory.used, memory.total, utilization.gpu` rows."""
    try:
        return [
            Gpu(_index(index), name, parse_int(used), parse_int(total), parse_int(util))
            for index, name, used, total, util in split_rows(output, len(QUERY_FIELDS), where=where)
        ]
    except ValueError as exc:
        raise NvidiaSmiError("unparsable", f"unexpected nvidia-smi value: {exc}", where=where) from None


def parse_compute_apps(output: str, *, where: str | None = None) -> list[ComputeApp]:
    """Parse `gpu_uuid, pid, process_name, used_memory` rows (empty output: no processes)."""
    try:
        return [
            ComputeApp(uuid, parse_int(pid), name, parse_int(mem))
            for uuid, pid, name, mem in split_rows(output, len(APP_FIELDS), where=where)
        ]
    except ValueError as exc:
        raise NvidiaSmiError("unparsable", f"unexpected nvidia-smi value: {exc}", where=where) from None

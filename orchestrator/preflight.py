"""Preflight: is each target ready for a run? One row per check per target, all targets in parallel.

Checks, in order: ssh (host reachable and authenticated), container (running), nvidia_smi (answers, with
each GPU), gpus_idle (under the inventory's gpu_idle thresholds), compute_apps (none running), workspace
(exists and writable, or not there yet and creatable by the launch; free disk) and python (runs; its torch version). One remote invocation per target: the
script inside the container (inside_script) answers everything; it also proves SSH, and a stopped or missing
container answers `pct exec` with pct's own message, which PctTarget maps (so no `pct status` first: on a
Proxmox node every pct call costs a Perl start-up). A launch runs the same script in its own call
(orchestrator/launchplan.py) and judges the rows with `blocking`, the one rule for what refuses a run.

A failure of one target never hides another: every target gets its rows, and a check that cannot run
because an earlier one failed is reported as skipped. This module must not start, stop or change anything
on a target beyond a temporary file in the workspace that proves it is writable (or, where the workspace is
not there yet, a temporary directory in its nearest existing parent, removed at once).
"""

from __future__ import annotations

import re
import shlex
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

from . import gpu
from .connections import Connections
from .errors import CommandTimeout, ContainerError, ContainerNotRunning, DfoError, RefusedError
from .inventory import TargetSpec
from .remote.base import Target

CHECKS = ("ssh", "container", "nvidia_smi", "gpus_idle", "compute_apps", "workspace", "python")
SECTION = "@@dfo-preflight "
HOST_TIMEOUT_SLACK_S = 20.0
PYTHON_TIMEOUT_S = 30
JOIN_POLL_S = 0.2
DF_AVAILABLE_RE = re.compile(r"\s\d+\s+\d+\s+(\d+)\s+\d+%\s")
"""`df -Pk`'s data row: ... 1024-blocks Used Available Capacity% Mounted-on (either end may hold spaces)."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False
    code: str | None = None  # why it failed, for callers (nvidia-smi's kind: missing, no_devices, ...)


GPU_CHECK_NAMES = ("nvidia_smi", "gpus_idle", "compute_apps")
NO_GPU_CODES = ("missing", "no_devices")


@dataclass
class TargetReport:
    target: str
    host: str
    checks: list[Check] = field(default_factory=list)
    expects_gpus: bool = False  # the inventory lists GPUs for this target

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def cpu_only(self) -> bool:
        """True when the target simply has no GPU (no nvidia-smi, or it finds none), the inventory lists none
        for it, and every other check passed: ready for CPU runs, nothing to fix."""
        smi = next((c for c in self.checks if c.name == "nvidia_smi"), None)
        return (not self.expects_gpus and smi is not None and smi.code in NO_GPU_CODES
                and all(c.ok or (c.skipped and c.name in GPU_CHECK_NAMES) for c in self.checks if c is not smi))

    def to_json(self) -> dict:
        """The report as JSON; a check's `code` only where it has one (the older shape otherwise)."""
        checks = [{k: v for k, v in asdict(c).items() if k != "code" or v is not None} for c in self.checks]
        return {"target": self.target, "host": self.host, "ok": self.ok, "checks": checks}


def preflight(connections: Connections, target_names: list[str], *, nvidia_smi_timeout: float = 10.0) -> list[TargetReport]:
    """Check every target in parallel (one thread each); reports come back in the order asked."""
    specs = [connections.inventory.target(name) for name in target_names]  # bad names fail before any I/O
    return _in_parallel(lambda spec: check_target(connections, spec, nvidia_smi_timeout), specs)


def _in_parallel(check: Callable[[TargetSpec], TargetReport], specs: list[TargetSpec]) -> list[TargetReport]:
    """check(spec) for every spec at once, in order. Daemon threads, not a pool: Ctrl-C must end dfo at once
    rather than wait out a slow host's timeouts (every remote command is bounded on the remote side too)."""
    reports: list[TargetReport | None] = [None] * len(specs)

    def work(index: int) -> None:
        reports[index] = check(specs[index])

    threads = [threading.Thread(target=work, args=(i,), name=f"preflight-{spec.name}", daemon=True) for i, spec in enumerate(specs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # a timed join: a SIGINT the OS handed to a worker thread still gets noticed
            thread.join(JOIN_POLL_S)
    return reports  # type: ignore[return-value]  # check_target never raises, so every slot is filled


def check_target(connections: Connections, spec: TargetSpec, nvidia_smi_timeout: float = 10.0) -> TargetReport:
    """All rows for one target, from one remote invocation; never raises."""
    script = inside_script(spec, nvidia_smi_timeout)
    try:
        host, target = connections.host(spec.host), connections.container(spec.name)
    except DfoError as exc:  # e.g. an unreadable ~/.ssh/config: the ssh row says so
        error = exc
        return report_for(spec, None, None, lambda _: _raise(error))
    return report_for(spec, host, target, lambda target: target.run(script, timeout=inside_timeout(nvidia_smi_timeout)).stdout,
                      nvidia_smi_timeout)


def _raise(exc: Exception) -> str:
    raise exc


def inside_timeout(nvidia_smi_timeout: float) -> float:
    """How long inside_script may take: nvidia-smi twice, python, and slack for SSH and pct."""
    return 2 * nvidia_smi_timeout + PYTHON_TIMEOUT_S + HOST_TIMEOUT_SLACK_S


def report_for(spec: TargetSpec, host: Target | None, target: Target | None, answer: Callable[[Target], str],
               nvidia_smi_timeout: float = 10.0) -> TargetReport:
    """The rows for one target from `answer(target)`: the output of inside_script run in `target` (on `host`),
    by check_target or by a launch's own call. Never raises: an error becomes the row it belongs to."""
    report = TargetReport(spec.name, spec.host, expects_gpus=bool(spec.gpus))
    try:
        report.checks += _rows(spec, host, target, answer, nvidia_smi_timeout)
    except Exception as exc:  # a bug or an unforeseen error must not hide the other targets' rows
        message = str(exc) if isinstance(exc, DfoError) else f"{type(exc).__name__}: {exc}"
        failed_at = next((name for name in CHECKS if name not in {c.name for c in report.checks}), "error")
        report.checks.append(Check(failed_at, False, message))
    done = {check.name for check in report.checks}
    reason = next((check.name for check in report.checks if not check.ok), "an earlier check")
    report.checks += [Check(name, False, f"skipped: {reason} failed", skipped=True) for name in CHECKS if name not in done]
    report.checks.sort(key=lambda check: CHECKS.index(check.name) if check.name in CHECKS else len(CHECKS))
    return report


def _rows(spec: TargetSpec, host: Target | None, target: Target | None, answer: Callable[[Target], str],
          nvidia_smi_timeout: float) -> list[Check]:
    """The ssh and container rows from how the one invocation went, the others from its output."""
    try:
        ssh_ok = Check("ssh", True, "local (this machine, no SSH)" if spec.transport == "local" else f"{_login(host, spec)} authenticated")
        output = answer(target)
    except ContainerNotRunning:
        return [ssh_ok, Check("container", False, f"ct {spec.ctid} is stopped (run `pct start {spec.ctid}` on host {spec.host})")]
    except ContainerError as exc:
        return [ssh_ok, Check("container", False, str(exc))]
    except CommandTimeout as exc:  # connected (a timeout runs on an open channel), but the script did not finish
        return [ssh_ok, Check("container", False, f"no answer from inside: {exc}")]
    except DfoError as exc:
        return [Check("ssh", False, str(exc))]
    if spec.ctid is None:
        container = Check("container", True, "no container (ctid: null): runs on the host", skipped=True)
    else:
        container = Check("container", True, f"ct {spec.ctid} running")
    sections = split_sections(output)
    return [
        ssh_ok,
        container,
        *_gpu_checks(sections, spec, nvidia_smi_timeout),
        _workspace_check(sections.get("workspace", (1, "")), spec),
        _python_check(sections.get("python", (1, "no answer")), spec),
    ]


def _login(host: Target, spec: TargetSpec) -> str:
    """user@address[:port] as the connection resolved them (~/.ssh/config included)."""
    user = getattr(host, "user", None) or spec.user
    return f"{user}@{spec.address}{':' + str(spec.port) if spec.port else ''}"


class PreflightFailed(RefusedError):
    """A run refused by its target's preflight; `report` holds every row, `failed` the refusing ones."""

    def __init__(self, report: TargetReport, failed: list[Check]) -> None:
        self.report, self.failed = report, failed
        busy_only = all(check.name in TOLERABLE_WHEN_BUSY for check in failed)
        super().__init__(f"preflight of {report.target} failed: {'; '.join(f'{c.name}: {c.detail}' for c in failed)}",
                         hint="pass --force to start on busy GPUs" if busy_only else "fix it, or pass --no-preflight")


TOLERABLE_WHEN_BUSY = ("gpus_idle", "compute_apps")
"""The checks `--force` (and a batch's own runs on a target) may override: the GPUs look busy."""


def blocking(report: TargetReport, spec: TargetSpec, *, tolerate: tuple[str, ...] = ()) -> list[Check]:
    """The failed checks that refuse a run on this target. Never blocking: a check skipped because an earlier
    one failed (that one blocks), no GPU answer on a target that lists no `gpus:` (a CPU run), and the checks
    named in `tolerate` (e.g. TOLERABLE_WHEN_BUSY). (A workspace not there yet that the launch can create passes.)"""
    return [
        check
        for check in report.checks
        if not (check.ok or check.skipped)
        and not (check.name == "nvidia_smi" and not spec.gpus)
        and check.name not in tolerate
    ]


PYTHON_SNIPPET = """\
import os, sys
def torch_version():
    for entry in sys.path:
        try:
            names = os.listdir(entry or '.')
        except OSError:
            continue
        for name in names:
            low = name.lower()
            if low.endswith(('.dist-info', '.egg-info')) and low.rpartition('.')[0].partition('-')[0] == 'torch':
                path = os.path.join(entry or '.', name)
                if os.path.isdir(path):
                    path = os.path.join(path, 'METADATA' if low.endswith('.dist-info') else 'PKG-INFO')
                with open(path, encoding='utf-8') as f:
                    for line in f:
                        if line.startswith('Version:'):
                            return line[len('Version:'):].strip()
                return None
    return None
try:
    t = torch_version() or 'torch not installed'
except Exception:
    t = 'torch not installed'
TORCH_FOUND
print(sys.version.split()[0], t, sep='|')
"""
"""The python row's answer: `VERSION|TORCH` (TORCH is torch's installed version or `torch not installed`). The
version is read as importlib.metadata.version('torch') finds it (the first torch-*.dist-info METADATA or
*.egg-info PKG-INFO along sys.path) without importing importlib.metadata, whose imports cost a container's
python more than its own start-up."""
TORCH_FOUND_SNIPPET = """\
try:
    import importlib.util
    print('torch=' + ('ok' if importlib.util.find_spec('torch') else 'missing'))
except Exception:
    print('torch=missing')
"""
"""What a launch's probe asks (torch importable, without importing it), from the same interpreter."""


def inside_script(spec: TargetSpec, nvidia_smi_timeout: float, *, torch_found: bool = False) -> str:
    """One sh script printing `@@dfo-preflight NAME RC` after each section's output. With `torch_found`, the
    python section's one interpreter also prints `torch=ok|missing` (torch importable: what a launch's probe
    asks) on a line before the version line the python row reads, so a launch starts no second python."""
    gpus = shlex.join(gpu.query_argv(gpu.QUERY_FIELDS, timeout=nvidia_smi_timeout))
    apps = shlex.join(gpu.query_argv(gpu.APP_FIELDS, timeout=nvidia_smi_timeout, apps=True))
    ws = shlex.quote(spec.workspace)
    snippet = PYTHON_SNIPPET.replace("TORCH_FOUND\n", TORCH_FOUND_SNIPPET if torch_found else "")
    python = f"timeout -k 2 {PYTHON_TIMEOUT_S} {shlex.quote(spec.python)} -c {shlex.quote(snippet)}"
    return "\n".join(
        [
            f"{gpus} 2>&1; rc=$?; echo; echo '{SECTION}gpus' $rc",
            f"if [ $rc = 0 ]; then {apps} 2>&1; echo; echo '{SECTION}apps' $?; fi",
            # a missing workspace: its nearest existing parent must take a directory (the launch's mkdir -p)
            f"if [ ! -d {ws} ]; then p={ws}; while [ ! -d \"$p\" ]; do p=$(dirname -- \"$p\"); done;"
            f" if t=$(mktemp -d \"$p/.dfo-preflight.XXXXXX\" 2>/dev/null); then rmdir \"$t\"; echo \"creatable $p\";"
            f" df -Pk \"$p\" | tail -n 1; else echo \"missing $p\"; fi;"
            f" elif t=$(mktemp {ws}/.dfo-preflight.XXXXXX 2>/dev/null);"
            f" then rm -f \"$t\"; echo writable; df -Pk {ws} | tail -n 1; else echo unwritable; fi",
            f"echo '{SECTION}workspace' 0",
            f"{python} 2>&1; echo; echo '{SECTION}python' $?",
        ]
    )


def split_sections(output: str) -> dict[str, tuple[int, str]]:
    """{section: (exit code, its output)} from the script's marked output."""
    sections, lines = {}, []
    for line in output.splitlines():
        if line.startswith(SECTION):
            name, rc = line[len(SECTION) :].split()
            sections[name] = (int(rc), "\n".join(lines).strip())
            lines = []
        else:
            lines.append(line)
    return sections


def _gpu_checks(sections: dict[str, tuple[int, str]], spec: TargetSpec, timeout: float) -> list[Check]:
    where = None  # each row already sits under its target
    rc, text = sections.get("gpus", (1, "no answer"))
    try:
        if rc != 0:
            raise gpu.error_for(rc, text, where=where, timeout=timeout)
        gpus = gpu.parse_gpus(text, where=where)
        apps_rc, apps_text = sections.get("apps", (1, "no answer"))
        apps = gpu.parse_compute_apps(apps_text, where=where) if apps_rc == 0 else gpu.error_for(apps_rc, apps_text, where=where, timeout=timeout)
    except gpu.NvidiaSmiError as exc:
        return [Check("nvidia_smi", False, exc.message, code=exc.kind)]
    if not gpus:
        return [Check("nvidia_smi", False, "nvidia-smi answered but listed no GPU")]
    rows = [Check("nvidia_smi", True, "; ".join(describe_gpu(g) for g in gpus)), gpus_idle_check(gpus, spec)]
    if isinstance(apps, gpu.NvidiaSmiError):
        return rows + [Check("compute_apps", False, apps.message)]
    return rows + [compute_apps_check(apps)]


def describe_gpu(g: gpu.Gpu) -> str:
    util = "?" if g.util_pct is None else f"{g.util_pct}%"
    return f"{g.index} {g.name} {_mib(g.mem_used_mib)}/{_mib(g.mem_total_mib)} MiB {util}"


def _mib(value: int | None) -> str:
    return "?" if value is None else str(value)


def gpus_idle_check(gpus: list[gpu.Gpu], spec: TargetSpec) -> Check:
    """Idle when memory used and utilization are at or under the inventory's thresholds."""
    limits = spec.gpu_idle
    by_index = {g.index: g for g in gpus}
    wanted = list(spec.gpus) or sorted(by_index)
    absent = [index for index in wanted if index not in by_index]
    if absent:
        return Check("gpus_idle", False, f"GPU {', '.join(map(str, absent))} not visible (sees {', '.join(map(str, sorted(by_index)))})")
    busy = [
        f"GPU {g.index} {_mib(g.mem_used_mib)} MiB {'?' if g.util_pct is None else g.util_pct}%"
        for g in (by_index[i] for i in wanted)
        if (g.mem_used_mib or 0) > limits.max_memory_mib or (g.util_pct or 0) > limits.max_util_pct
    ]
    if busy:
        return Check("gpus_idle", False, f"busy: {'; '.join(busy)} (limits {limits.max_memory_mib} MiB, {limits.max_util_pct:g}%)")
    return Check("gpus_idle", True, f"GPU {', '.join(map(str, wanted))} idle")


def compute_apps_check(apps: list[gpu.ComputeApp]) -> Check:
    if not apps:
        return Check("compute_apps", True, "none")
    listed = "; ".join(f"pid {a.pid} {a.process_name} {_mib(a.used_memory_mib)} MiB" for a in apps)
    return Check("compute_apps", False, f"{len(apps)} running: {listed}")


def _workspace_check(section: tuple[int, str], spec: TargetSpec) -> Check:
    """The workspace exists and is writable, or does not exist yet and its nearest existing parent takes a
    directory (the first launch creates it: `mkdir -p`); and its disk has min_free_disk_gb free."""
    lines = section[1].splitlines()
    state, _, parent = (lines[0] if lines else "no answer").partition(" ")
    if state == "missing":
        return Check("workspace", False, workspace_missing(spec, parent))
    if state not in ("writable", "creatable"):
        return Check("workspace", False, f"{spec.workspace} is not writable ({lines[0] if lines else 'no answer'})")
    available = DF_AVAILABLE_RE.search(lines[1]) if len(lines) > 1 else None
    if available is None:
        return Check("workspace", False, f"{spec.workspace} writable, but `df -Pk` gave no free space ({' '.join(lines[1:]) or 'no output'})")
    free_gb = int(available.group(1)) / 1024**2
    detail = (f"{spec.workspace} writable, {free_gb:.1f} GB free" if state == "writable" else
              f"{spec.workspace} not there yet: the first launch creates it ({parent} writable, {free_gb:.1f} GB free)")
    if free_gb < spec.min_free_disk_gb:
        return Check("workspace", False, f"{detail} (needs {spec.min_free_disk_gb:g} GB: free some space)")
    return Check("workspace", True, detail)


def workspace_missing(spec: TargetSpec, parent: str) -> str:
    return (f"{spec.workspace} does not exist and {parent or 'its parent'} is not writable, so a launch cannot create it "
            f"(create it: mkdir -p {spec.workspace}, or set the target's workspace: to a writable path)")


def _python_check(section: tuple[int, str], spec: TargetSpec) -> Check:
    rc, text = section
    if rc != 0 or "|" not in text:
        last = text.splitlines()[-1] if text.strip() else f"exit {rc}"
        return Check("python", False, f"{spec.python} does not run: {last}")
    version, torch = text.splitlines()[-1].split("|", 1)
    torch = torch if torch == "torch not installed" else f"torch {torch}"
    return Check("python", True, f"{spec.python} {version}, {torch}")

"""The tests' one way to run the dfo CLI, as a user runs it: `dfo(...)` in this process, `dfo_process(...)` in a
process of its own. Both go through `orchestrator.cli.main` (the console script's entry point: its DfoError ->
one line and exit code mapping included) and return what a finished process leaves (`Ran`: returncode,
stdout, stderr), so a test reads the same either way.

`dfo` runs the command in this process under click's CliRunner isolation (stdin, stdout, stderr and
os.environ swapped for the call): no interpreter start-up and no imports per call (about a second each on 2
busy cores). `dfo_process` starts the installed `dfo` script; use it where a test needs a process: to
kill it at a fault hook (orchestrator/faults.py), signal it (Ctrl-C), run two dfo at once, or check what a
process's exit leaves (nothing half-done, threads gone).

Environment: `env` adds to (a value of None removes from) the environment for the call; `$DFO_INVENTORY`
is always removed first unless `env` gives it, so no developer's inventory leaks into a test.

A fault hook that ends dfo (`os._exit`) or holds it for the test (orchestrator/faults.py) would end or hold the
test itself in this process: `dfo` runs a command whose `env` arms one as a process (`dfo_process`, bounded by
`timeout`), so a test helper may call `dfo` for every command it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from click.testing import CliRunner

from orchestrator import faults
from orchestrator.cli import main  # imported here, before any test's COLUMNS: rich sizes its consoles at import

DFO = str(Path(sys.executable).parent / "dfo")
PROCESS_TIMEOUT_S = 120.0
PROCESS_HOOKS = (faults.LAUNCH_EXIT_AT, faults.FALLBACK_EXIT_AT, faults.PAUSE_AT)
"""The fault hooks that need dfo in a process of its own: an exit at a point, a pause the test lifts."""


@dataclass(frozen=True)
class Ran:
    """What one dfo command left: its argv, exit status and output (as subprocess.CompletedProcess has them)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _environment(env: Mapping[str, str | None] | None) -> dict[str, str | None]:
    return {"DFO_INVENTORY": None, **(env or {})}


@contextmanager
def _cwd(path: Path | None) -> Iterator[None]:
    before = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def dfo(*args: str, env: Mapping[str, str | None] | None = None, cwd: Path | None = None,
        input: str | None = None, timeout: float = PROCESS_TIMEOUT_S) -> Ran:
    """Run `dfo ARGS` in this process and return what it left (as a process, within `timeout`, when `env` arms
    one of PROCESS_HOOKS)."""
    if any((env or {}).get(hook) for hook in PROCESS_HOOKS):
        return dfo_process(*args, env=env, cwd=cwd, input=input, timeout=timeout)
    argv = [str(arg) for arg in args]
    runner = CliRunner()
    code = 0
    with _cwd(cwd), runner.isolation(input=input, env=_environment(env)) as (stdout, stderr, _):
        saved_argv = sys.argv
        sys.argv = ["dfo", *argv]
        try:
            main()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        finally:
            sys.argv = saved_argv
            sys.stdout.flush()
            sys.stderr.flush()
        out, err = stdout.getvalue(), stderr.getvalue()
    return Ran(argv, code, out.decode(errors="replace"), err.decode(errors="replace"))


def dfo_process(*args: str, env: Mapping[str, str | None] | None = None, cwd: Path | None = None,
                input: str | None = None, timeout: float = PROCESS_TIMEOUT_S) -> Ran:
    """Run the installed `dfo ARGS` as a process of its own (bounded by `timeout`) and return what it left."""
    merged = dict(os.environ)
    for key, value in _environment(env).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    argv = [str(arg) for arg in args]
    done = subprocess.run([DFO, *argv], capture_output=True, text=True, timeout=timeout, env=merged, cwd=cwd,
                          input=input)
    return Ran(argv, done.returncode, done.stdout, done.stderr)

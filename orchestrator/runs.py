"""Runs on a target: launch one detached with a named log, stop it (identity-checked), tail its log.

Launch follows docs/design.md's "Detached launch" contract: `setsid nohup sh -c WRAPPER </dev/null >>LOG 2>&1 &`,
so the run outlives the SSH session and `pct exec`; the wrapper traps TERM with a handler so it can write
the run's exit status to LOG.exit. Secrets travel on the start script's stdin into a mode-0600 file that
the wrapper sources and deletes before the run starts: they are never on a command line, in output, logs
or the registry. Round trips for a launch: one (orchestrator/launchplan.py: the preflight when a gate is
given, the probe of python, torch, package and log name, and the start, in one script that waits for dfo's
word between its checks and the start), plus the push when the package is missing.

This module must not decide anything about a run's health (decide/ does) and never overwrites a log:
the log is created with noclobber, so two launches of one name cannot both start.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import events, faults
from .agent import stopper
from .errors import CommandTimeout, DfoError, RefusedError, RemoteError, UsageError
from .inventory import START_GRACE_S, STOP_GRACE_S
from .launchplan import PROBE_TIMEOUT_S, SECRETS_FROM_STDIN, Gate, Opened, open_plan
from .logfmt import format_ts
from .names import check_name
from .package import PUSH_MARGIN_S, Package, PushResult, build_package, parse_probe, pkg_dir, probe_script, push
from .preflight import TargetReport, inside_timeout
from .remote.base import Target
from .states import RunState
from .store import Run, Store, utc_now

START_TIMEOUT = 30.0
LAUNCH_LEASE_S = 15.0  # a `launching` row of another workstation's dfo not renewed for this long: that dfo died
LOG_TIMEOUT = 30.0
MAX_LOG_LINES = 10_000_000  # `dfo logs -n` at most: a larger count reached tail, whose refusal read as a missing log
SETTINGS_CHECK_S = 10.0  # after a launch with --set, how long the trainer gets to accept or refuse them
EXIT_USAGE = 2  # the trainer's exit status for settings it refuses (trainer/__main__.py EXIT_USAGE)
WRAPPER_HEAD = 'sh -c trap "true" TERM'  # how a run's wrapper reads in /proc/PID/cmdline (NULs as spaces)
FOLLOW_POLL_S = 0.5  # how often `dfo logs -f` looks for the run's end
FOLLOW_DRAIN_S = 1.5  # then how long tail gets to print the last lines (it polls the file each second)
LOG_EXISTS_EXIT = 17
KILL_SETTLE_S = 10.0
LOST_RECHECK_S = 300.0
"""`dfo runs` looks for a run whose start got no answer (`unconfirmed`) at most this often (look_due)."""
LATE_START_S = 3600.0
"""How long after a launch was marked failed `dfo runs` still looks for its run coming up late (may_start_late)."""
STOP_PROBE_TIMEOUT = 20.0
STOP_MARGIN_S = 2 * KILL_SETTLE_S + 2 * STOP_PROBE_TIMEOUT
"""A stop's remote calls end within grace + STOP_MARGIN_S (a wedged target gives CommandTimeout, not a hang)."""
LAUNCH_MARGIN_S = (PROBE_TIMEOUT_S + inside_timeout(Gate.nvidia_smi_timeout) + PUSH_MARGIN_S + START_TIMEOUT
                   + SETTINGS_CHECK_S + LOG_TIMEOUT)
"""A launch's remote calls end within this: the plan call (the probe, and a gate's checks), the push, the start and
the settings check, each at its timeout."""
POLL_S = 0.2
SET_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_NAME_SUFFIX = 50
WANDB_MODES = ("off", "offline", "online", "auto")
"""`python -m trainer --wandb` choices (auto: offline unless WANDB_API_KEY is set)."""
TRAINER_TOPOLOGIES = {"threaded": "threads", "procsplit": "procsplit"}
"""Inventory `topology:` -> `python -m trainer --topology` (trainer/config.py TOPOLOGIES)."""


@dataclass(frozen=True)
class RunSpec:
    """What to run where: a target's paths and one variant, resolved from the inventory (see spec_for)."""

    target: str
    host: str
    workspace: str
    python: str
    variant: str
    command: str | None = None  # a user's own command (run in the workspace) instead of the built-in trainer
    compile: str | None = None
    preset: str | None = None
    topology: str | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()  # names of workstation environment variables to pass through a 0600 file
    wandb: str = "off"
    batch: str | None = None
    parent: str | None = None
    chain: tuple[str, ...] | None = None  # the fallback chain ahead; () = no more variants, None = none given
    sets: Mapping[str, str] = field(default_factory=dict)  # the user's --set overrides (in `args` too), for fallbacks
    tags: tuple[str, ...] = ()  # W&B tags (the variant's)
    inventory_path: str | None = None  # the inventory file it comes from (None: the built-in one), kept in the registry
    resume: bool = False  # built-in trainer: --resume from OUT/<this run>/checkpoint.pt (dfo resume puts it there)
    inventory_hash: str | None = None

    @property
    def builtin(self) -> bool:
        return self.command is None


@dataclass(frozen=True)
class Launched:
    """A started run, the push it needed (None for a user command), secrets that were not set locally and the
    preflight's rows (None without a gate)."""

    run: Run
    push: PushResult | None
    missing_secrets: tuple[str, ...] = ()
    preflight: TargetReport | None = None


def parse_sets(pairs: Sequence[str]) -> dict[str, str]:
    """`["steps=50", "drafter.layers=2"]` -> dict; UsageError names the bad pair."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not SET_KEY_RE.fullmatch(key):
            raise UsageError(f"--set {pair!r}: expected key=value with a key of letters, digits, '_', '.', '-'")
        values[key] = value
    return values


def spec_for(inventory, target_name: str, variant_name: str, *, sets: Mapping[str, str] | None = None, **extra: Any) -> RunSpec:
    """The RunSpec for a target and variant of `inventory` (an orchestrator.inventory.Inventory).

    `sets` override the variant's args (built-in trainer only); `extra` sets wandb/batch/parent/chain."""
    target = inventory.target(target_name)
    variant = inventory.variant(variant_name)
    extra = {**inventory_file(inventory), **extra}
    if sets and variant.command is not None:
        raise UsageError(f"--set applies to built-in trainer variants; variant {variant_name!r} runs its own command")
    if variant.command is None:
        check_trainer_keys(sets or {}, variant.args, variant_name)
    return RunSpec(
        target=target.name,
        host=target.host,
        workspace=target.workspace,
        python=target.python,
        variant=variant_name,
        command=variant.command,
        compile=variant.compile,
        preset=variant.preset,
        topology=variant.topology,
        args={**variant.args, **(sets or {})},
        env=dict(variant.env),
        tags=tuple(variant.tags),
        secrets=tuple(inventory.secrets),
        sets=dict(sets or {}),
        **extra,
    )


def check_trainer_keys(sets: Mapping[str, Any], args: Mapping[str, Any], variant_name: str) -> None:
    """Refuse, before anything is launched, a `--set` key or variant `args:` key the built-in trainer does not
    take (it would start a run that dies at once with exit 2): "unknown trainer key 'stepz'; did you mean
    'steps'?". The keys come from the trainer's own config schema (trainer.config imports no torch)."""
    from trainer.config import override_keys

    known = override_keys()
    for where, keys in (("--set", sets), (f"variant {variant_name!r} args", args)):
        for key in keys:
            if str(key) not in known:
                raise UsageError(f"{where}: unknown trainer key {str(key)!r}{_did_you_mean(str(key), known)}",
                                 hint="see docs/trainer.md for the keys the built-in trainer takes")


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    """`; did you mean 'steps'?` for the closest known key, a bare field name matched to its sections too
    (`lr` -> 'optim.lr', `layers` -> 'target.layers' or 'drafter.layers')."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    close += [name for name in known if name.rpartition(".")[2] == key and name not in close]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(name) for name in close[:3]) + "?"


def inventory_file(inventory) -> dict[str, str | None]:
    """{inventory_path, inventory_hash} of the file `inventory` was loaded from (both None for the built-in one)."""
    source = inventory.source
    if source.startswith("<"):
        return {"inventory_path": None, "inventory_hash": None}
    path = os.path.abspath(source)
    try:
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    except OSError:
        digest = None
    return {"inventory_path": path, "inventory_hash": digest}


def launcher_id() -> str:
    """`host:pid` of this dfo: a `launching` row whose launcher is gone was left by a dfo that died."""
    return f"{socket.gethostname()}:{os.getpid()}"


def launcher_alive(run: Run, *, now: float | None = None) -> bool:
    """Whether the dfo that is launching `run` still lives: one of this workstation by its PID; one of another
    workstation (which cannot be looked at from here) while it renews the row (owner_seen_at within
    LAUNCH_LEASE_S by the wall clock; a row of a dfo from before the renewals: taken to live)."""
    host, _, pid = (run.owner or "").rpartition(":")
    if host != socket.gethostname():
        if not run.owner:
            return False
        return run.owner_seen_at is None or (time.time() if now is None else now) - run.owner_seen_at < LAUNCH_LEASE_S
    return pid.isdigit() and process_alive(host, int(pid))


def keep_launch_alive(store: Store, name: str, owner: str) -> None:
    """Renew `name`'s `launching` row for its launcher `owner` every LAUNCH_LEASE_S / 4 on a thread of its own
    (`launch-lease-NAME`), until the row is no longer that launcher's `launching` one (started, given up,
    forgotten) or the registry can no longer be written (its dfo is ending): a dfo of another workstation tells a
    launch under way from one whose dfo died by it (launcher_alive). The thread ends by itself."""
    def renew() -> None:
        try:
            while True:
                time.sleep(LAUNCH_LEASE_S / 4)
                if not store.renew_launch(name, owner, time.time()):
                    return
        except Exception:  # noqa: BLE001 - the registry closed under it (the dfo is ending): the lease lapses
            return

    threading.Thread(target=renew, name=f"launch-lease-{name}", daemon=True).start()


def launch_under_way(run: Run) -> bool:
    """Whether a dfo that lives is launching `run` now (its row `launching`, no PID recorded yet: its package may be
    going up, its start not answered yet): what follows the run waits for that dfo to record the start."""
    return run.state == RunState.LAUNCHING and run.pid is None and launcher_alive(run)


def process_alive(host: str | None, pid: int | None) -> bool:
    """Whether process `pid` of workstation `host` (a dfo: a launch's, a claim's holder) still lives. One on
    another workstation, or of no known PID, cannot be looked at from here: assumed alive. A zombie (it ended,
    its parent has not reaped it yet) is not."""
    if host != socket.gethostname() or pid is None:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as stat:
            return stopper.live(stat.read())
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        pass
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- paths

def out_dir(spec: RunSpec, name: str) -> str:
    """Where the built-in trainer keeps run `name`'s checkpoint: WORKSPACE/<args.out, default runs>/<name>."""
    out = str(spec.args.get("out") or "runs")
    return f"{out if out.startswith('/') else spec.workspace + '/' + out}/{name}"


def log_path(workspace: str, name: str) -> str:
    return f"{workspace}/logs/{name}.log"


def exit_path(workspace: str, name: str) -> str:
    return f"{log_path(workspace, name)}.exit"


def exit_part_path(workspace: str, name: str) -> str:
    """Where the wrapper writes the exit status before renaming it to exit_path (wrapper_script)."""
    return f"{exit_path(workspace, name)}.part"


def secrets_path(workspace: str, name: str) -> str:
    return f"{workspace}/.dfo/secrets/{name}.env"


def default_name(variant: str, now: datetime | None = None) -> str:
    """`train_<variant>_<YYYYmmdd-HHMM>` (local time of the workstation)."""
    return f"train_{variant}_{(now or datetime.now()):%Y%m%d-%H%M}"


# ---------------------------------------------------------------------------------------------- commands

def trainer_command(spec: RunSpec, name: str, pkg_dir: str) -> str:
    """`PYTHONPATH=PKG PYTHON -m trainer --run-name NAME ...`: an arg `log_every: 5` goes as `--log-every 5`,
    one with a dotted key as `--set drafter.layers=2`."""
    argv = [spec.python, "-m", "trainer", "--run-name", name]
    if spec.compile:
        argv += ["--variant", spec.compile]
    if spec.preset:
        argv += ["--preset", spec.preset]
    if spec.topology:
        argv += ["--topology", trainer_topology(spec.topology)]
    for key, value in spec.args.items():
        key = str(key)
        argv += ["--set", f"{key}={_arg(value)}"] if "." in key else [f"--{key.replace('_', '-')}", _arg(value)]
    argv += ["--wandb", spec.wandb]
    if spec.resume:
        argv.append("--resume")
    wandb = "".join(f"{key}={shlex.quote(value)} " for key, value in wandb_env(spec).items())
    return f"{wandb}PYTHONPATH={shlex.quote(pkg_dir)}${{PYTHONPATH:+:$PYTHONPATH}} {shlex.join(argv)}"


def wandb_env(spec: RunSpec) -> dict[str, str]:
    """W&B's own variables for a run that logs to W&B: its batch as the group, its variant as the job type, the
    variant's tags. Set on the command line, not in `env`, so a fallback run gets its own variant's."""
    if spec.wandb == "off":
        return {}
    env = {"WANDB_JOB_TYPE": spec.variant}
    if spec.batch:
        env["WANDB_RUN_GROUP"] = spec.batch
    if spec.tags:
        env["WANDB_TAGS"] = ",".join(spec.tags)
    return env


def trainer_topology(topology: str) -> str:
    """The trainer's `--topology` word for an inventory `topology:` (the inventory says `threaded`)."""
    try:
        return TRAINER_TOPOLOGIES[topology]
    except KeyError:
        raise UsageError(f"topology {topology!r}: expected one of {', '.join(TRAINER_TOPOLOGIES)}") from None


def _arg(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def wrapper_script(spec: RunSpec, name: str, command: str, *, with_secrets: bool) -> str:
    """What the detached `sh -c` runs: keep TERM from killing it, load and delete the secrets, run, write $?.

    The status goes to LOG.exit.part, which is then renamed to LOG.exit, so a reader finds no exit file or the
    whole status, never an empty or half-written one. The rename is the wrapper itself (`exec mv`: its PID, still
    alone in its group, as the stopper expects of a wrapper writing the status), ignoring TERM (a stop's signal
    to the group cannot cut it short) and found on the system's PATH whatever the run's `env:` made of it."""
    parts = [WRAPPER_HEAD.removeprefix("sh -c ")]
    if with_secrets:
        secrets = shlex.quote(secrets_path(spec.workspace, name))
        parts.append(f"set -a; . {secrets}; set +a; rm -f {secrets}")
    for key, value in spec.env.items():
        parts.append(f"export {key}={shlex.quote(str(value))}")
    # A subshell, so a user's command that says `exit` still lets the wrapper write the exit file. Its TERM trap
    # waits for the running command (a trainer checkpointing on SIGTERM) and passes on that command's status
    # instead of dying at once or going on to the next command; a 0 there (TERM arrived between commands)
    # becomes 143. The newline before `)` keeps a trailing comment in the command from swallowing it.
    run = f"( trap 's=$?; [ $s = 0 ] && s=143; exit $s' TERM; {command}\n)"
    done, part = shlex.quote(exit_path(spec.workspace, name)), shlex.quote(exit_part_path(spec.workspace, name))
    return "; ".join(parts) + f"; {run}; echo $? > {part}; trap '' TERM; PATH=/usr/bin:/bin:$PATH exec mv -f {part} {done}"


def start_script(spec: RunSpec, name: str, wrapper: str, *, with_secrets: bool, secrets_from: str = "cat") -> str:
    """Reserve the log (noclobber), write the secrets from stdin (read by `secrets_from`), start the wrapper
    detached, print its PID and stat."""
    q = shlex.quote
    log, secrets = q(log_path(spec.workspace, name)), q(secrets_path(spec.workspace, name))
    lines = [
        f"mkdir -p {q(spec.workspace + '/logs')} {q(spec.workspace + '/.dfo/secrets')} && cd {q(spec.workspace)} || exit 1",
        f"if ! (set -C; : > {log}) 2>/dev/null; then echo 'log exists' >&2; exit {LOG_EXISTS_EXIT}; fi",
        f"rm -f {q(exit_path(spec.workspace, name))} {q(exit_part_path(spec.workspace, name))}",
    ]
    if with_secrets:  # never through a file or link that is there already (planted by whoever can write the
        # workspace: `>` would follow a link, or keep a file's mode), checked, then created with noclobber (O_EXCL)
        planted = q(f"the secrets file {secrets_path(spec.workspace, name)} already exists (planted? remove it)")
        lines += [f"if [ -e {secrets} ] || [ -L {secrets} ]; then echo {planted} >&2; rm -f {log}; exit 1; fi",
                  f"if ! (umask 077; set -C; {secrets_from} > {secrets}); then rm -f {secrets} {log}; exit 1; fi"]
    if faults.slow_start_s(name):
        lines.append(f"sleep {faults.slow_start_s(name):g}")
    lines += [
        f"setsid nohup sh -c {q(wrapper)} </dev/null >>{log} 2>&1 &",
        "pid=$!",
        "echo pid=$pid",
        'echo "stat=$(cat /proc/$pid/stat 2>/dev/null)"',
    ]
    return "\n".join(lines)


def gone(stat: str, started: int | None = None) -> bool:
    """The process a /proc/PID/stat line (read a moment ago) describes has ended: no line, a zombie (or dead), or
    (given the start time it had) another process's line. The line is read as the stop program reads it."""
    return not stopper.live(stat) or (started is not None and stopper.starttime(stat) != started)


# ---------------------------------------------------------------------------------------------- launch

def launch(target: Target, spec: RunSpec, store: Store, *, start_grace_s: float | None = None, **options: Any) -> Launched:
    """Start `spec` detached on `target` and record it, in one remote call (plus the push when needed); the
    options are prepare's (name, environ, package, now, gate).
    Refuses (RefusedError) a taken name, an existing log, a missing python or torch, and with a `gate` a
    failed preflight (preflight.PreflightFailed, with every row); a failure halfway removes what it created
    and records nothing as running. A start that got no answer is StartsUnseen (its hint names the inventory's
    `start_grace_s` when given)."""
    prepared = prepare(target, spec, store, **options)
    try:
        return prepared.start()
    except DfoError as exc:
        row = store.find_run(prepared.name)
        if row is not None and start_unseen(row):
            raise StartsUnseen(prepared.name, [(row, exc)], None, grace_s=start_grace_s) from exc
        raise


class StartsUnseen(CommandTimeout):
    """A launch whose start got no answer (a multi-node run's: on some of its nodes): those runs are left
    `unconfirmed` (start_unseen) and may come up all the same. The message names the run, each such node and its
    target (a single run: the run and its target once), the nodes that did start (`started`, None for a single
    run) and what happens next; `answer` is what the target said (or did not), for a fallback's own message
    (chains.StartUnseen)."""

    def __init__(self, run: str, unseen: Sequence[tuple[Run, DfoError]], started: Sequence[Run] | None, *,
                 grace_s: float | None) -> None:
        self.answer = unseen[0][1].message
        unconfirmed = ", ".join(f"{row.name} on {row.target}" for row, _ in unseen)
        if started is None:  # a single run: the run and its target named once
            [(row, exc)] = unseen
            said = exc.detail if isinstance(exc, RemoteError) and exc.where == row.target else exc.message
            message, left = f"{run}: the start on {row.target} got no answer ({said})", "it may still come up"
        else:
            message = (f"{run}: the start of {unconfirmed} got no answer ({self.answer}); started: "
                       + (", ".join(f"{node.name} on {node.target} (PID {node.pid})" for node in started) or "no node"))
            left = f"{unconfirmed}, which may still come up"
        grace = "watch.start_grace_s" + (f" ({grace_s:g} s)" if grace_s is not None else "")
        after = (f"the started nodes wait for it at the rendezvous (run.rendezvous_timeout_s) and end on their own "
                 f"if it never comes; `dfo stop {run}` stops every node, waiting for an unconfirmed one while its start "
                 f"grace lasts" if started is not None else
                 f"`dfo stop {run}` stops it, waiting for it while its start grace lasts")
        super().__init__(f"{message}; left `unconfirmed`: {left}",
                         hint=f"`dfo runs {run}` or `dfo watch {run}` looks for it by its exit file: adopted if it runs, "
                              f"marked failed if nothing of it shows within {grace}; {after}")


@dataclass
class Prepared:
    """A launch up to its start: the name reserved (`launching` row), the call open on the target with its
    preflight and probe passed, waiting for the word to start. `start()` pushes and starts it; `cancel()`
    starts nothing and forgets the row. A multi-node launch prepares every node before it starts any; once
    the nodes are recorded as one run (store.add_nodes), a node that is not started keeps its row, `failed`
    with why (`start(recorded=True)`, `cancel(why)`): the run goes on naming it."""

    target: Target
    spec: RunSpec
    store: Store
    name: str
    opened: Opened
    package: Package | None
    secrets: Mapping[str, str]
    missing: tuple[str, ...]

    def start(self, *, recorded: bool = False) -> Launched:
        """Push and start it; a start that fails forgets the row (`recorded`: marks it `failed`), one that got
        no answer leaves it `unconfirmed` (start_unseen)."""
        target, spec, store, name, opened, package = self.target, self.spec, self.store, self.name, self.opened, self.package
        starting = False
        try:
            pushed = push(target, spec.workspace, package=package, store=store, target_name=spec.target, probe=opened.probe) if package else None
            starting = True
            pid, stat = _start(opened, spec, name, self.secrets)
        except BaseException as exc:
            opened.call.cancel()
            _abandon(target, spec, name, store, exc, maybe_started=starting and isinstance(exc, (CommandTimeout, KeyboardInterrupt)),
                     forget=not recorded)
            raise
        faults.exit_at("started")
        if spec.parent:
            faults.exit_at("launch_started", faults.FALLBACK_EXIT_AT)
        command = _command(spec, name, package)
        run = store.transition(name, RunState.RUNNING, RunState.unsettled(), pid=pid, proc_starttime=stopper.starttime(stat),
                               started_at=utc_now(), command=command, owner=None) or store.get_run(name)
        faults.exit_at("recorded")
        events.record(store, events.Launched(at=utc_now(), run=name, pid=pid, target=spec.target, variant=spec.variant,
                                             sets=dict(spec.sets), env=dict(spec.env), wandb=spec.wandb))
        if spec.builtin and spec.sets:
            _refuse_settings_the_trainer_refused(target, store, spec, run)
        return Launched(run, pushed, self.missing, opened.report)

    def cancel(self, why: str | None = None) -> None:
        """Start nothing: the row is forgotten, or with `why` (its run names it) kept as `failed` with `why`."""
        self.opened.call.cancel()
        if why is None:
            self.store.delete_run(self.name)
        else:
            mark_failed(self.store, self.name, why)


def prepare(
    target: Target,
    spec: RunSpec,
    store: Store,
    *,
    name: str | None = None,
    environ: Mapping[str, str] | None = None,
    package: Package | None = None,
    now: datetime | None = None,
    gate: Gate | None = None,
) -> Prepared:
    """Everything of `launch` up to the start (see Prepared); refuses as launch does, leaving nothing."""
    validate_spec(spec)
    environ = os.environ if environ is None else environ
    secrets = {key: environ[key] for key in spec.secrets if key in environ}
    missing = tuple(key for key in spec.secrets if key not in environ)
    package = (package or build_package()) if spec.builtin else None
    name, opened = _reserve_name(target, spec, store, name, package, now, gate, bool(secrets))
    faults.exit_at("reserved")
    if spec.parent:  # a successor (a fallback's): its row is `launching`, nothing started yet
        faults.exit_at("launching", faults.FALLBACK_EXIT_AT)
    return Prepared(target, spec, store, name, opened, package, secrets, missing)


def _refuse_settings_the_trainer_refused(target: Target, store: Store, spec: RunSpec, run: Run) -> None:
    """The trainer checks its settings before it loads torch and answers a bad `--set` at once with exit 2;
    it makes its run directory once they are good. Wait for one or the other (SETTINGS_CHECK_S at most), so a
    refused key fails the launch with the trainer's own message instead of a `launched` that is already over."""
    q = shlex.quote
    script = (f"i=0; while [ $i -lt {int(SETTINGS_CHECK_S / POLL_S)} ] && [ ! -s {q(run.exit_path)} ] "
              f"&& [ ! -d {q(out_dir(spec, run.name))} ]; do sleep {POLL_S}; i=$((i + 1)); done\n"
              f'echo "exit=$(cat {q(run.exit_path)} 2>/dev/null)"; tail -n 3 {q(run.log_path)}')
    try:
        output = target.run(script, timeout=SETTINGS_CHECK_S + LOG_TIMEOUT).stdout
    except DfoError:
        return  # the run started; whether it likes its settings, the watch will tell
    head, _, tail = output.partition("\n")
    if head.strip() != f"exit={EXIT_USAGE}":
        return
    _record_end(store, run, str(EXIT_USAGE), "the trainer refused its settings")
    message = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "no message")
    raise RefusedError(f"the trainer refused the settings of {run.name}: {message}",
                       hint="see docs/trainer.md for the keys it takes (python -m trainer --help)")


def _command(spec: RunSpec, name: str, package: Package | None) -> str:
    return trainer_command(spec, name, pkg_dir(spec.workspace, package.sha256)) if package else spec.command


def validate_spec(spec: RunSpec) -> None:
    """Refuse, before anything reaches a shell, names and keys that could carry shell syntax."""
    check_name(spec.variant, "variant")
    check_name(spec.target, "target")
    if spec.topology:
        trainer_topology(spec.topology)
    if spec.builtin and spec.wandb not in WANDB_MODES:
        raise UsageError(f"--wandb {spec.wandb!r}: expected one of {', '.join(WANDB_MODES)}")
    for key in spec.args:
        if not SET_KEY_RE.fullmatch(str(key)):
            raise UsageError(f"variant {spec.variant!r}: argument name {key!r} must be letters, digits, '_', '.', '-'")
    for key in [*spec.env, *spec.secrets]:
        if not ENV_KEY_RE.fullmatch(key):
            raise UsageError(f"variant {spec.variant!r}: environment name {key!r} must be letters, digits and '_'")


def _reserve_name(target: Target, spec: RunSpec, store: Store, name: str | None, package: Package | None, now: datetime | None,
                  gate: Gate | None, with_secrets: bool) -> tuple[str, Opened]:
    """Record the run as `launching` under a free name, then open the launch's call on the target (one round
    trip per name tried; it waits for the word to start).
    The registry row is taken first, so two dfo processes never pick the same name. An explicit name that is
    taken in the registry or has a log on the target is refused; a default name moves on to `-2`, `-3`, ..."""
    explicit = name is not None
    candidates = [check_name(name, "run name")] if explicit else default_names(spec.variant, now)
    for candidate in candidates:
        try:
            row = store.add_run(_launching_run(spec, candidate, package))
        except RefusedError:
            if explicit:
                raise
            continue
        keep_launch_alive(store, candidate, row.owner)
        try:
            opened = _probe(target, spec, candidate, package, gate, with_secrets)
        except BaseException:
            store.delete_run(candidate)
            raise
        if opened.probe.get("log") != "exists":
            return candidate, opened
        opened.call.cancel()
        store.delete_run(candidate)
        if explicit:
            raise RefusedError(
                f"{log_path(spec.workspace, candidate)} already exists on {spec.target}; dfo never overwrites a log",
                hint="choose another --name",
            )
    raise RefusedError(f"no free run name among {candidates[0]}..{candidates[-1]}", hint="pass --name")


def default_names(variant: str, now: datetime | None) -> list[str]:
    """The default name, then `-2`, `-3`, ... (a launch takes the first that is free)."""
    base = default_name(variant, now)
    return [base] + [f"{base}-{i}" for i in range(2, MAX_NAME_SUFFIX + 1)]


def _probe(target: Target, spec: RunSpec, name: str, package: Package | None, gate: Gate | None, with_secrets: bool) -> Opened:
    log = shlex.quote(log_path(spec.workspace, name))
    script = f"if [ -e {log} ]; then echo log=exists; else echo log=free; fi\n"
    if package:
        own_python = gate is not None and gate.spec.python == spec.python  # the gate's python answers torch too
        script += probe_script(spec.workspace, package, spec.python, torch=not own_python)
    command = _command(spec, name, package)
    wrapper = wrapper_script(spec, name, command, with_secrets=with_secrets)
    start = start_script(spec, name, wrapper, with_secrets=with_secrets, secrets_from=SECRETS_FROM_STDIN)
    opened = open_plan(target, gate, probe=script, start=start)
    try:
        _refuse_without_python(spec, opened.probe)
    except RefusedError:
        opened.call.cancel()
        raise
    return opened


def _refuse_without_python(spec: RunSpec, probe: dict[str, str]) -> None:
    if probe.get("python") == "missing":
        raise RefusedError(
            f"{spec.python} not found in {spec.target}", hint="install python there or set `python:` for the container in the inventory"
        )
    if probe.get("torch") == "missing":
        raise RefusedError(
            f"{spec.python} in {spec.target} has no torch; dfo installs nothing", hint=f"install torch in {spec.target} first"
        )


def _launching_run(spec: RunSpec, name: str, package: Package | None) -> Run:
    return Run(
        name=name,
        target=spec.target,
        host=spec.host,
        variant=spec.variant,
        command=spec.command,
        log_path=log_path(spec.workspace, name),
        exit_path=exit_path(spec.workspace, name),
        workspace=spec.workspace,
        trainer_hash=package.sha256 if package else None,
        parent=spec.parent,
        chain=list(spec.chain) if spec.chain is not None else None,
        batch=spec.batch,
        state="launching",
        inventory_path=spec.inventory_path,
        inventory_hash=spec.inventory_hash,
        owner=launcher_id(),
        owner_seen_at=time.time(),
    )


def _start(opened: Opened, spec: RunSpec, name: str, secrets: Mapping[str, str]) -> tuple[int, str]:
    faults.lose_start_answer("before_start", successor=bool(spec.parent), timeout_s=START_TIMEOUT)
    timeout = faults.SLOW_START_ANSWER_S if faults.slow_start_s(name) else START_TIMEOUT
    result = opened.call.start(_env_file(secrets) if secrets else b"", timeout=timeout)
    if result.exit_code == LOG_EXISTS_EXIT:
        raise RefusedError(f"{log_path(spec.workspace, name)} appeared on {spec.target} meanwhile; dfo never overwrites a log")
    info = parse_probe(result.stdout)
    if result.failed or not info.get("pid", "").isdigit():
        raise RemoteError(f"starting run {name} failed: {result.tail(3) or 'no PID printed'}", where=spec.target)
    faults.lose_start_answer("after_start", successor=bool(spec.parent), timeout_s=START_TIMEOUT)
    return int(info["pid"]), info.get("stat", "")


def _env_file(secrets: Mapping[str, str]) -> bytes:
    """`KEY='value'` lines for `set -a; . FILE` (values quoted for sh)."""
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in secrets.items()).encode()


def _abandon(target: Target, spec: RunSpec, name: str, store: Store, exc: BaseException, *, maybe_started: bool,
             forget: bool = True) -> None:
    """After a failed launch: remove the secrets file and the empty log we made, and forget the run (unless not
    `forget`: marked `failed`); a start that timed out or was interrupted may be running, so its log stays and
    it is recorded as `unconfirmed`."""
    log_is_ours = not maybe_started and not isinstance(exc, RefusedError)  # a refused start never made the log
    _remove_launch_files(target, spec.workspace, name, log=log_is_ours)
    error = str(exc)[:500] or type(exc).__name__
    if maybe_started:
        events.record(store, events.LaunchFailed(at=utc_now(), run=name, error=error))
        store.transition(name, RunState.UNCONFIRMED, [RunState.LAUNCHING], ended_at=utc_now())
    elif forget:
        events.record(store, events.LaunchFailed(at=utc_now(), run=name, error=error))
        store.delete_run(name)
    else:
        mark_failed(store, name, error)


def mark_failed(store: Store, name: str, why: str) -> Run:
    """Record that launch `name` never started its run: `failed`, `why` its `launch_failed` event (recorded only by
    the dfo that made the change: one that found it settled already, running or failed, records nothing)."""
    failed = store.transition(name, RunState.FAILED, [RunState.LAUNCHING, RunState.UNCONFIRMED], ended_at=utc_now(),
                              owner=None)
    if failed is None:
        return store.get_run(name)
    events.record(store, events.LaunchFailed(at=utc_now(), run=name, error=why))
    return failed


def _remove_launch_files(target: Target, workspace: str, name: str, *, log: bool) -> None:
    """Remove what a start that never ran its wrapper may have made: the secrets file and (`log`) an empty log."""
    secrets, log_file = shlex.quote(secrets_path(workspace, name)), shlex.quote(log_path(workspace, name))
    try:
        target.run(f"rm -f {secrets}" + (f"; [ -s {log_file} ] || rm -f {log_file}" if log else ""), timeout=START_TIMEOUT)
    except DfoError:
        pass  # the target is unreachable: nothing more can be removed now


def start_unseen(run: Run) -> bool:
    """A start dfo sent but never saw answered (it timed out, or dfo was interrupted): `unconfirmed`, no PID, no
    exit status. Its run may well be going: look (resolve_launch) before taking it for nothing."""
    return run.state == RunState.UNCONFIRMED


def needs_look(run: Run) -> bool:
    """Whether what the registry says of `run` may be out of date: it is active, or its start was never seen
    answered (start_unseen)."""
    return run.active or start_unseen(run)


def never_started(run: Run) -> bool:
    """A launch recorded `failed` without a PID: given up before its start, or a start nothing of which showed (it
    may still come up late: may_start_late). Nothing of it runs to follow or judge."""
    return run.state == RunState.FAILED and run.pid is None


def start_unsettled(run: Run) -> bool:
    """A start whose outcome dfo never learnt: one it never saw answered (start_unseen), or one whose launching dfo
    died before recording it (`launching`, its launcher gone: launcher_alive). Its run may be going or not; the
    next look at its target settles it (look)."""
    return start_unseen(run) or (run.state == RunState.LAUNCHING and not launcher_alive(run))


def may_start_late(run: Run, *, within_s: float | None = None, now: float | None = None) -> bool:
    """A launch marked `failed` because nothing of it showed (its start got no answer within its grace, or its
    dfo died): no PID, no exit status. A start slower than its grace brings its run up all the same, so it is
    looked for again (look: adopted if its process shows) by what looks at it by name (`dfo watch NAME`,
    `dfo stop NAME`, a fallback finishing) and, `within_s` of being marked failed, by `dfo runs` (--recheck, or a
    look at its target made anyway)."""
    if run.state != RunState.FAILED or run.pid is not None or run.exit_code is not None:
        return False
    if within_s is None or not run.ended_at:
        return within_s is None
    return (now if now is not None else time.time()) - datetime.fromisoformat(run.ended_at).timestamp() < within_s


def worth_a_look(run: Run) -> bool:
    """What a look at its target may change: needs_look, or a failed launch whose run may come up late."""
    return needs_look(run) or may_start_late(run)


def look_due(run: Run, *, recheck: bool = False, now: float | None = None, every_s: float = LOST_RECHECK_S) -> bool:
    """Whether `dfo runs` looks at `run` now: an active row always, but a start never settled (start_unsettled)
    only when it was never tried, or last tried (checked_at) `every_s` or more ago: its target may be gone, and
    each try can cost a timeout (`recheck`, `dfo runs --recheck`: looks anyway, and for a launch marked failed
    within LATE_START_S too: may_start_late)."""
    if not needs_look(run):
        return recheck and may_start_late(run, within_s=LATE_START_S, now=now)
    if recheck or not run.checked_at or not start_unsettled(run):
        return True
    return (now if now is not None else time.time()) - datetime.fromisoformat(run.checked_at).timestamp() >= every_s


def started(run: Run) -> bool:
    """Whether `run`'s process was ever seen: a PID recorded, or an end read from its exit file (a launch a dfo
    did not finish recording whose run ended before anyone looked has no PID)."""
    return run.pid is not None or run.exit_code is not None


def start_grace_left(run: Run, grace_s: float = START_GRACE_S) -> float:
    """Seconds a start never seen answered (start_unseen) still has for its process to appear, counted from when
    dfo gave up on the answer (its ended_at): a slow start is not taken for one that started nothing. 0 for
    any other row."""
    if not start_unseen(run) or not run.ended_at:
        return 0.0
    return max(0.0, datetime.fromisoformat(run.ended_at).timestamp() + grace_s - time.time())


def resolve_launch(target: Target, store: Store, run: Run, *, grace_s: float = START_GRACE_S, wait: bool = True) -> Run:
    """`run` as `target` shows it now (look; ended rows as they are). A launch a dfo that died left `launching`,
    or a start it never saw answered (start_unseen), is settled: its process, found by its exit file path,
    adopted (`running`, with its PID; or its end, read from its exit file), or with none found the run marked
    `failed` and the secrets file and empty log its start may have made removed. A start never seen answered
    is looked for every LOOK_POLL_S until its grace (start_grace_left) is over before it is marked failed; with
    `wait` False it is looked for once, and left `unconfirmed` while its grace lasts (a watch looks again on its
    own polls, not asleep here)."""
    if not worth_a_look(run):
        return run
    [settled] = look(target, store, [run], grace_s=grace_s) or [run]
    while wait and (left := start_grace_left(settled, grace_s)) > 0:
        time.sleep(min(LOOK_POLL_S, left))
        [settled] = look(target, store, [settled], grace_s=grace_s) or [settled]
    if run.pid is None and settled.state == RunState.FAILED:
        _remove_launch_files(target, run.workspace, run.name, log=True)
    return settled


# ---------------------------------------------------------------------------------------------- stop

STOPPER = Path(stopper.__file__)


def stopper_script(run: Run, grace_s: float, python: str) -> str:
    """The stop program (orchestrator/agent/stopper.py) for `run` as one sh script: the target's python (`python`,
    else python3 or python on its PATH) runs its source, every argument quoted; `identity=nopython` without one."""
    argv = ["-c", STOPPER.read_text(), "--pid", str(int(run.pid)),
            "--starttime", "none" if run.proc_starttime is None else str(int(run.proc_starttime)),
            "--exit-file", run.exit_path, "--grace", f"{grace_s:g}", "--settle", f"{KILL_SETTLE_S:g}"]
    return (f"for py in {shlex.quote(python)} python3 python; do\n"
            f'  if command -v "$py" >/dev/null 2>&1; then exec "$py" {shlex.join(argv)}; fi\n'
            "done\necho identity=nopython\n")


@dataclass(frozen=True)
class Stopped:
    """How a stop ended: the updated run, and which signal finished it (None if it had already ended)."""

    run: Run
    signal: str | None


class StopWait:
    """What a stop says while it waits for the run to end after its SIGTERM (given to stop's `on_wait`)."""

    def __init__(self, name: str, grace_s: float, waited_s: float) -> None:
        self.name, self.grace_s, self.waited_s = name, grace_s, waited_s

    def __str__(self) -> str:
        return self.text()

    def text(self, on_ctrl_c: str = "Ctrl-C leaves it running") -> str:
        """The line `dfo stop` says; `on_ctrl_c`: what Ctrl-C does where it is said (`dfo watch` finishes a
        fallback first)."""
        return (f"waiting for run {self.name} to checkpoint and exit (SIGTERM sent {self.waited_s:.0f} s ago; "
                f"SIGKILL at {self.grace_s:g} s; {on_ctrl_c})")


class StopInterrupted(KeyboardInterrupt):
    """Ctrl-C during a stop: nothing more is signalled. `term_sent_s`: how long ago its SIGTERM went out (None:
    none did, and the stop request was withdrawn)."""

    def __init__(self, run: str, term_sent_s: float | None) -> None:
        super().__init__(run)
        self.run, self.term_sent_s = run, term_sent_s

    def __str__(self) -> str:
        if self.term_sent_s is None:
            return f"interrupted before any signal: {self.run} goes on, and its stop request is withdrawn"
        return (f"interrupted: {self.run} goes on (its SIGTERM went out {self.term_sent_s:.0f} s ago, so it may "
                f"still be checkpointing; no SIGKILL follows); `dfo runs {self.run}` shows how it ends")


def stop(target: Target, store: Store, name: str, *, grace_s: float = STOP_GRACE_S, python: str = "python3",
         on_wait: Callable[[StopWait], None] | None = None) -> Stopped:
    """SIGTERM the run's process group, SIGKILL after `grace_s`, record how it ended.

    One remote program (orchestrator/agent/stopper.py, on `python`) checks that the recorded PID is still the run
    and signals it, holding a pidfd on the process it checked: a PID the kernel gave to another process meanwhile
    is never signalled. The stop request is recorded after that check and before any signal. `on_wait` hears about
    every second while the run has its SIGTERM. Ctrl-C (KeyboardInterrupt) ends the program, so nothing more is
    signalled: StopInterrupted. Refuses (RefusedError) a run that is not active, and a PID that now belongs to
    another process."""
    run = store.get_run(name)
    if not run.active or run.pid is None:
        raise RefusedError(f"run {name} is not running (state {run.state}); nothing to stop")
    asked_before = ours = None  # the stop request asked before ours (another stop's, or a multi-node run's), ours
    with _StopTalk(target, run, stopper_script(run, grace_s, python)) as talk:
        try:
            info = _identified(store, run, talk, python)
            if info.get("identity") == "gone":  # ended before the look, or while it looked: nothing to signal
                return Stopped(_ended_before_stop(store, run, talk.until("exit", STOP_PROBE_TIMEOUT).get("exit", "")), None)
            faults.pause_at("identified")
            asked_before = store.get_run(name).stop_requested_at
            ours = store.request_stop(name).stop_requested_at  # before the signal: a watch reads its exit as stopped
            info = talk.signal(grace_s, on_wait)
        except KeyboardInterrupt:
            if talk.term_sent_at is not None:
                raise StopInterrupted(name, time.monotonic() - talk.term_sent_at) from None
            if ours is not None:
                _withdraw(store, name, asked_before, ours)
            raise StopInterrupted(name, None) from None
    if "signal" not in info:  # the program ended early (it died, or its target went away)
        raise RemoteError(f"stopping {name}: the stop program ended early; "
                          + ("its SIGTERM went out" if talk.term_sent_at is not None else "nothing was signalled"),
                          where=run.target, hint=f"`dfo runs {name}` shows how it ends; `dfo stop {name}` again")
    if info["signal"] in ("none", "withheld"):  # it ended after the look, before the signal
        now = store.get_run(name)
        if not now.active:  # its end is recorded already: by another stop, whose signal ended it, or a watch
            return Stopped(now, None)
        now = _withdraw(store, name, asked_before, ours)
        if info.get("signal") == "withheld":
            raise RemoteError(f"stopping {name}: the stop program got no word to signal; nothing was signalled",
                              where=run.target, hint=f"run `dfo stop {name}` again")
        return Stopped(_ended_before_stop(store, now, info.get("exit", "")), None)
    ended = _record_end(store, run, info.get("exit", ""), f"stopped by dfo (SIG{info['signal']})", state="stopped")
    return Stopped(ended, info["signal"])


def _identified(store: Store, run: Run, talk: "_StopTalk", python: str) -> dict[str, str]:
    """The stop program's identity check of `run`: what it said (`identity` ok or gone); a PID now another
    process's is recorded as the run's end and refused (RefusedError), no answer or no python is a RemoteError."""
    info = talk.until("cmdline", STOP_PROBE_TIMEOUT)
    if info.get("identity") == "nopython":
        raise RemoteError(f"stopping {run.name} needs python on {run.target}; found none of {python}, python3, python",
                          where=run.target, hint="set the container's `python:` in the inventory")
    if info.get("identity") not in ("ok", "gone", "reused"):
        raise RemoteError(f"stopping {run.name}: the stop program gave no answer ({info or 'no output'}); nothing "
                          "was signalled", where=run.target, hint=f"run `dfo stop {run.name}` again")
    if info["identity"] == "reused":
        _record_end(store, run, talk.until("exit", STOP_PROBE_TIMEOUT).get("exit", ""), "its PID was reused")
        raise RefusedError(
            f"PID {run.pid} on {run.target} is no longer run {run.name}: that process started at tick "
            f"{info.get('started')}, the run at tick {run.proc_starttime} (command {info['cmdline'][:60]!r}); "
            "not signalling it", hint="the run had already ended; it is now recorded as such")
    return info


def _withdraw(store: Store, name: str, asked_before: str | None, ours: str | None) -> Run:
    """A stop request of ours that no signal followed is withdrawn; one asked before (another stop's) holds."""
    now = store.get_run(name)
    return store.update_run(name, stop_requested_at=asked_before) if now.stop_requested_at == ours else now


class _StopTalk:
    """dfo's end of the stop program's stream: its `key=value` lines as they come, dfo's word, and a bound on each
    wait (a target that stops answering is a CommandTimeout naming the run, never a hang). Closing it ends the
    program: whatever it has not signalled yet is never signalled."""

    def __init__(self, target: Target, run: Run, script: str) -> None:
        self.run, self.stream = run, target.stream(script)
        self.buffer, self.info = b"", {}
        self.term_sent_at: float | None = None

    def __enter__(self) -> "_StopTalk":
        return self

    def __exit__(self, *exc) -> None:
        self.stream.close()

    def until(self, key: str, timeout: float) -> dict[str, str]:
        """Read lines until one gives `key` (or the program ends) within `timeout`; what all lines said so far."""
        deadline = time.monotonic() + timeout
        while key not in self.info and self._line(deadline, timeout):
            pass
        return self.info

    def signal(self, grace_s: float, on_wait: Callable[[StopWait], None] | None) -> dict[str, str]:
        """Say `stop`, then follow the program to its end: the settle, SIGTERM, the grace (`waiting=` lines, each
        given to `on_wait`), SIGKILL. Bound: the grace, a settle before the signal and one after KILL, and a probe."""
        self.stream.write(b"stop\n")
        bound = grace_s + 2 * KILL_SETTLE_S + STOP_PROBE_TIMEOUT
        deadline = time.monotonic() + bound
        while "exit" not in self.info:
            key = self._line(deadline, bound)
            if key is None:
                break
            if key == "term":
                self.term_sent_at = time.monotonic()
            elif key == "waiting" and on_wait is not None:
                on_wait(StopWait(self.run.name, grace_s, float(self.info["waiting"])))
        return self.info

    def _line(self, deadline: float, bound: float) -> str | None:
        """Read one `key=value` line into info; its key, or None at the end of the program's output."""
        while b"\n" not in self.buffer:
            try:
                chunk = self.stream.read(timeout=max(0.0, deadline - time.monotonic()))
            except CommandTimeout:
                raise CommandTimeout(
                    f"stopping {self.run.name}: no answer within {bound:g}s; the run may still be going",
                    where=self.run.target,
                    hint=f"check it with `dfo logs {self.run.name}`, then run `dfo stop {self.run.name}` again",
                ) from None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        key, _, value = line.decode(errors="replace").partition("=")
        self.info[key] = value
        return key


def _ended_before_stop(store: Store, run: Run, exit_text: str) -> Run:
    """Record the end of a run that ended on its own before stop signalled it: `exited`/`crashed` with its exit
    status (`lost` without one), unless another stop was asked (a multi-node run's, for all nodes at once,
    whose node 0's SIGTERM ended this node; or a second `dfo stop` of the run): that holds, `stopped`."""
    state = RunState.STOPPED if run.stop_requested_at and exit_text.strip() else None
    return _record_end(store, run, exit_text, "exited on its own before stop signalled it", state=state)


def _record_end(store: Store, run: Run, exit_text: str, why: str, *, state: str | None = None,
                exit_mtime: str | None = None) -> Run:
    """Record the end of a run from its exit file's text ('' when there is none). `exit_mtime`: the exit file's
    mtime (Unix seconds, as text), which is when the run ended (ended_from exit_file); without it ended_at is
    now (ended_from noticed: right for a stop dfo just made, late for a run that ended while nobody looked)."""
    code = int(exit_text) if exit_text.strip().lstrip("-").isdigit() else None
    if state is None:
        state = "lost" if code is None else ("exited" if code == 0 else "crashed")
    ended_at = format_ts(float(exit_mtime)) if exit_mtime and exit_mtime.strip().isdigit() else None
    ended = store.transition(run.name, RunState(state), RunState.endable(), exit_code=code, ended_at=ended_at or utc_now(),
                             ended_from="exit_file" if ended_at else "noticed")
    if ended is None:  # another dfo recorded its end first (a watch, a look, a stop): that record stands
        return store.get_run(run.name)
    events.record(store, events.Ended(at=utc_now(), run=run.name, chain=store.lineage(run.name)[0], exit_code=code,
                                      state=str(state), why=why))  # the shape a watch stores
    return ended


def follow_script(run: Run, lines: int) -> str:
    """`tail -F` the log until the run ends; then give tail a moment (it polls each second) for the last lines.
    `tail -F` ignores its stdin, so a background `cat` ends everything when stdin closes (dfo went away)."""
    q = shlex.quote
    tail = shlex.join(["tail", "-n", str(int(lines)), "-F", run.log_path])
    alive = f" && kill -0 {int(run.pid)} 2>/dev/null" if run.pid is not None else ""
    return (f"{tail} & t=$!\n"
            f"exec 3<&0; ( cat <&3; kill $t $$ ) >/dev/null 2>&1 & c=$!\n"  # (& alone gives it /dev/null; its cat,
            # left after kill $c, holds no output open: the stream's end is seen when the script ends)
            f"while [ ! -s {q(run.exit_path)} ]{alive}; do sleep {FOLLOW_POLL_S}; done\n"
            f"sleep {FOLLOW_DRAIN_S}; kill $t $c 2>/dev/null; exit 0\n")


# ---------------------------------------------------------------------------------------------- looking

LOOK_TIMEOUT = 15.0
LOOK_POLL_S = 1.0  # resolve_launch: how often a start never seen answered is looked for during its grace


def look_script(runs: Sequence[Run]) -> str:
    """One cheap look at runs on one target: for each, its exit file, and its process: the recorded PID's stat,
    or (a launch dfo did not finish recording) the session leader whose command line names its exit file,
    found in one scan of /proc for all such rows (a scan per row made `dfo runs` slow with many of them).
    The processes are looked at first, the exit files after: the wrapper writes its exit file before its PID
    goes away, so a run seen gone has its exit status in the file read after (read the other way round, a run
    ending between the two reads was recorded `lost` with none); one that ends in between is seen running."""
    lines, cases, exits = [], [], []
    for index, run in enumerate(runs):
        exit_file = shlex.quote(run.exit_path)
        exits.append(f'echo "@{index} exit=$(cat {exit_file} 2>/dev/null)"')
        exits.append(f'echo "@{index} mtime=$(stat -c %Y {exit_file} 2>/dev/null)"')  # when it ended
        if run.pid is not None:
            lines.append(f'echo "@{index} stat=$(cat /proc/{int(run.pid)}/stat 2>/dev/null)"')
            continue
        # the wrapper itself (its command line begins `sh -c trap "true" TERM; ...`), not the launch script that
        # started it, nor another dfo's look at once, whose script names the wrapper and its exit file too (found
        # as the run, its PID was recorded: gone a moment later, the run read as lost); for a launch marked
        # failed, only while its log exists (an empty one is removed; a late start makes it again)
        needle = shlex.quote(WRAPPER_HEAD) + "*" + shlex.quote(run.exit_path)
        late = f" [ -e {shlex.quote(run.log_path)} ] ||" if run.state == RunState.FAILED else ""
        lines.append(f"w{index}=1;{late} w{index}=" if late else f"w{index}=1")
        cases.append(f'  case "$c" in {needle}*) [ -n "$w{index}" ] && found {index} "$d";; esac')
    if cases:  # a session leader (its session is its PID) that is not this look's own shell
        lines += ['found() { read -r st < "$2/stat" 2>/dev/null || return 0; p=${2#/proc/}; set -- "$1" ${st##*) }; '
                  '[ "$5" = "$p" ] && [ "$p" != "$$" ] && echo "@$1 found=$p $st"; return 0; }',
                  f'if [ -n "{"".join(f"$w{i}" for i in range(len(runs)) if runs[i].pid is None)}" ]; then',
                  "for d in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null)", *cases, "done; fi"]
    return "\n".join(lines + exits) + "\ntrue\n"


def look(target: Target, store: Store, runs: Sequence[Run], *, timeout: float = LOOK_TIMEOUT,
         grace_s: float = START_GRACE_S) -> list[Run]:
    """Bring the registry up to date with what `target` shows of `runs` (active rows and starts never seen
    answered, start_unseen; a `launching` row only once its launcher is gone) in one remote call. Returns the
    runs as now recorded. A start never seen answered whose process is not there yet stays `unconfirmed` while it is
    within its grace (start_grace_left with `grace_s`), then is marked failed."""
    runs = [run for run in runs if run.state != RunState.LAUNCHING or not launcher_alive(run)]
    if not runs:
        return []
    output = target.run(look_script(runs), timeout=timeout, check=True).stdout
    seen: dict[int, dict[str, str]] = {}
    for line in output.splitlines():
        head, _, rest = line.partition(" ")
        if head.startswith("@") and head[1:].isdigit():
            key, _, value = rest.partition("=")
            seen.setdefault(int(head[1:]), {})[key] = value
    return [_settle(store, run, seen.get(index, {}), grace_s) for index, run in enumerate(runs)]


def _settle(store: Store, run: Run, seen: Mapping[str, str], grace_s: float) -> Run:
    exit_text = seen.get("exit", "")
    if run.pid is None:  # a launch dfo died in: adopt the process it started, or call the launch failed
        late = " after it was marked failed: it started after its start grace" if run.state == RunState.FAILED else ""
        if seen.get("found"):
            pid, _, stat = seen["found"].partition(" ")
            adopted = store.transition(run.name, RunState.RUNNING, RunState.unsettled(), pid=int(pid),
                                       proc_starttime=stopper.starttime(stat), started_at=run.started_at or utc_now(),
                                       ended_at=None, owner=None)
            if adopted is not None:  # of two dfo that found it (a watch and a look), the one that recorded it says so
                events.record(store, events.LaunchResolved(at=utc_now(), run=run.name, pid=int(pid),
                                                           how="found by its exit file path" + late))
            run = adopted or store.get_run(run.name)
            return run if not exit_text.strip() else _record_end(store, run, exit_text, "ended before dfo looked",
                                                                 exit_mtime=seen.get("mtime"))
        if exit_text.strip():  # it started and ended before anyone looked: resolved as a late start is, then its end
            events.record(store, events.LaunchResolved(at=utc_now(), run=run.name, pid=None,
                                                       how="found ended by its exit file" + late))
            run = store.update_run(run.name, owner=None)
            return _record_end(store, run, exit_text, "ended before dfo looked", exit_mtime=seen.get("mtime"))
        if run.state == RunState.FAILED or start_grace_left(run, grace_s) > 0:
            return run  # a slow start may bring it up yet: not judged until its grace is over (or again, failed)
        return mark_failed(store, run.name, "its start got no answer; no process found" if start_unseen(run)
                           else "the dfo launching it went away before the start; no process found")
    stat = seen.get("stat", "")
    if not gone(stat, run.proc_starttime):
        return run
    if run.stop_requested_at and exit_text.strip():
        return _record_end(store, run, exit_text, "stopped on request", state=RunState.STOPPED,
                           exit_mtime=seen.get("mtime"))
    return _record_end(store, run, exit_text, "ended while nobody watched", exit_mtime=seen.get("mtime"))


# ---------------------------------------------------------------------------------------------- logs

def log_tail(target: Target, run: Run, lines: int = 80) -> str:
    """The last `lines` lines of the run's log."""
    result = target.run(["tail", "-n", str(int(lines)), run.log_path], timeout=LOG_TIMEOUT)
    if result.failed:
        raise RemoteError(f"cannot read {run.log_path}: {result.tail(1)}", where=run.target, hint="the workspace may have been cleaned")
    return result.stdout


def follow_log(target: Target, run: Run, lines: int = 80, *, poll_s: float = 1.0) -> Iterator[bytes]:
    """Yield the log's tail, then new bytes as they come, over one kept-open channel, until the run ends (its
    exit file appears, or its process is gone) or the caller stops (closing the channel ends only the remote
    `tail`, never the run). The stream ending early (a dropped connection) is told apart by a look at the run."""
    stream = target.stream(follow_script(run, lines))
    try:
        while True:
            try:
                chunk = stream.read(timeout=poll_s)
            except CommandTimeout:
                continue
            if not chunk:
                return
            yield chunk
    finally:
        stream.close()

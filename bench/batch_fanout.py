"""Benchmark: preflight + launch of one run on each of 8 hosts, dfo against Ansible's ad-hoc mode, and dfo at
8 hosts against dfo at 1 host. Prints figures (medians); asserts nothing.

Each host is a network namespace of its own with its own sshd and one real LXC container behind the pct
stand-in (tests/preflight_fleet.py), so every remote command really crosses SSH and `pct exec`.

dfo: what `dfo batch` does before it starts watching: a fresh Connections, preflight of every target at once
(orchestrator.batch.preflight_problems), then the cells' first runs launched at once (batch.launcher, i.e.
runs.launch). Ansible: the very same remote command strings dfo sent over SSH (recorded from a dfo pass,
the run name templated per host), one `ansible all -i INV -m raw -a CMD --forks 8` per command in dfo's
order, with Ansible's default connection reuse (OpenSSH ControlMaster/ControlPersist). Ansible is not a
dfo dependency: `pip install ansible-core` into the venv first. Needs root, iproute2, lxc, openssh.

    sudo .venv/bin/python bench/batch_fanout.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from preflight_fleet import Fleet, fleet  # noqa: E402

from orchestrator.batch import launcher, parse_experiments, preflight_problems  # noqa: E402
from orchestrator.connections import Connections  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.remote import ssh  # noqa: E402
from orchestrator.remote.base import render  # noqa: E402
from orchestrator.store import Store  # noqa: E402

HOSTS = 8
RUN_SECONDS = 20  # the launched runs just sleep, then end on their own
ANSIBLE_TIMEOUT_S = 120


def add_variant(hosts: Fleet) -> None:
    data = yaml.safe_load(hosts.inventory.read_text())
    data["variants"] = {"sleeper": {"command": f"sleep {RUN_SECONDS}"}}
    hosts.inventory.write_text(yaml.safe_dump(data, sort_keys=False))


def dfo_pass(hosts: Fleet, targets: list[str], batch: str, store: Store) -> float:
    """Seconds for preflight + launch of one run per target, as `dfo batch` does them. Fails loudly."""
    inventory = load_inventory(hosts.inventory)
    text = f"batch: {batch}\ntargets: [{', '.join(targets)}]\nmatrix: {{variant: [sleeper]}}\n"
    plan = parse_experiments(text, inventory)
    started = time.monotonic()
    with Connections(inventory) as connections:
        problems = preflight_problems(connections, targets, ours=set())
        start = launcher(plan, inventory, connections, store)
        with ThreadPoolExecutor(max_workers=len(plan.cells)) as pool:
            list(pool.map(lambda cell: start(cell, (), cell.variant, cell.run_name(batch), None), plan.cells))
    elapsed = time.monotonic() - started
    failed = {target: problem for target, problem in problems.items() if problem}
    if failed:
        raise SystemExit(f"preflight failed, figures would be meaningless: {failed}")
    return elapsed


def record_commands(hosts: Fleet, store: Store) -> list[str]:
    """The command strings one dfo pass sends over SSH to host1, in order, with its run name as {{ run }}."""
    sent: list[tuple[str, str]] = []
    original = ssh.SshTarget.run

    def recording(self, cmd, **kwargs):
        sent.append((self.name, render(cmd)))
        return original(self, cmd, **kwargs)

    ssh.SshTarget.run = recording
    try:
        dfo_pass(hosts, hosts.targets[:1], "record", store)
    finally:
        ssh.SshTarget.run = original
    run_name = "record.sleeper.ct1.r1"
    return [templated(command, run_name) for host, command in sent if host == "host1"]


def templated(command: str, run_name: str) -> str:
    """`command` for Ansible's Jinja: the run name replaced by the host variable `run`, shell text that looks
    like Jinja kept raw (not at the very start: ad-hoc args starting with `{` are read as JSON)."""
    pieces = [f"{{% raw %}}{piece}{{% endraw %}}" if re.search(r"\{[{%#]", piece) else piece for piece in command.split(run_name)]
    return "{{ run }}".join(pieces)


def ansible_pass(hosts: Fleet, commands: list[str], workdir: Path, tag: str) -> float:
    """Seconds for the same commands on every host through `ansible all -m raw`, one invocation each."""
    inventory = workdir / f"ansible-{tag}.ini"
    lines = ["[all]"] + [f"host{k} run=ans{tag}.sleeper.ct{k}.r1" for k in range(1, HOSTS + 1)]
    inventory.write_text("\n".join(lines) + "\n")
    ansible = str(Path(sys.executable).parent / "ansible")
    env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
           "LC_ALL": "C.UTF-8", "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"),
           # OpenSSH reads the passwd home, not $HOME: point it at the fleet's config and known_hosts. Appended to
           # Ansible's default ssh_args, so ControlMaster/ControlPersist (its connection reuse) stay as they are.
           "ANSIBLE_SSH_COMMON_ARGS": f"-F {hosts.home.config_path} -o UserKnownHostsFile={hosts.home.known_hosts}"}
    started = time.monotonic()
    for command in commands:
        result = subprocess.run([ansible, "all", "-i", str(inventory), "-m", "raw", "-a", command, "--forks", str(HOSTS)],
                                capture_output=True, text=True, env=env, timeout=ANSIBLE_TIMEOUT_S)
        if result.returncode != 0:
            raise SystemExit(f"ansible failed ({result.returncode}): {result.stdout[-2000:]} {result.stderr[-1000:]}")
    return time.monotonic() - started


def close_ansible_masters(home: Path) -> None:
    """End the ControlPersist masters Ansible left (else their sshd sessions outlive the fleet's namespaces)."""
    for socket in (home / ".ansible" / "cp").glob("*"):
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "bench-host"], capture_output=True, timeout=10)


def cpu_seconds() -> float:
    """CPU time of every process on the machine, reaped children included (sshd sessions, lxc-attach, ...)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise SystemExit("needs root and iproute2 (network namespaces)")
    if not (Path(sys.executable).parent / "ansible").exists():
        raise SystemExit("ansible is not installed in this venv: pip install ansible-core (for the benchmark only)")
    with tempfile.TemporaryDirectory(prefix="dfo-bench-") as tmp, fleet(Path(tmp), HOSTS, netns=True, python=sys.executable) as hosts:
        workdir = Path(tmp)
        os.environ["HOME"] = str(hosts.home.home)
        os.environ.pop("SSH_AUTH_SOCK", None)
        add_variant(hosts)
        with Store(workdir / "dfo.db") as store:
            commands = record_commands(hosts, store)  # also the warm-up: page cache, first exec in each container
            one, eight, ansible, cpu_all, cpu_dfo = [], [], [], [], []
            try:
                for repeat in range(args.repeats):
                    one.append(dfo_pass(hosts, hosts.targets[:1], f"one{repeat}", store))
                    before_all, before_dfo = cpu_seconds(), own_cpu_seconds()
                    eight.append(dfo_pass(hosts, hosts.targets, f"eight{repeat}", store))
                    cpu_all.append(cpu_seconds() - before_all)
                    cpu_dfo.append(own_cpu_seconds() - before_dfo)
                    ansible.append(ansible_pass(hosts, commands, workdir, str(repeat)))
            finally:
                close_ansible_masters(hosts.home.home)
        single, fanned, adhoc = (statistics.median(v) for v in (one, eight, ansible))
        print(f"hosts: netns, {HOSTS} with own sshd  cpus: {os.cpu_count()}  load: {os.getloadavg()[0]:.1f}  repeats: {args.repeats}  (medians)")
        print(f"remote commands per host: {len(commands)} (dfo's own, replayed by ansible)")
        print(f"dfo     preflight+launch, 1 host : {single:.2f} s")
        print(f"dfo     preflight+launch, {HOSTS} hosts: {fanned:.2f} s   ({fanned / single:.2f}x one host; goal <= 1.5x)")
        print(f"ansible same commands,   {HOSTS} hosts: {adhoc:.2f} s   (dfo is {adhoc / fanned:.1f}x faster; goal >= 5x)")
        print(f"CPU during dfo's {HOSTS}-host pass: {statistics.median(cpu_all):.2f} s over all processes (dfo itself "
              f"{statistics.median(cpu_dfo):.2f} s) on {os.cpu_count()} cores: the wall time cannot drop below "
              f"{statistics.median(cpu_all) / os.cpu_count():.2f} s here")


if __name__ == "__main__":
    main()

"""Benchmark: preflight + launch of one run on each of 8 hosts, dfo against an Ansible play doing the same job,
and dfo at 8 hosts against dfo at 1 host. Prints figures (medians) and the remote commands each host's sshd
started (from its own log); asserts nothing.

Each host is a network namespace of its own with its own sshd and one real LXC container behind the pct
stand-in (tests/preflight_fleet.py), so every remote command really crosses SSH and `pct exec`; every pct
call first waits PCT_STANDIN_START_S (--pct-start, default 0.5 s: what a real node's pct spends loading the
PVE modules before it does anything).

dfo: what `dfo batch` does before it starts watching, in this process (no CLI start-up): a fresh Connections
and batch.launcher for every cell at once; each target's first launch carries its preflight, in one remote
command with the launch (orchestrator/launchplan.py). The run is a built-in-trainer variant: the package is
in place after the warm-up pass (dfo checks it every time, pushes only a changed one), and the containers'
python stand-in turns `python -m trainer ...` into a sleep.

Ansible: the same job as its users would write it, not a replay of dfo's commands: `ansible-playbook` with one
play per run (gather_facts off, its default connection reuse: OpenSSH ControlMaster/ControlPersist, masters
closed between passes as a fresh dfo has no connection either; --forks 8): `pct status`, `pct exec`
nvidia-smi + an assert that the GPUs are idle, `copy` of the package archive to the host + `pct push` into the
container, then unpack and a detached start in one `pct exec`. Ansible is not a dfo dependency:
`pip install ansible-core` into the venv first. Needs root, iproute2, lxc, openssh.

    sudo .venv/bin/python bench/batch_fanout.py [--repeats 5] [--pct-start 0.5]
"""

from __future__ import annotations

import argparse
import os
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

from orchestrator.batch import launcher  # noqa: E402
from orchestrator.experiments import parse_experiments  # noqa: E402
from orchestrator.connections import Connections  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.package import build_package  # noqa: E402
from orchestrator.store import Store  # noqa: E402

HOSTS = 8
RUN_SECONDS = 20  # the launched runs just sleep, then end on their own
ANSIBLE_TIMEOUT_S = 300
SETTLE_S = 0.3
BENCH_PYTHON = "/workspace/bench-python"
PYTHON_STANDIN = """#!/bin/sh
# `-m trainer ...` sleeps (the run); anything else (dfo's python and torch checks) is the real python
if [ "$1" = "-m" ] && [ "$2" = "trainer" ]; then exec sleep {seconds}; fi
exec {python} "$@"
"""
PLAY = """\
- name: launch one run per container
  hosts: all
  gather_facts: false
  tasks:
    - name: the container is running
      command: pct status {{ ctid }}
      register: ct
      changed_when: false
      failed_when: "'status: running' not in ct.stdout"
    - name: nvidia-smi answers in the container
      command: pct exec {{ ctid }} -- timeout 10 nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits
      register: smi
      changed_when: false
    - name: its GPUs are idle
      assert:
        that: smi.stdout_lines | map('split', ', ') | map(attribute=1) | map('int') | max <= 1024
        quiet: true
    - name: the package on the host
      copy: {src: "{{ package }}", dest: /tmp/dfo-bench-pkg.tar.gz, mode: "0644"}
    - name: the package into the container
      command: pct push {{ ctid }} /tmp/dfo-bench-pkg.tar.gz /workspace/dfo-bench-pkg.tar.gz
    - name: unpack and start the run detached
      command: >-
        pct exec {{ ctid }} -- sh -c 'mkdir -p /workspace/ans /workspace/logs
        && tar -xzf /workspace/dfo-bench-pkg.tar.gz -C /workspace/ans && cd /workspace
        && setsid nohup sh -c "sleep %(seconds)d" </dev/null >logs/{{ run }}.log 2>&1 & echo $!'
"""


def prepare(hosts: Fleet) -> None:
    """The built-in-trainer variant, and the python stand-in in every container."""
    data = yaml.safe_load(hosts.inventory.read_text())
    data["variants"] = {"bench": {"compile": "eager", "preset": "tiny-cpu"}}
    hosts.inventory.write_text(yaml.safe_dump(data, sort_keys=False))
    for container in hosts.containers:
        standin = container.path(BENCH_PYTHON)
        standin.write_text(PYTHON_STANDIN.format(seconds=RUN_SECONDS, python=sys.executable))
        standin.chmod(0o755)


def dfo_pass(hosts: Fleet, targets: list[str], batch: str, store: Store) -> float:
    """Seconds for preflight + launch of one run per target, as `dfo batch` starts them. Fails loudly."""
    inventory = load_inventory(hosts.inventory)
    plan = parse_experiments(f"batch: {batch}\ntargets: [{', '.join(targets)}]\nmatrix: {{variant: [bench]}}\n", inventory)
    started = time.monotonic()
    with Connections(inventory) as connections:
        start = launcher(plan, inventory, connections, store)
        with ThreadPoolExecutor(max_workers=len(plan.cells)) as pool:
            list(pool.map(lambda cell: start(cell, (), cell.variant, cell.run_name(batch), None), plan.cells))
    return time.monotonic() - started


def ansible_pass(hosts: Fleet, workdir: Path, package: Path, tag: str) -> float:
    """Seconds for the play on every host (one ansible-playbook invocation). Fails loudly."""
    inventory = workdir / f"ansible-{tag}.ini"
    lines = ["[all]"] + [f"host{k} ctid={c.vmid} run=ans{tag}.ct{k} package={package}" for k, c in enumerate(hosts.containers, 1)]
    inventory.write_text("\n".join(lines) + "\n")
    play = workdir / "play.yml"
    play.write_text(PLAY % {"seconds": RUN_SECONDS})
    env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
           "LC_ALL": "C.UTF-8", "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"),
           # OpenSSH reads the passwd home, not $HOME: point it at the fleet's config and known_hosts. Appended to
           # Ansible's default ssh_args, so ControlMaster/ControlPersist (its connection reuse) stay as they are.
           "ANSIBLE_SSH_COMMON_ARGS": f"-F {hosts.home.config_path} -o UserKnownHostsFile={hosts.home.known_hosts}"}
    playbook = str(Path(sys.executable).parent / "ansible-playbook")
    started = time.monotonic()
    result = subprocess.run([playbook, "-i", str(inventory), str(play), "--forks", str(HOSTS)],
                            capture_output=True, text=True, env=env, timeout=ANSIBLE_TIMEOUT_S)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"ansible failed ({result.returncode}): {result.stdout[-3000:]} {result.stderr[-1000:]}")
    return elapsed


def close_ansible_masters(home: Path) -> None:
    """End the ControlPersist masters Ansible left (else their sshd sessions outlive the fleet's namespaces)."""
    for socket in (home / ".ansible" / "cp").glob("*"):
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "bench-host"], capture_output=True, timeout=10)


def commands_started(hosts: Fleet) -> list[int]:
    return [server.commands_started() for server in hosts.servers]


def since(before: list[int], hosts: Fleet) -> list[int]:
    return [now - then for now, then in zip(commands_started(hosts), before)]


def fleet_cpu_seconds(hosts: Fleet) -> float:
    """CPU time the simulated hosts spent: each sshd listener's own and its reaped descendants' (sessions, pct,
    lxc-attach and what they ran in the container). Other processes on the machine do not count."""
    ticks = 0
    for server in hosts.servers:
        fields = Path(f"/proc/{server.pid}/stat").read_text().rpartition(")")[2].split()
        ticks += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pct-start", type=float, default=0.5, help="seconds every pct call waits first (PCT_STANDIN_START_S)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise SystemExit("needs root and iproute2 (network namespaces)")
    if not (Path(sys.executable).parent / "ansible-playbook").exists():
        raise SystemExit("ansible is not installed in this venv: pip install ansible-core (for the benchmark only)")
    env = {"PCT_STANDIN_START_S": f"{args.pct_start:g}"}
    with tempfile.TemporaryDirectory(prefix="dfo-bench-") as tmp, \
            fleet(Path(tmp), HOSTS, netns=True, python=BENCH_PYTHON, env=env) as hosts:
        workdir = Path(tmp)
        os.environ["HOME"] = str(hosts.home.home)
        os.environ.pop("SSH_AUTH_SOCK", None)
        prepare(hosts)
        package = workdir / "trainer.tar.gz"
        package.write_bytes(build_package().data)
        with Store(workdir / "dfo.db") as store:
            try:
                dfo_pass(hosts, hosts.targets, "warmup", store)  # pushes the package; page cache, first exec in each container
                ansible_pass(hosts, workdir, package, "warmup")  # its copy lands once; later passes find it unchanged
                close_ansible_masters(hosts.home.home)
                one, eight, ansible, cpu_fleet, cpu_dfo = [], [], [], [], []
                for repeat in range(args.repeats):
                    before = commands_started(hosts)
                    one.append(dfo_pass(hosts, hosts.targets[:1], f"one{repeat}", store))
                    one_commands = since(before, hosts)[0]
                    before, before_fleet, before_dfo = commands_started(hosts), fleet_cpu_seconds(hosts), own_cpu_seconds()
                    eight.append(dfo_pass(hosts, hosts.targets, f"eight{repeat}", store))
                    cpu_dfo.append(own_cpu_seconds() - before_dfo)
                    time.sleep(SETTLE_S)  # the closed sessions' processes are reaped by their sshd
                    cpu_fleet.append(fleet_cpu_seconds(hosts) - before_fleet)
                    dfo_commands = since(before, hosts)
                    before = commands_started(hosts)
                    ansible.append(ansible_pass(hosts, workdir, package, str(repeat)))
                    ansible_commands = since(before, hosts)
                    close_ansible_masters(hosts.home.home)
            finally:
                close_ansible_masters(hosts.home.home)
        single, fanned, played = (statistics.median(v) for v in (one, eight, ansible))
        print(f"hosts: netns, {HOSTS} with own sshd  cpus: {os.cpu_count()}  load: {os.getloadavg()[0]:.1f}  "
              f"repeats: {args.repeats} (medians)  pct start-up: {args.pct_start:g} s per call")
        print(f"remote commands per host (sshd's log), last pass: dfo {dfo_commands} (1 host alone: {one_commands}); "
              f"ansible {ansible_commands}")
        print(f"dfo     preflight+launch, 1 host : {single:.2f} s   (runs: {', '.join(f'{v:.2f}' for v in one)})")
        print(f"dfo     preflight+launch, {HOSTS} hosts: {fanned:.2f} s   ({fanned / single:.2f}x one host; goal <= 1.5x)"
              f"   (runs: {', '.join(f'{v:.2f}' for v in eight)})")
        print(f"ansible play, same job,  {HOSTS} hosts: {played:.2f} s   (dfo is {played / fanned:.1f}x faster; goal >= 5x)"
              f"   (runs: {', '.join(f'{v:.2f}' for v in ansible)})")
        work = statistics.median(cpu_fleet) + statistics.median(cpu_dfo)
        print(f"CPU of dfo's {HOSTS}-host pass: the hosts' side {statistics.median(cpu_fleet):.2f} s + dfo itself "
              f"{statistics.median(cpu_dfo):.2f} s = {work:.2f} s on {os.cpu_count()} cores: the wall time cannot drop "
              f"below {work / os.cpu_count():.2f} s here even on an idle machine (other load: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

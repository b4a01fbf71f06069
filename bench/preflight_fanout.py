"""Benchmark: preflight of 4 targets on 4 hosts vs 1 target, printed as a ratio (lower is better; 4.0 = serial).

Each host is a real sshd of its own with one real LXC container behind the pct stand-in (tests/harness):
in a network namespace of its own when run as root with iproute2, else on a loopback port (--loopback
forces that). Every target costs what it costs in the field minus network latency: an SSH handshake,
one script inside the container (nvidia-smi twice, the workspace, python; a stopped container would answer
with pct's own message, so no `pct status` goes first), each pct call after PCT_STANDIN_START_S (--pct-start,
default 0: a real node's pct spends ~0.5 s loading the PVE modules). Needs root, lxc and openssh-server.
Also prints how many SSH connections and remote commands each sshd saw per dfo invocation (its own log).

    sudo .venv/bin/python bench/preflight_fanout.py [--repeats 5] [--loopback] [--pct-start 0.5]

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from preflight_fleet import Fleet, fleet  # noqa: E402

from orchestrator.connections import Connections  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.preflight import preflight  # noqa: E402

HOSTS = 4


def timed_preflight(hosts: Fleet, targets: list[str]) -> float:
    """Seconds for one dfo-like invocation: fresh connections, preflight, close. Fails loudly if a check fails."""
    started = time.monotonic()
    with Connections(load_inventory(hosts.inventory)) as connections:
        reports = preflight(connections, targets)
    elapsed = time.monotonic() - started
    failed = [report.to_json() for report in reports if not report.ok]
    if failed:
        raise SystemExit(f"preflight failed, figures would be meaningless: {failed}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loopback", action="store_true", help="loopback sshd hosts even when netns is possible")
    parser.add_argument("--pct-start", type=float, default=0.0, help="seconds every pct call waits first (PCT_STANDIN_START_S)")
    args = parser.parse_args()
    netns = not args.loopback and os.geteuid() == 0 and shutil.which("ip") is not None
    env = {"PCT_STANDIN_START_S": f"{args.pct_start:g}"}
    with tempfile.TemporaryDirectory(prefix="dfo-bench-") as workdir, fleet(Path(workdir), HOSTS, netns=netns, env=env) as hosts:
        os.environ["HOME"] = str(hosts.home.home)
        os.environ.pop("SSH_AUTH_SOCK", None)
        timed_preflight(hosts, hosts.targets)  # warm-up: page cache, container first exec
        one, four = [], []
        for _ in range(args.repeats):
            one.append(timed_preflight(hosts, hosts.targets[:1]))
            before = [(server.accepted_connections(), server.commands_started()) for server in hosts.servers]
            four.append(timed_preflight(hosts, hosts.targets))
            per_host = [server.accepted_connections() - b[0] for server, b in zip(hosts.servers, before)]
            commands = [server.commands_started() - b[1] for server, b in zip(hosts.servers, before)]
        single, fanned = statistics.median(one), statistics.median(four)
        print(f"hosts: {hosts.kind}  cpus: {os.cpu_count()}  load: {os.getloadavg()[0]:.1f}  repeats: {args.repeats}  (medians)"
              f"  pct start-up: {args.pct_start:g} s")
        print(f"1 target  on 1 host : {single:.2f} s")
        print(f"{HOSTS} targets on {HOSTS} hosts: {fanned:.2f} s")
        print(f"ratio {HOSTS}-target / 1-target: {fanned / single:.2f}x  (serial would be {HOSTS}.00x)")
        print(f"SSH connections accepted per host in one {HOSTS}-target invocation: {per_host}")
        print(f"remote commands per host in one {HOSTS}-target invocation: {commands}")


if __name__ == "__main__":
    main()

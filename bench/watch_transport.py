"""Benchmark of dfo's watch transport: how soon a log line reaches dfo, what watching spawns, what it costs.

Measured on this machine, through the real agent and the real Observer/PollObserver:
  (a) latency from a line being written to the observer yielding it: streaming vs a plain 5 s poll loop;
      the seed's `sleep 180; tail` loop is computed (a line waits on average half a cycle), plus the
      measured cost of one seed-style look;
  (b) processes spawned per minute of watching, counted in a PID namespace of the agent's own;
  (c) workstation CPU used by the observer (and the consumer draining its queue) following 8 logs, each
      written at 10 lines/s.
`--ssh` repeats (a) and (c) over a real OpenSSH server on 127.0.0.1 (the test harness's sshd fixture).

    .venv/bin/python bench/watch_transport.py [--ssh] [--quick]

It prints figures; it asserts nothing and must not be collected as a test.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the test harness: sshd fixture and nvidia-smi stand-in

from harness import STANDIN_BIN  # noqa: E402
from harness.nvidia_smi import Gpu, NvidiaSmiState  # noqa: E402
from orchestrator.agent import agent as agent_module  # noqa: E402
from orchestrator.observe import ObserverBase, Observer, PollObserver  # noqa: E402
from orchestrator.remote.base import Target  # noqa: E402
from orchestrator.remote.local import LocalTarget  # noqa: E402

AGENT_CMD = ["python3", agent_module.__file__]  # the container-like python3 on CONTAINER_PATH
CONTAINER_PATH = f"{STANDIN_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SEED_SLEEP_S = 180.0
POLL_S = 5.0
CPU_LOGS, CPU_LINES_PER_S = 8, 10
CLK_TCK = os.sysconf("SC_CLK_TCK")
SEED_LOOK = "sleep 0; tail -n 80 {log}; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader"

SEED_PROCESSES = ("ssh", "sshd session", "remote shell", "pct (perl)", "lxc-attach", "bash -l", "sleep", "tail",
                  "nvidia-smi")  # by construction of the seed's command line (docs/design.md)
WRITER = """
import sys, time
logs = [open(p, "ab", buffering=0) for p in sys.argv[2:]]
end, step = time.time() + float(sys.argv[1]), 0
while time.time() < end:
    for f in logs:
        f.write(b"ts=%.3f event=step step=%d tok_s=153200.5 loss=2.3100 acc=0.412 q_fill=0.94 active=7/8\\n" % (time.time(), step))
    step += 1
    time.sleep(0.1)
"""


def wait_for(observer: ObserverBase, kind: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        observation = observer.get(timeout=0.2)
        if observation is not None and observation.kind == kind:
            return observation
    raise RuntimeError(f"no {kind!r} observation within {timeout:g} s")


def line_latencies(make: Callable[[], ObserverBase], samples: int, max_gap: float, workdir: Path) -> list[float]:
    """Write `samples` lines at random moments; seconds from each write to the observer reporting it."""
    log = workdir / f"latency-{random.randrange(1 << 30)}.log"
    log.touch()
    latencies = []
    with make() as observer, open(log, "ab", buffering=0) as writer:
        observer.follow("probe", str(log))
        wait_for(observer, "connected")
        for i in range(samples):
            time.sleep(random.uniform(0.05, max_gap))
            written = time.time()
            writer.write(b"probe %d\n" % i)
            latencies.append(wait_for(observer, "lines", timeout=max_gap + 30).at - written)
    return latencies


def seed_look_s(target: Target, log: Path, looks: int = 5) -> float:
    """Median seconds of one seed-style look (tail + nvidia-smi) through `target` (a fresh ssh for OpenSSH)."""
    times = []
    for _ in range(looks):
        started = time.monotonic()
        target.run(SEED_LOOK.format(log=log), timeout=60)
        times.append(time.monotonic() - started)
    return statistics.median(times)


class OpenSshTarget(LocalTarget):
    """The seed's way over SSH: every command a fresh `ssh` client process and connection."""

    def __init__(self, config: Path) -> None:
        super().__init__("openssh")
        self.config = config

    def run(self, cmd, **kwargs):
        return super().run(["ssh", "-F", str(self.config), "-o", "BatchMode=yes", "testhost", cmd], **kwargs)


def describe(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"median {statistics.median(ordered):.3f} s, p95 {p95:.3f} s, max {ordered[-1]:.3f} s (n={len(ordered)})"


def bench_latency(name: str, target: Target, seed_target: Target, workdir: Path, quick: bool) -> None:
    stream = line_latencies(lambda: Observer(target, AGENT_CMD), 10 if quick else 30, 0.5, workdir)
    poll = line_latencies(lambda: PollObserver(target, AGENT_CMD, interval=POLL_S), 3 if quick else 8, POLL_S, workdir)
    look = seed_look_s(seed_target, workdir / "seed.log")
    print(f"[{name}] (a) line -> observer, streaming:   {describe(stream)}")
    print(f"[{name}] (a) line -> observer, {POLL_S:g} s poll:  {describe(poll)}")
    print(f"[{name}] (a) seed `sleep {SEED_SLEEP_S:g}; tail` (computed): mean {SEED_SLEEP_S / 2 + look:.1f} s, "
          f"worst {SEED_SLEEP_S + look:.1f} s (one look measured at {look:.3f} s)")


def agent_host_pid(namespace_leader: int) -> int:
    """The agent: the child of the `unshare --fork` process."""
    children = Path(f"/proc/{namespace_leader}/task/{namespace_leader}/children").read_text().split()
    return int(children[0])


def last_pid_in_namespace(pid: int) -> int:
    """The namespace's last allocated PID (the `cat` that reads it is one of them)."""
    done = subprocess.run(["nsenter", "--target", str(pid), "--pid", "--mount", "cat",
                           "/proc/sys/kernel/ns_last_pid"], capture_output=True, text=True, timeout=10, check=True)
    return int(done.stdout)


def find_namespace_leader(agent_marker: str) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[:1] == [b"unshare"] and agent_marker.encode() in argv:
                return int(proc.name)
    raise RuntimeError("the agent's unshare process is not running")


def bench_processes(workdir: Path, quick: bool) -> None:
    """(b): PIDs allocated in the agent's own PID namespace while a stream watches one busy log."""
    minutes = 0.25 if quick else 1.0
    log = workdir / "procs.log"
    log.touch()
    marker = str(workdir / "agent-for-process-count.py")
    shutil.copy(agent_module.__file__, marker)
    namespaced = ["unshare", "--pid", "--fork", "--mount-proc", "python3", marker]
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(minutes * 60 + 5), str(log)])
    with Observer(LocalTarget("bench"), namespaced) as observer:
        observer.follow("busy", str(log))
        wait_for(observer, "gpu")  # the sampler is up: the agent's start-up spawning is over
        agent = agent_host_pid(find_namespace_leader(marker))
        before = last_pid_in_namespace(agent)
        time.sleep(minutes * 60)
        after = last_pid_in_namespace(agent)
    writer.wait(30)
    spawned = after - before - 1  # the second `cat` is not the agent's doing
    once = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                           f"python3 {marker} --once >/dev/null; cat /proc/sys/kernel/ns_last_pid"],
                          capture_output=True, text=True, timeout=60, check=True)
    per_poll = int(once.stdout) - 2  # minus the sh (PID 1) and the cat
    print(f"(b) processes spawned per minute of watching, streaming: {spawned / minutes:.0f} "
          f"(agent + its one sampler started once: {before - 1} PIDs)")
    print(f"(b) per {POLL_S:g} s poll round trip: {per_poll} (agent --once + one nvidia-smi), "
          f"{per_poll * 60 / POLL_S:.0f}/min before the transport's own (ssh session, shell, pct, lxc-attach)")
    per_look = len(SEED_PROCESSES)
    print(f"(b) seed's way: {per_look} per look ({', '.join(SEED_PROCESSES)}): {per_look * 60 / SEED_SLEEP_S:.0f}/min "
          f"at one look per {SEED_SLEEP_S:g} s, {per_look * 60 / POLL_S:.0f}/min if it looked every {POLL_S:g} s")


def cpu_seconds_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def bench_cpu(name: str, target: Target, workdir: Path, quick: bool) -> None:
    """(c): this process's CPU while it follows 8 logs written at 10 lines/s each, draining every observation."""
    seconds = 10.0 if quick else 30.0
    logs = [workdir / f"{name}-cpu-{i}.log" for i in range(CPU_LOGS)]
    for log in logs:
        log.touch()
    with Observer(target, AGENT_CMD) as observer:
        for i, log in enumerate(logs):
            observer.follow(f"run{i}", str(log))
        agent = wait_for(observer, "connected").data["pid"]
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(seconds + 1), *map(str, logs)])
        cpu_before, agent_before, lines = time.process_time(), cpu_seconds_of(agent), 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            observation = observer.get(timeout=0.2)
            lines += len(observation.lines) if observation is not None else 0
        used, agent_used = time.process_time() - cpu_before, cpu_seconds_of(agent) - agent_before
        writer.wait(30)
    print(f"[{name}] (c) {CPU_LOGS} logs x {CPU_LINES_PER_S} lines/s for {seconds:g} s ({lines} lines): "
          f"observer {100 * used / seconds:.2f}% of one core, agent (container side) {100 * agent_used / seconds:.2f}%")


@contextmanager
def openssh_host(workdir: Path, session_env: dict[str, str]) -> Iterator[tuple[Target, Target]]:
    """The harness's sshd on 127.0.0.1 with a user-like ~/.ssh: (SshTarget, seed-style OpenSSH target)."""
    from harness.ssh_home import SshHome
    from harness.sshd import SshServer
    from orchestrator.remote.ssh import SshTarget

    server = SshServer(workdir / "sshd", env=session_env)
    server.start()
    home = SshHome(workdir / "home")
    home.add_host("testhost", server)
    os.environ["HOME"] = str(home.home)
    target = SshTarget("sshd-loopback", "testhost")
    try:
        yield target, OpenSshTarget(home.config_path)
    finally:
        target.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ssh", action="store_true", help="also measure over a real sshd on 127.0.0.1")
    parser.add_argument("--quick", action="store_true", help="fewer samples and shorter windows")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dfo-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        state = NvidiaSmiState(workdir / "nvidia-smi.json", [Gpu(i, memory_used_mib=81000, utilization_pct=97)
                                                             for i in range(8)])
        os.environ.update(state.env(), PATH=CONTAINER_PATH)  # no pyenv shims: they fork dozens per python3
        (workdir / "seed.log").write_bytes(b"step line\n" * 200)
        local = LocalTarget("local")
        print(f"watch transport benchmark, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
              f"8 stand-in GPUs (nvidia-smi stand-in)")
        bench_latency("local", local, local, workdir, args.quick)
        bench_processes(workdir, args.quick)
        bench_cpu("local", local, workdir, args.quick)
        if args.ssh:
            ssh, openssh = stack.enter_context(openssh_host(workdir, state.env()))
            bench_latency("ssh", ssh, openssh, workdir, args.quick)
            bench_cpu("ssh", ssh, workdir, args.quick)


if __name__ == "__main__":
    main()

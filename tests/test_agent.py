"""The watch agent as a real process on this machine: real files, real processes, the nvidia-smi stand-in."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import STANDIN_BIN
from harness.nvidia_smi import Gpu, NvidiaSmiState
from orchestrator.agent import agent as agent_module
from orchestrator.agent.protocol import MAX_LOG_CHUNK, FrameDecoder, Record

AGENT = Path(agent_module.__file__)
NO_NVIDIA_PATH = "/usr/bin:/bin"  # nvidia-smi is on neither


class AgentProcess:
    """`python3 agent.py` with a pipe on stdin and a decoder on stdout."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, **env},
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.decoder = FrameDecoder()
        self.seen: list[Record] = []

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def follow(self, run: str, log: Path, **fields) -> None:
        self.send(cmd="follow", run=run, log=str(log), **fields)

    def read_until(self, done, timeout: float = 5.0) -> list[Record]:
        """Records read until `done(all records so far)` holds; fails the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done(self.seen):
            assert time.monotonic() < deadline, f"agent never got there; last records: {self.seen[-5:]}"
            try:
                data = os.read(self.proc.stdout.fileno(), 1 << 20)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            self.seen.extend(self.decoder.feed(data))
        return self.seen

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def start_agent():
    started: list[AgentProcess] = []

    def start(env: dict[str, str] | None = None, *args: str) -> AgentProcess:
        started.append(AgentProcess(env or {"PATH": NO_NVIDIA_PATH}, *args))
        return started[-1]

    yield start
    for agent in started:
        agent.close()


def of_type(records: list[Record], kind: str, run: str | None = None) -> list[Record]:
    return [r for r in records if r.type == kind and (run is None or r.header.get("run") == run)]


def log_bytes(records: list[Record], run: str) -> bytes:
    """The log payloads of `run`, checked to be contiguous, joined."""
    chunks = of_type(records, "log", run)
    for before, after in zip(chunks, chunks[1:]):
        assert after.header["off"] == before.header["off"] + len(before.payload)
    return b"".join(r.payload for r in chunks)


def has_bytes(run: str, size: int):
    return lambda records: len(log_bytes(records, run)) >= size


def test_agent_says_hello_first_and_then_beats_every_second(start_agent):
    agent = start_agent()
    records = agent.read_until(lambda rs: len(of_type(rs, "hb")) >= 3, timeout=4)
    assert records[0].type == "hello" and records[0].header["pid"] == agent.proc.pid
    beats = [r.header["ts"] for r in of_type(records, "hb")]
    assert 0.8 < beats[2] - beats[1] < 1.5


def test_appended_lines_and_a_partial_line_arrive_with_their_offsets(start_agent, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"old line\n")
    agent = start_agent()
    agent.follow("r1", log, offset=9)  # the first line was handled by an earlier watch
    with open(log, "ab") as writer:
        writer.write(b"step 1\nstep 2 half")
        writer.flush()
        agent.read_until(has_bytes("r1", 18))
        writer.write(b"-done\n\xff\xfe not utf-8\n")
    records = agent.read_until(has_bytes("r1", 18 + 18))
    assert of_type(records, "log", "r1")[0].header["off"] == 9
    assert log_bytes(records, "r1") == b"step 1\nstep 2 half-done\n\xff\xfe not utf-8\n"


def test_a_truncated_log_is_reported_and_read_again_from_the_start(start_agent, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"a long first life of the log\n")
    agent = start_agent()
    agent.follow("r1", log, offset=0)
    agent.read_until(has_bytes("r1", 29))
    log.write_bytes(b"reborn\n")
    records = agent.read_until(lambda rs: of_type(rs, "log", "r1")[-1].payload == b"reborn\n")
    [truncated] = of_type(records, "truncated", "r1")
    assert truncated.header["size"] == 7
    assert of_type(records, "log", "r1")[-1].header["off"] == 0


def test_a_5mb_flood_arrives_whole_in_capped_records_without_holding_up_another_run(start_agent, tmp_path):
    log = tmp_path / "flood.log"
    flood = b"".join(b"flood line %07d %s\n" % (i, b"x" * 40) for i in range(5 * 1024 * 1024 // 60))
    log.write_bytes(flood)
    (tmp_path / "quiet.log").write_bytes(b"step 1\n")
    agent = start_agent()
    agent.follow("flood", log, offset=0)
    agent.follow("quiet", tmp_path / "quiet.log", offset=0)
    records = agent.read_until(has_bytes("flood", len(flood)), timeout=20)
    assert log_bytes(records, "flood") == flood
    assert max(len(r.payload) for r in of_type(records, "log")) <= MAX_LOG_CHUNK
    assert records.index(of_type(records, "log", "quiet")[0]) < records.index(of_type(records, "log", "flood")[-1])


def test_process_state_and_exit_code_from_the_exit_file(start_agent, tmp_path):
    exit_file = tmp_path / "run.exit"
    run = subprocess.Popen(["sh", "-c", f"sleep 0.7; echo 3 > {exit_file}; exit 3"])
    starttime = agent_module.read_proc_stat(run.pid)[1]
    agent = start_agent()
    agent.follow("r1", tmp_path / "run.log", exit=str(exit_file), pid=run.pid, starttime=starttime, offset=0)
    records = agent.read_until(lambda rs: of_type(rs, "proc", "r1")[-1:] and not of_type(rs, "proc")[-1].header["alive"])
    run.wait(5)
    states = [(r.header["alive"], r.header["exit_code"]) for r in of_type(records, "proc", "r1")]
    assert states == [(True, None), (False, 3)]


def test_a_reused_pid_is_not_taken_for_the_run(start_agent, tmp_path):
    other = subprocess.Popen(["sleep", "30"])  # alive, but started later than the run we follow did
    try:
        real_starttime = agent_module.read_proc_stat(other.pid)[1]
        agent = start_agent()
        agent.follow("reused", tmp_path / "x.log", pid=other.pid, starttime=real_starttime - 1)
        agent.follow("same", tmp_path / "y.log", pid=other.pid, starttime=real_starttime)
        records = agent.read_until(lambda rs: of_type(rs, "proc", "reused") and of_type(rs, "proc", "same"))
        assert of_type(records, "proc", "reused")[0].header == {"t": "proc", "run": "reused", "alive": False,
                                                                "exit_code": None}
        assert of_type(records, "proc", "same")[0].header["alive"] is True
    finally:
        other.kill()
        other.wait(5)


def gpu_env(tmp_path: Path, gpus: list[Gpu], mode: str = "ok") -> dict[str, str]:
    state = NvidiaSmiState(tmp_path / "nvidia-smi.json", gpus, mode)
    return {"PATH": f"{STANDIN_BIN}:{NO_NVIDIA_PATH}", **state.env()}


def test_gpu_samples_come_from_one_long_lived_sampler_and_parse_na(start_agent, tmp_path):
    env = gpu_env(tmp_path, [Gpu(0, memory_used_mib=80000, utilization_pct=97), Gpu(1, utilization_pct=None)])
    agent = start_agent(env)
    records = agent.read_until(lambda rs: len(of_type(rs, "gpu")) >= 3, timeout=8)
    assert of_type(records, "gpu")[0].header["gpus"] == [
        {"index": 0, "mem_used_mib": 80000, "mem_total_mib": 143771, "util_pct": 97},
        {"index": 1, "mem_used_mib": 0, "mem_total_mib": 143771, "util_pct": None},
    ]
    assert len(sampler_children(agent.proc.pid)) == 1


def test_missing_nvidia_smi_is_reported_once_and_not_retried_every_second(start_agent):
    agent = start_agent({"PATH": NO_NVIDIA_PATH})
    records = agent.read_until(lambda rs: len(of_type(rs, "hb")) >= 3, timeout=5)
    [error] = of_type(records, "gpu_error")
    assert error.header["code"] == 127 and "nvidia-smi" in error.header["text"]


def test_a_failing_nvidia_smi_reports_its_own_text_and_exit_code(start_agent, tmp_path):
    agent = start_agent(gpu_env(tmp_path, [], mode="no_driver"))
    records = agent.read_until(lambda rs: of_type(rs, "gpu_error"), timeout=5)
    error = of_type(records, "gpu_error")[0].header
    assert error["code"] == 9 and "couldn't communicate with the NVIDIA driver" in error["text"]


def sampler_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_closing_stdin_kills_the_sampler_and_the_agent_exits(start_agent, tmp_path):
    agent = start_agent(gpu_env(tmp_path, [Gpu(0)]))
    agent.read_until(lambda rs: of_type(rs, "gpu"), timeout=8)
    [sampler] = sampler_children(agent.proc.pid)
    agent.proc.stdin.close()
    assert agent.proc.wait(5) == 0
    assert not Path(f"/proc/{sampler}").exists() or agent_module.read_proc_stat(sampler)[0] == "Z"


def test_sigkilled_agent_takes_its_sampler_with_it(start_agent, tmp_path):
    agent = start_agent(gpu_env(tmp_path, [Gpu(0)]))
    agent.read_until(lambda rs: of_type(rs, "gpu"), timeout=8)
    [sampler] = sampler_children(agent.proc.pid)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(5)
    deadline = time.monotonic() + 3
    while Path(f"/proc/{sampler}").exists() and agent_module.read_proc_stat(sampler)[0] != "Z":
        assert time.monotonic() < deadline, "nvidia-smi outlived the agent"
        time.sleep(0.05)


def test_once_prints_one_snapshot_and_exits(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"one\ntwo\nthr")
    (tmp_path / "run.exit").write_text("0\n")
    follow = {"cmd": "follow", "run": "r1", "log": str(log), "exit": str(tmp_path / "run.exit"), "offset": 4}
    done = subprocess.run([sys.executable, str(AGENT), "--once", json.dumps(follow)], capture_output=True,
                          timeout=15, env={**os.environ, **gpu_env(tmp_path, [Gpu(0, utilization_pct=5)])})
    records = FrameDecoder().feed(done.stdout)
    assert done.returncode == 0
    assert [r.type for r in records] == ["hello", "log", "proc", "gpu"]
    assert records[1].header["off"] == 4 and records[1].payload == b"two\nthr"
    assert records[2].header["exit_code"] == 0
    assert records[3].header["gpus"][0]["util_pct"] == 5


def test_agent_is_one_stdlib_file_that_python_3_8_can_parse():
    source = AGENT.read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= sys.stdlib_module_names | {"__future__"}, imported - sys.stdlib_module_names


def test_a_bad_command_gets_an_error_record_and_the_agent_keeps_going(start_agent, tmp_path):
    agent = start_agent()
    agent.send(cmd="follow", run="r1")  # no log
    agent.send(cmd="follow", run="r2", log=str(tmp_path / "x.log"), pid="not a pid")
    agent.proc.stdin.write(b"not json\n")
    agent.proc.stdin.flush()
    records = agent.read_until(lambda rs: len(of_type(rs, "error")) == 3 and of_type(rs, "hb"))
    assert all("bad command" in r.header["text"] for r in of_type(records, "error"))
    assert agent.proc.poll() is None

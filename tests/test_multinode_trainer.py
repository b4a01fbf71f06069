"""procsplit across nodes: two `python -m trainer` processes (node_rank 0 and 1) meeting on loopback through
torch.distributed's TCPStore, as two hosts would; each node has its own output directory (its own disk)."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import time

import pytest

from trainer_helpers import TrainerRun, trainer_cmd, trainer_env

UNIFORM_LOSS = math.log(63)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(tmp_path, rank: int, port: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    out = tmp_path / f"node{rank}"
    out.mkdir(exist_ok=True)
    cmd = trainer_cmd(out, "mn", "--topology", "procsplit", "--nnodes", "2", "--node-rank", str(rank),
                      "--master-port", str(port), *args)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or trainer_env(), cwd=out, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> TrainerRun:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    return TrainerRun(proc.returncode, stdout, stderr)


def run_two_nodes(tmp_path, *args: str, timeout: float = 240) -> tuple[TrainerRun, TrainerRun]:
    port = free_port()
    nodes = [start_node(tmp_path, rank, port, *args) for rank in (1, 0)]  # node 1 first: it waits for node 0
    return finish(nodes[1], timeout), finish(nodes[0], timeout)


def test_two_nodes_train_one_model_and_resume_on_every_node(tmp_path):
    node0, node1 = run_two_nodes(tmp_path, "--steps", "40", "--log-every", "10")
    assert (node0.code, node1.code) == (0, 0), node0.stderr[-3000:] + node1.stderr[-3000:]
    start0, start1 = node0.events("start")[0].fields, node1.events("start")[0].fields
    assert (start0["node_rank"], start1["node_rank"], start0["nnodes"]) == ("0", "1", "2")
    steps = node0.steps
    assert [s.step for s in steps] == [s.step for s in node1.steps] == [5, 10, 20, 30, 40]  # each node's lead reports
    assert [s.loss for s in steps] == [s.loss for s in node1.steps]  # the whole run's figures
    assert all(s.active == "2/2" for s in steps)
    assert steps[-1].loss < UNIFORM_LOSS * 0.5, [s.loss for s in steps]
    done = node0.events("done")[0].fields
    assert done["replicas"] == "identical" and len(done["replica_hashes"].split(",")) == 2
    for node in ("node0", "node1"):  # each node's local rank 0 keeps a checkpoint on its own disk
        assert (tmp_path / node / "mn" / "checkpoint.pt").is_file()
    step40 = (tmp_path / "node1" / "mn" / "checkpoint.pt").read_bytes()

    node0, node1 = run_two_nodes(tmp_path, "--steps", "50", "--log-every", "10", "--resume")
    assert (node0.code, node1.code) == (0, 0), node0.stderr[-3000:] + node1.stderr[-3000:]
    assert [s.step for s in node0.steps] == [45, 50]  # continued from step 40 (45 closes the warm-up)
    assert node0.events("done")[0].fields["replicas"] == "identical"

    (tmp_path / "node1" / "mn" / "checkpoint.pt").write_bytes(step40)  # node 1's disk is a run behind
    node0, node1 = run_two_nodes(tmp_path, "--steps", "60", "--resume")
    # seen once in CI (session 6): node 0 exited 0 here; the output says how, should it happen again
    assert (node0.code, node1.code) == (1, 1), "\n".join(
        f"node{rank} exit {node.code}:\n{node.stdout[-2000:]}\n{node.stderr[-3000:]}" for rank, node in enumerate((node0, node1)))
    assert "ranks start at different steps [50, 40]" in node0.events("error")[0].fields["reason"]


def test_a_node_that_never_comes_ends_the_run_with_a_rendezvous_error(tmp_path):
    started = time.monotonic()
    node0 = finish(start_node(tmp_path, 0, free_port(), "--set", "run.rendezvous_timeout_s=3"), timeout=90)
    assert node0.code == 1
    assert time.monotonic() - started < 60
    error = node0.events("error")[0].fields
    assert error["cause"] == "rendezvous" and "not every rank joined within 3s" in error["reason"]
    assert "start every node" in error["reason"]


def test_a_taken_rendezvous_port_is_named_and_no_node_hangs(tmp_path):
    with socket.socket() as squatter:  # something else listens on the port and never answers
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        started = time.monotonic()
        nodes = [start_node(tmp_path, rank, port, "--set", "run.rendezvous_timeout_s=3") for rank in (0, 1)]
        node0, node1 = finish(nodes[0], 90), finish(nodes[1], 90)
        elapsed = time.monotonic() - started
    assert (node0.code, node1.code) == (1, 1)
    assert elapsed < 60  # the client that reached the squatter is cut off by the supervisor's deadline
    assert "the port is already taken" in node0.events("error")[0].fields["reason"]
    assert node1.events("error")[0].fields["cause"] == "rendezvous"
    assert "error: rendezvous at" in node0.stderr  # a one-line error on stderr, no traceback
    assert "Traceback" not in node0.stderr


@pytest.mark.slow
def test_a_killed_node_makes_the_other_exit_nonzero_naming_the_lost_peer(tmp_path):
    port = free_port()
    args = ("--steps", "1000", "--log-every", "2", "--set", "debug.step_sleep_s=0.1")
    node1, node0 = start_node(tmp_path, 1, port, *args), start_node(tmp_path, 0, port, *args)
    try:
        deadline = time.monotonic() + 120
        while "event=step step=4 " not in node0.stdout.readline():
            assert time.monotonic() < deadline and node0.poll() is None
        os.killpg(node1.pid, signal.SIGKILL)  # the whole node goes: supervisor, target and drafter
        killed = time.monotonic()
        result = finish(node0, timeout=90)
    finally:
        finish(node1, timeout=10)
    assert result.code == 1
    assert time.monotonic() - killed < 60
    error = result.events("error")[0].fields
    assert error["cause"] == "peer_lost" and error["node"] == "0", error
    assert "a peer rank ended or is unreachable" in error["reason"]


def test_node_settings_come_from_torch_style_environment_and_flags_win(monkeypatch):
    from trainer.__main__ import config_from_args, parse_args

    for name, value in {"MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "29555", "NODE_RANK": "1", "NNODES": "3"}.items():
        monkeypatch.setenv(name, value)
    run = config_from_args(parse_args(["--topology", "procsplit"])).run
    assert (run.master_addr, run.master_port, run.node_rank, run.nnodes) == ("10.9.8.7", 29555, 1, 3)
    assert config_from_args(parse_args(["--topology", "procsplit", "--node-rank", "2"])).run.node_rank == 2


def test_inconsistent_node_settings_exit_2_naming_the_key(tmp_path):
    cases = {("--nnodes", "2", "--node-rank", "2"): "run.node_rank: expected an integer in 0..1",
             ("--nnodes", "2", "--topology", "threads"): "run.nnodes: expected 1 unless run.topology=procsplit"}
    for args, message in cases.items():
        proc = subprocess.run(trainer_cmd(tmp_path, "bad", "--topology", "procsplit", *args), capture_output=True,
                              text=True, env=trainer_env(), timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = subprocess.run(trainer_cmd(tmp_path, "bad", "--topology", "procsplit", "--nnodes", "2"),
                          capture_output=True, text=True, env=dict(trainer_env(), WORLD_SIZE="3"), timeout=60)
    assert proc.returncode == 2 and "WORLD_SIZE=3: expected 2" in proc.stderr, proc.stderr


def test_a_single_node_config_hash_is_unchanged_by_the_node_keys():
    from trainer.config import build_config

    one = build_config("tiny-cpu", ["run.topology=procsplit"])
    assert one.hash() == build_config("tiny-cpu", ["run.topology=procsplit", "run.master_port=1234"]).hash()
    two = [build_config("tiny-cpu", ["run.topology=procsplit", "run.nnodes=2", f"run.node_rank={k}"]) for k in (0, 1)]
    assert two[0].hash() == two[1].hash() != one.hash()  # nodes agree; the world size changes what is trained

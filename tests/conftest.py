"""Shared pytest fixtures: a real sshd, a user-like ~/.ssh, LXC containers behind the pct stand-in, the
nvidia-smi stand-in's state, and network-namespace hosts. The machinery lives in tests/harness/."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from harness import STANDIN_BIN, write_inventory  # noqa: F401  (write_inventory re-exported for tests)
from harness.lxc import ContainerFactory, LxcContainer
from harness.netns import NetnsHost, NetnsHosts, remove_stale_namespaces
from harness.ssh_home import SshHome
from harness.sshd import SshServer

HOST_ALIAS = "testhost"
PCT_NODE = "testnode"


def pytest_configure(config) -> None:
    """A suite started with SIGINT ignored (`nohup pytest &`, a shell without job control) would pass that on to
    every dfo it starts, and the Ctrl-C tests would time out; ignore it in neither (children get the default)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Test files whose tests run the torch trainer (CPU-bound: compiles, procsplit processes, hundreds of steps).
# Under pytest-xdist's `--dist loadgroup` (scripts/test.sh) they all go to one worker, one test at a time, so
# two of them never share the 2 cores, while the other worker takes the rest (mostly waiting on sshd,
# containers, watch leases). This group is the suite's critical path (at bbff09b: >= 771 s of its tests among
# a 878-s run's 100 slowest; the rest >= 513 s). test_multinode_ssh.py stays in it although its tests go
# through sshd: they train too, two procsplit nodes at a time (one test: 37 s of CPU in 25 s on an idle
# 2-core machine, ~30 s of it the node starts' torch imports, 3 processes a node), so out of the group it
# would share the 2 cores with a compile or a learning run; docs/benchmarks.md has the figures.
TRAINER_FILES = frozenset({"test_trainer_learning.py", "test_trainer_cli.py", "test_trainer_replicas.py", "test_trainer_step.py",
                           "test_compile_scope.py", "test_procsplit.py", "test_multinode_trainer.py",
                           "test_multinode_ssh.py", "test_trainer.py"})

# Tests of TRAINER_FILES whose trainer is a played script (no torch), or whose real trainer takes no step or a
# few before it only waits: they leave the group and run on either worker beside it. As "FILE::TEST" (a
# parametrized test's every case); tests/test_suite_layout.py checks that each still exists.
NOT_TRAINING = frozenset({
    # 12 s of a played checkpoint, 18 s in all: off the critical path
    "test_multinode_ssh.py::test_the_nodes_a_multinode_fallback_stops_get_their_variants_stop_grace_to_write_their_checkpoint",
    # refused before any node starts, or no node's trainer ever starts: 12 s of the group's critical path
    "test_multinode_ssh.py::test_three_containers_of_one_host_in_one_launch_are_refused_at_once_with_the_fix",
    "test_multinode_ssh.py::test_a_node_whose_preflight_fails_starts_nothing_anywhere",
    "test_multinode_ssh.py::test_every_node_that_refuses_is_named_in_one_line",
    "test_multinode_ssh.py::test_a_taken_rendezvous_port_is_refused_before_anything_starts",
    "test_multinode_ssh.py::test_a_variant_that_cannot_span_nodes_is_a_usage_error",
    "test_multinode_ssh.py::test_a_master_addr_with_shell_metacharacters_is_refused_before_any_connection",
    "test_multinode_ssh.py::test_a_failed_launch_waits_for_a_node_whose_start_got_no_answer_only_the_inventorys_start_grace",
    "test_multinode_ssh.py::test_nodes_not_started_after_a_failed_start_stay_listed_as_failed_saying_why",
    # their nodes' trainer is played (PLAYED_NODE): ~145 s of the group's path, CPU 38 s for the 8 (was ~1.5 cores)
    "test_multinode_ssh.py::test_a_multinode_fallback_left_half_done_by_a_killed_dfo_is_finished_once_by_two_racing_watches",
    "test_multinode_ssh.py::test_a_multinode_fallback_killed_between_starting_its_nodes_is_relaunched_whole_once",
    "test_multinode_ssh.py::test_a_multinode_successor_whose_starts_got_no_answer_is_adopted_if_it_runs_and_launched_again_only_if_not",
    "test_multinode_ssh.py::test_ctrl_c_during_a_multinode_fallback_says_what_it_finishes_and_finishes_it_first",
    "test_multinode_ssh.py::test_a_second_ctrl_c_during_a_multinode_fallback_leaves_it_half_done_for_the_next_watch",
    "test_multinode_ssh.py::test_a_multinode_fallback_is_carried_out_while_the_watch_goes_on_following_another_run_and_its_successor",
    "test_multinode_ssh.py::test_a_multinode_successor_waits_only_for_the_gpus_its_predecessor_used",
    "test_multinode_ssh.py::test_a_multinode_successor_starts_once_the_gpus_its_predecessor_used_are_released",
    # refused (no checkpoint) before any step: one torch import, 2.8 s of the group's path at f501374
    "test_trainer_cli.py::test_resume_without_checkpoint_is_a_usage_error",
    # nodes whose rendezvous fails (3 s): they import torch and wait, no step: 23 s of the group's path, CPU 18 s
    "test_multinode_trainer.py::test_a_node_that_never_comes_ends_the_run_with_a_rendezvous_error",
    "test_multinode_trainer.py::test_a_taken_rendezvous_port_is_named_and_no_node_hangs",
    # two steps, then the drafters wait on a SIGSTOPped target and the stop on STOP_WAIT_S and REAP_GRACE_S: ~33 s
    # of the group's path, CPU ~20 s; beside the learning test both pass with room (took ~13 s against 45)
    "test_procsplit.py::test_sigterm_with_a_stopped_target_stops_one_rank_with_a_checkpoint_at_once",
    "test_procsplit.py::test_sigterm_with_a_stopped_target_ends_several_ranks_with_an_error_naming_it",
})


def trainer_group_of(nodeid: str) -> bool:
    """Whether the test `nodeid` (as pytest names it: `tests/FILE::TEST[CASE]`) runs in the trainer group."""
    path, _, name = nodeid.partition("::")
    file = path.rsplit("/", 1)[-1]
    return file in TRAINER_FILES and f"{file}::{name.split('[', 1)[0]}" not in NOT_TRAINING


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with TRAINER_FILES as one group. Done here because xdist 3.8's own grouping (the
    `xdist_group` mark) renames items through `item._nodeid`, which pytest 9 no longer reads: the mark groups
    nothing."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class TrainerTestsOnOneWorker(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if trainer_group_of(nodeid):
                return "trainer"
            return super()._split_scope(nodeid)

    return TrainerTestsOnOneWorker(config, log)


@pytest.fixture(scope="session")
def procsplit_two_drafter_run(tmp_path_factory):
    """One finished `python -m trainer` run of tiny-cpu over procsplit with two drafter ranks (80 steps, a step
    line every 20), shared by the tests that read it (test_procsplit.py, test_trainer_replicas.py): each such run
    costs four processes that import torch, ~8 s of the trainer group's path (issue 30)."""
    from trainer_helpers import run_trainer

    return run_trainer(tmp_path_factory.mktemp("procsplit-two-drafters"), "split", "--topology", "procsplit",
                       "--set", "run.drafters=cpu,cpu", "--steps", "80", "--log-every", "20", timeout=280)


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root")


@pytest.fixture(scope="session")
def lxc_path(tmp_path_factory):
    """This session's LXCPATH: every test container lives here, never in /var/lib/lxc."""
    return tmp_path_factory.mktemp("lxc")


@pytest.fixture(scope="session")
def pct_standin_env(lxc_path) -> dict[str, str]:
    """What the pct stand-in reads to find this session's containers and name its node."""
    return {"PCT_STANDIN_LXCPATH": str(lxc_path), "PCT_STANDIN_NODE": PCT_NODE}


@pytest.fixture
def sshd(tmp_path_factory, pct_standin_env) -> SshServer:
    """A running OpenSSH server on a free 127.0.0.1 port, stopped (by PID, open sessions too) at teardown. Its sessions have the
    stand-ins (pct, nvidia-smi) first on PATH and reach this session's containers."""
    if not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed (scripts/test.sh installs it)")
    server = SshServer(tmp_path_factory.mktemp("sshd"), env=dict(pct_standin_env))
    server.start()
    yield server
    server.kill_sessions()  # connections a test left open end with it
    server.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that had the `sshd` fixture shows the tail of sshd's log: what the server saw of a
    connection that broke (a CI run keeps nothing else of it)."""
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("sshd")
    if report.when == "call" and report.failed and isinstance(server, SshServer):
        report.sections.append((f"sshd log, last lines ({server.log_path})", server.log_tail()))


@pytest.fixture
def ssh_home(sshd, tmp_path_factory, monkeypatch) -> SshHome:
    """HOME pointed at a fresh directory whose ~/.ssh/config has `Host testhost` for the `sshd` fixture,
    with its key as ~/.ssh/id_ed25519 and its host key in ~/.ssh/known_hosts. ssh-agent is hidden."""
    home = SshHome(tmp_path_factory.mktemp("home"))
    home.add_host(HOST_ALIAS, sshd)
    monkeypatch.setenv("HOME", str(home.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


@pytest.fixture
def pct_env(monkeypatch, pct_standin_env) -> None:
    """Put the stand-ins (pct, nvidia-smi) first on this process's PATH, for local targets."""
    monkeypatch.setenv("PATH", f"{STANDIN_BIN}:{os.environ.get('PATH', '')}")
    for key, value in pct_standin_env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def containers(lxc_path, pct_env) -> ContainerFactory:
    """Factory: `containers(vmid=None, start=True, gpus=None) -> LxcContainer` (real LXC, destroyed at teardown).
    Each container's nvidia-smi shows two idle H200s unless `gpus` says otherwise."""
    _require_root("LXC containers")
    if not shutil.which("lxc-start") or not os.path.exists("/usr/bin/busybox"):
        pytest.skip("lxc and busybox-static are not installed (scripts/test.sh installs them)")
    factory = ContainerFactory(lxc_path)
    yield factory
    factory.destroy_all()


@pytest.fixture
def container(containers) -> LxcContainer:
    """One running container (the first free VMID from 200 up)."""
    return containers()


@pytest.fixture
def netns_hosts(ssh_home, pct_standin_env, tmp_path_factory):
    """Factory: `netns_hosts(n) -> list[NetnsHost]`, n hosts in network namespaces (198.18.0.0/15), each with
    its own sshd on port 22, trusted and listed in ~/.ssh/config as `nshost0`, `nshost1`, ... (also after
    earlier calls); `netns_hosts.link(a, b)` cables two of them together. All are torn down at teardown, even
    when the test failed."""
    _require_root("network namespaces")
    if not shutil.which("ip"):
        pytest.skip("iproute2 is not installed (scripts/test.sh installs it)")
    remove_stale_namespaces()
    factory = NetnsHosts(tmp_path_factory.mktemp("netns"), env=dict(pct_standin_env))

    def make(count: int) -> list[NetnsHost]:
        hosts = factory(count)
        for host in hosts:
            ssh_home.add_host(f"nshost{factory.hosts.index(host)}", host.server)
        return hosts

    make.link = factory.link  # netns_hosts.link(a, b): a direct cable between two hosts (harness/netns.py)
    yield make
    factory.destroy_all()

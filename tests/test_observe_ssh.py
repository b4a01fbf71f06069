"""The Observer over a real OpenSSH server: the channel dies with sshd and the watch resumes when it is back."""

from __future__ import annotations

import time

import pytest

from orchestrator.observe import Observer
from orchestrator.remote.ssh import SshTarget
from test_observe import AGENT_CMD, LineWriter, agent_gone, observe  # noqa: F401  (observe is a fixture)


@pytest.mark.slow
def test_sshd_killed_and_restarted_mid_stream_loses_and_doubles_nothing(ssh_home, sshd, observe, tmp_path):
    log = tmp_path / "run.log"
    writer = LineWriter(log, n=200, every=0.02)
    target = SshTarget("pve1", "testhost", connect_timeout=3)
    try:
        seen = observe(Observer(target, AGENT_CMD, heartbeat_timeout=3, backoff_initial=0.2, backoff_max=1.0))
        seen.observer.follow("r1", str(log))
        writer.thread.start()
        seen.until(lambda s: len(s.lines("r1")) >= 20)
        first_agent = seen.kinds("connected")[0].data["pid"]
        sshd.kill_sessions()  # the channel (and the agent at its end) goes
        sshd.stop()  # and the host refuses connections for a while
        time.sleep(1.0)
        sshd.start()
        seen.until(lambda s: len(s.lines("r1")) >= writer.n, timeout=20)
        assert seen.lines("r1") == writer.expected()
        assert len(seen.kinds("gap")) == 1 and seen.kinds("gap")[0].data["duration_s"] >= 1.0
        assert seen.kinds("disconnected")  # shown while it lasted
        assert agent_gone(first_agent)  # the dropped channel's agent left nothing behind
    finally:
        seen.observer.close()
        target.close()

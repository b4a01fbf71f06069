"""SshTarget against a real OpenSSH server: commands, transfers and streams over one kept-open connection,
~/.ssh/config honoured, host keys verified (unknown refused unless opted in, changed always refused), and
every failure a dfo error with a message a user can act on."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from orchestrator.errors import AuthError, CommandFailed, CommandTimeout, ConnectError, HostKeyChanged, HostKeyUnknown, TransferError
from orchestrator.remote import ssh as ssh_module
from orchestrator.remote.ssh import SshTarget, trust_host_key


@pytest.fixture
def target(ssh_home):
    """The `testhost` alias of ~/.ssh/config: no address, port, user or key given here."""
    ssh = SshTarget("pve1", "testhost")
    yield ssh
    ssh.close()


def test_alias_resolves_through_ssh_config(target, sshd):
    assert (target.host, target.port, target.user) == (sshd.host, sshd.port, "root")


def test_run_argv_is_quoted_and_script_runs_in_sh(target):
    result = target.run(["printf", "%s|", "two words", "$HOME", "a;b"])
    assert (result.exit_code, result.stdout) == (0, "two words|$HOME|a;b|")
    result = target.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_run_feeds_input_and_env(target):
    assert target.run(["cat"], input=b"payload\x00bytes").stdout == "payload\x00bytes"
    assert target.run("echo $GREETING", env={"GREETING": "hello 'there'"}).stdout == "hello 'there'\n"
    assert target.run(["cat"]).stdout == ""  # stdin closed: a reader sees EOF, it does not hang


def test_large_input_echoed_back_does_not_block_on_a_full_window(target):
    data = b"0123456789abcdef" * (1 << 18)  # 4 MiB: twice paramiko's default channel window
    assert target.run(["cat"], input=data, timeout=20).stdout.encode() == data


def test_check_raises_command_failed_with_exit_code_and_last_lines(target):
    with pytest.raises(CommandFailed) as caught:
        target.run("echo boom >&2; exit 4", check=True)
    assert caught.value.result.exit_code == 4
    assert "exited 4: boom" in str(caught.value) and str(caught.value).startswith("pve1: ")


def test_timeout_raises_and_kills_the_remote_command(target):
    started = time.monotonic()
    with pytest.raises(CommandTimeout, match="timeout"):
        target.run("sleep 987.5", timeout=0.5)
    assert time.monotonic() - started < 10  # 0.5 s, and a loaded machine's slack (3 s was a margin of 2.5)
    deadline = time.monotonic() + 3
    while target.run("pgrep -f 'sleep 98[7].5' || true").stdout.strip():
        assert time.monotonic() < deadline, "the timed-out command is still running"
        time.sleep(0.1)


def test_many_commands_from_many_threads_share_one_connection(target, sshd):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: target.run(["echo", str(i)]).stdout, range(40)))
    assert results == [f"{i}\n" for i in range(40)]
    assert sshd.accepted_connections() == 1


CHANNEL_EOF = 96
"""SSH_MSG_CHANNEL_EOF (RFC 4254), the first byte of such a message."""


@pytest.fixture
def late_eofs(monkeypatch):
    """Every channel EOF dfo sends leaves 0.3 s after paramiko built it. paramiko builds an EOF under the
    channel's lock and sends it after releasing it; when the host's CLOSE is answered in between (by
    paramiko's own thread), the EOF follows our CLOSE and sshd drops the whole connection ("ieof packet
    referred to nonexistent channel", paramiko issue 1115). That window opens by itself, rarely (2 in 900
    loops of test_many_commands_from_many_threads_share_one_connection's 40 commands); this makes it wide."""
    send_late(monkeypatch, CHANNEL_EOF)


def send_late(monkeypatch, message_type: int, delay_s: float = 0.3) -> None:
    """Every message of `message_type` dfo sends leaves `delay_s` after paramiko built it."""
    transport_class = ssh_module.paramiko.Transport
    send = transport_class._send_user_message

    def send_it_late(transport, message):
        if message.asbytes()[:1] == bytes([message_type]):
            time.sleep(delay_s)
        return send(transport, message)

    monkeypatch.setattr(transport_class, "_send_user_message", send_it_late)


CHANNEL_DATA = 94
"""SSH_MSG_CHANNEL_DATA (RFC 4254)."""


@pytest.fixture
def late_data(monkeypatch):
    """Every channel data message dfo sends leaves 0.3 s after paramiko built it: the same gap as late_eofs'
    for what a stream writes to a command that ends meanwhile (sshd: "idata packet referred to nonexistent
    channel")."""
    send_late(monkeypatch, CHANNEL_DATA)


def test_commands_that_end_at_once_keep_the_connection_when_eofs_leave_late(target, sshd, late_eofs):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: target.run(["echo", str(i)]).stdout, range(8)))
    assert results == [f"{i}\n" for i in range(8)]
    assert target.run(["cat"]).stdout == ""  # stdin still reads as closed
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_a_command_that_fails_before_reading_its_input_keeps_the_connection_when_eofs_leave_late(
        target, sshd, late_eofs, tmp_path):
    with pytest.raises(CommandFailed, match="no/such/dir"):
        target.put_bytes(b"x" * 100_000, str(tmp_path / "no/such/dir/file"))  # `cat > ...` fails at once
    result = target.run("cat; exit 3", input=b"payload")
    assert (result.exit_code, result.stdout) == (3, "payload")
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_a_connection_the_host_ends_with_a_reason_fails_the_command_saying_that_reason(target, sshd):
    def stray_eof_soon():  # a protocol error sshd answers with a disconnect that says why
        time.sleep(0.5)
        message = ssh_module.paramiko.Message()
        message.add_byte(bytes([CHANNEL_EOF]))
        message.add_int(4242)
        target._transport()._send_user_message(message)

    sender = threading.Thread(target=stray_eof_soon)
    sender.start()
    with pytest.raises(ConnectError, match=r"lost the connection to 127\.0\.0\.1:\d+ while running sh -c 'sleep 5': "
                                           r"the host disconnected: ieof packet referred to nonexistent channel 4242 \(code 2\)"):
        target.run("sleep 5", timeout=20)
    sender.join(timeout=5)
    assert "nonexistent channel 4242" in sshd.log_tail()


def test_closing_a_stream_whose_command_ended_keeps_the_connection_when_eofs_leave_late(target, sshd, late_eofs):
    for _ in range(3):
        stream = target.stream(["echo", "hi"])
        output = b""
        while chunk := stream.read(timeout=5):
            output += chunk
        assert output == b"hi\n"
        stream.close()
    assert target.run(["echo", "after"]).stdout == "after\n"
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_closing_a_stream_as_its_command_ends_keeps_the_connection_when_eofs_leave_late(target, sshd, late_eofs):
    # closed before its end was seen: our EOF was built while the command still ran, and left after the host's
    # CLOSE had been answered (a stream's close had only the case of an end already seen covered)
    for _ in range(3):
        stream = target.stream(["true"])
        stream.close()
        assert stream.exit_code() == 0
    assert target.run(["echo", "after"]).stdout == "after\n"
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_writing_to_a_stream_as_its_command_ends_keeps_the_connection_when_data_leaves_late(target, sshd, late_data):
    # as dfo answers a launch script or the stop program that has just ended on its own
    for _ in range(3):
        stream = target.stream("exit 5")
        stream.write(b"start 0\n")
        assert stream.read(timeout=5) == b""  # its end, seen as before
        stream.close()
        assert stream.exit_code() == 5
    assert target.run(["echo", "after"]).stdout == "after\n"
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_put_copies_bytes_and_mode(target, tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(bytes(range(256)) * 4000)
    dest = tmp_path / "copied"
    target.put(src, str(dest), mode=0o600)
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o600
    with pytest.raises(TransferError, match="no/such/dir"):
        target.put(src, str(tmp_path / "no/such/dir/blob"))


def test_put_bytes_writes_without_command_line(target, tmp_path):
    target.put_bytes(b"TOKEN=secret\n", str(tmp_path / "run.env"))
    assert (tmp_path / "run.env").read_bytes() == b"TOKEN=secret\n"
    assert (tmp_path / "run.env").stat().st_mode & 0o777 == 0o600


def test_stream_reads_incrementally_writes_stdin_and_reports_exit(target):
    with target.stream("while read line; do echo got:$line; done; exit 7") as stream:
        with pytest.raises(CommandTimeout):
            stream.read(timeout=0.2)  # nothing yet
        stream.write(b"one\n")
        assert stream.read(timeout=5) == b"got:one\n"
        assert stream.exit_code() is None
        stream.close()
        assert stream.exit_code() == 7


CHANNEL_REQUEST = 98
"""SSH_MSG_CHANNEL_REQUEST (RFC 4254)."""


def handled_late(monkeypatch, request: str, delay_s: float) -> None:
    """Every channel request `request` the host sends (exit-status ...) is handled `delay_s` after it came: a slow
    link between the host and dfo (paramiko's reading thread waits, as everything behind it on the link would)."""
    table = ssh_module.paramiko.Transport._channel_handler_table
    handle = table[CHANNEL_REQUEST]

    def handle_it_late(channel, message):
        at = message.packet.tell()
        kind = message.get_text()
        message.packet.seek(at)
        if kind == request:
            time.sleep(delay_s)
        return handle(channel, message)

    monkeypatch.setitem(table, CHANNEL_REQUEST, handle_it_late)


def test_a_streams_exit_code_answers_at_once_while_the_status_is_on_its_way(target, monkeypatch):
    # the watch loop asks a stream for its exit code: it waited up to 2 s there for a status still in flight
    with target.stream(["cat"]) as running:
        started = time.monotonic()
        assert running.exit_code() is None and time.monotonic() - started < 1.0  # it waited 2 s
    handled_late(monkeypatch, "exit-status", 3.0)
    # its output closed 1 s before it exits: sshd sends the EOF first (with `echo done; exit 4` it may send the
    # status first on a loaded machine, and then the 3 s are spent before the EOF: the status was there)
    stream = target.stream("echo done; exec >&- 2>&-; sleep 1; exit 4")
    output = b""
    while chunk := stream.read(timeout=5):
        output += chunk
    assert output == b"done\n"
    started = time.monotonic()
    assert stream.exit_code() is None
    assert time.monotonic() - started < 2.0  # the status is 3 s on its way
    assert stream.wait_exit(10) == 4  # once it arrived
    stream.close()


def test_a_stream_ends_with_its_command_when_a_process_it_left_behind_holds_its_output(target, sshd):
    # the background sleep holds the channel's stdout and stderr: before, read waited for an EOF that only its
    # end would bring (as `dfo logs -f` hung until fa9cf4e); now the command's exit status ends the stream
    started = time.monotonic()
    stream = target.stream("sleep 30 & echo $!; echo to-stderr >&2; exit 3")
    output = b""
    try:
        while chunk := stream.read(timeout=10):
            output += chunk
        assert stream.read(timeout=1) == b""  # and it stays ended
        assert stream.wait_exit(5) == 3
        assert time.monotonic() - started < 5
        assert stream.stderr_tail() == "to-stderr\n"
        stream.close()
    finally:
        if output.strip().isdigit():
            os.kill(int(output), signal.SIGKILL)
    assert target.run(["echo", "after"]).stdout == "after\n"
    assert sshd.accepted_connections() == 1, sshd.log_tail()


def test_stream_read_returns_eof_when_the_connection_drops(target, sshd):
    stream = target.stream(["cat"])  # ends by itself once its pipes close
    sshd.kill_sessions()
    assert stream.read(timeout=5) == b""
    stream.close()


LOST_TO_EOF = r"lost the connection to 127\.0\.0\.1:\d+ while running sh -c 'sleep 5': (the host closed the connection \(EOF\)|ConnectionResetError)"
"""What a command cut off by the host's end of the connection going away says (a FIN, or a reset where data was unread)."""


def test_a_dropped_connection_fails_the_running_command_at_once_and_the_next_reconnects(target, sshd):
    def drop_soon():
        time.sleep(0.5)
        sshd.kill_sessions()

    dropper = threading.Thread(target=drop_soon)
    dropper.start()
    started = time.monotonic()
    with pytest.raises(ConnectError, match=LOST_TO_EOF):
        target.run("sleep 5", timeout=20)
    assert time.monotonic() - started < 4
    dropper.join(timeout=5)
    assert target.run(["echo", "back"]).stdout == "back\n"
    assert sshd.accepted_connections() == 2


def test_every_command_a_dropped_connection_cuts_off_says_what_ended_it(target, sshd):
    # paramiko hands the exception its transport died of to one caller only; all four are told
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(target.run, "sleep 5", timeout=20) for _ in range(4)]
        deadline = time.monotonic() + 10
        while sshd.commands_started() < 4:
            assert time.monotonic() < deadline, "the four commands did not start"
            time.sleep(0.05)
        sshd.kill_sessions()
        errors = [future.exception(timeout=10) for future in running]
    assert all(isinstance(error, ConnectError) for error in errors), errors
    assert all(re.search(LOST_TO_EOF, str(error)) for error in errors), [str(error) for error in errors]


def test_command_killed_by_a_signal_reads_exit_code_minus_one(target):
    assert target.run("kill -KILL $$").exit_code == -1


def test_refused_port_is_a_connect_error(ssh_home, sshd):
    sshd.stop()
    with pytest.raises(ConnectError, match="refused"):
        SshTarget("pve1", "testhost").run("true")


def test_silent_host_fails_within_the_connect_timeout(ssh_home):
    with socket.socket() as silent:  # accepts TCP (backlog) but never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        started = time.monotonic()
        with pytest.raises(ConnectError, match="no SSH answer from 127.0.0.1"):
            SshTarget("pve9", "127.0.0.1", port=silent.getsockname()[1], connect_timeout=1.0).run("true")
        assert time.monotonic() - started < 3


def test_wrong_client_key_is_an_auth_error(ssh_home):
    ssh_home.wrong_client_key()
    with pytest.raises(AuthError, match="rejected"):
        SshTarget("pve1", "testhost").run("true")


def test_unknown_host_key_refused_then_recorded_after_opt_in(ssh_home, sshd):
    ssh_home.empty_known_hosts()
    with pytest.raises(HostKeyUnknown) as caught:
        SshTarget("pve1", "testhost").run("true")
    assert "dfo hostkey trust pve1" in str(caught.value) and "--accept-new-host-key" not in str(caught.value)
    with pytest.raises(HostKeyUnknown) as caught:  # a command that has the option (preflight) names it
        SshTarget("pve1", "testhost", offer_accept_new=True).run("true")
    assert "--accept-new-host-key" in str(caught.value)
    assert ssh_home.known_hosts.read_text() == ""  # never added silently
    assert SshTarget("pve1", "testhost", accept_new_host_key=True).run("true").ok
    assert sshd.host_key_pub.split()[1] in ssh_home.known_hosts.read_text()
    assert SshTarget("pve1", "testhost").run("true").ok  # trusted from now on


def test_changed_host_key_is_refused_even_with_opt_in(ssh_home):
    ssh_home.wrong_known_hosts("testhost")
    before = ssh_home.known_hosts.read_text()
    with pytest.raises(HostKeyChanged, match="HOST KEY CHANGED"):
        SshTarget("pve1", "testhost", accept_new_host_key=True).run("true")
    assert ssh_home.known_hosts.read_text() == before


def test_trust_host_key_records_once_and_refuses_a_changed_key(ssh_home, sshd):
    ssh_home.empty_known_hosts()
    fingerprint = trust_host_key("testhost")
    assert fingerprint.startswith("SHA256:")
    assert trust_host_key("testhost") == fingerprint
    assert ssh_home.known_hosts.read_text().count("\n") == 1
    assert SshTarget("pve1", "testhost").run("true").ok
    ssh_home.wrong_known_hosts("testhost")
    with pytest.raises(HostKeyChanged):
        trust_host_key("testhost")


def test_explicit_address_port_user_and_known_hosts(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh at all
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    known = tmp_path / "kh"
    known.write_text(sshd.known_hosts_line())
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n    IdentityFile {sshd.client_key}\n")
    ssh = SshTarget("h", sshd.host, port=sshd.port, user="root", known_hosts=known, ssh_config=config)
    assert ssh.run(["id", "-u"]).stdout == "0\n"
    ssh.close()


def test_proxyjump_goes_through_the_jump_host_whose_key_is_checked_too(ssh_home, sshd, tmp_path_factory):
    from harness.sshd import SshServer

    with SshServer(tmp_path_factory.mktemp("jump")) as jump:
        ssh_home.add_host("jump", jump)
        with ssh_home.config_path.open("a") as config:
            config.write(f"Host behind\n    HostName {sshd.host}\n    Port {sshd.port}\n    ProxyJump jump\n"
                         f"    IdentityFile {ssh_home.identity}\n")
        behind = SshTarget("pve2", "behind", user="root")
        assert behind.run(["echo", "through"]).stdout == "through\n"
        behind.close()
        assert (jump.accepted_connections(), sshd.accepted_connections()) == (1, 1)
        ssh_home.known_hosts.write_text(sshd.known_hosts_line())  # forget the jump host only
        with pytest.raises(HostKeyUnknown, match=f":{jump.port}"):
            SshTarget("pve2", "behind", user="root").run("true")


def test_ssh_config_user_applies_unless_the_inventory_sets_one(ssh_home, sshd, tmp_path):
    from harness import write_inventory
    from orchestrator.connections import Connections
    from orchestrator.inventory import load_inventory

    with ssh_home.config_path.open("a") as config:
        config.write(f"Host as-ghost\n    HostName {sshd.host}\n    Port {sshd.port}\n    User ghost\n")
    hosts = {"pve1": {"address": "as-ghost", "containers": {"ct200": {"ctid": 200}}}}
    with Connections(load_inventory(write_inventory(tmp_path, {"hosts": hosts}, "plain.yaml"))) as connections:
        with pytest.raises(AuthError, match="ghost@127.0.0.1"):  # ~/.ssh/config's User, not the default root
            connections.host("pve1").run("true")
    explicit = {"defaults": {"user": "root"}, "hosts": hosts}
    with Connections(load_inventory(write_inventory(tmp_path, explicit, "explicit.yaml"))) as connections:
        assert connections.host("pve1").run(["id", "-un"]).stdout == "root\n"  # set in the inventory: it wins


def test_an_alias_without_user_logs_in_as_root_not_as_the_local_login(ssh_home, sshd, monkeypatch):
    for variable in ("LOGNAME", "USER", "LNAME", "USERNAME"):  # getpass.getuser(), fabric's fallback
        monkeypatch.setenv(variable, "alice")
    with ssh_home.config_path.open("a") as config:
        config.write(f"Host no-user\n    HostName {sshd.host}\n    Port {sshd.port}\n")
    assert SshTarget("pve1", "no-user").user == "root"


def test_a_key_held_only_by_ssh_agent_logs_in(ssh_home, sshd, tmp_path, monkeypatch):
    import shutil
    import subprocess

    agent_key = tmp_path / "agent_key"
    shutil.move(ssh_home.identity, agent_key)  # no key file left for paramiko to find on its own
    ssh_home.config_path.write_text(f"Host testhost\n    HostName {sshd.host}\n    Port {sshd.port}\n    User root\n")
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(socket_path))
        subprocess.run(["ssh-add", "-q", str(agent_key)], check=True, timeout=10, capture_output=True)
        ssh = SshTarget("pve1", "testhost")
        assert ssh.run(["echo", "via agent"]).stdout == "via agent\n"
        ssh.close()
    finally:
        agent.terminate()
        agent.wait(timeout=5)


def test_identity_file_from_ssh_config_is_used_when_no_default_key_exists(ssh_home, sshd):
    import shutil

    lab_key = ssh_home.ssh_dir / "lab_key"
    shutil.move(ssh_home.identity, lab_key)  # ~/.ssh/id_ed25519 is gone: only IdentityFile can find the key
    ssh_home.config_path.write_text(
        f"Host testhost\n    HostName {sshd.host}\n    Port {sshd.port}\n    User root\n    IdentityFile {lab_key}\n"
    )
    ssh = SshTarget("pve1", "testhost")
    assert ssh.run(["echo", "ok"]).stdout == "ok\n"
    ssh.close()

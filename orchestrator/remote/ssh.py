"""SshTarget: commands on a host over ONE kept-open SSH connection (paramiko, with fabric reading ~/.ssh/config).

The connection opens lazily on first use and is shared by every command, transfer and stream (a channel
each), from any number of threads. ~/.ssh/config is honoured (aliases, HostName, User, Port, IdentityFile,
ProxyJump) as OpenSSH reads it, Include and Match too: through `ssh -G HOST` where the OpenSSH client is
installed, else through paramiko's parser (Match; dfo inlines Include for it). ssh-agent and the default key files apply. Host keys are checked against known_hosts: an
unknown key is refused unless the caller opted in (then it is recorded, like OpenSSH's accept-new); a
changed key is always refused.

This is the only module that imports paramiko or fabric, and `_mapped_errors` is the one place where their
exceptions (and socket errors) become errors.py classes. It must never add a host key silently.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import select
import shlex
import shutil
import socket
import subprocess
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Iterator

import paramiko
from fabric import Config, Connection

from ..errors import (AuthError, CommandFailed, CommandTimeout, ConnectError, DfoError, HostKeyChanged, HostKeyUnknown,
                      TransferError, UsageError)
from ..words import counted
from .base import DEFAULT_TIMEOUT, Command, Result, Stream, Target, env_argv, render

DEFAULT_USER = "root"
"""The SSH user when neither the caller nor ~/.ssh/config names one."""
MAX_PARALLEL_COMMANDS = 8
"""Concurrent short-lived channels per connection; OpenSSH's default MaxSessions is 10 (streams use the rest)."""
POLL_S = 0.2
CLOSE_WAIT_S = 1.0
STDERR_TAIL_BYTES = 8192
OPENSSH_CARRIED = frozenset({"hostname", "user", "port", "identityfile", "proxyjump", "proxycommand", "userknownhostsfile"})
"""What dfo takes from `ssh -G` (the settings paramiko acts on); every other keyword is OpenSSH's business."""
SSH_G_TIMEOUT_S = 10.0
MAX_JUMP_HOPS = 8
SILENT_PEER_TEXTS = ("Error reading SSH protocol banner", "No existing session")
"""paramiko's words for a peer that accepted TCP but never spoke SSH within the timeout."""

# paramiko logs its transport thread's failures (with tracebacks) at ERROR; with no handler configured,
# Python's last-resort handler would print them on the user's terminal. dfo reports them as ConnectError.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SshTarget(Target):
    """A host reached over SSH. `name` is what messages call it; `host` an address or ~/.ssh/config alias.
    `user`/`port` given here win over ~/.ssh/config; left None, its User/Port apply (else root and 22).
    `offer_accept_new`: the calling command has --accept-new-host-key, so an unknown key's hint names it."""

    def __init__(
        self,
        name: str,
        host: str,
        *,
        port: int | None = None,
        user: str | None = None,
        connect_timeout: float = 10.0,
        accept_new_host_key: bool = False,
        offer_accept_new: bool = False,
        known_hosts: str | Path | None = None,
        ssh_config: str | Path | None = None,
    ) -> None:
        self.name = name
        self.connect_timeout = connect_timeout
        self.accept_new_host_key = accept_new_host_key
        self.offer_accept_new = offer_accept_new  # the command has --accept-new-host-key: its hint may name it
        self._connection = _resolve(host, port=port, user=user, ssh_config=ssh_config)
        self.host, self.port, self.user = self._connection.host, int(self._connection.port), self._connection.user
        self.known_hosts = Path(known_hosts) if known_hosts else _known_hosts_path(self._connection)
        self._open_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_PARALLEL_COMMANDS)
        self._causes_lock = threading.Lock()
        self._causes: weakref.WeakKeyDictionary[paramiko.Transport, BaseException] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"<SshTarget {self.name} {self.user}@{self.host}:{self.port}>"

    # -- connection ---------------------------------------------------------------------------------------

    def _transport(self) -> paramiko.Transport:
        """The kept-open transport, opened on first use (and again if the host dropped it)."""
        with self._open_lock:
            if not self._connection.is_connected:
                self._open()
            return self._connection.transport

    def _open(self) -> None:
        self._guard(self._connection)
        with self._mapped_errors("connect"):
            self._connection.open()
        self._connection.transport.set_keepalive(30)

    def _guard(self, connection: Connection) -> None:
        """Give `connection` and every ProxyJump hop before it a fresh client that checks host keys against
        known_hosts with our policy (fabric's own would auto-add) and our connect timeouts."""
        client = paramiko.SSHClient()
        if self.known_hosts.exists():
            client.get_host_keys().load(str(self.known_hosts))  # loaded, never saved back by paramiko
        client.set_missing_host_key_policy(_RecordOrRefuse(self))
        connection.client = client
        connection.connect_timeout = None  # fabric rounds it to whole seconds; it goes in connect_kwargs
        connection.connect_kwargs.update(
            timeout=self.connect_timeout, banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
            transport_factory=_Transport,
        )
        if isinstance(connection.gateway, Connection):
            self._guard(connection.gateway)

    def close(self) -> None:
        # A connect still in progress on another thread (Ctrl-C during preflight) holds the lock until its
        # timeout; dfo is leaving then, so do not wait for it: that thread is a daemon and dies with dfo.
        if not self._open_lock.acquire(timeout=CLOSE_WAIT_S):
            return
        try:
            self._connection.close()
            if self._connection.gateway is not None and not isinstance(self._connection.gateway, str):
                self._connection.gateway.close()
        finally:
            self._open_lock.release()

    # -- commands -----------------------------------------------------------------------------------------

    def run(
        self,
        cmd: Command,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        input: bytes | None = None,
        check: bool = False,
        env: dict[str, str] | None = None,
    ) -> Result:
        command = _with_env(render(cmd), env)
        started = time.monotonic()
        deadline = started + timeout
        with self._slots, self._channel(command, _session_script(command, feeds_input=bool(input)), timeout) as channel:
            with self._mapped_errors(command, timeout=timeout):
                stdout, stderr = _exchange(channel, input, deadline)
            exit_code = channel.recv_exit_status() if stdout is not None else None
        pgid, stderr = _split_pgid(stderr)
        if stdout is None:
            self._kill_group(pgid)
            raise CommandTimeout(f"{command[:120]} ran past its {timeout:g}s timeout", where=self.name)
        result = Result(command, exit_code, stdout.decode(errors="replace"), stderr.decode(errors="replace"),
                        time.monotonic() - started)
        if check and result.failed:
            raise CommandFailed(result, where=self.name)
        return result

    def _kill_group(self, pgid: int | None) -> None:
        """SIGKILL a timed-out command's process group. sshd will not signal a root session for us (the
        RFC 4254 "signal" request needs privilege separation, which root logins skip), so a fresh channel
        does it. Detached runs started with setsid are in their own groups and are left alone."""
        if pgid is None:
            return
        with contextlib.suppress(DfoError):
            self.run(["kill", "-KILL", "--", f"-{pgid}"], timeout=self.connect_timeout)

    @contextlib.contextmanager
    def _channel(self, command: str, script: str, timeout: float) -> Iterator[paramiko.Channel]:
        """A session channel running `script` (which runs `command`), closed on the way out."""
        transport = self._transport()
        with self._mapped_errors(command, timeout=timeout, transport=transport):
            channel = transport.open_session(timeout=min(timeout, self.connect_timeout))
            channel.exec_command(script)
        try:
            yield channel
        finally:
            channel.close()

    def put(self, local: Path, remote: str, *, mode: int = 0o644, timeout: float = 120.0) -> None:
        local = Path(local)
        if not local.is_file():
            raise TransferError(f"{local} is not a readable file", where=self.name)
        size = local.stat().st_size
        transport = self._transport()
        with self._slots, self._mapped_errors(f"put {remote}", timeout=timeout, transport=transport,
                                              doing=f"copying {local} to {remote}"):
            sftp = paramiko.SFTPClient.from_transport(transport)
            try:
                sftp.get_channel().settimeout(timeout)
                try:
                    sftp.put(str(local), remote, confirm=False)
                    sftp.chmod(remote, mode)
                    remote_size = sftp.stat(remote).st_size
                except OSError as exc:
                    raise TransferError(f"copy {local} -> {remote} failed: {exc.strerror or exc}", where=self.name) from None
            finally:
                sftp.close()
        if remote_size != size:
            raise TransferError(f"{remote} has {counted(remote_size, 'byte')} after the copy, {local} has {size}", where=self.name)

    def stream(self, cmd: Command) -> "SshStream":
        command = render(cmd)
        transport = self._transport()
        with self._mapped_errors(command, transport=transport):
            channel = transport.open_session(timeout=self.connect_timeout)
            channel.exec_command(_stream_script(command))
        return SshStream(channel, self, command)

    # -- the one place library errors are mapped ---------------------------------------------------------

    @contextlib.contextmanager
    def _mapped_errors(self, action: str, *, timeout: float | None = None, transport: paramiko.Transport | None = None,
                       doing: str | None = None) -> Iterator[None]:
        """Turn paramiko's and the socket layer's exceptions into dfo's error tree. `action` is "connect" or the
        command; `doing` what a lost connection interrupted (default: running the command); `transport` the
        connection the action used (default: the current one)."""
        address = f"{self.host}:{self.port}"
        try:
            yield
        except DfoError:
            raise
        except paramiko.BadHostKeyException as exc:
            # paramiko names the host without its port; known_hosts (and ssh-keygen -R) use [host]:port off 22
            hostname = _known_hosts_name(self.host, self.port) if exc.hostname == self.host else exc.hostname
            raise _changed_key(self, hostname, exc.key) from None
        except paramiko.AuthenticationException as exc:
            raise AuthError(f"{self.user}@{address} rejected our keys ({exc})",
                            where=self.name, hint="add your public key to the host's authorized_keys or set IdentityFile in ~/.ssh/config") from None
        except socket.gaierror:
            raise ConnectError(f"cannot resolve host name {self.host!r}", where=self.name,
                               hint="check the address in the inventory or HostName in ~/.ssh/config") from None
        except (socket.timeout, TimeoutError):
            if action == "connect":
                raise self._no_answer() from None
            raise CommandTimeout(f"{action[:120]} ran past its {timeout:g}s timeout", where=self.name) from None
        except (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError):
            raise ConnectError(f"connection to {address} refused", where=self.name,
                               hint="check that sshd runs there and the port is right") from None
        except paramiko.SSHException as exc:
            if action == "connect" and any(text in str(exc) for text in SILENT_PEER_TEXTS):
                raise self._no_answer() from None
            raise self._lost(action, exc, transport, doing) from None
        except (EOFError, OSError) as exc:
            raise self._lost(action, exc, transport, doing) from None

    def _no_answer(self) -> ConnectError:
        return ConnectError(f"no SSH answer from {self.host}:{self.port} within {self.connect_timeout:g}s", where=self.name,
                            hint="check that the host is up and the address/port are right")

    def _lost(self, action: str, exc: BaseException, transport: paramiko.Transport | None, doing: str | None) -> ConnectError:
        hint = "check that the host is up; dfo reconnects on the next command"
        if action == "connect":
            return ConnectError(f"connect to {self.host}:{self.port} failed: {_describe(exc)}", where=self.name, hint=hint)
        transport = transport or self._connection.transport
        why = self._why_lost(transport, exc)
        if why is None and isinstance(exc, _ConnectionDropped) and transport is not None and transport.is_active():
            why = "the host closed its channel before the output ended (no EOF)"
        return ConnectError(f"lost the connection to {self.host}:{self.port} while {doing or 'running ' + action[:120]}: "
                            f"{why or _describe(exc)}", where=self.name, hint=hint)

    def _why_lost(self, transport: paramiko.Transport | None, exc: BaseException) -> str | None:
        """What ended `transport`, in words, for every command it cut off: the reason the host gave when it
        disconnected, else the exception paramiko's reading thread died of (which paramiko hands to one caller
        only: get_exception clears it, a racing open_session raises it itself). None while it lives."""
        if transport is None:
            return None
        if isinstance(exc, _ConnectionDropped):
            transport.join(timeout=CLOSE_WAIT_S)  # its thread closes the channels first, then ends
        if transport.is_active():
            return None
        reason = getattr(transport, "disconnect_reason", None)
        if reason:
            return f"the host disconnected: {reason}"
        cause = self._cause_of_loss(transport, exc)
        return _describe(cause) if cause is not None else None

    def _cause_of_loss(self, transport: paramiko.Transport, exc: BaseException) -> BaseException | None:
        with self._causes_lock:
            cause = self._causes.get(transport)
            if cause is None:
                cause = transport.get_exception()
                if cause is None and not isinstance(exc, (_ConnectionDropped, paramiko.SSHException)):
                    cause = exc  # raised by paramiko with the transport's own exception (open_session took it)
                if cause is not None:
                    self._causes[transport] = cause
            return cause


ENDED_MARK = b"\x1edfo-ended\n"
"""What a stream's session writes on stderr once its command has ended (`_stream_script`); not in stderr_tail."""
STREAM_EXIT_WAIT_S = 2.0
"""How long closing a stream waits for the command's exit status after our EOF."""


class SshStream(Stream):
    """A long-lived command on an exec channel: non-blocking reads of stdout (stderr drained into a tail)."""

    def __init__(self, channel: paramiko.Channel, target: SshTarget, command: str) -> None:
        self._channel = channel
        self._target = target
        self._command = command
        self._stderr = deque(maxlen=STDERR_TAIL_BYTES)
        self._stderr_end = b""  # the last bytes drained, so an ENDED_MARK split between two chunks is found
        self._over = False  # read gave b"" for the command's end: it keeps doing so
        self._input_lock = threading.Lock()  # no data after our EOF (sshd drops a connection that sends it)

    def read(self, n: int = 65536, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._target._mapped_errors(self._command, timeout=timeout, transport=self._channel.get_transport()):
            while not self._over:
                self._drain_stderr()  # sends our EOF once the command ended (ENDED_MARK)
                if self._channel.recv_ready() or self._channel.eof_received or self._channel.closed:
                    return self._channel.recv(n)  # b"" once the command ended or the connection dropped
                if self._channel.exit_status_ready():  # it ended; what it left running holds its output open
                    self._over = True
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CommandTimeout(f"no output within {timeout:g}s", where=self._target.name)
                select.select([self._channel], [], [], POLL_S if remaining is None else min(remaining, POLL_S))
        return b""

    def _drain_stderr(self) -> None:
        """Drain stderr into the tail; at ENDED_MARK (the command ended, its session waits for our EOF) send our
        EOF, so that the session ends and its exit status comes even while a process the command left in the
        background holds the output open (which keeps the channel's own EOF from ever coming)."""
        while self._channel.recv_stderr_ready():
            chunk = self._channel.recv_stderr(65536)
            if ENDED_MARK in self._stderr_end + chunk:
                self._end_input()
            self._stderr_end = (self._stderr_end + chunk)[-len(ENDED_MARK):]
            self._stderr.extend(chunk)

    def stderr_tail(self) -> str:
        """The last few KB the command wrote to stderr (for error messages)."""
        self._drain_stderr()
        return bytes(self._stderr).replace(ENDED_MARK, b"").decode(errors="replace")

    def write(self, data: bytes) -> None:
        """Send `data` to the command's stdin; once our EOF went out (the command ended, or the stream is closing)
        it goes nowhere, as it would have gone to the session's drain of stdin."""
        with self._input_lock, self._target._mapped_errors(self._command, transport=self._channel.get_transport(),
                                                           doing=f"writing to {self._command[:120]}"):
            if not self._channel.eof_sent:  # paramiko's sendall would spin on a channel whose EOF was sent
                self._channel.sendall(data)

    def close(self) -> None:
        """Close stdin, give the command 2 s to exit, close the channel. Safe at any moment, the command ending
        meanwhile or not: its session ends only once our EOF has arrived (`_stream_script`)."""
        if self._channel.closed:
            return
        self._end_input()
        deadline = time.monotonic() + STREAM_EXIT_WAIT_S
        while not self._channel.exit_status_ready() and not self._channel.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        self._channel.close()

    def exit_code(self) -> int | None:
        """The command's exit status once it has arrived, else None; it never waits (the watch loop asks). Once
        the command's output has ended (read gave b""), our EOF goes out, so that its session can end
        (`_stream_script`): the status follows a round trip later (`wait_exit` waits for it)."""
        self._drain_stderr()
        if self._channel.eof_received and not self._channel.closed:
            self._end_input()
        return self._channel.recv_exit_status() if self._channel.exit_status_ready() else None

    def _end_input(self) -> None:
        """Send our EOF (once)."""
        with self._input_lock, contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            if not self._channel.eof_sent:
                self._channel.shutdown_write()


# -- host keys ----------------------------------------------------------------------------------------------


class _RecordOrRefuse(paramiko.MissingHostKeyPolicy):
    """Called by paramiko for a key known_hosts lacks: record it if the user opted in, else refuse."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        target = self.target
        if client.get_host_keys().lookup(hostname):
            raise _changed_key(target, hostname, key)  # known with another key type: treat as changed
        if not target.accept_new_host_key:
            raise HostKeyUnknown(
                f"host key of {hostname} ({key.get_name()} {key.fingerprint}) is not in {target.known_hosts}",
                where=target.name,
                hint=f"check the fingerprint, then run `dfo hostkey trust {target.name}`"
                     + (" or pass --accept-new-host-key" if target.offer_accept_new else ""),
            )
        record_host_key(target.known_hosts, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _changed_key(target: SshTarget, hostname: str, key: paramiko.PKey) -> HostKeyChanged:
    return HostKeyChanged(
        f"HOST KEY CHANGED for {hostname}: it now offers {key.get_name()} {key.fingerprint}, which differs from "
        f"{target.known_hosts}; refusing to connect (this can be a man-in-the-middle attack)",
        where=target.name,
        hint=f"if the host was reinstalled, run `ssh-keygen -R '{hostname}' -f {target.known_hosts}` and trust it again",
    )


def record_host_key(known_hosts: Path, hostname: str, key: paramiko.PKey) -> None:
    """Append a plain OpenSSH known_hosts line for `hostname` (`[host]:port` form off port 22)."""
    known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(known_hosts, "a") as handle:
        handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def trust_host_key(
    host: str,
    *,
    port: int | None = None,
    known_hosts: str | Path | None = None,
    ssh_config: str | Path | None = None,
    timeout: float = 10.0,
    name: str | None = None,
) -> str:
    """Fetch `host`'s key and record it in known_hosts (for `dfo hostkey trust`); return its fingerprint.
    `host` may be an ~/.ssh/config alias (HostName and Port apply); the key is fetched directly, not through
    a ProxyJump hop.

    A host already trusted with the same key is left alone; one recorded with a different key raises
    HostKeyChanged (the old entry must be removed deliberately). `name` is what messages call the host."""
    target = SshTarget(name or host, host, port=port, connect_timeout=timeout, known_hosts=known_hosts, ssh_config=ssh_config)
    hostname = _known_hosts_name(target.host, target.port)
    with target._mapped_errors("connect"):
        with socket.create_connection((target.host, target.port), timeout=timeout) as sock:
            transport = paramiko.Transport(sock)
            try:
                transport.banner_timeout = timeout
                transport.start_client(timeout=timeout)
                key = transport.get_remote_server_key()
            finally:
                transport.close()
    known = paramiko.HostKeys(str(target.known_hosts)) if target.known_hosts.exists() else paramiko.HostKeys()
    recorded = known.lookup(hostname)
    if recorded:
        if recorded.get(key.get_name()) == key:
            return key.fingerprint
        raise _changed_key(target, hostname, key)
    record_host_key(target.known_hosts, hostname, key)
    return key.fingerprint


# -- helpers ------------------------------------------------------------------------------------------------


def _known_hosts_name(host: str, port: int) -> str:
    """How known_hosts names a host: `host` on port 22, else `[host]:port`."""
    return host if port == 22 else f"[{host}]:{port}"


def _resolve(host: str, *, port: int | None, user: str | None, ssh_config: str | Path | None) -> Connection:
    """A not-yet-open fabric Connection with ~/.ssh/config (or `ssh_config`) applied to `host`: as the OpenSSH
    client reads it (`ssh -G`, which follows Include and Match) where that client is installed, else as
    paramiko reads it (Match), with Include lines inlined first."""
    path = str(ssh_config) if ssh_config is not None else os.path.expanduser("~/.ssh/config")
    openssh = _openssh_config(host, path)
    if openssh is not None:
        config = Config(ssh_config=openssh)
    elif ssh_config is not None or os.path.exists(path):
        config = Config(ssh_config=paramiko.SSHConfig.from_text(_config_text(Path(path))))
    else:
        config = Config(user_ssh_path=path)
    connection = Connection(host, user=user, port=port, config=config)
    if user is None and "user" not in connection.ssh_config:  # not the local login name: Proxmox hosts log in as root
        connection = Connection(host, user=DEFAULT_USER, port=port, config=config)
    return connection


def openssh_client() -> str | None:
    """The OpenSSH client's path, or None where it is not installed (then paramiko reads ssh config)."""
    return shutil.which("ssh")


def _openssh_config(host: str, path: str) -> paramiko.SSHConfig | None:
    """`host`'s settings as `ssh -G` resolves them from the config file at `path` (Include and Match followed),
    as a paramiko SSHConfig holding only what the file set (HostName, User, Port, IdentityFile, ProxyJump,
    ProxyCommand, UserKnownHostsFile), with a block for each ProxyJump hop too. None without an OpenSSH client.
    A config that ssh itself refuses raises UsageError with ssh's own words."""
    client = openssh_client()
    if client is None:
        return None
    blocks, pending = [], [host]
    while pending and len(blocks) < MAX_JUMP_HOPS:
        name = pending.pop(0)
        settings = _ssh_g(client, name, path)
        defaults = _ssh_g(client, name, os.devnull)
        chosen = {key: values for key, values in settings.items() if key in OPENSSH_CARRIED and values != defaults.get(key)}
        blocks.append(f"Host {name}\n" + "".join(f"  {key} {value}\n" for key, values in chosen.items() for value in values))
        for hop in chosen.get("proxyjump", [""])[0].split(","):
            hop_host = hop.rpartition("@")[2].rsplit(":", 1)[0] if hop and hop != "none" else ""
            if hop_host and hop_host not in pending and all(not b.startswith(f"Host {hop_host}\n") for b in blocks):
                pending.append(hop_host)
    return paramiko.SSHConfig.from_text("".join(blocks))


def _ssh_g(client: str, host: str, path: str) -> dict[str, list[str]]:
    """`ssh -G host` as {keyword: [values]} (IdentityFile and a few others may repeat), reading `path` as the
    user's config: ssh's own ~/.ssh/config (with /etc/ssh/ssh_config) when `path` is that file, else `-F path`."""
    config_file = path if os.path.exists(path) else os.devnull
    own = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh", "config")
    choice = [] if config_file == own else ["-F", config_file]
    try:
        done = subprocess.run([client, "-G", *choice, "--", host], capture_output=True, text=True,
                              timeout=SSH_G_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"cannot read ssh config {config_file} with `ssh -G`: {exc}") from None
    if done.returncode != 0:
        why = next((line for line in done.stderr.splitlines() if line.strip()), f"exit {done.returncode}")
        raise UsageError(f"ssh config: {why}", hint="fix that line; `ssh -G HOST` shows what OpenSSH reads")
    settings: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        settings.setdefault(key.lower(), []).append(value)
    return settings


def _config_text(path: Path, depth: int = 0) -> str:
    """An ssh config file's text with its Include lines replaced by the files they name (globs, relative
    to ~/.ssh, nested up to 16 deep), for paramiko, whose parser skips Include. Missing files read as empty."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    out = []
    for line in lines:
        keyword, _, rest = line.strip().replace("=", " ", 1).partition(" ")
        if keyword.lower() != "include" or depth >= 16:
            out.append(line)
            continue
        for pattern in shlex.split(rest):
            pattern = os.path.join(os.path.expanduser("~/.ssh"), os.path.expanduser(pattern))
            out.extend(_config_text(Path(found), depth + 1) for found in sorted(glob.glob(pattern)))
    return "\n".join(out)


def _known_hosts_path(connection: Connection) -> Path:
    """UserKnownHostsFile from ssh config if set, else ~/.ssh/known_hosts."""
    configured = connection.ssh_config.get("userknownhostsfile")
    if configured:
        return Path(os.path.expanduser(configured.split()[0]))
    return Path(os.path.expanduser("~/.ssh/known_hosts"))


def _with_env(command: str, env: dict[str, str] | None) -> str:
    return f"{shlex.join(env_argv(env))} {command}" if env else command


def _exchange(channel: paramiko.Channel, data: bytes | None, deadline: float) -> tuple[bytes | None, bytes]:
    """Feed `data` to stdin, then EOF (nothing is sent without data: the command reads /dev/null, see
    `_session_script`) while reading stdout and stderr until the command exits; (None, stderr so far) if the
    deadline passes first. Interleaved, so a command that echoes a large
    input back cannot block on a full window while we still send. A command killed by a signal has no exit
    status (sshd sends exit-signal, which paramiko ignores): its exit code reads -1. A channel closed without
    EOF was cut off (paramiko closes every channel of a dying connection before it marks the connection
    inactive, so `is_active()` cannot tell yet): _ConnectionDropped."""
    pending = memoryview(data or b"")
    stdout, stderr = bytearray(), bytearray()
    while True:
        if pending and channel.send_ready():
            pending = pending[channel.send(pending[:32768]):]
            if not pending:
                channel.shutdown_write()
        while channel.recv_ready():
            stdout += channel.recv(65536)
        while channel.recv_stderr_ready():
            stderr += channel.recv_stderr(65536)
        if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
            if channel.closed and not channel.eof_received:  # sshd sends EOF before it closes a channel
                raise _ConnectionDropped()
            if channel.eof_received:
                return bytes(stdout), bytes(stderr)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, bytes(stderr)
        _wait_for_output(channel, min(remaining, 0.005 if pending else POLL_S))


class _Transport(paramiko.Transport):
    """paramiko's Transport, keeping the reason a host gives when it disconnects (paramiko only logs it)."""

    disconnect_reason: str | None = None

    def _parse_disconnect(self, m: paramiko.Message) -> None:
        code, text = m.get_int(), m.get_text()
        self.disconnect_reason = f"{text.strip()} (code {code})"
        m.rewind()
        super()._parse_disconnect(m)


class _ConnectionDropped(EOFError):
    """The connection ended under a running command (`_lost` looks for what ended it)."""

    def __str__(self) -> str:
        return "the connection dropped while the command ran"


def _describe(exc: BaseException) -> str:
    """An exception as a message part: its text, with its class where that says more (EOFError has no text)."""
    if isinstance(exc, EOFError) and not isinstance(exc, _ConnectionDropped):
        return "the host closed the connection (EOF)"
    text = str(exc)
    if not text:
        return type(exc).__name__
    return text if isinstance(exc, (paramiko.SSHException, _ConnectionDropped)) else f"{type(exc).__name__}: {text}"


def _wait_for_output(channel: paramiko.Channel, timeout: float) -> None:
    if channel.eof_received:  # output done, exit status still in flight: select would spin
        channel.status_event.wait(timeout)
    else:
        select.select([channel], [], [], timeout)


PGID_MARK = b"\x1edfo-pgid:"
"""Prefix of the first stderr line of every `run`: the command's process group, stripped before callers see it."""


def _session_script(command: str, *, feeds_input: bool) -> str:
    """What a `run` session executes: a report of its process group (sshd makes the session's shell a group
    leader), then `command`, arranged so that dfo sends nothing on the channel once the command may have ended.

    paramiko builds a channel's EOF (or data) under the channel's lock and sends it after releasing it; if the
    host's CLOSE for an ended command is answered in between (by paramiko's own thread), our EOF follows our
    CLOSE and sshd drops the whole connection, every command on it too ("ieof packet referred to nonexistent
    channel", paramiko issue 1115). So without input the command reads /dev/null and no EOF is ever sent
    (closing the channel sends EOF and CLOSE in order); with input, the session drains stdin after the command
    and so ends only once our EOF has arrived (a command killed by a signal then exits 128+N, not -1)."""
    report = "printf '\\036dfo-pgid:%s\\n' $$ >&2; "
    if not feeds_input:
        return f"{report}exec {command} </dev/null"
    return f"{report}{command}; s=$?; cat >/dev/null; exit $s"


def _stream_script(command: str) -> str:
    """What a `stream` session executes: `command` in a shell of its own (its `$$` and its `exit` stay its own),
    then ENDED_MARK on stderr, then the session closes its output (the reader sees the command's end as before:
    read gives b"") and drains stdin, so it ends only once our EOF has arrived. Whatever dfo writes, or closes,
    while the command ends is then never sent after the host's CLOSE (the race `_session_script` describes; a
    write or a close racing a command that ended at that moment cost the whole connection: "idata/ieof packet
    referred to nonexistent channel"). A process the command left in the background that holds its output open
    keeps the channel's EOF from coming: the mark still says the command ended, and our EOF answers it, so the
    session ends and its exit status ends the stream (SshStream.read). A command killed by a signal exits 128+N,
    not -1."""
    return f"sh -c {shlex.quote(command)}; s=$?; printf '\\036dfo-ended\\n' >&2; exec >&- 2>&-; cat >/dev/null; exit $s"


def _split_pgid(stderr: bytes) -> tuple[int | None, bytes]:
    """The process group reported by `_session_script` and the command's own stderr."""
    if not stderr.startswith(PGID_MARK) or b"\n" not in stderr:
        return None, stderr
    line, _, rest = stderr.partition(b"\n")
    pgid = line[len(PGID_MARK):]
    return (int(pgid) if pgid.isdigit() else None), rest

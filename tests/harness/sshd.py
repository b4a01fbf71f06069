"""A real OpenSSH server for tests: `/usr/sbin/sshd -D` on a free loopback port (or inside a network
namespace) with its own temporary host key, client key and authorized_keys, stopped by PID.

It must not touch the system's sshd, its config or its keys, and must never listen outside 127.0.0.0/8 or
a namespace the test created.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import STANDIN_BIN

SSHD = "/usr/sbin/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT_S = 10.0
MASK_RC_SCRIPT = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
"""Run by `unshare --mount`: lay an empty file over root's ~/.bashrc for this sshd (and its sessions) only."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def generate_key(path: Path, comment: str = "dfo-test") -> Path:
    """Write a fresh passphrase-less ed25519 key pair at `path` and `path`.pub; return `path`."""
    for existing in (path, path.with_name(path.name + ".pub")):
        existing.unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        timeout=10,
    )
    return path


def public_key(private_key: Path) -> str:
    """The `ssh-ed25519 AAAA... comment` line of a key pair."""
    return private_key.with_name(private_key.name + ".pub").read_text().strip()


def known_hosts_line(host: str, port: int, host_key_pub: str) -> str:
    """A plain known_hosts entry, in OpenSSH's `[host]:port` form for non-default ports."""
    key_type, key_b64 = host_key_pub.split()[:2]
    where = host if port == 22 else f"[{host}]:{port}"
    return f"{where} {key_type} {key_b64}\n"


@dataclass
class SshServer:
    """One sshd process. `env` reaches every session through sshd_config SetEnv (PATH gets the stand-ins)."""

    workdir: Path
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    netns: str | None = None
    max_sessions: int = 100  # channels per connection; OpenSSH's own default (a stock Proxmox node) is 10
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = 22 if self.netns else free_port(self.host)
        self.host_key = generate_key(self.workdir / "ssh_host_ed25519_key", "dfo-test-host")
        self.client_key = generate_key(self.workdir / "client_ed25519", "dfo-test-client")
        self.authorized_keys = self.workdir / "authorized_keys"
        self.authorized_keys.write_text(public_key(self.client_key) + "\n")
        self.config_path = self.workdir / "sshd_config"
        self.log_path = self.workdir / "sshd.log"
        self.pid_path = self.workdir / "sshd.pid"

    @property
    def host_key_pub(self) -> str:
        return public_key(self.host_key)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def known_hosts_line(self) -> str:
        return known_hosts_line(self.host, self.port, self.host_key_pub)

    def accepted_connections(self) -> int:
        """How many sessions sshd accepted so far (LogLevel VERBOSE logs one line per authenticated connection)."""
        if not self.log_path.exists():
            return 0
        return self.log_path.read_text(errors="replace").count("Accepted publickey")

    def commands_started(self) -> int:
        """How many remote commands (exec requests; not sftp) sshd started so far, as its VERBOSE log says."""
        if not self.log_path.exists():
            return 0
        return self.log_path.read_text(errors="replace").count("Starting session: command ")

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of sshd's log (what the server saw; added to a failed test's report)."""
        if not self.log_path.exists():
            return "(no sshd log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _config_text(self) -> str:
        session_env = {"PATH": f"{STANDIN_BIN}:{SYSTEM_PATH}", **self.env}
        set_env = " ".join(f'"{key}={value}"' for key, value in session_env.items())
        return "\n".join(
            [
                f"ListenAddress {self.host}:{self.port}",
                f"HostKey {self.host_key}",
                f"AuthorizedKeysFile {self.authorized_keys}",
                f"PidFile {self.pid_path}",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "LogLevel VERBOSE",
                "Subsystem sftp internal-sftp",
                "MaxStartups 100:30:200",
                f"MaxSessions {self.max_sessions}",
                f"SetEnv {set_env}",
                "",
            ]
        )

    def start(self) -> "SshServer":
        """Start sshd and return once it listens. Raises RuntimeError with sshd's log if it does not."""
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege-separation dir sshd insists on
        self.config_path.write_text(self._config_text())
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        argv = self._masking_root_bashrc([SSHD, "-D", "-E", str(self.log_path), "-f", str(self.config_path)])
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_listening(offset)
        return self

    def _masking_root_bashrc(self, argv: list[str]) -> list[str]:
        """Sessions should start like a stock Proxmox root login: bash sources ~/.bashrc for ssh commands, and
        a developer's (pyenv init and the like) can cost half a second per command. The file is hidden in a
        private mount namespace of this sshd only; nothing on the machine changes."""
        bashrc = Path(pwd.getpwuid(0).pw_dir) / ".bashrc"
        if os.geteuid() != 0 or not bashrc.is_file():
            return argv
        empty = self.workdir / "empty_bashrc"
        empty.write_text("")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", MASK_RC_SCRIPT, "sh",
                str(empty), str(bashrc), *argv]

    def _wait_listening(self, log_offset: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if "Server listening on" in self._log_since(log_offset):
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"sshd did not start on {self.host}:{self.port}:\n{self._log_since(log_offset)}")

    def _log_since(self, offset: int) -> str:
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal sshd by PID and reap it. Sessions already open keep their own processes. Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)
        self.process = None

    def kill(self) -> None:
        """SIGKILL sshd (a host that vanishes rather than shutting down)."""
        self.stop(signal.SIGKILL)

    def kill_sessions(self) -> None:
        """SIGKILL every session process this server started (its children), leaving the listener up."""
        if self.process is None:
            return
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        for pid in children.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart(self) -> "SshServer":
        """Stop and start again on the same address with the same keys."""
        self.stop()
        return self.start()

    def __enter__(self) -> "SshServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

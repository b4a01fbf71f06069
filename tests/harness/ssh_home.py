"""A throwaway home directory laid out like a user's: ~/.ssh/config with `Host <alias>` entries,
~/.ssh/id_ed25519 and ~/.ssh/known_hosts, so dfo is tested honouring ~/.ssh/config as on a workstation.

It only writes under its own directory; the caller points HOME at it (the `ssh_home` fixture does).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .sshd import SshServer, generate_key, known_hosts_line, public_key


class SshHome:
    """`~/.ssh` of a test user. Aliases are added with `add_host`; known_hosts starts out trusting them."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.ssh_dir = self.home / ".ssh"
        self.ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config_path = self.ssh_dir / "config"
        self.known_hosts = self.ssh_dir / "known_hosts"
        self.identity = self.ssh_dir / "id_ed25519"
        self.servers: dict[str, SshServer] = {}
        self.config_path.write_text("")
        self.known_hosts.write_text("")

    def add_host(self, alias: str, server: SshServer, *, trusted: bool = True) -> str:
        """Add `Host alias` for `server`, use its client key as ~/.ssh/id_ed25519, trust its host key."""
        self.servers[alias] = server
        if not self.identity.exists():
            shutil.copy(server.client_key, self.identity)
            shutil.copy(server.client_key.with_name(server.client_key.name + ".pub"), self.identity.with_suffix(".pub"))
            self.identity.chmod(0o600)
        else:
            authorize(server, self.identity)
        with self.config_path.open("a") as config:
            config.write(
                f"Host {alias}\n    HostName {server.host}\n    Port {server.port}\n"
                f"    User root\n    IdentityFile {self.identity}\n\n"
            )
        if trusted:
            with self.known_hosts.open("a") as known:
                known.write(server.known_hosts_line())
        return alias

    def empty_known_hosts(self) -> None:
        """Forget every host key (the first connection to any host is then 'unknown')."""
        self.known_hosts.write_text("")

    def wrong_known_hosts(self, alias: str) -> None:
        """Record a different key for `alias`'s server (as after a reinstall or an attack)."""
        server = self.servers[alias]
        other = generate_key(self.ssh_dir / "other_host_key", "other-host")
        self.known_hosts.write_text(known_hosts_line(server.host, server.port, public_key(other)))

    def wrong_client_key(self) -> None:
        """Replace ~/.ssh/id_ed25519 with a key no server accepts."""
        generate_key(self.identity, "unauthorized")
        self.identity.chmod(0o600)


def authorize(server: SshServer, private_key: Path) -> None:
    """Let `private_key` log in to `server` too."""
    with server.authorized_keys.open("a") as keys:
        keys.write(public_key(private_key) + "\n")

"""dfo's own error tree. Every layer raises these; only the CLI turns them into a message and an exit code.

    DfoError                      anything dfo reports to the user (one line, names the fix)
    +-- UsageError                bad input from the user (exit 2)
    |   +-- InventoryError        the inventory file is broken (carries one message per problem)
    |   +-- InvalidName           a target/variant/run name with characters outside [A-Za-z0-9._-]
    |   +-- UnknownTarget         --host names no container of the inventory (lists the known ones)
    |   +-- UnknownVariant
    |   +-- UnknownRun
    +-- RemoteError               something went wrong reaching or running on a machine (exit 1)
    |   +-- ConnectError          refused, unreachable, DNS, connect timeout
    |   +-- AuthError             the server rejected every key / password
    |   +-- HostKeyError
    |   |   +-- HostKeyUnknown    not in known_hosts: refused unless the user opts in
    |   |   +-- HostKeyChanged    differs from known_hosts: always refused
    |   +-- ContainerError
    |   |   +-- ContainerMissing      pct: Configuration file ... does not exist
    |   |   +-- ContainerNotRunning   pct: container 'N' not running!
    |   +-- CommandFailed         a command exited non-zero where success was required (exit code + last lines)
    |   +-- CommandTimeout        a command ran past its timeout
    |   +-- TransferError         a file did not arrive intact
    |   +-- gpu.NvidiaSmiError    nvidia-smi missing, failing or hung (`kind` says which)
    +-- RefusedError              dfo declined to act (busy GPUs, existing run name, reused PID) (exit 1)

The SSH library's exceptions are caught in exactly one place (remote/ssh.py) and mapped here.
"""

from __future__ import annotations


class DfoError(Exception):
    """Base of everything dfo reports. `str(err)` is the one-line message shown to the user."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message} ({hint})")


class UsageError(DfoError):
    exit_code = 2


class InventoryError(UsageError):
    """A broken inventory. `problems` holds one line per problem: `FILE: key.path: what is expected, got X`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class InvalidName(UsageError):
    pass


class UnknownTarget(UsageError):
    pass


class UnknownVariant(UsageError):
    pass


class UnknownRun(UsageError):
    pass


class RemoteError(DfoError):
    """Something went wrong reaching or running on `where` (a host or container name); `detail` is the message
    without it, for a caller whose own words name `where` already."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None) -> None:
        self.where, self.detail = where, message
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + message, hint=hint)


class ConnectError(RemoteError):
    pass


class AuthError(RemoteError):
    pass


class HostKeyError(RemoteError):
    pass


class HostKeyUnknown(HostKeyError):
    pass


class HostKeyChanged(HostKeyError):
    pass


class ContainerError(RemoteError):
    pass


class ContainerMissing(ContainerError):
    pass


class ContainerNotRunning(ContainerError):
    pass


class CommandFailed(RemoteError):
    """A command exited non-zero. Carries the Result so callers can look at stdout/stderr."""

    def __init__(self, result, *, where: str | None = None, what: str | None = None) -> None:
        self.result = result
        tail = result.tail(5).strip()
        label = what or result.command
        msg = f"{label} exited {result.exit_code}"
        if tail:
            msg += ": " + " | ".join(line for line in tail.splitlines() if line.strip())
        super().__init__(msg, where=where)


class CommandTimeout(RemoteError):
    pass


class TransferError(RemoteError):
    pass


class RefusedError(DfoError):
    pass

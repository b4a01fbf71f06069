"""The trainer package: a deterministic tar.gz of trainer/ plus the watch agent, and pushing it into a target.

Same files -> same bytes -> same sha256: names sorted, mtime 0, uid/gid 0, no user names, modes normalised
to 0644/0755, gzip header without name or time. The archive holds `trainer/...` and `dfo_agent.py` (the
stdlib-only agent from orchestrator/agent/agent.py) and unpacks into W/.dfo/pkg/<sha256>/, whose
`.complete` file (content: the sha256) is written last. A target that already has it costs one round trip, in
which its files are hashed again (tree_script) against the tree hash dfo computed from its own archive: a package
directory changed since it was unpacked (a file edited, added or missing) is not used; it is unpacked again.

This module must not install anything in the target (a missing torch is reported, never fixed) and must
never leave a half-unpacked package under its final name.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shlex
import tarfile
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from .errors import DfoError, TransferError
from .remote.base import Target
from .store import Store

AGENT_NAME = "dfo_agent.py"
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", "wandb", ".git"}
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
PROBE_TIMEOUT = 30.0
UNPACK_TIMEOUT = 120.0
PUSH_MARGIN_S = PROBE_TIMEOUT + 2 * UNPACK_TIMEOUT
"""A transfer's remote calls end within this (the directories, the copy, the check and unpack, each at its timeout)."""
SHA_MISMATCH_EXIT = 41


@dataclass(frozen=True)
class Package:
    """An archive in memory: its bytes, sha256 and the member names it holds."""

    data: bytes
    sha256: str
    members: tuple[str, ...]
    tree_sha256: str  # the files as unpacked: sha256 of the `sha256sum` lines tree_script prints (tree_hash)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class PushResult:
    """What a push did: the package hash, whether bytes moved and how many, and what python the target has.

    python_found/torch_found are None when no python was checked; `replaced`: the target had the package, but
    its files had changed since it was unpacked, so it was unpacked again."""

    sha256: str
    transferred: bool
    bytes_sent: int
    pkg_dir: str
    replaced: bool = False
    python_found: bool | None = None
    torch_found: bool | None = None


def trainer_dir() -> Path:
    """Where the trainer package's sources are (this checkout's trainer/, or the installed one)."""
    spec = find_spec("trainer")
    if spec is None or not spec.submodule_search_locations:
        raise DfoError("the trainer package is not installed next to dfo", hint="reinstall dfo (pip install -e .)")
    return Path(list(spec.submodule_search_locations)[0])


def agent_file() -> Path:
    return Path(__file__).resolve().parent / "agent" / "agent.py"


def package_files(trainer: Path | None = None, agent: Path | None = None) -> dict[str, Path]:
    """Archive name -> local file, for trainer/ (sources and data files) and the agent."""
    trainer = trainer or trainer_dir()
    agent = agent or agent_file()
    files = {
        f"trainer/{path.relative_to(trainer).as_posix()}": path
        for path in trainer.rglob("*")
        if path.is_file() and _shipped(path.relative_to(trainer))
    }
    if agent.is_file():
        files[AGENT_NAME] = agent
    return files


def _shipped(relative: Path) -> bool:
    if any(part in SKIPPED_DIRS or part.startswith(".") for part in relative.parts):
        return False
    return not relative.name.endswith(SKIPPED_SUFFIXES)


def build_package(files: dict[str, Path] | None = None) -> Package:
    """The deterministic archive of `files` (default: package_files())."""
    files = package_files() if files is None else files
    raw = io.BytesIO()
    contents = {name: files[name].read_bytes() for name in sorted(files)}
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in contents.items():
            _add_normalised(tar, name, files[name], content)
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    data = packed.getvalue()
    return Package(data=data, sha256=hashlib.sha256(data).hexdigest(), members=tuple(contents),
                   tree_sha256=tree_hash(contents))


def tree_hash(contents: dict[str, bytes]) -> str:
    """What tree_script prints for a directory holding exactly these files (name -> bytes): the sha256 of their
    `sha256sum` lines (`HASH  ./NAME`), in byte order of the names."""
    lines = "".join(f"{hashlib.sha256(content).hexdigest()}  ./{name}\n" for name, content in sorted(contents.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def tree_script(directory: str) -> str:
    """Shell printing the tree hash of the files of `directory` (a shell word, quoted by the caller): every
    entry but directories, `.complete` and the bytecode Python writes under `__pycache__` when the trainer runs,
    hashed in byte order of their names (GNU and busybox find, sort, xargs and sha256sum). It changes directory:
    run it in a subshell (`$(...)`)."""
    return (f"cd {directory} 2>/dev/null && find . -name __pycache__ -prune -o ! -type d ! -path ./.complete "
            "-print0 | LC_ALL=C sort -z | xargs -0r sha256sum | sha256sum | cut -d' ' -f1")


def _add_normalised(tar: tarfile.TarFile, name: str, path: Path, content: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(content)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
    tar.addfile(info, io.BytesIO(content))


# ---------------------------------------------------------------------------------------------- push

def pkg_dir(workspace: str, sha256: str) -> str:
    return f"{workspace}/.dfo/pkg/{sha256}"


def probe_script(workspace: str, package: Package, python: str | None = None, *, torch: bool = True) -> str:
    """Shell printing `pkg=present|changed|absent` (is this package complete there, with its files as unpacked?
    `changed`: complete, but a file was edited, added or removed since) and, given a python, `python=ok|missing`
    and, unless `torch` is False (the caller's own python answers it), `torch=ok|missing` (found without
    importing it)."""
    directory = pkg_dir(workspace, package.sha256)
    complete = shlex.quote(f"{directory}/.complete")
    script = (f'if [ "$(cat {complete} 2>/dev/null)" != {package.sha256} ]; then echo pkg=absent; '
              f'elif [ "$({tree_script(shlex.quote(directory))})" = {package.tree_sha256} ]; then echo pkg=present; '
              "else echo pkg=changed; fi\n")
    if python:
        py = shlex.quote(python)
        has_torch = shlex.quote('import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("torch") else 1)')
        script += (
            f"if command -v {py} >/dev/null 2>&1; then echo python=ok;"
            + (f" if {py} -c {has_torch} >/dev/null 2>&1; then echo torch=ok; else echo torch=missing; fi;" if torch else "")
            + " else echo python=missing; fi\n"
        )
    return script


def parse_probe(stdout: str) -> dict[str, str]:
    """`key=value` lines -> dict (later lines win)."""
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def _found(probe: dict[str, str], key: str) -> bool | None:
    return None if key not in probe else probe[key] == "ok"


def push(
    target: Target,
    workspace: str,
    *,
    package: Package | None = None,
    store: Store | None = None,
    target_name: str | None = None,
    python: str | None = None,
    probe: dict[str, str] | None = None,
) -> PushResult:
    """Make sure `target` has `package` unpacked under W/.dfo/pkg/<sha>/; transfer only when it lacks it.

    One round trip when it is there (the probe, which also checks `python` and its torch when given).
    `probe` lets a caller that already ran probe_script in its own round trip skip ours.
    Raises TransferError when the archive arrives corrupted (nothing is left unpacked). Installs nothing.
    """
    package = package or build_package()
    if probe is None:
        probe = parse_probe(target.run(probe_script(workspace, package, python), timeout=PROBE_TIMEOUT, check=True).stdout)
    transferred = probe.get("pkg") != "present"
    if transferred:
        _transfer(target, workspace, package)
    result = PushResult(
        package.sha256,
        transferred=transferred,
        bytes_sent=package.size if transferred else 0,
        pkg_dir=pkg_dir(workspace, package.sha256),
        replaced=probe.get("pkg") == "changed",
        python_found=_found(probe, "python"),
        torch_found=_found(probe, "torch"),
    )
    if store is not None:
        store.record_push(target_name or target.name, package.sha256, result.bytes_sent)
    return result


def _transfer(target: Target, workspace: str, package: Package) -> None:
    incoming = f"{workspace}/.dfo/incoming"
    remote_archive = f"{incoming}/{package.sha256}.{os.getpid()}.tar.gz"
    target.run(["mkdir", "-p", incoming, f"{workspace}/.dfo/pkg"], timeout=PROBE_TIMEOUT, check=True)
    with tempfile.TemporaryDirectory(prefix="dfo-pkg-") as tmp:
        local = Path(tmp) / f"{package.sha256}.tar.gz"
        local.write_bytes(package.data)
        target.put(local, remote_archive, mode=0o644, timeout=UNPACK_TIMEOUT)
    result = target.run(_verify_and_unpack_script(workspace, package, remote_archive), timeout=UNPACK_TIMEOUT)
    if result.exit_code == SHA_MISMATCH_EXIT:
        raise TransferError(
            f"package archive arrived corrupted ({result.stderr.strip()}); nothing was unpacked",
            where=target.name,
            hint="run `dfo push` again",
        )
    if result.failed:
        raise TransferError(f"unpacking the package failed: {result.tail(3)}", where=target.name, hint="check disk space in the workspace")


def _verify_and_unpack_script(workspace: str, package: Package, archive: str) -> str:
    """Check the archive's sha256, unpack into a temp dir, check its tree hash, write .complete, then rename into
    place: over a package directory whose files changed since it was unpacked too (moved aside first, so the
    final name never holds a half-removed tree), not over one that another push completed meanwhile. The
    archive is hashed and unpacked from stdin, in the directory: sha256sum marks a file name holding `\\` with
    one more, and GNU tar unquotes `\\` escapes in -C and -f arguments, so a workspace with one would fail."""
    q = shlex.quote
    sha256 = package.sha256
    final = pkg_dir(workspace, sha256)
    return f"""
a={q(archive)}
got=$(sha256sum < "$a" | cut -d' ' -f1)
if [ "$got" != {sha256} ]; then rm -f "$a"; echo "sha256 $got, expected {sha256}" >&2; exit {SHA_MISMATCH_EXIT}; fi
d=$(mktemp -d {q(workspace + '/.dfo/pkg/.unpack.')}XXXXXX) || exit 1
if ! (cd "$d" && tar -xzf - < "$a"); then rm -rf "$d" "$a"; exit 1; fi
rm -f "$a"
if [ "$({tree_script('"$d"')})" != {package.tree_sha256} ]; then rm -rf "$d"; echo "the unpacked files differ from the archive's" >&2; exit 1; fi
printf %s {sha256} > "$d/.complete"
if [ "$(cat {q(final)}/.complete 2>/dev/null)" = {sha256} ] && [ "$({tree_script(q(final))})" = {package.tree_sha256} ]; then rm -rf "$d"; exit 0; fi
if [ -e {q(final)} ]; then old=$(mktemp -d {q(workspace + '/.dfo/pkg/.changed.')}XXXXXX) && mv {q(final)} "$old/" && rm -rf "$old"; fi
mv "$d" {q(final)} && chmod 755 {q(final)}
"""

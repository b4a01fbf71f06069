"""LocalTarget: the subprocess implementation of the Target contract (timeouts kill the whole group)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator.errors import CommandFailed, CommandTimeout, TransferError
from orchestrator.remote.local import LocalTarget


@pytest.fixture
def local() -> LocalTarget:
    return LocalTarget("box")


def test_argv_is_not_interpreted_by_a_shell(local: LocalTarget) -> None:
    result = local.run(["echo", "a;b", "$HOME"])
    assert (result.exit_code, result.stdout) == (0, "a;b $HOME\n")


def test_script_runs_in_sh_with_exit_code_and_stderr(local: LocalTarget) -> None:
    result = local.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr, result.failed) == (3, "out\n", "err\n", True)


def test_check_raises_command_failed_with_last_lines(local: LocalTarget) -> None:
    with pytest.raises(CommandFailed, match=r"box: .* exited 4: boom"):
        local.run("echo boom >&2; exit 4", check=True)


def test_input_and_env_reach_the_command(local: LocalTarget) -> None:
    result = local.run('cat; echo "$DFO_TEST_VAR"', input=b"piped\n", env={"DFO_TEST_VAR": "set"})
    assert result.stdout == "piped\nset\n"


def test_timeout_kills_the_whole_process_group(local: LocalTarget, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(CommandTimeout, match="box: .*timeout"):
        local.run(f"sleep 60 & echo $! > {pid_file}; wait", timeout=0.5)
    assert time.monotonic() - started < 5
    assert not is_running(int(pid_file.read_text()))  # the script's background child died with it


def is_running(pid: int) -> bool:
    """True if `pid` is a live process (a zombie awaiting its reaper counts as dead)."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    return True


def test_put_copies_with_mode(local: LocalTarget, tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(4096))
    local.put(source, str(tmp_path / "dest.bin"), mode=0o600)
    assert (tmp_path / "dest.bin").read_bytes() == source.read_bytes()
    assert (tmp_path / "dest.bin").stat().st_mode & 0o777 == 0o600


def test_put_into_missing_directory_is_a_transfer_error(local: LocalTarget, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.write_text("x")
    with pytest.raises(TransferError, match="box: copy"):
        local.put(source, str(tmp_path / "absent" / "dest"))


def test_put_bytes_writes_secret_file_with_mode(local: LocalTarget, tmp_path: Path) -> None:
    local.put_bytes(b"TOKEN=x\n", str(tmp_path / "s.env"))
    assert (tmp_path / "s.env").read_bytes() == b"TOKEN=x\n"
    assert (tmp_path / "s.env").stat().st_mode & 0o777 == 0o600


def test_stream_reads_incrementally_and_times_out(local: LocalTarget) -> None:
    with local.stream(["sh", "-c", "while read line; do echo got:$line; done"]) as stream:
        stream.write(b"one\n")
        assert stream.read(timeout=5) == b"got:one\n"
        with pytest.raises(CommandTimeout):
            stream.read(timeout=0.2)
        assert stream.exit_code() is None
    assert stream.exit_code() == 0  # closing stdin ended the loop


def test_stream_returns_empty_bytes_at_eof(local: LocalTarget) -> None:
    stream = local.stream(["echo", "done"])
    chunks = b""
    while chunk := stream.read(timeout=5):
        chunks += chunk
    stream.close()
    assert chunks == b"done\n"


def test_env_names_that_could_pass_for_options_or_shell_words_are_refused(tmp_path: Path) -> None:
    from orchestrator.remote.pct import PctTarget

    recorded = []

    class Recorder(LocalTarget):
        def run(self, cmd, **kwargs):
            recorded.append(cmd)
            return super().run(["true"])

    for bad in ("-S", "A B", "X;reboot"):
        with pytest.raises(ValueError, match="invalid environment variable name"):
            PctTarget(Recorder("pve1"), 200).run(["true"], env={bad: "1"})
    assert recorded == []  # refused before anything ran
    PctTarget(Recorder("pve1"), 200).run(["printenv", "A"], env={"A": "x y"})
    assert recorded == [["pct", "exec", "200", "--", "env", "A=x y", "printenv", "A"]]


def test_a_missing_or_non_executable_program_exits_127_or_126_like_a_shell(local: LocalTarget, tmp_path: Path) -> None:
    missing = local.run(["dfo-no-such-program", "x"])
    assert (missing.exit_code, missing.stderr) == (127, "dfo-no-such-program: No such file or directory\n")
    assert local.run([str(tmp_path)]).exit_code == 126
    with pytest.raises(CommandFailed, match="exited 127"):
        local.run(["dfo-no-such-program"], check=True)


@pytest.mark.parametrize(
    "stderr",
    ["pct: No such file or directory\n", "sh: 1: exec: pct: not found\n", "bash: line 1: exec: pct: not found\n"],
)
def test_a_host_without_pct_is_a_container_error_naming_ctid_null(stderr: str) -> None:
    from orchestrator.errors import ContainerError
    from orchestrator.remote.base import Result
    from orchestrator.remote.pct import PctTarget

    with pytest.raises(ContainerError, match=r"host pve1 has no `pct` command.*set `ctid: null`"):
        PctTarget(LocalTarget("pve1"), 200, name="ct200").raise_for_pct(Result("pct status 200", 127, "", stderr, 0.0))
    PctTarget(LocalTarget("pve1"), 200).raise_for_pct(Result("pct exec 200 -- x", 127, "", "x: not found\n", 0.0))  # the command's own 127

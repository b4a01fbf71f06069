"""Hostile logs and bad input (issue 13): what a run prints cannot drive the terminal, style itself, crash a
watch or replay, or be stored out of range. Each test is one attack an operator would otherwise suffer."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from harness import cli, write_inventory
from orchestrator.agent.agent import Follow
from orchestrator.agent.protocol import FrameDecoder
from orchestrator.cli import app
from orchestrator.commands.common import print_error, print_json
from orchestrator.errors import CommandFailed, UsageError
from orchestrator.logfmt import MalformedLine, StepRecord, parse_logfmt, make_parser
from orchestrator.remote.base import Result
from orchestrator.sanitize import SafeConsole, finite_json, visible
from orchestrator.store import Run, Store
from orchestrator.view import render

from test_watch import lab, run_until  # noqa: F401  (the local lab fixture)

PY = sys.executable
CLIPBOARD = "\x1b]52;c;aGFja2Vk\x07"  # OSC 52: write "hacked" to the operator's clipboard
CLEAR = "\x1b[2J"
HOSTILE_TEXT = f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB [/x] {CLIPBOARD} {CLEAR} [bold red]X[/]"
T0 = "2026-11-29T11:40:00"


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, as RFC 8259 parsers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def assert_no_raw_controls(output: str) -> None:
    assert "\x1b]" not in output and CLEAR not in output and "\x07" not in output, repr(output[:500])


def watch_script(lab, name: str, source: str):
    """Launch `source` as a python trainer named `name` on the lab's local target; its watcher and WatchedRun."""
    script = lab.workspace.parent / f"{name}.py"
    script.write_text(source)
    lab.inventory.variants[name] = lab.inventory.variants["short"].model_copy(update={"command": f"{PY} {script}"})
    lab.launch(name, name)
    watcher = lab.watcher(fallback=False)
    return watcher, watcher.attach(name)


# ------------------------------------------------------------------ the display boundary


def test_visible_escapes_every_control_and_keeps_printable_text():
    assert visible(f"a{CLIPBOARD}b") == "a\\x1b]52;c;aGFja2Vk\\x07b"
    assert visible("\x9b2J \u202egnp.exe") == "\\x9b2J \\u202egnp.exe"  # C1 CSI, right-to-left override
    assert visible("line 1\nline 2", keep_newlines=True) == "line 1\nline 2"
    assert visible("line 1\nline 2") == "line 1\\x0aline 2"
    assert visible("naïve [bold] 温度 ok") == "naïve [bold] 温度 ok"


def test_safe_console_never_writes_a_raw_control_even_from_a_careless_caller():
    out = io.StringIO()
    console = SafeConsole(file=out, force_terminal=True, width=300)
    console.print(f"remote said: {CLIPBOARD}{CLEAR}", markup=False, highlight=False)
    text = out.getvalue()
    assert_no_raw_controls(text)
    assert "\\x1b]52;c;aGFja2Vk" in text and "\\x1b[2J" in text


def test_replay_of_a_hostile_crash_line_shows_it_escaped_and_unstyled(tmp_path):
    log = tmp_path / "run-h.log"
    log.write_text(f"ts={T0}Z event=step step=1 tok_s=100.0\n{HOSTILE_TEXT}\n")
    result = CliRunner().invoke(app, ["replay", str(log)])
    assert result.exit_code == 1, result.output  # a crash, not a MarkupError
    assert "cuda_oom" in result.output
    assert_no_raw_controls(result.output)
    assert "\\x1b]52;c;aGFja2Vk\\x07" in result.output and "[bold red]X[/]" in result.output and "[/x]" in result.output


def test_error_messages_carrying_remote_stderr_are_shown_escaped(capsys):
    failed = CommandFailed(Result("nvidia-smi", 9, "", f"NVIDIA-SMI has failed {CLEAR}[/x]{CLIPBOARD}", 0.1), where="ct200")
    print_error(failed)
    err = capsys.readouterr().err
    assert_no_raw_controls(err)
    assert "dfo: error: ct200: nvidia-smi exited 9: NVIDIA-SMI has failed \\x1b[2J[/x]" in err


def test_the_live_view_shows_hostile_log_lines_escaped(lab):
    watcher, watched = watch_script(lab, "h1", "import time\n"
                                    f"print({HOSTILE_TEXT!r}, flush=True)\n"
                                    "print('[bold red]styled?[/] and [/x]', flush=True)\n"
                                    "time.sleep(600)\n")
    run_until(watcher, lambda w: len(watched.lines) >= 2)
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=250, color_system="truecolor").print(render(watcher))
    shown = out.getvalue()
    assert_no_raw_controls(shown)
    assert "\\x1b]52;c;aGFja2Vk" in shown and "[bold red]styled?[/] and [/x]" in shown


# ------------------------------------------------------------------ the parsing boundary


@pytest.mark.parametrize("line, why", [
    ("ts=1e20 event=step step=5 tok_s=100", "ts="),
    (f"ts={T0}Z event=step step=99999999999999999999999 tok_s=100", "step="),
    (f"ts={T0}Z event=step step=-3 tok_s=100", "step="),
    (f"ts={T0}Z event=step step=5 tok_s=inf", "tok_s="),
    (f"ts={T0}Z event=step step=5 tok_s=nan", "tok_s="),
    (f"ts={T0}Z event=step step=5 tok_s=-1", "tok_s="),
    ("ts=9999-12-31T23:59:59-23:59 event=step step=5 tok_s=1", "ts="),
    ("ts=1e20 event=eval acc=0.5", "ts="),
])
def test_out_of_range_fields_make_a_malformed_line_that_says_why(line, why):
    record = parse_logfmt(line, 1.0)
    assert isinstance(record, MalformedLine) and record.reason.startswith(why) and record.text == line


def test_a_user_regex_applies_the_same_ranges():
    parse = make_parser(r"it (?P<step>\d+) speed (?P<tok_s>\S+)")
    assert isinstance(parse("it 99999999999999999999999 speed 5", 1.0), MalformedLine)
    assert isinstance(parse("it 4 speed inf", 1.0), MalformedLine)
    assert parse("it 4 speed 5.5", 1.0) == StepRecord(ts=1.0, step=4, tok_s=5.5)
    record = parse_logfmt(f"ts={T0}Z event=step step=5 tok_s=10 loss=nan", None)
    assert isinstance(record, StepRecord) and record.loss != record.loss  # a NaN loss the judge must still see


def test_replay_counts_and_names_malformed_lines_and_still_judges(tmp_path):
    lines = [f"ts={T0}.{i:03d}Z event=step step={i} tok_s=100.0" for i in range(1, 6)]
    lines[2] = "ts=1e20 event=step step=3 tok_s=100.0"
    lines.append(f"ts={T0}.900Z event=step step=99999999999999999999999 tok_s=1")
    log = tmp_path / "p.log"
    log.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["replay", str(log)])
    assert result.exit_code == 1 and result.output.startswith("undecided"), result.output  # 4 steps: judged, too few
    assert "2 malformed metric lines ignored; first, line 3: ts=" in result.output
    assert strict_json(CliRunner().invoke(app, ["replay", str(log), "--json"]).output)["malformed_lines"] == 2


def test_replay_refuses_a_negative_line_interval(tmp_path):
    log = tmp_path / "q.log"
    log.write_text("step 1 tok/s 5\n")
    result = CliRunner().invoke(app, ["replay", str(log), "--line-interval", "-5"])
    assert result.exit_code == 2
    assert "dfo: error: --line-interval -5: the seconds between lines must be more than 0" in result.output


def test_a_watch_stores_every_good_step_and_counts_the_poisoned_lines(lab):
    watcher, watched = watch_script(lab, "p1",
        "import time\nfrom datetime import datetime, timezone\n"
        "def now(): return datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%f')[:-3] + 'Z'\n"
        "for step in range(1, 61):\n"
        "    if step == 10: print('ts=1e20 event=step step=10 tok_s=1000', flush=True)\n"
        "    elif step == 20: print(f'ts={now()} event=step step=99999999999999999999999 tok_s=1000', flush=True)\n"
        "    else: print(f'ts={now()} event=step step={step} tok_s=1000.0 loss=nan', flush=True)\n"
        "    time.sleep(0.02)\n"
        "time.sleep(600)\n")
    events = run_until(watcher, lambda w: len(lab.store.samples("p1")) >= 58)
    assert [s["step"] for s in lab.store.samples("p1")] == [s for s in range(1, 61) if s not in (10, 20)]
    assert watched.malformed == 2
    assert [e.reason[:5] for e in events if e.kind == "malformed"] == ["ts=1e", "step="]
    step = next(e for e in events if e.kind == "step")
    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        print_json(step.to_json())
    finally:
        sys.stdout = sys_stdout
    assert strict_json(out.getvalue())["nonfinite"] == {"loss": "NaN"}
    def progress() -> str:
        return str(render(watcher).renderables[1].renderable.columns[0]._cells[0])
    assert "2 malformed metric lines ignored" in progress()
    watched.malformed = 1  # the count as one poisoned line leaves it
    assert "1 malformed metric line ignored" in progress()  # it said "1 malformed metric line(s) ignored"


def test_a_run_poisoned_by_an_older_dfo_is_watched_again(lab):
    lab.launch("short", "old1")
    lab.store.add_samples("old1", [{"step": 1, "ts": 1e20, "tok_s": 100.0}])  # what a dfo without range checks stored
    watcher = lab.watcher(fallback=False)
    watcher.attach("old1")
    run_until(watcher, lambda w: len(lab.store.samples("old1")) >= 30)
    assert watcher.final_decisions()[0].decision in ("steady", "undecided", "exited")


# ------------------------------------------------------------------ --json


def test_json_output_has_no_nan_or_infinity_and_keeps_what_they_were(capsys):
    print_json({"kind": "step", "step": 3, "tok_s": 5.0, "loss": float("nan"),
                "interval": [float("-inf"), 2.0], "nested": {"x": float("inf")}})
    printed = strict_json(capsys.readouterr().out)
    assert printed == {"kind": "step", "step": 3, "tok_s": 5.0, "loss": None, "interval": [None, 2.0],
                       "nested": {"x": None, "nonfinite": {"x": "Infinity"}},
                       "nonfinite": {"loss": "NaN", "interval": ["-Infinity", None]}}
    assert finite_json([1.0, "a"]) == [1.0, "a"]


# ------------------------------------------------------------------ launch


def test_push_and_launch_into_a_workspace_with_markup_in_its_path_print_it_plainly(lab, tmp_path):
    workspace = tmp_path / "ws[/x]"
    path = write_inventory(tmp_path, {
        "defaults": {"workspace": str(workspace)},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": {"quick": {"command": "echo hi"}},
    }, name="markup.yaml")
    pushed = CliRunner().invoke(app, ["push", "--host", "here", "-i", str(path)])
    assert pushed.exit_code == 0 and f"to {workspace}/.dfo/pkg/" in pushed.output, pushed.output
    result = CliRunner().invoke(app, ["launch", "--host", "here", "--variant", "quick", "--name", "m1",
                                      "--no-preflight", "-i", str(path)])
    assert result.exit_code == 0, result.output
    assert f"log:  {workspace}/logs/m1.log" in result.output


# ------------------------------------------------------------------ truncation and rotation


def step_lines(first: int, last: int) -> bytes:
    return b"".join(b"ts=2026-11-29T11:40:00Z event=step step=%d tok_s=1000.0\n" % step for step in range(first, last + 1))


def read_all(follow: Follow) -> tuple[list[dict], bytes]:
    """One agent tick of `follow`: the `truncated` headers and the log bytes, checked to start where reading did."""
    records = FrameDecoder().feed(b"".join(follow.log_records(1 << 24)))
    truncated = [r.header for r in records if r.type == "truncated"]
    logs = [r for r in records if r.type == "log"]
    return truncated, b"".join(r.payload for r in logs)


def test_a_log_truncated_and_regrown_within_one_agent_tick_is_read_again_whole(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(step_lines(1, 100))
    follow = Follow({"run": "r", "log": str(log), "offset": 0})
    assert read_all(follow) == ([], step_lines(1, 100))
    log.write_bytes(step_lines(101, 400))  # truncated and longer than before by the next tick
    truncated, data = read_all(follow)
    assert [t["why"] for t in truncated] == ["rewritten"] and data == step_lines(101, 400)
    with open(log, "ab") as f:
        f.write(step_lines(401, 402))
    assert read_all(follow) == ([], step_lines(401, 402))  # plain growth is no truncation


@pytest.mark.parametrize("how", ["copytruncate", "rename"])
def test_a_log_rotated_between_two_watches_is_followed_from_0_by_the_next_agent(tmp_path, how):
    log = tmp_path / "run.log"
    log.write_bytes(step_lines(1, 100))
    first = Follow({"run": "r", "log": str(log), "offset": 0})
    read_all(first)
    stored = {"offset": first.offset, "ident": first.ident}  # what the registry keeps between the two watches
    if how == "copytruncate":
        log.write_bytes(log.read_bytes() + step_lines(101, 110))  # written while nobody watched ...
        (tmp_path / "run.log.1").write_bytes(log.read_bytes())
        os.truncate(log, 0)  # ... copied away, then emptied in place
    else:
        log.rename(tmp_path / "run.log.1")
    with open(log, "ab") as f:
        f.write(step_lines(111, 600))
    second = Follow({"run": "r", "log": str(log), **stored})
    truncated, data = read_all(second)
    assert [t["why"] for t in truncated] == ["rewritten" if how == "copytruncate" else "replaced"]
    assert data == step_lines(111, 600)


def test_a_log_renamed_away_is_read_to_its_end_while_the_trainer_writes_on_then_the_new_one_from_0(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(step_lines(1, 10))
    follow = Follow({"run": "r", "log": str(log), "offset": 0})
    read_all(follow)
    with open(log, "ab") as trainer:  # the trainer's own descriptor: it keeps writing to the renamed file
        log.rename(tmp_path / "run.log.1")
        log.write_bytes(b"")  # logrotate's `create`
        trainer.write(step_lines(11, 20))
        trainer.flush()
        assert read_all(follow) == ([], step_lines(11, 20))  # lines 11..20 are not lost
        log.write_bytes(step_lines(21, 30))  # a trainer that reopens its log writes here
        trainer.write(step_lines(31, 31))  # ... after one last line to the old file
        trainer.flush()
        assert read_all(follow) == ([], step_lines(31, 31))
        truncated, data = read_all(follow)
    assert [t["why"] for t in truncated] == ["replaced"] and data == step_lines(21, 30)


@pytest.mark.parametrize("variant, read", [("nographs", "past"), ("paced", "under")])
def test_a_watch_after_a_copytruncate_stores_every_step_of_the_new_log_once(lab, variant, read):
    lab.launch(variant, "ct1")
    first = lab.watcher(fallback=False)
    first.attach("ct1")
    # the first watch reads past the 4 KiB a log's identity hashes (agent.HEAD_BYTES), or stops short of them
    # (the paced trainer writes ~1 KiB a second): either way the second one is told of the copytruncate
    if read == "past":
        run_until(first, lambda w: len(lab.store.samples("ct1")) >= 40 and lab.store.get_run("ct1").log_offset >= 4096)
    else:
        run_until(first, lambda w: len(lab.store.samples("ct1")) >= 3)
    first.close()
    stale = lab.store.get_run("ct1").log_offset
    assert (stale >= 4096) == (read == "past")
    log = lab.workspace / "logs" / "ct1.log"
    os.truncate(log, 0)  # logrotate's copytruncate, between two watches
    deadline = time.monotonic() + 20
    while log.stat().st_size <= stale + 2000:
        assert time.monotonic() < deadline, "the trainer stopped writing"
        time.sleep(0.05)
    second = lab.watcher(fallback=False)
    second.attach("ct1")
    # every step of the log as it is now gets stored: none lost at the stale offset (the attach's own events are
    # handed out by the first step(), which run_until may not take when the attach stored every step already)
    events = second.step(0.2)
    events += run_until(second, lambda w: set(lab.log_steps("ct1")) <= {s["step"] for s in lab.store.samples("ct1")})
    assert [e.why for e in events if e.kind == "truncated"] == ["rewritten"]
    steps = [s["step"] for s in lab.store.samples("ct1")]
    assert steps == sorted(set(steps))  # once each


# ------------------------------------------------------------------ ~/.ssh/config as OpenSSH reads it


def included_host(ssh_home, sshd, alias: str) -> None:
    """`alias` defined only in a file that ~/.ssh/config Includes (by an absolute glob)."""
    conf_d = ssh_home.ssh_dir / "conf.d"
    conf_d.mkdir(exist_ok=True)
    (conf_d / "lab.conf").write_text(f"Host {alias}\n    HostName {sshd.host}\n    Port {sshd.port}\n"
                                     f"    User root\n    IdentityFile {ssh_home.identity}\n")
    ssh_home.config_path.write_text(f"Include {conf_d}/*.conf\n" + ssh_home.config_path.read_text())


def matched_host(ssh_home, sshd, alias: str) -> None:
    """`alias` reached only through a `Match host` block, in a file that ~/.ssh/config Includes."""
    match_file = ssh_home.ssh_dir / "match.conf"
    match_file.write_text(f"Match host {alias}\n    HostName {sshd.host}\n    Port {sshd.port}\n"
                          f"    IdentityFile {ssh_home.identity}\n")
    ssh_home.config_path.write_text(f"Include {match_file}\n" + ssh_home.config_path.read_text())


@pytest.mark.parametrize("client", ["openssh", "paramiko"])
def test_an_alias_from_an_included_file_connects(ssh_home, sshd, client, monkeypatch):
    from orchestrator.remote import ssh

    if client == "paramiko":
        monkeypatch.setattr(ssh, "openssh_client", lambda: None)
    else:
        assert ssh.openssh_client() is not None, "the OpenSSH client is part of the test image"
    included_host(ssh_home, sshd, "inclab")
    target = ssh.SshTarget("lab", "inclab")
    try:
        assert (target.host, target.port) == (sshd.host, sshd.port)
        assert target.run(["echo", "included"]).stdout == "included\n"
    finally:
        target.close()


@pytest.mark.parametrize("client", ["openssh", "paramiko"])
def test_an_alias_set_by_a_match_block_connects_and_a_bad_config_is_named(ssh_home, sshd, client, monkeypatch):
    from orchestrator.remote import ssh

    if client == "paramiko":
        monkeypatch.setattr(ssh, "openssh_client", lambda: None)
    matched_host(ssh_home, sshd, "matchlab")
    target = ssh.SshTarget("lab", "matchlab")
    try:
        assert target.run(["echo", "matched"]).stdout == "matched\n"
    finally:
        target.close()
    if client == "openssh":
        ssh_home.config_path.write_text(ssh_home.config_path.read_text() + "NoSuchOption yes\n")
        with pytest.raises(UsageError, match=r"ssh config: .*line \d+: Bad configuration option: nosuchoption"):
            ssh.SshTarget("lab", "matchlab")


# ------------------------------------------------------------------ bad input: one clean line, no traceback


def dfo(*args: str, home: Path) -> cli.Ran:
    """The console script's entry point (its real error handling, tests/harness/cli.py), with its own DFO_HOME."""
    return cli.dfo(*args, env={"DFO_HOME": str(home)})


def assert_clean_error(done, code: int, *texts: str) -> None:
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("dfo: error: "), done.stderr
    for text in texts:
        assert text in done.stderr, done.stderr


def local_inventory(tmp_path: Path, workspace: str, **variants) -> Path:
    return write_inventory(tmp_path, {
        "defaults": {"workspace": workspace},
        "hosts": {"local": {"transport": "local", "containers": {"here": {"ctid": None}}}},
        "variants": variants or {"quick": {"command": "echo hi"}},
    }, name="local.yaml")


def test_a_batch_file_that_is_not_utf8_is_named_in_one_line(tmp_path):
    experiments = tmp_path / "sweep.yaml"
    experiments.write_bytes(b"batch: s\n\xff\xfe matrix: {}\n")
    assert_clean_error(dfo("batch", str(experiments), home=tmp_path / "state"), 2,
                       f"{experiments}: not UTF-8 text (byte 9): expected a YAML file")


def test_a_dfo_home_that_cannot_be_created_is_named_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_clean_error(dfo("runs", home=blocker / "state"), 1,
                       f"run registry directory {blocker / 'state'}: cannot create it: Not a directory",
                       "set DFO_HOME to a directory you can write")


def test_a_registry_damaged_after_it_was_made_fails_watch_cleanly_while_runs_still_lists(tmp_path):
    home = tmp_path / "state"
    with Store(home / "dfo.db") as store:
        store.add_run(Run(name="r1", target="here", state="running", log_path=str(tmp_path / "r1.log")))
        store.add_samples("r1", [{"step": i, "ts": 1.8e9 + i, "tok_s": 100.0} for i in range(3000)], offset=10)
        root = store.query("SELECT rootpage FROM sqlite_master WHERE name = 'samples'")[0][0]
        page = store.query("PRAGMA page_size")[0][0]
        store.query("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(home / "dfo.db", "r+b") as db:  # one page of the samples table overwritten
        db.seek((root - 1) * page)
        db.write(b"\xff" * page)
    listed = dfo("runs", home=home)
    assert listed.returncode == 0 and "r1" in listed.stdout
    assert_clean_error(dfo("watch", "r1", "--json", home=home), 1,
                       f"run registry {home / 'dfo.db'}: database disk image is malformed", "move the file aside")


def test_a_workspace_with_a_backslash_gets_its_package_intact(tmp_path):
    inventory = local_inventory(tmp_path, str(tmp_path / "ws\\back"))
    first = dfo("push", "--host", "here", "-i", str(inventory), home=tmp_path / "state")
    assert first.returncode == 0 and "pushed trainer" in first.stdout, first.stderr
    again = dfo("push", "--host", "here", "-i", str(inventory), home=tmp_path / "state")
    assert "nothing transferred" in again.stdout, again.stderr


def test_a_package_changed_in_the_workspace_is_unpacked_again_not_used_as_it_is(tmp_path):
    """A package directory with its `.complete` was used as it was: a file edited or planted there after the
    unpack ran in every later run. Bytecode Python writes there is no change."""
    inventory = local_inventory(tmp_path, str(tmp_path / "ws"))
    first = json.loads(dfo("push", "--host", "here", "-i", str(inventory), "--json", home=tmp_path / "state").stdout)
    pkg = tmp_path / "ws" / ".dfo" / "pkg" / first["hash"]
    main = (pkg / "trainer" / "__main__.py").read_text()
    (pkg / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (pkg / "trainer" / "__pycache__" / "__main__.cpython-311.pyc").write_bytes(b"bytecode")
    kept = dfo("push", "--host", "here", "-i", str(inventory), home=tmp_path / "state")
    assert kept.stdout.endswith("nothing transferred\n"), kept.stdout + kept.stderr
    for tamper in (lambda: (pkg / "trainer" / "__main__.py").write_text("print('not the trainer')\n"),
                   lambda: (pkg / "trainer" / "sitecustomize.py").write_text("import os\n"),
                   lambda: (pkg / "trainer" / "__main__.py").unlink()):
        tamper()
        again = dfo("push", "--host", "here", "-i", str(inventory), home=tmp_path / "state")
        assert again.returncode == 0 and f"trainer {first['hash'][:12]}'s files there had changed since it was " \
            "unpacked; pushed it again" in " ".join(again.stdout.split()), again.stdout + again.stderr
        assert (pkg / "trainer" / "__main__.py").read_text() == main and not (pkg / "trainer" / "sitecustomize.py").exists()
        assert sorted(p.name for p in pkg.parent.iterdir()) == [first["hash"]]  # nothing left beside it


def test_a_relative_workspace_on_the_local_host_is_refused_by_inventory_check(tmp_path):
    inventory = local_inventory(tmp_path, "relative/ws")
    assert_clean_error(dfo("inventory", "check", "-i", str(inventory), home=tmp_path / "state"), 2,
                       "defaults.workspace: expected an absolute path or ~/... on local host 'local'")


def test_a_metrics_regex_without_step_is_refused_before_anything_starts(tmp_path):
    inventory = local_inventory(tmp_path, str(tmp_path / "ws"),
                                mine={"command": "echo 'it 1 speed 5 tok/s'", "metrics": r"speed (?P<tok_s>[\d.]+) tok/s"})
    expected = r"lacks the named group step (add e.g. (?P<step>\d+) and (?P<tok_s>[\d.]+))"
    assert_clean_error(dfo("inventory", "check", "-i", str(inventory), home=tmp_path / "state"), 2,
                       "variants.mine.metrics: expected a regex with named groups step and tok_s", expected)
    launched = dfo("launch", "--host", "here", "--variant", "mine", "--no-preflight", "--watch", "-i", str(inventory),
                   home=tmp_path / "state")
    assert_clean_error(launched, 2, expected)
    assert not (tmp_path / "ws" / "logs").exists()  # nothing started


def test_gpu_and_process_names_from_a_remote_nvidia_smi_are_shown_escaped_in_the_preflight_table(tmp_path,
                                                                                                  monkeypatch):
    from harness import STANDIN_BIN
    from harness.nvidia_smi import STATE_ENV, Gpu, GpuApp, NvidiaSmiState

    monkeypatch.setenv("PATH", f"{STANDIN_BIN}:{os.environ['PATH']}")
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "smi.json"))
    NvidiaSmiState(tmp_path / "smi.json", gpus=[Gpu(0, name=f"H200 {CLEAR}[/x]", memory_used_mib=9000,
                                                    apps=[GpuApp(pid=7, used_memory_mib=9000,
                                                                 process_name=f"{CLIPBOARD}[bold]x")])])
    inventory = local_inventory(tmp_path, str(tmp_path / "ws"))
    result = CliRunner().invoke(app, ["preflight", "--host", "here", "-i", str(inventory)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert_no_raw_controls(result.output)
    assert "\\x1b[2J[/x]" in result.output and "\\x1b]52;c;aGFja2Vk" in result.output


def test_dfo_logs_on_a_terminal_shows_controls_escaped_and_a_pipe_gets_the_bytes(tmp_path):
    import pty

    script = tmp_path / "noisy.py"
    script.write_text(f"print({HOSTILE_TEXT!r}, flush=True)\n")
    inventory = local_inventory(tmp_path, str(tmp_path / "ws"), noisy={"command": f"{PY} {script}"})
    home = tmp_path / "state"
    assert dfo("launch", "--host", "here", "--variant", "noisy", "--name", "n1", "--no-preflight", "-i", str(inventory),
               home=home).returncode == 0
    log = tmp_path / "ws" / "logs" / "n1.log"
    deadline = time.monotonic() + 20
    while not log.exists() or CLEAR not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    piped = dfo("logs", "n1", "-i", str(inventory), home=home)
    assert CLIPBOARD in piped.stdout  # a file or pipe gets the log as written
    primary, secondary = pty.openpty()
    env = {**os.environ, "DFO_HOME": str(home)}
    env.pop("DFO_INVENTORY", None)
    done = subprocess.run([str(Path(sys.executable).parent / "dfo"), "logs", "n1", "-i", str(inventory)],
                          stdout=secondary, stderr=subprocess.PIPE, timeout=60, env=env)
    os.close(secondary)
    shown = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(primary)
    assert done.returncode == 0, done.stderr
    text = shown.decode()
    assert_no_raw_controls(text)
    assert "\\x1b]52;c;aGFja2Vk\\x07" in text

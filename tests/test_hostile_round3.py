"""Hostile input, round 3 (issue 29): a tenant of a container, or an unlucky operator, cannot blind dfo with
one number, one odd file at a log's path, one bad registry row or one YAML file. Each test is one attack."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from harness import STANDIN_BIN
from harness.nvidia_smi import STATE_ENV, Gpu, NvidiaSmiState
from orchestrator import gpu
from orchestrator.cli import app
from orchestrator.logfmt import EventRecord, MalformedLine, StepRecord, parse_logfmt
from orchestrator.observe import Observer
from orchestrator.remote.local import LocalTarget
from orchestrator.view import render

from test_agent import NO_NVIDIA_PATH, of_type, start_agent  # noqa: F401  (the agent process fixture)
from test_hostile import assert_no_raw_controls, local_inventory, watch_script
from test_observe import Collected, agent_gone, observe  # noqa: F401  (the observer fixture)
from test_watch import lab, run_until  # noqa: F401  (the local lab fixture)

T0 = "2026-11-29T11:40:00Z"
DIGITS_5000 = "9" * 5000
DIGITS_400 = "9" * 400


# ------------------------------------------------------------------ one numeric check for every parsed figure


@pytest.mark.parametrize("line, why", [
    ("event=start steps=\u00b2", "steps="),  # isdigit() is True for a superscript two; int() refuses it
    (f"event=start steps={DIGITS_5000}", "steps="),  # int() refuses 5,000 digits (and is slow on 4,000)
    (f"event=start steps={DIGITS_400}", "steps="),  # a 400-digit total overflowed the live view's ETA
    (f"ts={T0} event=step step=\u0661\u0662 tok_s=5", "step="),  # Arabic-Indic digits: int() takes them as 12
    (f"ts={T0} event=step step=1_000 tok_s=5", "step="),  # int() takes 1_000 as 1000
    (f"ts={T0} event=step step=5 tok_s=\u0661\u0660\u0660", "tok_s="),
    ("ts=\uff11\uff17\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10 event=step step=1 tok_s=5", "ts="),  # fullwidth
    (f"ts={T0} event=step step={DIGITS_5000} tok_s=5", "step="),
    (f"ts={T0} event=step step=5 tok_s={DIGITS_5000}", "tok_s="),
])
def test_a_number_that_is_not_ascii_digits_finite_and_in_range_makes_the_line_malformed(line, why):
    record = parse_logfmt(line, 1.0)
    assert isinstance(record, MalformedLine) and record.reason.startswith(why), record
    assert len(record.reason) < 120  # the reason names the field, not its 5,000 digits


def test_a_good_start_line_still_gives_its_step_count_and_a_nan_loss_stays():
    record = parse_logfmt("event=start steps=3000 run=r1", 1.0)
    assert isinstance(record, EventRecord) and record.count("steps") == 3000
    step = parse_logfmt(f"ts={T0} event=step step=7 tok_s=1.5e5 loss=nan", None)
    assert isinstance(step, StepRecord) and step.step == 7 and step.tok_s == 150000.0 and step.loss != step.loss


def test_a_start_line_with_a_hostile_step_count_is_counted_and_the_watch_and_its_eta_go_on(lab):
    """`steps=²` and 5,000 digits killed the watch (at the same offset on every restart); 400 digits killed the
    live view's ETA."""
    watcher, watched = watch_script(lab, "n1",
        "import time\nfrom datetime import datetime, timezone\n"
        "def now(): return datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%f')[:-3] + 'Z'\n"
        "print('event=start steps=100', flush=True)\n"
        "print('event=start steps=\\u00b2', flush=True)\n"
        f"print('event=start steps={DIGITS_5000}', flush=True)\n"
        f"print('event=start steps={DIGITS_400}', flush=True)\n"
        "for step in range(1, 31):\n"
        "    print(f'ts={now()} event=step step={step} tok_s=1000.0', flush=True)\n"
        "    time.sleep(0.02)\n"
        "time.sleep(600)\n")
    run_until(watcher, lambda w: len(lab.store.samples("n1")) >= 30)
    assert watched.malformed == 3 and watched.steps_total == 100
    out = io.StringIO()
    Console(file=out, width=250).print(render(watcher))
    assert "step 30 of 100" in out.getvalue() and "3 malformed metric lines ignored" in out.getvalue()


# ------------------------------------------------------------------ nvidia-smi's figures


@pytest.mark.parametrize("value", ["inf", "1e999", "nan", "\u00b2", "-5"])
def test_a_hostile_nvidia_smi_figure_is_an_unparsable_error_not_an_overflow(value):
    with pytest.raises(gpu.NvidiaSmiError) as info:
        gpu.parse_gpus(f"0, NVIDIA H200, {value}, 143771, 5\n", where="ct200")
    assert info.value.kind == "unparsable" and "nvidia-smi" in str(info.value)


def test_preflight_names_a_hostile_nvidia_smi_figure_and_never_says_overflow(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{STANDIN_BIN}:{os.environ['PATH']}")
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "smi.json"))
    NvidiaSmiState(tmp_path / "smi.json", gpus=[Gpu(0, memory_used_mib="inf")])
    inventory = local_inventory(tmp_path, str(tmp_path / "ws"))
    result = CliRunner().invoke(app, ["preflight", "--host", "here", "-i", str(inventory)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "OverflowError" not in result.output and "unexpected nvidia-smi value" in result.output


def test_the_agent_survives_nvidia_smi_printing_inf_and_garbage_and_goes_on_sampling(start_agent, tmp_path):  # noqa: F811
    state = NvidiaSmiState(tmp_path / "smi.json", [Gpu(0, memory_used_mib="inf", utilization_pct="\u00b2"),
                                                   Gpu(1, memory_total_mib=DIGITS_400, utilization_pct="garbage")])
    agent = start_agent({"PATH": f"{STANDIN_BIN}:{NO_NVIDIA_PATH}", **state.env()})
    records = agent.read_until(lambda rs: len(of_type(rs, "gpu")) >= 3, timeout=8)
    assert of_type(records, "gpu")[-1].header["gpus"] == [
        {"index": 0, "mem_used_mib": None, "mem_total_mib": 143771, "util_pct": None},
        {"index": 1, "mem_used_mib": 0, "mem_total_mib": None, "util_pct": None}]
    assert agent.proc.poll() is None


def test_a_follow_command_with_a_hostile_number_gets_an_error_record_and_the_agent_keeps_going(start_agent, tmp_path):  # noqa: F811
    log = tmp_path / "r.log"
    log.write_text("one\n")
    agent = start_agent()
    for field, value in (("offset", "1e400"), ("pid", DIGITS_400), ("starttime", "\u00b2"), ("offset", -5)):
        agent.proc.stdin.write(f'{{"cmd": "follow", "run": "bad", "log": "{log}", "{field}": {json.dumps(value)}}}\n'
                               .replace('"1e400"', "1e400").encode())
    agent.proc.stdin.flush()
    agent.follow("good", log)
    records = agent.read_until(lambda rs: len(of_type(rs, "error")) == 4 and of_type(rs, "log", "good"))
    assert all("expected an integer" in r.header["text"] for r in of_type(records, "error"))
    assert agent.proc.poll() is None


def test_an_agent_sending_hostile_numbers_gets_error_observations_and_the_observer_goes_on(observe, tmp_path):  # noqa: F811
    """A tenant can replace dfo_agent.py: records with `off` 1e400, a 400-digit exit code or `inf` GPU figures
    are errors or unknowns, never a dead observer thread."""
    fake = tmp_path / "fake_agent.py"
    fake.write_text(
        "import sys, time\n"
        "w = sys.stdout.buffer.write\n"
        "w(b'{\"t\":\"hello\",\"version\":1,\"ts\":1e400}\\n')\n"
        "w(b'{\"t\":\"log\",\"run\":\"r1\",\"off\":1e400,\"len\":2}\\nx\\n')\n"
        f"w(b'{{\"t\":\"proc\",\"run\":\"r1\",\"alive\":false,\"exit_code\":{DIGITS_400}}}\\n')\n"
        "w(b'{\"t\":\"gpu\",\"ts\":1.0,\"gpus\":[{\"index\":0,\"mem_used_mib\":1e400,\"util_pct\":\"inf\"},7]}\\n')\n"
        "w(b'{\"t\":\"log\",\"run\":\"r1\",\"off\":0,\"len\":5}\\ngood\\n')\n"
        "sys.stdout.flush()\n"
        "while True:\n"
        "    w(b'{\"t\":\"hb\",\"ts\":1.0}\\n'); sys.stdout.flush(); time.sleep(0.2)\n")
    observer = Observer(LocalTarget("here"), [sys.executable, str(fake)])
    observer.follow("r1", str(tmp_path / "r1.log"))
    seen = observe(observer)
    seen.until(lambda c: c.lines("r1") == ["good"])
    [connected] = seen.kinds("connected")
    [proc] = seen.kinds("proc")
    [sample] = seen.kinds("gpu")
    assert connected.data["ts"] is None and proc.data["exit_code"] is None
    assert sample.data["gpus"] == [{"index": 0, "mem_used_mib": None, "mem_total_mib": None, "util_pct": None}]
    assert any("off=inf is not an offset" in o.data["text"] for o in seen.kinds("error"))
    assert observer.thread.is_alive()


# ------------------------------------------------------------------ what lies at a log's path


def log_bytes(records, run: str) -> bytes:
    return b"".join(r.payload or b"" for r in of_type(records, "log", run))


@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_a_log_path_that_is_no_regular_file_is_named_once_and_blocks_nothing(start_agent, tmp_path, kind):  # noqa: F811
    """A tenant replaced the log by a FIFO: open() blocked the agent, so no step of any run of the container
    arrived. Now the agent names it once and goes on with the other runs and its heartbeat."""
    odd = tmp_path / "odd.log"
    if kind == "a FIFO":
        os.mkfifo(odd)
    elif kind == "a directory":
        odd.mkdir()
    else:
        odd.symlink_to("/dev/zero")
    good = tmp_path / "good.log"
    good.write_text("step 1\n")
    agent = start_agent()
    agent.follow("odd", odd)
    agent.follow("good", good)
    records = agent.read_until(lambda rs: log_bytes(rs, "good") == b"step 1\n" and len(of_type(rs, "hb")) >= 3)
    [error] = of_type(records, "error")
    assert error.header == {"t": "error", "run": "odd", "text": f"odd: the log is {kind}, not a regular file: not read"}
    assert not of_type(records, "log", "odd") and agent.proc.poll() is None


def test_a_sparse_hole_appended_to_a_log_is_skipped_not_read(start_agent, tmp_path):  # noqa: F811
    """3 GB of hole were read at 15 MB/s: the steps after it stayed invisible for minutes (a false stall)."""
    log = tmp_path / "r.log"
    log.write_bytes(b"step 1\n")
    os.truncate(log, 3 * 2**30)
    with log.open("ab") as f:
        f.write(b"step 2\n")
    agent = start_agent()
    agent.follow("r", log)
    records = agent.read_until(lambda rs: log_bytes(rs, "r").endswith(b"step 2\n"))
    [skip] = [r for r in of_type(records, "log", "r") if r.header.get("skipped")]
    assert skip.header["off"] == 3 * 2**30 and skip.header["skipped"] >= 3 * 2**30 - 4096
    assert len(log_bytes(records, "r")) < 2 * 4096  # the hole's bytes never crossed the channel


def test_dfo_sees_the_lines_around_a_hole_and_the_problem_of_a_fifo_and_leaves_no_agent_behind(observe, tmp_path):  # noqa: F811
    from test_observe import AGENT_CMD

    log, fifo = tmp_path / "r.log", tmp_path / "f.log"
    log.write_bytes(b"step 1\n")
    os.truncate(log, 3 * 2**30 + 100)  # the zeros of the hole's last block are not a line either
    with log.open("ab") as f:
        f.write(b"step 2\n")
    os.mkfifo(fifo)
    observer = Observer(LocalTarget("here"), AGENT_CMD)
    observer.follow("r", str(log))
    observer.follow("f", str(fifo))
    seen = observe(observer)
    seen.until(lambda c: c.lines("r") == ["step 1", "step 2"] and len(c.kinds("error")) >= 2)
    texts = {o.run: o.data["text"] for o in seen.kinds("error")}
    assert texts["f"] == "f: the log is a FIFO, not a regular file: not read"
    assert texts["r"] == (f"r: a hole of {3 * 2**30 - 4096:,} bytes (a sparse region of zeros) at offset 4,096 "
                          "of the log was skipped, not read")
    [connected] = seen.kinds("connected")
    agent_pid = connected.data["pid"]
    observer.close()
    assert agent_gone(agent_pid)


# ------------------------------------------------------------------ registry rows


def damage_decision(store, name: str, text: str) -> None:
    store.query("UPDATE runs SET decision = ? WHERE name = ?", (text, name))


@pytest.mark.parametrize("text, why", [("{not json", "runs.decision is not JSON"),
                                       ("[1, 2]", "runs.decision is not a JSON object"),
                                       ('{"decision": "steady", "steady_tok_s": "fast"}',
                                        "runs.decision has a steady_tok_s that is not a number")])
def test_a_run_whose_decision_cannot_be_read_is_shown_unreadable_and_the_rest_listed(tmp_path, text, why):
    from orchestrator.store import Run, Store
    from test_hostile import dfo

    home = tmp_path / "state"
    with Store(home / "dfo.db") as store:
        store.add_run(Run(name="good", target="here", state="exited", exit_code=0,
                          decision={"decision": "steady", "steady_tok_s": 1000.0}))
        store.add_run(Run(name="bad", target="here", state="exited", exit_code=0))
        damage_decision(store, "bad", text)
    listed = dfo("runs", home=home)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[-1] for line in listed.stdout.splitlines()[2:]}
    assert rows == {"good": "steady", "bad": "(unreadable)"}
    shown = dfo("runs", "bad", home=home)
    assert shown.returncode == 0 and f"registry: unreadable: {why} (shown as empty)" in shown.stdout, shown.stderr
    as_json = json.loads(dfo("runs", "--json", home=home).stdout)
    assert [(run["name"], run["unreadable"]) for run in as_json] == [("good", None), ("bad", why)]


def test_a_watch_of_a_run_whose_decision_cannot_be_read_judges_it_afresh(lab):
    lab.launch("short", "d1")
    damage_decision(lab.store, "d1", "{not json")
    watcher = lab.watcher(fallback=False)
    watcher.attach("d1")
    run_until(watcher, lambda w: lab.store.find_run("d1").decision is not None)  # the watch wrote it anew
    assert lab.store.find_run("d1").unreadable is None and len(lab.store.samples("d1")) > 0


# ------------------------------------------------------------------ one YAML loader for the files a user writes

HOSTS = "hosts: {pve1: {address: 10.0.0.1, containers: {ct200: {ctid: 200}}}}\n"


def yaml_bomb(levels: int = 9) -> str:
    """Anchors of anchors: `i` expands to 9**9 (387 million) strings in a file of 600 bytes."""
    names = "abcdefghij"[:levels + 1]
    text = f"      {names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]\n"
    for before, name in zip(names, names[1:]):
        text += f"      {name}: &{name} [{', '.join(['*' + before] * 9)}]\n"
    return text


def test_a_yaml_bomb_in_a_variants_args_is_refused_by_inventory_check_in_one_line(tmp_path):
    """It passed `inventory check`; then `launch` spent 1.8 GB and died with MemoryError."""
    from test_hostile import assert_clean_error, dfo

    path = tmp_path / "bomb.yaml"
    path.write_text(HOSTS + "variants:\n  v:\n    compile: trees\n    preset: tiny-cpu\n    args:\n" + yaml_bomb())
    done = dfo("inventory", "check", "-i", str(path), home=tmp_path / "state")
    assert_clean_error(done, 2, f"{path}: line 12, column 18: more than 100,000 values once its aliases are expanded")
    assert len(done.stderr.strip().splitlines()) == 1


def test_yaml_nested_20000_deep_is_one_line_not_a_recursion_error(tmp_path):
    from test_hostile import assert_clean_error, dfo

    path = tmp_path / "deep.yaml"
    path.write_text(HOSTS + "variants: {v: {compile: trees, preset: tiny-cpu, args: {x: "
                    + "[" * 20_000 + "]" * 20_000 + "}}}\n")
    done = dfo("inventory", "check", "-i", str(path), home=tmp_path / "state")
    assert_clean_error(done, 2, f"{path}: line 2, column 120: nested deeper than 64 levels (flatten it)")
    assert "RecursionError" not in done.stderr


def test_yaml_merge_keys_work_and_a_key_beside_them_overrides_while_a_repeated_key_is_still_refused():
    from orchestrator.errors import InventoryError
    from orchestrator.inventory import parse_inventory

    inventory = parse_inventory(HOSTS + "variants:\n"
                                "  trees: &base {compile: trees, preset: tiny-cpu, args: {steps: 50}}\n"
                                "  eager: {<<: *base, compile: eager}\n")
    assert inventory.variants["eager"].compile == "eager" and inventory.variants["eager"].args == {"steps": 50}
    with pytest.raises(InventoryError) as info:
        parse_inventory(HOSTS + "variants:\n  trees: &base {compile: trees, preset: tiny-cpu}\n"
                        "  eager: {<<: *base, compile: eager, compile: trees}\n")
    assert info.value.problems == ["<memory>: line 4, column 38: YAML syntax error: duplicate key 'compile' (each key "
                                   "may appear once per mapping)"]


def test_the_experiments_file_refuses_a_key_given_twice_and_a_yaml_bomb_as_the_inventory_does():
    """`dfo batch` kept the last of two `targets:` silently."""
    from orchestrator.errors import InventoryError
    from orchestrator.experiments import parse_experiments
    from orchestrator.inventory import parse_inventory

    inventory = parse_inventory(HOSTS + "variants: {trees: {compile: trees, preset: tiny-cpu}}\n")
    twice = "batch: s\ntargets: [ct200]\nmatrix: {variant: [trees]}\ntargets: [all]\n"
    bomb = "batch: s\ntargets: [ct200]\nmatrix: {variant: [trees]}\nx:\n" + yaml_bomb()
    problems = []
    for text in (twice, bomb):
        with pytest.raises(InventoryError) as info:
            parse_experiments(text, inventory, source="sweep.yaml")
        problems += info.value.problems
    assert problems == [
        "sweep.yaml: line 4, column 1: YAML syntax error: duplicate key 'targets' (each key may appear once per mapping)",
        "sweep.yaml: line 10, column 18: more than 100,000 values once its aliases are expanded (a YAML bomb? write "
        "the values out, or use fewer aliases)"]


# ------------------------------------------------------------------ discover: remote names into YAML


def discovered(*containers: tuple[str, int, str]):
    """A Discovery of running containers (name, vmid, GPU name), as discover() would make from a host."""
    from orchestrator.discover import Discovery, Found, Listed, PveConfig
    from orchestrator.gpu import Gpu as SeenGpu

    found = [Found(Listed(vmid, "running", "", name), PveConfig({"hostname": name, "cores": "8"}, []),
                   gpus_seen=[SeenGpu(0, gpu_name, 0, 143771, 0)], name=name) for name, vmid, gpu_name in containers]
    return Discovery("pve1", "10.0.0.1", None, None, found)


def test_discover_merge_keeps_containers_named_like_numbers_as_names():
    """`0o17` and `1e3` are strings to PyYAML (YAML 1.1) but numbers to ruamel (YAML 1.2), which --merge uses."""
    from orchestrator.discover import merge_inventory, render
    from orchestrator.inventory import parse_inventory

    text = render(discovered(("0o17", 117, "NVIDIA H200"), ("1e3", 118, "NVIDIA H200"), ("gpu-a", 119, "NVIDIA H200")),
                  when="2026-12-03T09:00Z")
    existing = "hosts:\n  pve1:\n    address: 10.0.0.1\n    containers:\n      gpu-a: {ctid: 119}  # by hand\n"
    merged = merge_inventory(existing, text, source="lab.yaml")
    assert merged.added == ["0o17", "1e3"] and merged.kept == ["gpu-a"]
    containers = parse_inventory(merged.text).hosts["pve1"].containers
    assert {name: c.ctid for name, c in containers.items()} == {"gpu-a": 119, "0o17": 117, "1e3": 118}
    assert "# by hand" in merged.text
    assert merge_inventory(merged.text, text, source="lab.yaml").added == []  # merging again adds nothing


def test_hostile_gpu_names_go_escaped_into_discovers_yaml_comments_and_the_inventory_still_loads():
    """An ESC in a GPU name made the YAML unreadable (the whole discovery failed); U+202E reordered the line."""
    from orchestrator.discover import merge_inventory, render
    from orchestrator.inventory import parse_inventory

    text = render(discovered(("gpu-a", 117, "H200 \x1b[2J\x1b]52;c;aGFja2Vk\x07"), ("gpu-b", 118, "H200 \u202eevil[bold]x[/]")),
                  when="2026-12-03T09:00Z")
    assert_no_raw_controls(text) and "\u202e" not in text
    assert "nvidia-smi: 1 x H200 \\x1b[2J\\x1b]52;c;aGFja2Vk\\x07" in text
    assert "nvidia-smi: 1 x H200 \\u202eevil[bold]x[/]" in text
    assert set(parse_inventory(text).hosts["pve1"].containers) == {"gpu-a", "gpu-b"}
    merged = merge_inventory("hosts: {}\n", text, source="lab.yaml")
    assert "\u202e" not in merged.text and set(parse_inventory(merged.text).hosts["pve1"].containers) == {"gpu-a", "gpu-b"}


# ------------------------------------------------------------------ smaller: command-line values and addresses


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "0"])
def test_replay_refuses_a_baseline_that_is_no_positive_finite_figure(tmp_path, value):
    log = tmp_path / "q.log"
    log.write_text("step 1 tok/s 5\n")
    result = CliRunner().invoke(app, ["replay", str(log), "--baseline", value])
    assert result.exit_code == 2, result.output
    assert f"dfo: error: --baseline {float(value):g}: the baseline must be a number of tok/s above 0" in result.output


@pytest.mark.parametrize("count", ["1e20", "99999999999999999999"])
def test_logs_refuses_a_line_count_beyond_its_range_with_the_option_named(tmp_path, count):
    """A count past tail's limit reached tail, whose refusal came with `the workspace may have been cleaned`."""
    from orchestrator.store import Run, Store
    from test_hostile import dfo

    home = tmp_path / "state"
    log = tmp_path / "r1.log"
    log.write_text("a\nb\n")
    with Store(home / "dfo.db") as store:
        store.add_run(Run(name="r1", target="here", state="exited", exit_code=0, log_path=str(log)))
    done = dfo("logs", "r1", "-n", count, home=home)
    assert done.returncode == 2 and "'-n' / '--lines'" in done.stderr, done.stderr
    assert "tail" not in done.stderr and "workspace" not in done.stderr
    assert dfo("logs", "r1", "-n", "1", home=home).stdout == "b\n"


@pytest.mark.parametrize("address", ["10.0.0.1\nProxyCommand touch /tmp/x", "-oProxyCommand=touch /tmp/x", "pve 1"])
def test_an_address_with_a_newline_or_a_leading_dash_is_a_bad_address_not_an_ssh_config_error(tmp_path, address):
    from orchestrator.errors import InventoryError
    from orchestrator.inventory import parse_inventory

    with pytest.raises(InventoryError) as info:
        parse_inventory(f"hosts: {{pve1: {{address: {json.dumps(address)}, containers: {{ct200: {{ctid: 200}}}}}}}}\n")
    assert info.value.problems == [f"<memory>: hosts.pve1.address: expected a word ssh takes as it is (no spaces or "
                                   f"control characters, not starting with '-'), got {address!r}"]


def test_discover_of_a_host_with_a_newline_or_a_leading_dash_names_it_in_one_line(tmp_path):
    from test_hostile import assert_clean_error, dfo

    for host in ("pve1\nProxyCommand touch /tmp/x", "-oProxyCommand=touch /tmp/x"):
        done = dfo("inventory", "discover", "--", host, home=tmp_path / "state")
        assert_clean_error(done, 2, f"HOST {host!r}: expected a word ssh takes as it is")
        assert len(done.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ inventory and experiments numbers


@pytest.mark.parametrize("setting, line", [
    ("variants: {v: {compile: trees, baseline_tok_s: .inf}}",
     "variants.v.baseline_tok_s: expected a number above 0 and at most 1e12, got inf"),
    ("watch: {baseline_tok_s: .nan}", "watch.baseline_tok_s: expected a number above 0 and at most 1e12, got nan"),
    ("watch: {stall_floor_s: .inf}", "watch.stall_floor_s: expected a number above 0 and at most 604800, got inf"),
    ("watch: {unreachable_s: 1.0e+400}", "watch.unreachable_s: expected a number above 0 and at most 604800, got inf"),
    ("watch: {min_steady_seconds: -5}", "watch.min_steady_seconds: expected a number from 0 to 604800, got -5"),
    ("watch: {precision: .nan}", "watch.precision: expected a number above 0 and below 1, got nan"),
    ("watch: {min_steady_steps: true}", "watch.min_steady_steps: expected an integer from 1 to 1e9, got True"),
    ("defaults: {connect_timeout: .inf}", "defaults.connect_timeout: expected a number above 0 and at most 600, got inf"),
    ("defaults: {gpu_idle: {max_util_pct: .nan}}",
     "defaults.gpu_idle.max_util_pct: expected a number from 0 to 100, got nan"),
    ("notify: {command: 'true', timeout_s: .inf}",
     "notify.timeout_s: expected a number above 0 and at most 120, got inf"),
    ("variants: {v: {compile: trees, stop_grace_s: .inf}}",
     "variants.v.stop_grace_s: expected a number above 0 and at most 604800, got inf"),
])
def test_an_inventory_number_that_is_not_finite_and_in_range_is_one_line_naming_the_key_and_the_range(tmp_path,
                                                                                                     setting, line):
    """`baseline_tok_s: .inf` passed (pydantic's float takes infinity): every comparison with it was then false,
    so a run was never too slow; `stall_floor_s: .inf` meant no stall verdict ever."""
    from test_hostile import assert_clean_error, dfo

    path = tmp_path / "lab.yaml"
    path.write_text(HOSTS + setting + "\n")
    done = dfo("inventory", "check", "-i", str(path), home=tmp_path / "state")
    assert_clean_error(done, 2, f"{path}: {line}")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("setting, line", [
    ("stop_when: {minutes: .inf}", "stop_when: expected steady, {steps: N} or {minutes: M} (N an integer from 1 to "
                                   "1,000,000,000,000, M a number above 0 and at most 10080), got {'minutes': inf}"),
    ("stop_when: {steps: 1.0e+300}", "stop_when: expected steady, {steps: N} or {minutes: M} (N an integer from 1 to "
                                  "1,000,000,000,000, M a number above 0 and at most 10080), got {'steps': 1e+300}"),
    ("repeats: 1.0e+9", "repeats: expected an integer from 1 to 1000, got 1000000000.0"),
    ("gpus: true", "gpus: expected an integer from 1 to 1024, got True"),
    ("concurrency: {per_target: .inf}", "concurrency.per_target: expected an integer from 1 to 1024, got inf"),
])
def test_an_experiments_number_that_is_not_finite_and_in_range_is_one_line_naming_the_key_and_the_range(setting,
                                                                                                       line):
    from orchestrator.errors import InventoryError
    from orchestrator.experiments import parse_experiments
    from orchestrator.inventory import parse_inventory

    inventory = parse_inventory(HOSTS + "variants: {trees: {compile: trees, preset: tiny-cpu}}\n")
    with pytest.raises(InventoryError) as info:
        parse_experiments(f"batch: s\ntargets: [ct200]\nmatrix: {{variant: [trees]}}\n{setting}\n", inventory,
                          source="sweep.yaml")
    assert info.value.problems == [f"sweep.yaml: {line}"]

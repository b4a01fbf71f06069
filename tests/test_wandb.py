"""W&B: `auto` finds a `wandb login` key as W&B's own client does (netrc), runs carry group=<batch>,
job_type=<variant> and the inventory's tags (a fallback run its own variant's), the trainer announces where its
W&B run is, the watcher keeps it and `dfo runs NAME` shows it."""

from __future__ import annotations

import contextlib

import io
import textwrap
from pathlib import Path

import pytest

from harness.cli import dfo
from orchestrator.inventory import parse_inventory
from orchestrator.runs import spec_for, trainer_command
from trainer.metrics import MetricLog, resolve_mode, wandb_login_present



def test_auto_is_online_with_a_key_in_the_environment_or_a_wandb_login_netrc_entry(tmp_path):
    assert resolve_mode("auto", {"HOME": str(tmp_path)}) == "offline"
    assert resolve_mode("auto", {"HOME": str(tmp_path), "WANDB_API_KEY": "k" * 40}) == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert resolve_mode("auto", {"HOME": str(tmp_path)}) == "online"  # what `wandb login` writes
    assert not wandb_login_present({"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.lab.example"})
    other = tmp_path / "other-netrc"
    other.write_text("machine wandb.lab.example login user password " + "b" * 40 + "\n")
    other.chmod(0o600)
    assert wandb_login_present({"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.lab.example", "NETRC": str(other)})
    assert resolve_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"  # an explicit mode stands


INVENTORY = parse_inventory(textwrap.dedent("""
    hosts: {pve1: {address: 10.0.0.1, containers: {ct200: {ctid: 200}}}}
    variants:
      trees: {compile: trees, preset: tiny-cpu, tags: [h200, compile-sweep]}
      nographs: {compile: nographs, preset: tiny-cpu}
    fallback: [trees, nographs]
"""))


def test_runs_carry_the_batch_as_group_the_variant_as_job_type_and_its_tags():
    trees = trainer_command(spec_for(INVENTORY, "ct200", "trees", wandb="offline", batch="sweep1"), "r1", "/w/pkg")
    assert trees.startswith("WANDB_JOB_TYPE=trees WANDB_RUN_GROUP=sweep1 WANDB_TAGS=h200,compile-sweep PYTHONPATH=")
    fallback = trainer_command(spec_for(INVENTORY, "ct200", "nographs", wandb="offline", batch="sweep1"), "r1.2", "/w/pkg")
    assert fallback.startswith("WANDB_JOB_TYPE=nographs WANDB_RUN_GROUP=sweep1 PYTHONPATH=")
    assert "WANDB" not in trainer_command(spec_for(INVENTORY, "ct200", "trees"), "r2", "/w/pkg")  # --wandb off
    with pytest.raises(Exception, match="W&B tag"):
        parse_inventory("hosts: {}\nvariants: {a: {compile: eager, tags: ['a,b']}}\n")


@pytest.mark.slow
def test_a_real_offline_wandb_run_has_group_job_type_tags_and_announces_its_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from trainer.metrics import WandbSink

    monkeypatch.chdir(tmp_path)
    for key, value in {"WANDB_RUN_GROUP": "sweep1", "WANDB_JOB_TYPE": "trees", "WANDB_TAGS": "h200,compile-sweep",
                       "WANDB_SILENT": "true", "WANDB_MODE": "offline", "HOME": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    sink = WandbSink("auto", "r1", {"steps": 10}, str(tmp_path))
    out = io.StringIO()
    log = MetricLog(out, sink)
    try:
        log.emit("step", step=1, tok_s=10.0)
        assert (sink.run.group, sink.run.job_type, tuple(sink.run.tags)) == ("sweep1", "trees", ("h200", "compile-sweep"))
    finally:
        log.close()
    first = out.getvalue().splitlines()[0]
    assert " event=wandb mode=offline dir=" in first
    directory = first.split(" dir=")[1]
    assert Path(directory).is_dir() and Path(directory).name.startswith("offline-run-")


WANDB_TRAINER = """\
from datetime import datetime, timezone
def now():
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
print(f"ts={now()} event=start run=w steps=50", flush=True)
print(f"ts={now()} event=wandb mode=offline dir=/workspace/runs/w/wandb/offline-run-20261130_120000-abc", flush=True)
for step in range(1, 51):
    print(f"ts={now()} event=step step={step} tok_s=100.0", flush=True)
    time.sleep(0.02)
"""


def test_the_watcher_keeps_where_the_wandb_run_is_and_dfo_runs_name_shows_it(tmp_path, monkeypatch):
    from orchestrator.connections import Connections
    from orchestrator.errors import RefusedError
    from orchestrator.runs import launch, stop
    from orchestrator.store import Store
    from orchestrator.watch import Watcher

    from test_view_progress import script_inventory
    from test_watch import run_until

    inventory = script_inventory(tmp_path, monkeypatch, "w", WANDB_TRAINER)
    with Connections(inventory) as connections, Store(tmp_path / "state" / "dfo.db") as store:
        launch(connections.container("here"), spec_for(inventory, "here", "w"), store, name="w1")
        watcher = Watcher(inventory, connections, store)
        try:
            watcher.attach("w1")
            run_until(watcher, lambda _: store.events("w1", kind="wandb"))  # the wandb line is kept
        finally:
            watcher.close()
            with contextlib.suppress(RefusedError):  # the 1-s script may have ended already
                stop(connections.container("here"), store, "w1", grace_s=2)
    shown = dfo("runs", "w1", env={"DFO_HOME": str(tmp_path / "state"), "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert ("W&B:      offline: /workspace/runs/w/wandb/offline-run-20261130_120000-abc (upload: wandb sync "
            "/workspace/runs/w/wandb/offline-run-20261130_120000-abc)") in shown.stdout
    assert "variant:  w" in shown.stdout

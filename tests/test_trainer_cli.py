"""`python -m trainer` end to end on CPU, as dfo runs it: metric lines, exit codes, failure, resume, SIGTERM."""

from __future__ import annotations

import math
import signal
import subprocess
import time

import pytest
import torch

from trainer_helpers import run_trainer, trainer_cmd, trainer_env

UNIFORM_LOSS = math.log(63)  # tiny-cpu: 64 ids, the last one is MASK


def test_bad_set_exits_2_naming_key_and_form(tmp_path):
    result = run_trainer(tmp_path, "bad", "--set", "drafter.layers=two", timeout=30)
    assert result.code == 2
    assert "drafter.layers" in result.stderr and "an integer" in result.stderr


def test_run_name_outside_the_output_directory_exits_2(tmp_path):
    result = run_trainer(tmp_path, "../escape", timeout=30)
    assert result.code == 2 and "--run-name" in result.stderr
    assert not (tmp_path.parent / "escape").exists()


@pytest.mark.slow
def test_loss_falls_and_lines_follow_the_contract(tmp_path):
    result = run_trainer(tmp_path, "falls", "--variant", "eager", "--steps", "80", "--log-every", "10",
                         "--set", "run.drafters=cpu,cpu", timeout=240)
    assert result.code == 0, result.stderr[-2000:]
    start = result.events("start")[0].fields
    assert start["variant"] == "eager" and start["torch"] == torch.__version__
    assert start["drafters"] == "cpu,cpu" and len(start["config"]) == 12
    assert sorted(int(e.fields["drafter"]) for e in result.events("compile")) == [0, 1]
    steps = result.steps
    assert [s.step for s in steps] == [5] + list(range(10, 81, 10))
    assert steps[0].phase == "warmup" and all(s.phase == "train" for s in steps[1:])
    assert all(s.tok_s > 0 and s.active == "2/2" and s.ts > 0 for s in steps)
    assert steps[0].loss > UNIFORM_LOSS * 0.9
    assert min(s.loss for s in steps[-3:]) < UNIFORM_LOSS * 0.4, [s.loss for s in steps]
    assert result.events("done")[0].fields["reason"] == "finished"
    assert (tmp_path / "falls" / "checkpoint.pt").is_file()


def test_worker_exception_ends_the_run_nonzero_with_its_traceback(tmp_path):
    result = run_trainer(tmp_path, "dies", "--steps", "50", "--set", "run.drafters=cpu,cpu",
                         "--set", "debug.fail_at_step=3", "--set", "debug.fail_drafter=1", timeout=60)
    assert result.code == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "injected failure in drafter 1" in result.stderr
    assert "drafter1" in result.events("error")[0].fields["reason"]
    assert all(s.step <= 3 for s in result.steps)


def test_resume_continues_the_step_count(tmp_path):
    first = run_trainer(tmp_path, "again", "--steps", "10", "--log-every", "5", timeout=60)
    assert first.code == 0
    resumed = run_trainer(tmp_path, "again", "--steps", "20", "--log-every", "5", "--resume", timeout=60)
    assert resumed.code == 0, resumed.stderr[-2000:]
    assert [s.step for s in resumed.steps] == [15, 20]
    assert resumed.events("done")[0].fields["step"] == "20"


def test_resume_without_checkpoint_is_a_usage_error(tmp_path):
    result = run_trainer(tmp_path, "none", "--steps", "5", "--resume", timeout=60)
    assert result.code == 2 and "no checkpoint" in result.stderr


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_75(tmp_path):
    cmd = trainer_cmd(tmp_path, "term", "--steps", "1000", "--log-every", "1", "--set", "debug.step_sleep_s=0.1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_env(),
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while "event=step step=3 " not in proc.stdout.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-2000:]
    assert "event=checkpoint" in stdout and "reason=sigterm" in stdout
    saved = torch.load(tmp_path / "term" / "checkpoint.pt", weights_only=True)
    assert 3 <= saved["step"] < 1000


@pytest.mark.slow
def test_nographs_compiles_and_trains_on_cpu(tmp_path):
    result = run_trainer(tmp_path, "graphs", "--variant", "nographs", "--steps", "4", "--log-every", "2",
                         "--set", "drafter.layers=1", "--set", "run.warmup_log_steps=1", timeout=290)
    assert result.code == 0, result.stderr[-2000:]
    assert "triton.cudagraphs=False" in result.events("start")[0].fields["compile_settings"]
    assert float(result.events("compile")[0].fields["seconds"]) > 0
    assert [s.step for s in result.steps] == [1, 2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_h200_small_nographs_two_drafters_on_one_gpu(tmp_path):
    result = run_trainer(tmp_path, "gpu", "--preset", "h200-small", "--variant", "nographs", "--steps", "60",
                         timeout=290)
    assert result.code == 0, result.stderr[-2000:]
    assert result.steps[-1].active == "2/2"

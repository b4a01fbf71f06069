"""bench/stale.py: a figure measured at a commit is stale once trainer/ changed after it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STALE = Path(__file__).resolve().parents[1] / "bench" / "stale.py"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def commit_file(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path)
    return git(repo, "rev-parse", "--short", "HEAD")


def test_rows_measured_before_a_trainer_change_are_listed_and_fail(tmp_path):
    git(tmp_path, "init", "-q")
    old = commit_file(tmp_path, "trainer/model.py", "v1\n")
    commit_file(tmp_path, "trainer/model.py", "v2\n")
    new = commit_file(tmp_path, "docs/other.md", "docs only\n")
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n## Trainer\n| preset | tok/s | commit |\n|---|---|---|\n"
        f"| qwen | 10,000 | {old} |\n| small | 70,000 | `{new}` |\n| tiny | 5,000 | history |\n"
        "| bad | 1 | deadbeef |\n\n## Fan-out (no commit column)\n| hosts | s |\n|---|---|\n| 8 | 1.0 |\n")
    result = subprocess.run([sys.executable, str(STALE), "--doc", str(doc)], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 1
    assert f"stale: {doc}:5 [Trainer] qwen | 10,000 | {old}" in result.stdout
    assert "unknown:" in result.stdout and "deadbeef" in result.stdout
    assert "small" not in result.stdout and "Fan-out" not in result.stdout
    assert result.stdout.strip().endswith("1 current, 1 stale, 1 unknown, 1 history")


def test_all_current_exits_zero(tmp_path):
    git(tmp_path, "init", "-q")
    rev = commit_file(tmp_path, "trainer/model.py", "v1\n")
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"| preset | commit |\n|---|---|\n| qwen | {rev} |\n")
    result = subprocess.run([sys.executable, str(STALE), "--doc", str(doc)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout
    assert "1 current, 0 stale" in result.stdout

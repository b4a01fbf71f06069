"""What users expect of any CLI, through the console script's entry point (tests/harness/cli.py): --version, --help
placeholders that read as words, and shell completion of run, target and variant names (the protocol
`dfo --install-completion` sets up)."""

from __future__ import annotations

import re
import subprocess
import sys

from harness import write_inventory
from harness.cli import dfo

from orchestrator.store import Run, Store

COMMANDS = ["", "launch", "watch", "batch", "report", "replay", "runs", "logs", "stop", "push", "preflight", "metrics",
            "compare", "inventory", "inventory check", "inventory discover", "inventory import", "hostkey trust"]


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    shown = dfo("--version")
    assert (shown.returncode, shown.stdout) == (0, f"dfo {version('dfo')}\n")


PYTHON_TYPES = r"<(bool|str|int|float|list\[|path|float range|int range)>|\b(BOOLEAN|TEXT|INTEGER|FLOAT|PATH)\b"


def option_lines(help_text: str) -> list[str]:
    """The help's lines that show an option (`--name ...`, `* --host ...` when required), with typer's box drawing
    taken off. (Arguments are left out: every typer shows an argument's type beside its name.)"""
    return [line.strip(" │") for line in help_text.splitlines() if re.match(r"\*?\s*-", line.strip(" │"))]


def test_help_placeholders_are_words_not_python_types():
    helps = {}
    for command in COMMANDS:
        shown = dfo(*command.split(), "--help", env={"COLUMNS": "200"})
        assert shown.returncode == 0, (command, shown.stderr)
        assert not [line for line in option_lines(shown.stdout) if re.search(PYTHON_TYPES, line)], (command, shown.stdout)
        helps[command] = shown.stdout
    assert re.search(r"--interval\s+SECONDS", helps["watch"])
    assert re.search(r"--variant\s+VARIANT", helps["launch"]) and re.search(r"--name\s+NAME", helps["launch"])
    assert re.search(r"--lines\s+(-n\s+)?N\b", helps["logs"])


def test_help_text_is_shown_as_written_not_read_as_markup():
    shown = dfo("inventory", "import", "--help", env={"COLUMNS": "200"})
    assert "INI ([group] lines)" in " ".join(shown.stdout.replace("│", " ").split()), shown.stdout


def complete(words: str, **env: str) -> list[str]:
    shown = dfo(env={"_DFO_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1),
                     **env})
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.split()


def test_completion_offers_run_target_and_variant_names(tmp_path):
    with Store(tmp_path / "dfo.db") as store:
        for name in ("train_trees_1", "train_nographs_1", "sweep.trees.ct200.r1"):
            store.add_run(Run(name=name, target="ct200"))
    inventory = write_inventory(tmp_path, {
        "hosts": {"pve1": {"address": "10.0.0.1", "containers": {"ct200": {"ctid": 200}, "ct201": {"ctid": 201}}}},
        "variants": {"trees": {"compile": "trees"}, "nographs": {"compile": "nographs"}}})
    env = {"DFO_HOME": str(tmp_path), "DFO_INVENTORY": str(inventory)}
    assert complete("dfo metrics train_", **env) == ["train_nographs_1", "train_trees_1"]  # newest first
    assert complete("dfo compare train_trees_1 sw", **env) == ["sweep.trees.ct200.r1"]
    assert complete("dfo launch --host ct2", **env) == ["ct200", "ct201"]
    assert complete("dfo preflight --host ct20", **env) == ["ct200", "ct201"]
    assert complete("dfo launch --host ct200 --variant no", **env) == ["nographs"]
    assert complete("dfo launch --variant ", DFO_HOME=str(tmp_path), DFO_INVENTORY=str(tmp_path / "missing.yaml")) == []


def test_the_cli_starts_without_importing_torch_or_scipy():
    # `dfo --help`, `dfo runs`, `dfo stop` judge nothing: scipy.stats (the verdict rule's t quantiles, ~0.9 s of
    # imports) and torch (the trainer's) load only where a log is judged or a model trained. Before, every
    # command paid ~2.2 s to start, ~1 s of it scipy's.
    loaded = subprocess.run([sys.executable, "-c", "import sys, orchestrator.cli; "
                             "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'torch'}))"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]", loaded.stdout

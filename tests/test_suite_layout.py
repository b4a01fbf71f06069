"""The suite's own scheduling (tests/conftest.py): the trainer group names files and tests that exist, so a
renamed one cannot silently leave the group or stay in it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import NOT_TRAINING, TRAINER_FILES, trainer_group_of

TESTS = Path(__file__).parent


def functions_of(file: str) -> set[str]:
    tree = ast.parse((TESTS / file).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_trainer_file_and_every_test_that_leaves_the_group_exists():
    assert sorted(file for file in TRAINER_FILES if not (TESTS / file).is_file()) == []
    missing = [entry for entry in sorted(NOT_TRAINING)
               if entry.split("::")[0] not in TRAINER_FILES or entry.split("::")[1] not in functions_of(entry.split("::")[0])]
    assert missing == []


def test_a_test_that_trains_nothing_leaves_the_group_and_the_rest_of_its_file_stays():
    played = sorted(NOT_TRAINING)[0]
    file, name = played.split("::")
    assert not trainer_group_of(f"tests/{played}") and not trainer_group_of(f"tests/{played}[case]")
    others = sorted(functions_of(file) - {entry.split("::")[1] for entry in NOT_TRAINING if entry.startswith(f"{file}::")})
    assert others and all(trainer_group_of(f"tests/{file}::{other}") for other in others)
    assert not trainer_group_of("tests/test_watch.py::test_anything")

"""The documentation stands alone: no pointer out of the repository, every link resolves, every module listed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Notes that lived beside the repository while dfo was built; their contents are in docs/design.md now.
OUTSIDE_NOTES = ("DESIGN", "crash-signatures", "perf-notes", "steady-state", "STYLE")
OUTSIDE = re.compile(r"\.\./shared\b|/work/shared\b|\bshared/[\w-]+\.md|\b(?:" + "|".join(OUTSIDE_NOTES) + r")\.md\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files"], check=True, capture_output=True, text=True,
                           timeout=30).stdout.split()
    wanted = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".txt")
    return [ROOT / name for name in names
            if name.endswith(wanted) and not name.startswith("tests/data/") and (ROOT / name).is_file()]


def test_nothing_in_the_repository_points_to_notes_outside_it():
    here = Path(__file__).resolve()
    found = []
    for path in tracked_text_files():
        if path == here:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "point to docs/design.md (or the right docs page) instead:\n" + "\n".join(found)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def layout_entries() -> dict[str, set[str]]:
    """docs/architecture.md's Layout: the names listed under each top folder (`orchestrator/`, `trainer/`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    top = None
    for line in layout.splitlines():
        if match := re.match(r"^ {4}(\S+/)", line):
            top = match.group(1)
        elif (match := re.match(r"^ {6}(\S+)", line)) and top is not None:
            listed.setdefault(top, set()).add(match.group(1))
    return listed


@pytest.mark.parametrize("top", ["orchestrator/", "trainer/"])
def test_architecture_lists_every_module_of_orchestrator_and_trainer(top):
    listed = layout_entries().get(top, set())
    package = ROOT / top
    modules = {str(path.relative_to(package)) for path in package.rglob("*.py")
               if "__pycache__" not in path.parts and path.name != "__init__.py"}
    packages = {f"{path.parent.relative_to(package)}/" for path in package.rglob("__init__.py")
                if path.parent != package}
    missing = sorted((modules | packages) - listed)
    assert not missing, f"docs/architecture.md's Layout does not list under {top}: {', '.join(missing)}"
    gone = sorted(name for name in listed if (name.endswith(".py") or name.endswith("/"))
                  and not (package / name).exists())
    assert not gone, f"docs/architecture.md's Layout lists modules under {top} that do not exist: {', '.join(gone)}"

"""List the trainer figures in docs/benchmarks.md that no longer hold for today's code.

    python bench/stale.py [--doc docs/benchmarks.md] [--path trainer/] [--rev HEAD]

docs/benchmarks.md holds today's figures; docs/benchmarks-archive.md the history (`--doc` checks it too, where
most rows are `history` or stale by design).

Every Markdown table of the document with a `commit` column is a table of figures measured at that commit.
A row is current when `git diff --quiet COMMIT REV -- PATH` holds (nothing the figure measures changed
since); stale when it does not; unknown when git does not know the commit. A commit cell that is not a
hash (e.g. `history`) marks an older row kept as history. Prints one line per stale or unknown row and a
count per kind. Exit status: 0 when no row is stale or unknown, 1 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HASH = re.compile(r"`?([0-9a-f]{7,40})`?")


@dataclass(frozen=True)
class Row:
    line: int
    section: str
    cells: tuple[str, ...]
    commit: str


def cells_of(line: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in line.strip().strip("|").split("|"))


def rows_with_commits(text: str) -> list[Row]:
    """The rows of every table that has a `commit` column, with the section heading above them."""
    rows, section, column = [], "", None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if not line.lstrip().startswith("|"):
            column = None
            continue
        cells = cells_of(line)
        if column is None:
            lowered = [cell.lower() for cell in cells]
            column = lowered.index("commit") if "commit" in lowered else -1
            continue
        if column < 0 or set("".join(cells)) <= set("-: "):
            continue
        if column < len(cells):
            rows.append(Row(number, section, cells, cells[column]))
    return rows


def status(commit_cell: str, path: str, rev: str, repo: Path) -> str:
    match = HASH.fullmatch(commit_cell)
    if not match:
        return "history"
    result = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", match.group(1), rev, "--", path],
                            capture_output=True, timeout=60)
    return {0: "current", 1: "stale"}.get(result.returncode, "unknown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--path", default="trainer/", help="what the figures measure (default trainer/)")
    parser.add_argument("--rev", default="HEAD")
    args = parser.parse_args(argv)
    if not args.doc.is_file():
        print(f"stale.py: {args.doc} not found: run it from the repository root or give --doc", file=sys.stderr)
        return 2
    top = subprocess.run(["git", "-C", str(args.doc.resolve().parent), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True, timeout=60)
    if top.returncode != 0:
        print(f"stale.py: {args.doc} is not inside a git repository", file=sys.stderr)
        return 2
    repo = Path(top.stdout.strip())
    counts = {"current": 0, "stale": 0, "unknown": 0, "history": 0}
    for row in rows_with_commits(args.doc.read_text()):
        kind = status(row.commit, args.path, args.rev, repo)
        counts[kind] += 1
        if kind in ("stale", "unknown"):
            print(f"{kind}: {args.doc}:{row.line} [{row.section}] {' | '.join(row.cells[:4])} (commit {row.commit})")
    print(", ".join(f"{n} {kind}" for kind, n in counts.items()))
    return 1 if counts["stale"] or counts["unknown"] else 0


if __name__ == "__main__":
    sys.exit(main())

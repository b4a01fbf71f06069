"""How dfo words a count: `1 target`, `2 targets`, `0 runs`, never `1 targets` or `line(s)`.

The one helper for counts in what dfo prints, in a module of its own at the bottom of the layering so that every
layer may use it: commands/, the live view (view.py), the checks of the inventory and experiments file, and the
pure decide/ (it does no I/O and reads no clock). It must not import anything of dfo's.
"""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`noun` in the number `count` takes: `plural(1, "gap")` is `gap`, `plural(0, "gap")` is `gaps`."""
    return noun if count == 1 else f"{noun}s"


def counted(count: int, noun: str) -> str:
    """`1 target`, `2 targets`, `0 runs`: a count with its noun in the number it takes."""
    return f"{count} {plural(count, noun)}"

"""The one loader of the YAML files a user writes: the inventory and the experiments file (`dfo batch`).

Both go through `load_mapping`, so both get the same rules:
- a key given twice in one mapping is refused, with its line and column (PyYAML keeps the last one silently,
  which would drop a container or a setting without a word); merge keys (`<<: *base`) work, and a key set
  beside a merge overrides the merged one, as YAML says;
- alias expansion and nesting depth are bounded before anything is built: a YAML bomb (anchors of anchors
  expanding to billions of values), or 20,000 levels of `[[[[...`, is one line naming the line and column,
  within a fraction of a second, instead of gigabytes, a MemoryError or a RecursionError;
- a syntax error names its line and column; the file must hold a mapping.
Every problem is an InventoryError (one `SOURCE: ...` line, exit 2).

This module must not know what the files mean: the models in inventory.py and experiments.py check that.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from .errors import InventoryError

MAX_DEPTH = 64  # nested mappings/lists: a real inventory needs 5 or 6
MAX_VALUES = 100_000  # values once every alias is expanded: a real inventory has hundreds
MERGE_TAG = "tag:yaml.org,2002:merge"


def read_yaml_file(path: Path, *, missing: str, unreadable: str) -> str:
    """The UTF-8 text of a YAML file the user named; InventoryError (one line naming the file and the fix) if
    it is missing, unreadable or not UTF-8. `missing`/`unreadable`: the fix to suggest."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError([f"{path}: file not found ({missing})"]) from None
    except OSError as exc:
        raise InventoryError([f"{path}: cannot read: {exc.strerror} ({unreadable})"]) from None
    except UnicodeDecodeError as exc:
        raise InventoryError([f"{path}: not UTF-8 text (byte {exc.start}): expected a YAML file"]) from None


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping; merge keys are left to SafeLoader."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # `? [a]`: SafeLoader refuses it as an unhashable key, with its line
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (each key may appear once per mapping)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_mapping(text: str, source: str, *, expected: str) -> dict[str, Any]:
    """The mapping a YAML text holds, by the rules above. `expected`: what the mapping must have, for the
    message when the text holds something else (`at least 'hosts:'`)."""
    bounded(text, source)
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise InventoryError([f"{source}: {_where(getattr(exc, 'problem_mark', None))}YAML syntax error: "
                              f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}"]) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise InventoryError([f"{source}: expected a mapping with {expected}, got {got}"])
    return data


def bounded(text: str, source: str) -> None:
    """Refuse a YAML text nested deeper than MAX_DEPTH, or holding more than MAX_VALUES values once its aliases
    are expanded. One pass over PyYAML's event stream (its parser keeps no recursion), nothing built; a syntax
    error is left to the load that follows."""
    depth = 0
    sizes: dict[str, int] = {}  # anchor -> how many values its node expands to
    open_nodes: list[list] = [[None, 0]]  # per open collection: [its anchor, values in it so far]
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _refused(source, event, f"nested deeper than {MAX_DEPTH} levels (flatten it)")
                open_nodes.append([event.anchor, 1])
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
                anchor, size = open_nodes.pop()
            elif isinstance(event, yaml.ScalarEvent):
                anchor, size = event.anchor, 1
            elif isinstance(event, yaml.AliasEvent):
                anchor, size = None, sizes.get(event.anchor, 1)
            else:
                continue
            if anchor is not None:
                sizes[anchor] = size
            open_nodes[-1][1] += size
            if open_nodes[-1][1] > MAX_VALUES:
                raise _refused(source, event, f"more than {MAX_VALUES:,} values once its aliases are expanded (a "
                                              "YAML bomb? write the values out, or use fewer aliases)")
    except yaml.YAMLError:
        return


def _refused(source: str, event: yaml.Event, problem: str) -> InventoryError:
    return InventoryError([f"{source}: {_where(event.start_mark)}{problem}"])


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""

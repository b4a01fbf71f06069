"""Test harness for dfo: a real OpenSSH server, stand-ins for `pct` (over real LXC containers) and
`nvidia-smi`, and network-namespace "hosts". Imported by tests as `harness` (tests/ is on sys.path).

Nothing here is shipped: it must never be imported by orchestrator/ or trainer/.
"""

from __future__ import annotations

from pathlib import Path

import yaml

HARNESS_DIR = Path(__file__).resolve().parent
STANDIN_BIN = HARNESS_DIR / "bin"
"""Holds the executable stand-ins (`nvidia-smi`, `pct`); put on the PATH of the test sshd's sessions."""


def write_inventory(directory: Path, inventory: dict, name: str = "inventory.yaml") -> Path:
    """Dump `inventory` as YAML into `directory/name` and return the file's path."""
    path = Path(directory) / name
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path

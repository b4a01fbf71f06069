"""Validation of user-chosen names (targets, hosts, variants, runs) before anything reaches a shell."""

from __future__ import annotations

import re

from .errors import InvalidName

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str, kind: str = "name") -> str:
    """Return `name` if it is letters, digits and `._-` (not starting with `.` or `-`), else raise InvalidName."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid {kind} {name!r}: use letters, digits, '.', '_' and '-' only "
            "(at most 128, starting with a letter or digit)"
        )
    return name

"""`dfo inventory import FILE`: the hosts of an Ansible inventory (YAML or INI) as a dfo inventory.

Takes each host's `ansible_host` / `ansible_user` / `ansible_port` (and the older `ansible_ssh_*` spellings),
with Ansible's precedence: `all` vars < group vars (parents before children) < host vars. Host ranges
(`gpu[01:04].lab`, with a stride `gpu[01:09:2]`) are expanded; the JSON of `ansible-inventory --list` is read
too. Each host's Ansible groups are kept in its comment (`# Ansible groups: gpu, lab`) and as the inventory's
`groups:` (`gpu: [host:gpu01, host:gpu03]`), which `--host gpu` reads. Containers are not in an Ansible inventory: each host comes out with
`containers: {}` and a comment saying how to fill it (`dfo inventory discover HOST --merge FILE`).

This module reads the text it is given and returns text: no file or machine access.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from .discover import host_lines, scalar
from .errors import UsageError
from .names import check_name
from .sanitize import visible

CONNECTION_VARS = {
    "address": ("ansible_host", "ansible_ssh_host"),
    "user": ("ansible_user", "ansible_ssh_user"),
    "port": ("ansible_port", "ansible_ssh_port"),
}
RANGE_RE = re.compile(r"\[(\w*):(\w+)(?::(\w*))?\]")


@dataclass
class AnsibleHost:
    name: str
    vars: dict[str, Any] = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)  # the groups it is in, directly or through children (not all)


@dataclass
class Group:
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)


def expand(pattern: str) -> list[str]:
    """`gpu[01:03]` -> gpu01, gpu02, gpu03 (leading zeros kept), `gpu[01:05:2]` -> gpu01, gpu03, gpu05 (a stride),
    `[:2]` from 0, `[a:c]` letters too, as Ansible reads them. Several ranges in one name multiply."""
    match = RANGE_RE.search(pattern)
    if not match:
        return [pattern]
    start, end, stride = match.group(1) or "0", match.group(2), match.group(3)
    if stride is not None and not (stride.isdigit() and int(stride) > 0):
        raise UsageError(f"host range {match.group(0)!r} in {pattern!r}: the stride must be a whole number above 0")
    step = int(stride) if stride else 1
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") else 0
        values = [str(n).zfill(width) for n in range(int(start), int(end) + 1, step)]
    elif len(start) == len(end) == 1 and start.isalpha() and end.isalpha():
        values = [chr(c) for c in range(ord(start), ord(end) + 1, step)]
    else:
        raise UsageError(f"host range {match.group(0)!r} in {pattern!r}: expected [N:M], [N:M:STRIDE] or [a:z]")
    if not values:
        raise UsageError(f"host range {match.group(0)!r} in {pattern!r}: it names no host (its start is after its end)")
    return [name for value in values for name in expand(pattern[:match.start()] + value + pattern[match.end():])]


def parse_listing(data: dict[str, Any], source: str) -> dict[str, Group]:
    """`ansible-inventory --list` JSON: groups with lists of `hosts` and `children`, host vars under
    `_meta.hostvars` (ranges already expanded, vars of every source already merged by Ansible itself)."""
    groups: dict[str, Group] = {}
    host_vars = (data.get("_meta") or {}).get("hostvars") or {}
    for name, body in data.items():
        if name == "_meta":
            continue
        if not isinstance(body, dict):
            raise UsageError(f"{source}: group {name!r}: expected a mapping with hosts/vars/children")
        group = groups.setdefault(name, Group())
        for host in body.get("hosts") or []:
            group.hosts[str(host)] = dict(host_vars.get(host) or {})
        group.vars.update(body.get("vars") or {})
        group.children += [str(child) for child in body.get("children") or []]
    return groups


def parse_yaml(text: str, source: str) -> dict[str, Group]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{source}: not YAML or INI Ansible inventory: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{source}: expected an Ansible inventory (a mapping of groups such as `all:`)")
    if "_meta" in data:  # the JSON of `ansible-inventory --list`
        return parse_listing(data, source)
    groups: dict[str, Group] = {}

    def visit(name: str, body: Any) -> None:
        group = groups.setdefault(name, Group())
        body = body or {}
        if not isinstance(body, dict):
            raise UsageError(f"{source}: group {name!r}: expected a mapping with hosts/vars/children")
        for pattern, host_vars in (body.get("hosts") or {}).items():
            for host in expand(str(pattern)):
                group.hosts[host] = dict(host_vars or {})
        group.vars.update(body.get("vars") or {})
        for child, child_body in (body.get("children") or {}).items():
            group.children.append(child)
            visit(child, child_body)

    for name, body in data.items():
        visit(name, body)
    return groups


def parse_ini(text: str, source: str) -> dict[str, Group]:
    groups: dict[str, Group] = {"ungrouped": Group()}
    section, kind = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            header = line.strip("[]")
            section, _, kind = header.partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise UsageError(f"{source}: line {number}: unknown section kind {kind!r} (expected :vars or :children)")
            groups.setdefault(section, Group())
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise UsageError(f"{source}: line {number}: {exc}") from None
        if kind == "vars":
            key, _, value = line.partition("=")
            groups[section].vars[key.strip()] = yaml.safe_load(value.strip()) if value.strip() else ""
        elif kind == "children":
            groups[section].children.append(words[0])
            groups.setdefault(words[0], Group())
        else:
            host_vars = {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep:
                    raise UsageError(f"{source}: line {number}: expected key=value after the host name, got {word!r}")
                host_vars[key] = yaml.safe_load(value) if value else ""
            for host in expand(words[0]):
                groups[section].hosts[host] = host_vars
    return groups


def resolve(groups: dict[str, Group]) -> list[AnsibleHost]:
    """Every host with its merged vars: `all`, then groups from the top of the tree down, then its own."""
    parents: dict[str, list[str]] = {}
    for name, group in groups.items():
        for child in group.children:
            parents.setdefault(child, []).append(name)

    def depth(name: str, seen: frozenset = frozenset()) -> int:
        if name in seen:
            return 0
        return 1 + max((depth(p, seen | {name}) for p in parents.get(name, [])), default=0)

    order = sorted(groups, key=lambda name: (name != "all", depth(name)))
    hosts = []
    for host in dict.fromkeys(host for name in order for host in groups[name].hosts):
        merged: dict[str, Any] = {}
        for name in order:
            if name == "all" or _under(name, host, groups):
                merged.update(groups[name].vars)
        for name in order:
            merged.update(groups[name].hosts.get(host, {}))
        member = [name for name in groups if name not in ("all", "ungrouped") and _under(name, host, groups)]
        hosts.append(AnsibleHost(host, merged, member))
    return hosts


def _under(group: str, host: str, groups: dict[str, Group], seen: Optional[set] = None) -> bool:
    """True when `host` is in `group` directly or through its children."""
    seen = seen or set()
    if group in seen:
        return False
    seen.add(group)
    node = groups.get(group)
    return bool(node) and (host in node.hosts or any(_under(child, host, groups, seen) for child in node.children))


def import_inventory(text: str, *, source: str, when: str) -> str:
    """dfo inventory YAML with one host per Ansible host (address, user, port), containers left to discover."""
    stripped = text.lstrip()
    looks_ini = stripped.startswith("[") or (stripped and ":" not in stripped.splitlines()[0])
    groups = parse_ini(text, source) if looks_ini else parse_yaml(text, source)
    hosts = resolve(groups)
    if not hosts:
        raise UsageError(f"{source}: no hosts found", hint="an Ansible inventory lists hosts under groups, e.g. all: {hosts: {pve1: {ansible_host: 10.1.2.6}}}")
    lines = [f"# imported from the Ansible inventory {source} by `dfo inventory import` at {when}",
             "# containers: fill each host with `dfo inventory discover HOST --merge THIS_FILE`", "hosts:"]
    members: dict[str, list[str]] = {}  # dfo group -> host:NAME of its hosts
    for host in hosts:
        values = {key: next((host.vars[name] for name in names if name in host.vars), None)
                  for key, names in CONNECTION_VARS.items()}
        name, notes = _dfo_name(host.name, "host"), []
        if name != host.name:
            notes.append(f"Ansible name {host.name!r} is no valid dfo name")
        for group in host.groups:
            members.setdefault(_dfo_name(group, "group"), []).append(f"host:{name}")
        if host.groups:
            notes.append(f"Ansible groups: {', '.join(host.groups)}")
        note = visible("; ".join(notes))
        address = str(values["address"] or host.name)
        port = int(values["port"]) if values["port"] not in (None, "") else None
        user = str(values["user"]) if values["user"] not in (None, "") else None
        lines += host_lines(name, address, port, user, [], host_comment=note)
    if members:  # `--host GROUP` picks the targets of its hosts, once discover has filled them in
        lines += ["groups:  # Ansible's groups: `dfo preflight --host GROUP` checks every container of their hosts"]
        lines += [f"  {scalar(group)}: [{', '.join(scalar(member) for member in names)}]" for group, names in members.items()]
    return "\n".join(lines) + "\n"


def _dfo_name(name: str, kind: str) -> str:
    """`name` where dfo takes it as a host or group name, else its invalid characters made `-`."""
    try:
        check_name(name, kind)
    except Exception:
        return re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-._") or kind
    return name

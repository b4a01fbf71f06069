"""`dfo inventory discover HOST`: what a Proxmox host holds, as an inventory a user can start from.

Over one SSH connection (as preflight makes it): `pct list` for the containers, `pct config CTID` for each one's
hostname, cores, memory and GPU device lines (`devN: /dev/nvidiaN`, Proxmox 8.2+, and the older raw
`lxc.mount.entry: /dev/nvidiaN ...`), and one `nvidia-smi --query-gpu` inside each running container. The result
is YAML text with a comment on every line where dfo guessed (a stopped container, one without GPUs, GPU indices
its config passes that nvidia-smi does not show, a hostname that is no valid target name), and `merge_inventory`
adds it to an existing file without touching its variants or hand edits (ruamel.yaml keeps comments and order).

This module reaches the host only through the Target it is given; it writes no file (the CLI does).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from .agent.protocol import read_number
from .errors import CommandFailed, DfoError, InvalidName, RemoteError, UsageError
from .gpu import Gpu, NvidiaSmiError, query_gpus
from .names import check_name
from .remote.base import Target
from .remote.pct import PctTarget
from .sanitize import visible
from .words import counted, plural

PCT_TIMEOUT_S = 30.0
NVIDIA_SMI_TIMEOUT_S = 15.0
PARALLEL = 8  # containers looked at at once (one SSH channel each)
GPU_DEVICE_RE = re.compile(r"^/dev/nvidia([0-9]+)$")


@dataclass(frozen=True)
class Listed:
    """One row of `pct list`."""

    vmid: int
    status: str
    lock: str
    name: str


def parse_pct_list(text: str) -> list[Listed]:
    """`VMID Status Lock Name` rows (the Lock column is blank when unlocked); no output means no containers."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] == "VMID":
            continue
        vmid = read_number(parts[0], 0, 2**31, integer=True)
        if vmid is None or not parts[0].isdigit() or len(parts) not in (2, 3, 4):
            raise DfoError(f"unexpected `pct list` line {visible(line.strip()[:200])!r}", hint="is this a Proxmox VE host?")
        lock = parts[2] if len(parts) == 4 else ""
        name = parts[-1] if len(parts) >= 3 else ""
        rows.append(Listed(vmid, parts[1], lock, name))
    return rows


@dataclass(frozen=True)
class PveConfig:
    """`pct config CTID`: the `key: value` options and, in order, the raw `lxc.*` ones."""

    options: dict[str, str]
    raw: list[tuple[str, str]]

    @property
    def hostname(self) -> Optional[str]:
        return self.options.get("hostname")

    @property
    def cores(self) -> Optional[int]:
        return _int(self.options.get("cores"))

    @property
    def memory_mib(self) -> Optional[int]:
        return _int(self.options.get("memory"))

    def gpu_devices(self) -> list[int]:
        """GPU indices the config passes in: `devN: /dev/nvidiaK[,opts]` and `lxc.mount.entry: /dev/nvidiaK ...`
        (nvidiactl, nvidia-uvm and nvidia-caps are the driver's control devices, not GPUs)."""
        found = []
        for key, value in self.options.items():
            if re.fullmatch(r"dev\d+", key):
                path = value.split(",")[0]
                path = path.removeprefix("path=")
                found.append(path)
        found += [value.split()[0] for key, value in self.raw if key == "lxc.mount.entry" and value.split()]
        indices = [int(m.group(1)) for m in (GPU_DEVICE_RE.match(path) for path in found) if m]
        return sorted(set(indices))


def parse_pct_config(text: str) -> PveConfig:
    options, raw = {}, []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or not key.strip():
            continue
        key, value = key.strip(), value.strip()
        if key.startswith("lxc."):
            raw.append((key, value))
        else:
            options[key] = value
    return PveConfig(options, raw)


def _int(value: Optional[str]) -> Optional[int]:
    return None if value is None else read_number(value, 0, 2**40, integer=True)


@dataclass
class Found:
    """One container as discovered, with what dfo had to guess about it."""

    listed: Listed
    config: Optional[PveConfig] = None
    config_error: Optional[str] = None
    gpus_seen: Optional[list[Gpu]] = None  # nvidia-smi's answer inside (None: not asked or failed)
    smi_error: Optional[str] = None
    name: str = ""  # the target name in the inventory
    renamed_from: Optional[str] = None

    @property
    def running(self) -> bool:
        return self.listed.status == "running"

    @property
    def config_gpus(self) -> list[int]:
        return self.config.gpu_devices() if self.config else []

    @property
    def gpus(self) -> list[int]:
        """What goes into `gpus:`: the indices nvidia-smi shows inside when it answered, else the config's."""
        if self.gpus_seen is not None:
            return sorted(gpu.index for gpu in self.gpus_seen)
        return self.config_gpus

    def facts(self) -> list[str]:
        sizes = []
        if self.config and self.config.cores:
            sizes.append(counted(self.config.cores, "core"))
        if self.config and self.config.memory_mib:
            sizes.append(f"{self.config.memory_mib / 1024:g} GiB")
        facts = [", ".join(sizes)] if sizes else []
        if self.gpus_seen:
            names = sorted({gpu.name for gpu in self.gpus_seen})
            facts.append(f"nvidia-smi: {len(self.gpus_seen)} x {', '.join(names)}")
        return facts

    def guesses(self) -> list[str]:
        """Why this entry needs a look, one phrase each (empty: nothing was guessed)."""
        guesses = []
        if self.renamed_from is not None:
            guesses.append(f"hostname {self.renamed_from!r} is no valid target name (or is taken): named {self.name}")
        if self.listed.lock:
            guesses.append(f"locked ({self.listed.lock})")
        if self.config_error:
            guesses.append(f"pct config failed: {self.config_error}")
        if not self.running:
            what = f"{_gpus(self.config_gpus)} from its config, unchecked" if self.config_gpus else "no GPU in its config"
            guesses.append(f"{self.listed.status}: {what} (start it and discover again to confirm)")
        elif self.smi_error:
            what = f"{_gpus(self.config_gpus)} from its config" if self.config_gpus else "no GPU in its config"
            guesses.append(f"nvidia-smi failed inside: {self.smi_error}; {what}")
        elif not self.gpus_seen:
            guesses.append("no GPU seen by nvidia-smi" + (f" although its config passes {_devices(self.config_gpus)}"
                                                          if self.config_gpus else ", none in its config: CPU only"))
        else:
            unseen = sorted(set(self.config_gpus) - {gpu.index for gpu in self.gpus_seen})
            if unseen:
                guesses.append(f"config passes {_devices(unseen)} but nvidia-smi inside does not show "
                               f"{'it' if len(unseen) == 1 else 'them'}")
        return guesses


def _gpus(indices: list[int]) -> str:
    return f"{plural(len(indices), 'GPU')} {','.join(map(str, indices))}"


def _devices(indices: list[int]) -> str:
    return ", ".join(f"/dev/nvidia{i}" for i in indices)


@dataclass
class Discovery:
    host: str  # the host's name in the inventory
    address: str
    port: Optional[int]
    user: Optional[str]
    containers: list[Found] = field(default_factory=list)


def discover(host_target: Target, host: str, address: str, *, port: Optional[int] = None,
             user: Optional[str] = None) -> Discovery:
    """Everything `host_target` (a Proxmox host) says about its containers."""
    listing = host_target.run(["pct", "list"], timeout=PCT_TIMEOUT_S)
    if listing.exit_code == 127:
        raise RemoteError("no `pct` command here: is it a Proxmox VE host?", where=host,
                          hint="discover needs a Proxmox host; for a plain machine write `ctid: null` targets by hand")
    if listing.failed:
        raise CommandFailed(listing, where=host, what="pct list")
    found = [Found(listed) for listed in parse_pct_list(listing.stdout)]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        list(pool.map(lambda item: _look(host_target, item), found))
    _name(found)
    return Discovery(host, address, port, user, found)


def _look(host_target: Target, found: Found) -> None:
    container = PctTarget(host_target, found.listed.vmid)
    try:
        result = host_target.run(["pct", "config", str(found.listed.vmid)], timeout=PCT_TIMEOUT_S)
        container.raise_for_pct(result)
        if result.failed:
            raise CommandFailed(result, what=f"pct config {found.listed.vmid}")
        found.config = parse_pct_config(result.stdout)
    except RemoteError as exc:
        found.config_error = exc.message
    if not found.running:
        return
    try:
        found.gpus_seen = query_gpus(container, timeout=NVIDIA_SMI_TIMEOUT_S)
    except NvidiaSmiError as exc:
        if exc.kind in ("no_devices", "missing"):  # an answer: this container has no GPU
            found.gpus_seen = []
        else:
            found.smi_error = exc.message
    except RemoteError as exc:
        found.smi_error = exc.message


def _name(found: list[Found]) -> None:
    """Target names: the container's hostname when it is a valid, unused name, else `ct<VMID>`."""
    taken: set[str] = set()
    for item in found:
        wanted = (item.config.hostname if item.config else None) or item.listed.name or f"ct{item.listed.vmid}"
        name = wanted
        try:
            check_name(wanted, "target")
        except InvalidName:
            name = f"ct{item.listed.vmid}"
        if name in taken:
            name = f"ct{item.listed.vmid}"
        item.name = name
        item.renamed_from = wanted if name != wanted else None
        taken.add(name)


# ---------------------------------------------------------------------------------------------- YAML

def host_name_for(address: str) -> str:
    """An inventory host name from what the user typed (`root@pve1.lab:22` -> `pve1`; an IP -> `pve-10-1-2-6`)."""
    bare = address.rpartition("@")[2]
    if re.fullmatch(r"[\d.]+|[0-9a-fA-F:]+", bare):
        return "pve-" + re.sub(r"[.:]+", "-", bare).strip("-")
    bare = bare.split(".")[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", bare).strip("-._")
    return name or "pve"


YAML12_NOT_A_STRING = re.compile(
    r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+"
    r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)|null|Null|NULL|~|true|True|TRUE|false|False|FALSE")
"""Plain scalars a YAML 1.2 reader (ruamel, which --merge uses) takes for a number, bool or null: PyYAML (YAML 1.1)
writes `0o17` and `1e3` plain, as strings to it."""


def scalar(value: Any) -> str:
    """`value` as a YAML plain or quoted scalar that reads back as the same string/number under YAML 1.1 (PyYAML)
    and 1.2 (ruamel): a container named `0o17` or `1e3` stays a string for both."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
    if isinstance(value, str) and YAML12_NOT_A_STRING.fullmatch(text):
        return json.dumps(value)  # a double-quoted JSON string is a YAML string to every reader
    return text


def render(discovery: Discovery, *, when: str) -> str:
    """The discovered host as inventory YAML, with a comment on each container (`guessed:` where dfo guessed)."""
    lines = [f"# discovered from {discovery.address} by `dfo inventory discover` at {when}",
             "# lines marked `guessed` need a look; variants: see docs/inventory.md", "hosts:"]
    lines += host_lines(discovery.host, discovery.address, discovery.port, discovery.user,
                        [(item.name, item.listed.vmid, item.gpus, comment(item)) for item in discovery.containers])
    return "\n".join(lines) + "\n"


def host_lines(host: str, address: str, port: Optional[int], user: Optional[str],
               containers: list[tuple[str, Optional[int], list[int], str]], *, host_comment: str = "") -> list[str]:
    """One host block (two-space indent under `hosts:`); containers are (name, ctid, gpus, comment)."""
    lines = [f"  {scalar(host)}:" + (f"  # {host_comment}" if host_comment else ""), f"    address: {scalar(address)}"]
    if port is not None:
        lines.append(f"    port: {port}")
    if user is not None:
        lines.append(f"    user: {scalar(user)}")
    if not containers:
        lines.append("    containers: {}")
    else:
        lines.append("    containers:")
    for name, ctid, gpus, note in containers:
        fields = [f"ctid: {ctid if ctid is not None else 'null'}"] + ([f"gpus: [{', '.join(map(str, gpus))}]"] if gpus else [])
        lines.append(f"      {scalar(name)}: {{{', '.join(fields)}}}" + (f"  # {note}" if note else ""))
    return lines


def comment(item: Found) -> str:
    """The container's YAML comment: what dfo guessed and found. It quotes remote text (GPU names, nvidia-smi's
    and pct's words), so it goes through the display boundary: an ESC or U+202E is written as an escape (a raw
    one is no YAML at all, or reorders what the reader sees), a newline too."""
    guesses = item.guesses()
    parts = ([f"guessed: {'; '.join(guesses)}"] if guesses else []) + item.facts()
    return visible("; ".join(parts))


# ---------------------------------------------------------------------------------------------- merge

@dataclass
class MergeResult:
    text: str
    added: list[str]  # target names added
    kept: list[str]  # discovered targets already in the file, left as written
    host: str  # the host the containers went under


def merge_inventory(existing: str, discovered: str, *, source: str) -> MergeResult:
    """`discovered` (one host, from `render`) merged into the inventory text `existing`: a host already in the
    file (by name or address) gains the containers it lacks (matched by name or ctid); everything else in the
    file (variants, comments, order, hand-edited containers) stays as written."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    round_trip = YAML()
    round_trip.preserve_quotes = True
    round_trip.width = 4096
    try:
        document = round_trip.load(existing)
    except Exception as exc:  # ruamel's errors have no common base worth naming; the message says where
        raise UsageError(f"{source}: cannot read it as YAML: {str(exc).splitlines()[0]}",
                         hint="fix the file (dfo inventory check -i FILE), then merge again") from None
    if document is None:
        document = CommentedMap()
    if not isinstance(document, CommentedMap):
        raise UsageError(f"{source}: expected a mapping with `hosts:`, got {type(document).__name__}")
    new = round_trip.load(discovered)
    (new_host, new_entry), = new["hosts"].items()
    hosts = document.get("hosts")
    if hosts is None:
        document["hosts"] = hosts = CommentedMap()
    match = next((name for name, entry in hosts.items()
                  if name == new_host or (isinstance(entry, dict) and entry.get("address") == new_entry["address"])), None)
    added, kept = [], []
    if match is None:
        hosts[new_host] = new_entry
        _copy_comment(new["hosts"], new_host, hosts, new_host)
        added = list(new_entry.get("containers") or {})
        match = new_host
    else:
        entry = hosts[match]
        containers = entry.get("containers")
        if containers is None or not isinstance(containers, CommentedMap):
            entry["containers"] = containers = CommentedMap()
        containers.fa.set_block_style()
        ctids = {c.get("ctid") for c in containers.values() if isinstance(c, dict)}
        for name, spec in (new_entry.get("containers") or {}).items():
            if name in containers or spec.get("ctid") in ctids:
                kept.append(name)
                continue
            containers[name] = spec
            _copy_comment(new_entry["containers"], name, containers, name)
            added.append(name)
    import io

    out = io.StringIO()
    round_trip.dump(document, out)
    return MergeResult(out.getvalue(), added, kept, match)


def _copy_comment(source: Any, key: str, target: Any, new_key: str) -> None:
    """Carry the end-of-line comment of `source[key]` over to `target[new_key]` (ruamel keeps it on the map)."""
    comment_tokens = source.ca.items.get(key)
    if comment_tokens:
        target.ca.items[new_key] = comment_tokens

"""The inventory: which hosts and containers exist, which variants can run, and the watch thresholds.

Loads YAML into pydantic models (unknown keys are errors) and turns every validation problem into one line
that names the file, the dotted key path, what is expected and what was found. Resolves a target name
(`ct200`) into a TargetSpec with all defaults applied.

This module must not reach any machine: it only reads the inventory file.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import types
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Optional, Sequence

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from .decide.config import DecideConfig
from .errors import InvalidName, InventoryError, UnknownTarget, UnknownVariant
from .agent.protocol import read_number
from .logfmt import MAX_TOK_S, metrics_regex_problem
from .names import check_name
from .sanitize import is_visible, url_origin
from .yamlfile import load_mapping, read_yaml_file

CTID_MIN, CTID_MAX = 100, 999_999_999
BUILTIN_NAME = "default.yaml"


def _ctid(value: Any) -> Any:
    """Accept an int (or None) in Proxmox's VMID range; say so plainly otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not CTID_MIN <= value <= CTID_MAX:
        raise ValueError(f"expected an integer from {CTID_MIN} to {CTID_MAX}, got {value!r}")
    return value


def _compiled_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"expected a valid regular expression, got {pattern!r} ({exc})") from None
    return pattern


def _http_url(value: Any) -> Any:
    """An http(s) URL with a host, and no space or control character (urllib would refuse it only when sending,
    quoting the secret path). A refused URL is named by its url_origin() alone."""
    if not isinstance(value, str) or not re.match(r"https?://", value):
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    if not re.fullmatch(r"https?://[^\s/]+\S*", value) or not is_visible(value, keep_newlines=False):
        raise ValueError(f"expected an http:// or https:// URL without spaces or control characters, got one for "
                         f"{url_origin(value)} that has them (its path is not shown: it may hold a secret)")
    return value


def _ssh_word(value: Any) -> Any:
    """An address or user as ssh takes it: no space or control character (a newline would be read as another
    ssh_config line, and be reported as an ssh-config error), not starting with `-` (an option to ssh)."""
    if value is None or (isinstance(value, str) and value and not value.startswith("-")
                         and is_visible(value, keep_newlines=False) and not re.search(r"\s", value)):
        return value
    raise ValueError(f"expected a word ssh takes as it is (no spaces or control characters, not starting with '-'), "
                     f"got {value!r}")


SshWord = Annotated[Optional[str], BeforeValidator(_ssh_word)]


def _metrics_regex(pattern: Any) -> Any:
    """A `metrics:` regex that compiles and has the groups a step needs (the parser's own check)."""
    problem = metrics_regex_problem(pattern) if isinstance(pattern, str) else None
    if problem:
        raise ValueError(f"expected a regex with named groups step and tok_s: {problem}")
    return pattern


def _wandb_tag(value: Any) -> Any:
    if isinstance(value, str) and 0 < len(value) <= 64 and "," not in value and value.strip() == value:
        return value
    raise ValueError(f"expected a W&B tag (1-64 characters, no comma, no surrounding spaces), got {value!r}")


WandbTag = Annotated[str, BeforeValidator(_wandb_tag)]


def Number(*, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           integer: bool = False) -> Any:
    """The type of every numeric setting of the inventory and the experiments file: a finite number (an integer
    when `integer`) within its stated bounds (one of ge/gt, one of le/lt), through read_number, the check of
    every figure from outside dfo. `.inf`, `.nan`, `true`, 1e400 and a value out of range are refused with one
    line naming the key and the range (`watch.stall_floor_s: expected a number above 0 and at most 604800, got
    inf`), where pydantic's own float takes infinity and its int takes `true` as 1."""
    low, high = (ge if gt is None else gt), (le if lt is None else lt)
    if gt is None and lt is None:
        bounds = f"from {_bound(low)} to {_bound(high)}"
    else:
        bounds = f"{'above' if gt is not None else 'at least'} {_bound(low)} and " \
                 f"{'below' if lt is not None else 'at most'} {_bound(high)}"
    expected = f"expected {'an integer' if integer else 'a number'} {bounds}"

    def check(value: Any) -> Any:
        number = read_number(value, low, high, integer=integer)
        if number is None or number in (gt, lt):
            raise ValueError(f"{expected}, got {value!r:.60}")
        return number

    return Annotated[int if integer else float, BeforeValidator(check)]


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e7 else f"{value:g}".replace("e+0", "e").replace("e+", "e")


WEEK_S = 7 * 24 * 3600.0  # the longest wait or duration any setting may ask for
MAX_GPU_INDEX = 1023
Port = Number(ge=1, le=65535, integer=True)
Seconds = Number(gt=0, le=WEEK_S)
TokensPerSecond = Number(gt=0, le=MAX_TOK_S)
Ctid = Annotated[Optional[int], BeforeValidator(_ctid)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuIdle(_Strict):
    """A GPU counts as idle when both of these hold."""

    max_memory_mib: Number(ge=0, le=2**20, integer=True) = 1024  # MiB: 1 TiB at most
    max_util_pct: Number(ge=0, le=100) = 10


class Defaults(_Strict):
    user: Optional[str] = "root"  # unset or null: ~/.ssh/config's User, else root; set: wins over ~/.ssh/config
    workspace: str = "/workspace"
    python: str = "python3"
    connect_timeout: Number(gt=0, le=600) = 10
    gpu_idle: GpuIdle = GpuIdle()
    min_free_disk_gb: Number(ge=0, le=1e6) = 5


class Container(_Strict):
    ctid: Ctid = None  # null: run on the host itself, no pct
    gpus: list[Number(ge=0, le=MAX_GPU_INDEX, integer=True)] = []  # empty: every GPU the container sees
    workspace: Optional[str] = None
    python: Optional[str] = None


class Host(_Strict):
    address: SshWord = None  # an IP, a DNS name or an ~/.ssh/config alias
    port: Optional[Port] = None  # None: ~/.ssh/config, else 22
    user: SshWord = None
    transport: Literal["ssh", "local"] = "ssh"
    containers: dict[str, Container] = {}


class Notify(_Strict):
    """Who hears of a run's decision: `command` runs on the workstation with the decision JSON on stdin and
    DFO_* variables; `webhook` gets it POSTed with a Slack-compatible `text`. `decisions`: which ones (default:
    every one except `undecided`; not `on:`, which YAML reads as true)."""

    command: Optional[str] = None
    webhook: Optional[Annotated[str, BeforeValidator(_http_url)]] = None
    decisions: Optional[list[Literal["steady", "drifting", "crash", "stall", "too_slow", "stopped", "exited"]]] = None
    timeout_s: Number(gt=0, le=120) = 10
    retries: Number(ge=0, le=10, integer=True) = 2

    @model_validator(mode="after")
    def _says_how(self) -> "Notify":
        if self.command is None and self.webhook is None:
            raise ValueError("expected command and/or webhook, got neither")
        return self


class Variant(_Strict):
    compile: Optional[Literal["eager", "nographs", "notrees", "trees", "localtls"]] = None
    topology: Literal["threaded", "procsplit"] = "threaded"
    preset: Optional[str] = None
    args: dict[str, Any] = {}
    env: dict[EnvName, str] = {}
    command: Optional[str] = None  # a user's own trainer, run in the workspace
    metrics: Optional[Annotated[str, AfterValidator(_metrics_regex)]] = None
    baseline_tok_s: Optional[TokensPerSecond] = None
    notify: Optional[Notify] = None  # replaces the inventory's notify: for this variant's runs
    tags: list[WandbTag] = []  # W&B tags of its built-in trainer runs (with the batch as group, the variant as job type)
    nodes: Number(ge=1, le=1024, integer=True) = 1  # > 1: a multi-node run, launched with that many --host (docs/multinode.md)
    stop_grace_s: Optional[Seconds] = None  # a stop's SIGTERM -> SIGKILL wait for its runs (STOP_GRACE_S)
    master_port: Port = 29500  # its rendezvous port on the first target

    @model_validator(mode="after")
    def _command_or_builtin(self) -> "Variant":
        if self.nodes > 1 and (self.command is not None or self.topology != "procsplit"):
            raise ValueError(f"nodes: {self.nodes} needs a built-in trainer variant with topology: procsplit")
        if self.command is not None:
            given = [key for key in ("compile", "preset") if getattr(self, key) is not None]
            given += ["args"] if self.args else []
            if given:
                raise ValueError(f"expected either command or compile/preset/args, got command with {', '.join(given)}")
        elif self.compile is None:
            raise ValueError("expected compile (built-in trainer) or command (your own trainer), got neither")
        return self


_DECIDE = DecideConfig()
START_GRACE_S = 30.0
"""`watch.start_grace_s`'s default: after a start that got no answer, how long (from when dfo gave up on the
answer) its run gets to show before the launch counts as failed (runs.start_grace_left)."""


STOP_GRACE_S = 90.0
"""A stop's default wait between SIGTERM and SIGKILL (a variant's `stop_grace_s` replaces it). Above the built-in
trainer's own bound on a stop: procsplit's supervisor gives its drafters 60 s (trainer/procsplit.py STOP_GRACE_S)
and its targets 5 s more, and a stop lands at the next logging step and its checkpoint; a SIGKILL before that
loses the checkpoint the SIGTERM asked for (docs/trainer.md, exit 75)."""


class Watch(_Strict):  # the decide/ keys take their defaults from DecideConfig (docs/decisions.md)
    first_step_grace_s: Seconds = _DECIDE.first_step_grace_s
    min_steady_steps: Number(ge=1, le=10**9, integer=True) = _DECIDE.min_steady_steps
    min_steady_seconds: Number(ge=0, le=WEEK_S) = _DECIDE.min_steady_seconds
    stall_factor: Number(gt=1, le=1000) = _DECIDE.stall_factor
    stall_floor_s: Seconds = _DECIDE.stall_floor_s
    too_slow_tolerance: Number(ge=0, lt=1) = _DECIDE.too_slow_tolerance
    precision: Number(gt=0, lt=1) = _DECIDE.precision  # steady: no trend beyond it, its interval within it
    max_undecided_s: Seconds = _DECIDE.max_undecided_s  # then a final answer: steady (noisy) or drifting
    baseline_tok_s: Optional[TokensPerSecond] = None
    unreachable_s: Seconds = 300  # a host out of reach this long ends the watch of its runs
    start_grace_s: Seconds = START_GRACE_S  # a start that got no answer: how long its run may take to show

    def decide_mapping(self) -> dict[str, Any]:
        """The keys DecideConfig.from_mapping takes (it skips baseline_tok_s and unreachable_s itself)."""
        return self.model_dump(exclude={"start_grace_s"})


class Signature(_Strict):
    id: str
    pattern: Annotated[str, BeforeValidator(_compiled_regex)]
    meaning: str
    next: Optional[str] = None


class Inventory(_Strict):
    defaults: Defaults = Defaults()
    hosts: dict[str, Host]
    variants: dict[str, Variant] = {}
    fallback: list[str] = []
    secrets: list[EnvName] = []
    watch: Watch = Watch()
    signatures: list[Signature] = []
    notify: Optional[Notify] = None
    groups: dict[str, list[str]] = {}  # named sets of targets: `gpu: [ct200, host:pve2]`; `--host gpu` picks them
    _source: str = PrivateAttr("<memory>")  # the file it came from, for messages

    @property
    def source(self) -> str:
        return self._source

    def ssh_user(self, host_name: str) -> Optional[str]:
        """The SSH user the inventory sets for `host_name` (host, then defaults), or None when it sets none,
        so that ~/.ssh/config's User applies (and root after that)."""
        host = self.hosts[host_name]
        if host.user is not None:
            return host.user
        return self.defaults.user if "user" in self.defaults.model_fields_set else None

    def target_names(self) -> list[str]:
        return [name for host in self.hosts.values() for name in host.containers]

    def select_targets(self, selectors: Sequence[str], where: str = "targets") -> tuple[list[str], list[str]]:
        """Target names for `ct200`, `host:pve1` (its containers), a group of `groups:` and `all` (in inventory
        order, each once), and the problems, each starting `where` (`targets.0`, `--host`). The one reading of a target selector: a batch
        file's `targets:` and every `--host` (dfo preflight, dfo launch)."""
        names: list[str] = []
        problems = []
        for index, selector in enumerate(selectors):
            at = f"{where}.{index}" if where == "targets" else where
            if selector == "all":
                found = self.target_names()
            elif selector.startswith("host:"):
                host = self.hosts.get(selector.removeprefix("host:"))
                found = list(host.containers) if host else []
                if host is None:
                    problems.append(f"{at}: unknown host {selector[5:]!r}; known hosts: {', '.join(self.hosts)}")
            elif selector in self.groups:  # its members, each a target or host:NAME (checked at load)
                found = self.select_targets(self.groups[selector], where=f"groups.{selector}")[0]
            else:
                try:
                    found = [self.target(selector).name]
                except (UnknownTarget, InvalidName) as exc:
                    found = []
                    groups = f", a group ({', '.join(self.groups)})" if self.groups else ""
                    problems.append(f"{at}: {exc.message} (or use host:NAME{groups}, all)")
            names += [name for name in found if name not in names]
        return names, problems

    def targets_of(self, selectors: Sequence[str], option: str = "--host") -> list[str]:
        """select_targets for a command line: the names, or one UsageError line per problem."""
        names, problems = self.select_targets(selectors, where=option)
        if problems:
            raise InventoryError(problems)
        return names

    def target(self, name: str) -> "TargetSpec":
        """The resolved target `name` (a container name); UnknownTarget lists the known ones."""
        check_name(name, "target")
        for host_name, host in self.hosts.items():
            if name in host.containers:
                return _resolve(self.defaults, host_name, host, name, host.containers[name])
        known = ", ".join(self.target_names()) or "none"
        raise UnknownTarget(f"unknown target {name!r} in {self.source}; known targets: {known}")

    def variant(self, name: str) -> Variant:
        """The variant `name`; UnknownVariant lists the known ones."""
        check_name(name, "variant")
        if name not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise UnknownVariant(f"unknown variant {name!r} in {self.source}; known variants: {known}")
        return self.variants[name]


    def stop_grace(self, variant: str | None) -> float:
        """How long a stop of a run of `variant` waits between SIGTERM and SIGKILL: the variant's `stop_grace_s`,
        else STOP_GRACE_S (also for a variant this inventory does not have)."""
        found = self.variants.get(variant or "")
        return found.stop_grace_s if found is not None and found.stop_grace_s is not None else STOP_GRACE_S


VariantSpec = Variant


@dataclass(frozen=True)
class TargetSpec:
    """Everything needed to reach one target and judge its GPUs, with defaults applied."""

    name: str
    host: str
    transport: str
    address: Optional[str]
    port: Optional[int]
    user: Optional[str]
    ctid: Optional[int]
    gpus: tuple[int, ...]
    workspace: str
    python: str
    gpu_idle: GpuIdle
    min_free_disk_gb: float
    connect_timeout: float


def _resolve(defaults: Defaults, host_name: str, host: Host, name: str, container: Container) -> TargetSpec:
    workspace = container.workspace or defaults.workspace
    python = container.python or defaults.python
    if host.transport == "local":
        # This machine: `~` means the user running dfo, and an unset python is the one running dfo.
        workspace = os.path.expanduser(workspace)
        if container.python is None and "python" not in defaults.model_fields_set:
            python = sys.executable
    return TargetSpec(
        name=name,
        host=host_name,
        transport=host.transport,
        address=host.address,
        port=host.port,
        user=host.user if host.user is not None else defaults.user,
        ctid=container.ctid,
        gpus=tuple(container.gpus),
        workspace=workspace,
        python=python,
        gpu_idle=defaults.gpu_idle,
        min_free_disk_gb=defaults.min_free_disk_gb,
        connect_timeout=defaults.connect_timeout,
    )


# ---------------------------------------------------------------- loading


def load_inventory(path: Optional[Path] = None) -> Inventory:
    """Load `path`, else $DFO_INVENTORY, else the built-in inventory (host `local`, target `here`)."""
    if path is None and os.environ.get("DFO_INVENTORY"):
        path = Path(os.environ["DFO_INVENTORY"])
    if path is None:
        text = resources.files("orchestrator.builtin").joinpath(BUILTIN_NAME).read_text()
        return parse_inventory(text, source=f"<built-in {BUILTIN_NAME}>")
    text = read_yaml_file(path, missing="pass an existing file with -i, or unset DFO_INVENTORY",
                          unreadable="pass a readable YAML file with -i")
    return parse_inventory(text, source=str(path))


def parse_inventory(text: str, *, source: str = "<memory>") -> Inventory:
    """Validate YAML text; InventoryError carries one `SOURCE: key.path: problem` line per problem."""
    data = load_mapping(text, source, expected="at least 'hosts:'")
    try:
        inventory = Inventory.model_validate(data)
    except ValidationError as exc:  # with the name and chain problems too: every problem in one round
        problems = _describe(exc) + [line for line in _name_checks(data) if line not in _describe(exc)]
        raise InventoryError([f"{source}: {line}" for line in problems]) from None
    inventory._source = source
    problems = _cross_checks(inventory)
    if problems:
        raise InventoryError([f"{source}: {line}" for line in problems])
    return inventory


def describe_validation_error(exc: ValidationError, root: type[BaseModel] | None = None) -> list[str]:
    """One `key.path: problem` line per error of `exc`, raised validating `root` (default: Inventory)."""
    return _describe(exc, root or Inventory)


def _describe(exc: ValidationError, root: Any = None) -> list[str]:
    lines = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        if error["type"] == "extra_forbidden":
            parent, key = loc[:-1], loc[-1]
            lines.append(f"{_dotted(parent)}: unknown key {key!r}{_suggestion(parent, key, root)}")
        elif loc[-1:] == ["[key]"] and error["type"] == "string_type":  # a name YAML read as a number: `200:`
            lines.append(f"{_dotted(loc[:-1])}: expected a name, got the {type(error['input']).__name__} "
                         f"{error['input']!r} (quote it: '{error['input']}')")
        else:
            lines.append(f"{_dotted([part for part in loc if part != '[key]'])}: {_expected(error)}{_closest(error)}")
    return lines


def _closest(error: dict) -> str:
    """` (did you mean 'threaded'?)` for a value that is not one of the allowed words but close to one."""
    if error["type"] != "literal_error" or not isinstance(error.get("input"), str):
        return ""
    allowed = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
    close = difflib.get_close_matches(error["input"], allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _dotted(loc: list[str]) -> str:
    return ".".join(loc) if loc else "(top level)"


EXPECTED_BY_TYPE = {
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "string_pattern_mismatch": "expected an environment variable name (letters, digits, _)",
}


def _expected(error: dict) -> str:
    msg, kind = error["msg"], error["type"]
    if kind == "missing":
        return "required key is missing"
    if msg.startswith("Value error, "):
        return msg.removeprefix("Value error, ")
    if kind in EXPECTED_BY_TYPE:
        msg = EXPECTED_BY_TYPE[kind]
    elif msg.startswith("Input should be "):
        msg = "expected " + msg.removeprefix("Input should be ")
        msg = msg.replace("expected greater", "expected a number greater").replace("expected less", "expected a number less")
    return f"{msg}, got {error['input']!r}"


def _suggestion(parent: list[str], key: str, root: Any = None) -> str:
    close = difflib.get_close_matches(key, _fields_at(parent, root), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fields_at(loc: list[str], root: Any = None) -> list[str]:
    """The keys the model allows at `loc` (walking dict[str, X] and list[X] levels by their values)."""
    annotation: Any = root or Inventory
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            if field is None:
                return []
            annotation = field.annotation
        elif typing.get_origin(annotation) in (dict, list):
            annotation = typing.get_args(annotation)[-1]
        else:
            return []
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _cross_checks(inventory: Inventory) -> list[str]:
    """Problems pydantic cannot see alone: names, unique containers, workspaces, fallback and addresses."""
    problems = []
    for host_name, host in inventory.hosts.items():
        if host.transport == "ssh" and not host.address:
            problems.append(f"hosts.{host_name}.address: required for transport ssh (an IP, DNS name or ~/.ssh/config alias)")
        for name, container in host.containers.items():
            problems += _workspace_problem(inventory.defaults, host_name, host, name, container)
    names = {"hosts": {name: {"containers": host.containers} for name, host in inventory.hosts.items()},
             "variants": inventory.variants, "fallback": inventory.fallback}
    return _name_checks(names) + problems + _group_problems(inventory)


def _group_problems(inventory: Inventory) -> list[str]:
    """A group's name (a valid name, not `all`, not a target's) and its members (targets, or host:NAME of a
    host of the inventory, which may have no containers yet: `dfo inventory import` writes such groups)."""
    problems = []
    targets = set(inventory.target_names())
    for name, members in inventory.groups.items():
        problems += _name_problem(f"groups.{name}", str(name), "group")
        if name == "all":
            problems.append("groups.all: `all` already means every target; choose another group name")
        elif name in targets:
            problems.append(f"groups.{name}: a target is named {name!r} already; choose another group name")
        for index, member in enumerate(members):
            known = (member.removeprefix("host:") in inventory.hosts if member.startswith("host:")
                     else member in targets)
            if not known:
                what = f"host {member[5:]!r}" if member.startswith("host:") else f"target {member!r}"
                problems.append(f"groups.{name}.{index}: unknown {what}; a group lists targets and host:NAME")
    return problems


def _name_checks(data: Any) -> list[str]:
    """The names of hosts, containers (unique across hosts) and variants, and the fallback chain, read from the
    inventory's mapping as written: they are checked whether or not the rest of the file validated, so that
    one round of `dfo inventory check` names every problem."""
    if not isinstance(data, dict):
        return []
    problems = []
    seen: dict[str, str] = {}
    hosts = data.get("hosts") if isinstance(data.get("hosts"), dict) else {}
    for host_name, host in hosts.items():
        problems += _name_problem(f"hosts.{host_name}", str(host_name), "host")
        containers = host.get("containers") if isinstance(host, dict) else None
        for name in containers if isinstance(containers, dict) else ():
            problems += _name_problem(f"hosts.{host_name}.containers.{name}", str(name), "container")
            if name in seen:
                problems.append(f"hosts.{host_name}.containers.{name}: container name already used on host {seen[name]!r}; target names must be unique across hosts")
            seen.setdefault(name, host_name)
    variants = data.get("variants") if isinstance(data.get("variants"), dict) else {}
    for name in variants:
        problems += _name_problem(f"variants.{name}", str(name), "variant")
    fallback = data.get("fallback")
    if isinstance(fallback, list) and all(isinstance(name, str) for name in fallback):
        problems += chain_problems(fallback, [str(name) for name in variants])
    return problems


def chain_problems(chain: Sequence[str], variants: Iterable[str], where: str = "fallback") -> list[str]:
    """A fallback chain's problems (the inventory's `fallback:`, an experiments file's, `--chain`): a variant the
    inventory lacks, or one named twice (a chain runs each of its entries once, in order, so a repeat is a typo
    that would otherwise relaunch the first one again)."""
    known, problems, first = list(variants), [], {}
    for index, name in enumerate(chain):
        if name not in known:
            problems.append(f"{where}.{index}: unknown variant {name!r}; known variants: {', '.join(known) or 'none'}")
        elif name in first:
            problems.append(f"{where}.{index}: variant {name!r} is already {where}.{first[name]}; a chain runs each "
                            f"variant once, in order: remove the repeat")
        first.setdefault(name, index)
    return problems


def _workspace_problem(defaults: Defaults, host_name: str, host: Host, name: str, container: Container) -> list[str]:
    """A workspace must be absolute: remotely it is quoted on every command line, so `~` would never expand;
    on the local host `~` is expanded, but a relative path would depend on where dfo happens to be started."""
    workspace = container.workspace or defaults.workspace
    local = host.transport == "local"
    if workspace.startswith("/") or (local and workspace.startswith("~")):
        return []
    where = f"hosts.{host_name}.containers.{name}.workspace" if container.workspace else "defaults.workspace"
    if local:
        return [f"{where}: expected an absolute path or ~/... on local host {host_name!r} (e.g. ~/dfo-ws), got {workspace!r}"]
    return [f"{where}: expected an absolute path on SSH host {host_name!r} (e.g. /root/dfo), got {workspace!r}"]


def _name_problem(path: str, name: str, kind: str) -> list[str]:
    try:
        check_name(name, kind)
    except InvalidName as exc:
        return [f"{path}: {exc}"]
    return []

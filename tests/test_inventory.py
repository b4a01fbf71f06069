"""The inventory loader: what a user sees for a good file, for each kind of broken file, and for lookups."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import InvalidName, InventoryError, UnknownTarget, UnknownVariant
from orchestrator.inventory import load_inventory, parse_inventory

REPO = Path(__file__).resolve().parents[1]

GOOD = """
hosts:
  pve1:
    address: 10.1.2.6
    containers:
      ct200: {ctid: 200, gpus: [0, 1]}
      ct201: {ctid: 201, workspace: /data, python: /opt/venv/bin/python}
variants:
  trees: {compile: trees, preset: tiny-cpu, args: {steps: 20}}
  mine: {command: "bash run.sh", metrics: 'step (?P<step>\\d+) (?P<tok_s>[\\d.]+) tok/s'}
fallback: [trees]
"""


def problems_of(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "lab.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    return caught.value.problems


def with_hosts(containers: str, host_extra: str = "address: 10.0.0.1") -> str:
    return f"hosts:\n  pve1:\n    {host_extra}\n    containers:\n{textwrap.indent(containers, '      ')}\n"


def test_valid_inventory_resolves_targets_with_defaults() -> None:
    inv = parse_inventory(GOOD)
    ct200, ct201 = inv.target("ct200"), inv.target("ct201")
    assert (ct200.host, ct200.address, ct200.ctid, ct200.gpus) == ("pve1", "10.1.2.6", 200, (0, 1))
    assert (ct200.user, ct200.workspace, ct200.python, ct200.port) == ("root", "/workspace", "python3", None)
    assert (ct201.workspace, ct201.python) == ("/data", "/opt/venv/bin/python")
    assert ct200.gpu_idle.max_memory_mib == 1024 and ct200.min_free_disk_gb == 5
    assert inv.variant("trees").args == {"steps": 20}
    assert inv.watch.first_step_grace_s == 900


def test_bad_ctid_names_file_key_path_and_what_was_expected(tmp_path: Path) -> None:
    problems = problems_of(with_hosts("ct200: {ctid: abc}"), tmp_path)
    assert problems == [
        f"{tmp_path}/lab.yaml: hosts.pve1.containers.ct200.ctid: expected an integer from 100 to 999999999, got 'abc'"
    ]


def test_every_problem_gets_its_own_line(tmp_path: Path) -> None:
    problems = problems_of(with_hosts("ct200: {ctid: 5}\nct201: {ctid: 201, gpus: [x]}"), tmp_path)
    assert len(problems) == 2
    assert "hosts.pve1.containers.ct200.ctid: expected an integer from 100 to 999999999, got 5" in problems[0]
    assert "hosts.pve1.containers.ct201.gpus.0:" in problems[1]


def test_unknown_key_suggests_the_close_one(tmp_path: Path) -> None:
    problems = problems_of(with_hosts("ct200: {ctid: 200}", host_extra="adress: 10.0.0.1"), tmp_path)
    assert any("hosts.pve1: unknown key 'adress' (did you mean 'address'?)" in line for line in problems)


def test_unknown_key_inside_a_variant(tmp_path: Path) -> None:
    text = with_hosts("ct200: {ctid: 200}") + "variants:\n  v: {compile: eager, prest: tiny-cpu}\n"
    assert problems_of(text, tmp_path) == [f"{tmp_path}/lab.yaml: variants.v: unknown key 'prest' (did you mean 'preset'?)"]


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    (problem,) = problems_of("hosts:\n  pve1: {address: [unclosed\n", tmp_path)
    assert problem.startswith(f"{tmp_path}/lab.yaml: line ") and "YAML syntax error" in problem


def test_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="file not found"):
        load_inventory(tmp_path / "absent.yaml")


def test_fallback_naming_an_unknown_variant(tmp_path: Path) -> None:
    text = with_hosts("ct200: {ctid: 200}") + "variants:\n  eager: {compile: eager}\nfallback: [eager, trees]\n"
    (problem,) = problems_of(text, tmp_path)
    assert "fallback.1: unknown variant 'trees'; known variants: eager" in problem


def test_a_chain_naming_a_variant_twice_is_refused_with_the_fix(tmp_path: Path) -> None:
    text = with_hosts("ct200: {ctid: 200}") + "variants:\n  qa: {compile: eager}\n  qb: {compile: eager}\n  ok: {compile: eager}\nfallback: [qa, qb, qa, qb, ok]\n"
    problems = problems_of(text, tmp_path)
    assert problems == [f"{tmp_path}/lab.yaml: fallback.2: variant 'qa' is already fallback.0; a chain runs each variant once, in order: remove the repeat",
                        f"{tmp_path}/lab.yaml: fallback.3: variant 'qb' is already fallback.1; a chain runs each variant once, in order: remove the repeat"]


def test_chain_option_naming_a_variant_twice_is_refused() -> None:
    from orchestrator.chains import chain_from_option
    from orchestrator.errors import UsageError

    inventory = parse_inventory(with_hosts("ct200: {ctid: 200}") + "variants:\n  qa: {compile: eager}\n  qb: {compile: eager}\n")
    with pytest.raises(UsageError, match=r"--chain qa,qb,qa: entry.2: variant 'qa' is already entry.0") as caught:
        chain_from_option("qa,qb,qa", "qa", inventory)
    assert caught.value.hint == "e.g. --chain qa,qb"


def test_container_names_are_unique_across_hosts(tmp_path: Path) -> None:
    text = "hosts:\n  a: {address: h1, containers: {ct: {ctid: 200}}}\n  b: {address: h2, containers: {ct: {ctid: 300}}}\n"
    (problem,) = problems_of(text, tmp_path)
    assert "hosts.b.containers.ct: container name already used on host 'a'" in problem


def test_names_with_shell_metacharacters_are_rejected(tmp_path: Path) -> None:
    (problem,) = problems_of(with_hosts("'ct;reboot': {ctid: 200}"), tmp_path)
    assert "hosts.pve1.containers.ct;reboot: invalid container" in problem


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("{compile: fast}", "variants.v.compile: expected 'eager', 'nographs', 'notrees', 'trees' or 'localtls', got 'fast'"),
        ("{command: x, metrics: '(unclosed'}", "variants.v.metrics: expected a regex with named groups step and tok_s: '(unclosed' does not compile"),
        ("{command: x, metrics: 'loss=(?P<loss>.*)'}", "variants.v.metrics: expected a regex with named groups step and tok_s: 'loss=(?P<loss>.*)' lacks the named groups step, tok_s"),
        ("{command: x, metrics: '(?P<tok_s>[0-9.]+) tok/s'}", "variants.v.metrics: expected a regex with named groups step and tok_s: '(?P<tok_s>[0-9.]+) tok/s' lacks the named group step"),
        ("{command: x, compile: eager}", "variants.v: expected either command or compile/preset/args, got command with compile"),
        ("{preset: tiny-cpu}", "variants.v: expected compile (built-in trainer) or command"),
    ],
)
def test_variant_problems(variant: str, expected: str, tmp_path: Path) -> None:
    (problem,) = problems_of(with_hosts("ct200: {ctid: 200}") + f"variants:\n  v: {variant}\n", tmp_path)
    assert expected in problem


def test_signature_pattern_must_compile(tmp_path: Path) -> None:
    text = with_hosts("ct200: {ctid: 200}") + "signatures:\n  - {id: x, pattern: '[oops', meaning: m}\n"
    (problem,) = problems_of(text, tmp_path)
    assert "signatures.0.pattern: expected a valid regular expression" in problem


def test_ssh_host_needs_an_address(tmp_path: Path) -> None:
    (problem,) = problems_of("hosts:\n  pve1: {containers: {ct200: {ctid: 200}}}\n", tmp_path)
    assert "hosts.pve1.address: required for transport ssh" in problem


def test_unknown_target_and_variant_list_the_known_ones() -> None:
    inv = parse_inventory(GOOD)
    with pytest.raises(UnknownTarget, match="known targets: ct200, ct201"):
        inv.target("ct999")
    with pytest.raises(UnknownVariant, match="known variants: trees, mine"):
        inv.variant("notrees")
    with pytest.raises(InvalidName):
        inv.target("ct200; rm -rf /")


def test_builtin_inventory_is_used_without_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFO_INVENTORY", raising=False)
    inv = load_inventory(None)
    here = inv.target("here")
    assert (here.transport, here.ctid, here.gpus) == ("local", None, ())
    assert here.python == sys.executable  # the local target runs the Python that runs dfo
    assert inv.fallback == ["trees", "notrees", "nographs", "eager"]


def test_dfo_inventory_env_var_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.yaml"
    path.write_text(GOOD)
    monkeypatch.setenv("DFO_INVENTORY", str(path))
    assert load_inventory(None).target_names() == ["ct200", "ct201"]


def test_inventory_holds_only_inventories_and_each_validates() -> None:
    paths = sorted((REPO / "inventory").glob("*.yaml"))  # the experiments example lives in examples/
    assert paths and all(load_inventory(path).target_names() for path in paths), paths


def test_the_reference_example_validates() -> None:
    doc = (REPO / "docs" / "inventory.md").read_text()
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert parse_inventory(example).target("ct201").workspace == "/data/workspace"


def test_a_container_named_twice_on_one_host_is_an_error_not_a_silent_override(tmp_path: Path) -> None:
    (problem,) = problems_of(with_hosts("ct200: {ctid: 200}\nct200: {ctid: 201}"), tmp_path)
    assert problem.startswith(f"{tmp_path}/lab.yaml: line 6, column 7: ") and "duplicate key 'ct200'" in problem


def test_a_name_yaml_reads_as_a_number_says_to_quote_it(tmp_path: Path) -> None:
    (problem,) = problems_of(with_hosts("200: {ctid: 200}"), tmp_path)
    assert problem == f"{tmp_path}/lab.yaml: hosts.pve1.containers.200: expected a name, got the int 200 (quote it: '200')"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- a\n- b\n", "expected a mapping with at least 'hosts:', got list"),
        ("", "expected a mapping with at least 'hosts:', got an empty file"),
        ("hosts: {p: {address: x, port: twenty}}\n", "hosts.p.port: expected an integer from 1 to 65535, got 'twenty'"),
        ("hosts: {p: {address: x, port: 70000}}\n", "hosts.p.port: expected an integer from 1 to 65535, got 70000"),
        ("hosts: {p: {address: x, containers: [ct200]}}\n", "hosts.p.containers: expected a mapping, got ['ct200']"),
    ],
)
def test_wrong_shapes_name_the_key_and_what_was_found(text: str, expected: str, tmp_path: Path) -> None:
    assert problems_of(text, tmp_path) == [f"{tmp_path}/lab.yaml: {expected}"]


def test_unreadable_inputs_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r": cannot read: Is a directory \(pass a readable YAML file with -i\)"):
        load_inventory(tmp_path)
    binary = tmp_path / "lab.yaml"
    binary.write_bytes(b"hosts:\n\xff\xfe")
    with pytest.raises(InventoryError, match=r"lab.yaml: not UTF-8 text \(byte 7\): expected a YAML file"):
        load_inventory(binary)


def test_variant_env_names_must_be_environment_variable_names(tmp_path: Path) -> None:
    text = with_hosts("ct200: {ctid: 200}") + "variants:\n  v: {compile: eager, env: {'X;reboot': '1'}}\n"
    assert problems_of(text, tmp_path) == [
        f"{tmp_path}/lab.yaml: variants.v.env.X;reboot: expected an environment variable name (letters, digits, _), got 'X;reboot'"
    ]


def test_a_remote_workspace_must_be_absolute(tmp_path: Path) -> None:
    problems = problems_of(with_hosts("ct200: {ctid: 200, workspace: '~/dfo'}"), tmp_path)
    assert problems == [f"{tmp_path}/lab.yaml: hosts.pve1.containers.ct200.workspace: expected an absolute path on SSH host 'pve1' (e.g. /root/dfo), got '~/dfo'"]
    local = "defaults: {workspace: '~/dfo'}\nhosts:\n  me: {transport: local, containers: {here: {}}}\n"
    assert parse_inventory(local).target("here").workspace == str(Path.home() / "dfo")  # expanded on this machine


def test_groups_name_targets_and_hosts_and_their_problems_come_in_one_round() -> None:
    inventory = parse_inventory(with_hosts("ct200: {ctid: 200}\nct201: {ctid: 201}") + "groups:\n  pair: [ct201, host:pve1]\n")
    assert inventory.targets_of(["pair"]) == ["ct201", "ct200"]  # each once, in the group's order
    with pytest.raises(InventoryError) as refused:
        parse_inventory(with_hosts("ct200: {ctid: 200}") + "groups:\n  ct200: [ct200]\n  all: [ct200]\n"
                        "  x: [ct9, host:pve9]\n")
    assert refused.value.problems == [
        "<memory>: groups.ct200: a target is named 'ct200' already; choose another group name",
        "<memory>: groups.all: `all` already means every target; choose another group name",
        "<memory>: groups.x.0: unknown target 'ct9'; a group lists targets and host:NAME",
        "<memory>: groups.x.1: unknown host 'pve9'; a group lists targets and host:NAME"]

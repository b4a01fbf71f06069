"""`dfo inventory discover` through a real sshd and the pct stand-in over real LXC containers (pct list, pct
config in pve-container's format, one nvidia-smi inside each running container), `--merge` into a hand-edited
file, and `dfo inventory import` of Ansible inventories (YAML and INI)."""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap

import pytest

from harness.cli import dfo  # HOME is the test's ssh_home
from harness.nvidia_smi import Gpu
from orchestrator.discover import discover, parse_pct_config, parse_pct_list
from orchestrator.errors import RemoteError
from orchestrator.remote.local import LocalTarget
from orchestrator.inventory import parse_inventory



def pve_conf(container, text: str) -> None:
    (container.dir / "pve.conf").write_text(textwrap.dedent(text).lstrip())


@pytest.fixture
def lab(sshd, ssh_home, containers):
    """Four containers as a Proxmox host holds them: GPUs by devN (Proxmox 8.2+), GPUs by raw lxc.mount.entry
    with one that nvidia-smi does not show, a stopped one, and a CPU-only one."""
    a = containers(gpus=[Gpu(0), Gpu(1)])
    pve_conf(a, """
        memory: 65536
        hostname: gpu-a
        arch: amd64
        dev1: /dev/nvidia1,gid=44
        dev0: /dev/nvidia0
        cores: 16
        digest: 0123abcd
        """)
    b = containers(gpus=[Gpu(0), Gpu(1)])
    pve_conf(b, f"""
        arch: amd64
        hostname: gpu-b
        cores: 8
        lxc.cgroup2.devices.allow: c 195:* rwm
        lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
        lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
        lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file
        lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file
        """)
    c = containers(start=False)
    pve_conf(c, "hostname: gpu-c\ndev0: /dev/nvidia3\nmemory: 32768\n")
    d = containers(gpus=[])
    d.nvidia_smi([], mode="no_devices")
    pve_conf(d, "hostname: cpu-d\ncores: 4\n")
    return {"a": a, "b": b, "c": c, "d": d}


def containers_of(text: str) -> dict:
    inventory = parse_inventory(text, source="<discovered>")
    return {name: (c.ctid, list(c.gpus)) for host in inventory.hosts.values() for name, c in host.containers.items()}


def line_of(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(f"{name}:"))


def test_pct_config_prints_keys_sorted_and_raw_lxc_keys_last_without_digest(lab):
    shown = subprocess.run(["pct", "config", str(lab["b"].vmid)], capture_output=True, text=True, timeout=30)
    assert shown.stdout.splitlines()[:3] == ["arch: amd64", "cores: 8", "hostname: gpu-b"]
    assert shown.stdout.splitlines()[3].startswith("lxc.cgroup2.devices.allow")
    a = subprocess.run(["pct", "config", str(lab["a"].vmid)], capture_output=True, text=True, timeout=30).stdout
    assert "digest" not in a and a.splitlines()[2:4] == ["dev0: /dev/nvidia0", "dev1: /dev/nvidia1,gid=44"]


def test_discover_writes_a_valid_inventory_commented_where_it_guessed(lab, sshd, tmp_path):
    shown = dfo("inventory", "discover", "testhost", "-o", str(tmp_path / "lab.yaml"))
    assert shown.returncode == 0, shown.stderr
    text = (tmp_path / "lab.yaml").read_text()
    ids = {key: lab[key].vmid for key in lab}
    assert containers_of(text) == {"gpu-a": (ids["a"], [0, 1]), "gpu-b": (ids["b"], [0, 1]),
                                   "gpu-c": (ids["c"], [3]), "cpu-d": (ids["d"], [])}
    assert "guessed" not in line_of(text, "gpu-a") and "16 cores, 64 GiB; nvidia-smi: 2 x NVIDIA H200" in line_of(text, "gpu-a")
    assert "guessed: config passes /dev/nvidia2 but nvidia-smi inside does not show it" in line_of(text, "gpu-b")
    assert "guessed: stopped: GPU 3 from its config, unchecked" in line_of(text, "gpu-c")
    assert "guessed: no GPU seen by nvidia-smi, none in its config: CPU only" in line_of(text, "cpu-d")
    assert "testhost:" in text and "address: testhost" in text
    assert sshd.accepted_connections() == 1  # pct list, four pct configs and three nvidia-smi over one connection
    assert "guessed (see the comments): gpu-b, gpu-c, cpu-d" in shown.stderr


def test_discover_counts_one_container_and_one_core_in_the_singular(sshd, ssh_home, containers, tmp_path):
    only = containers(gpus=[])
    only.nvidia_smi([], mode="no_devices")
    pve_conf(only, "hostname: cpu-only\ncores: 1\n")
    shown = dfo("inventory", "discover", "testhost", "-o", str(tmp_path / "one.yaml"))
    assert shown.returncode == 0, shown.stderr
    assert set(containers_of((tmp_path / "one.yaml").read_text())) == {"cpu-only"}
    assert line_of((tmp_path / "one.yaml").read_text(), "cpu-only").endswith("CPU only; 1 core")  # it said "1 cores"
    assert shown.stderr.startswith("testhost: 1 container; "), shown.stderr  # it said "1 containers"


def test_merge_keeps_variants_and_hand_edits_and_adds_the_rest(lab, tmp_path):
    lab_file = tmp_path / "lab.yaml"
    lab_file.write_text(textwrap.dedent(f"""\
        # our lab (hand-written)
        hosts:
          testhost:
            address: testhost
            containers:
              gpu-a: {{ctid: {lab['a'].vmid}, gpus: [1]}}  # GPU 0 is for notebooks
        variants:
          trees: {{compile: trees, preset: tiny-cpu, args: {{steps: 2000}}}}  # the one we trust
        fallback: [trees]
        """))
    shown = dfo("inventory", "discover", "testhost", "--merge", str(lab_file))
    assert shown.returncode == 0, shown.stderr
    text = lab_file.read_text()
    assert "# our lab (hand-written)" in text and "# GPU 0 is for notebooks" in text and "# the one we trust" in text
    found = containers_of(text)
    assert found["gpu-a"] == (lab["a"].vmid, [1])  # the hand edit stands
    assert set(found) == {"gpu-a", "gpu-b", "gpu-c", "cpu-d"}
    assert "guessed: stopped" in line_of(text, "gpu-c")
    assert parse_inventory(text).fallback == ["trees"]
    assert "added gpu-b, gpu-c, cpu-d; kept as written: gpu-a" in shown.stderr
    again = dfo("inventory", "discover", "testhost", "--merge", str(lab_file))
    assert again.returncode == 0 and lab_file.read_text() == text  # a second merge changes nothing


def test_discover_of_an_unreachable_host_is_one_line_and_writes_nothing(ssh_home, tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connection refused
        shown = dfo("inventory", "discover", "127.0.0.1", "--port", str(port), "-o", str(tmp_path / "x.yaml"))
    assert shown.returncode == 1 and len(shown.stderr.strip().splitlines()) == 1 and "Traceback" not in shown.stderr
    assert "127.0.0.1" in shown.stderr and not (tmp_path / "x.yaml").exists()


def test_discover_of_a_machine_without_pct_says_it_is_no_proxmox_host(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no pct stand-in
    with pytest.raises(RemoteError, match="no `pct` command here: is it a Proxmox VE host"):
        discover(LocalTarget("here"), "here", "localhost")


def test_parsers_read_the_real_formats():
    listed = parse_pct_list("VMID       Status     Lock         Name\n200        running                 ct200\n"
                            "201        stopped    backup       ct201\n")
    assert [(c.vmid, c.status, c.lock, c.name) for c in listed] == [(200, "running", "", "ct200"), (201, "stopped", "backup", "ct201")]
    assert parse_pct_list("") == []
    config = parse_pct_config("dev0: path=/dev/nvidia4,mode=0666\ndev1: /dev/nvidia-uvm\nhostname: x\n"
                              "lxc.mount.entry: /dev/nvidia5 dev/nvidia5 none bind,optional,create=file\n"
                              "lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir\n")
    assert config.gpu_devices() == [4, 5] and config.hostname == "x"


# ---------------------------------------------------------------------------------------------- Ansible

def test_import_ansible_yaml_with_groups_vars_and_ranges(tmp_path):
    source = tmp_path / "hosts.yml"
    source.write_text(textwrap.dedent("""\
        all:
          vars: {ansible_user: admin}
          hosts:
            pve1: {ansible_host: 10.1.2.6}
          children:
            gpu:
              vars: {ansible_port: 2222}
              hosts:
                pve[2:3].lab: {ansible_user: root}
        """))
    shown = dfo("inventory", "import", str(source))
    assert shown.returncode == 0, shown.stderr
    inventory = parse_inventory(shown.stdout)
    hosts = {name: (h.address, h.port, h.user) for name, h in inventory.hosts.items()}
    assert hosts == {"pve1": ("10.1.2.6", None, "admin"), "pve2.lab": ("pve2.lab", 2222, "root"),
                     "pve3.lab": ("pve3.lab", 2222, "root")}
    assert "dfo inventory discover HOST --merge" in shown.stdout


def test_import_ansible_ini(tmp_path):
    source = tmp_path / "hosts.ini"
    source.write_text(textwrap.dedent("""\
        # lab
        [proxmox]
        pve1 ansible_host=10.1.2.6 ansible_port=2200
        pve2 ansible_ssh_host=10.1.2.7

        [proxmox:vars]
        ansible_user=ops

        [lab:children]
        proxmox
        """))
    out = tmp_path / "lab.yaml"
    shown = dfo("inventory", "import", str(source), "-o", str(out))
    assert shown.returncode == 0, shown.stderr
    inventory = parse_inventory(out.read_text())
    assert {name: (h.address, h.port, h.user) for name, h in inventory.hosts.items()} == {
        "pve1": ("10.1.2.6", 2200, "ops"), "pve2": ("10.1.2.7", None, "ops")}
    broken = tmp_path / "broken.ini"
    broken.write_text("[proxmox]\npve1 ansible_host\n")
    bad = dfo("inventory", "import", str(broken))
    assert bad.returncode == 2 and "line 2: expected key=value after the host name, got 'ansible_host'" in bad.stderr


def test_import_keeps_ansible_groups_and_expands_stride_ranges(tmp_path):
    source = tmp_path / "hosts.yml"
    source.write_text(textwrap.dedent("""\
        all:
          children:
            lab:
              children:
                gpu:
                  hosts:
                    gpu[01:05:2]: {ansible_user: root}
            cpu:
              hosts:
                box[:1]:
        """))
    shown = dfo("inventory", "import", str(source))
    assert shown.returncode == 0, shown.stderr
    assert sorted(parse_inventory(shown.stdout).hosts) == ["box0", "box1", "gpu01", "gpu03", "gpu05"]  # was gpu-01-05-2
    lines = {line.split(":")[0].strip(): line for line in shown.stdout.splitlines() if line.startswith("  ") and
             not line.startswith("    ")}
    assert lines["gpu03"].endswith("# Ansible groups: lab, gpu") and lines["box1"].endswith("# Ansible groups: cpu")
    imported = parse_inventory(shown.stdout)  # and as the inventory's groups, which --host GROUP reads
    assert imported.groups == {"cpu": ["host:box0", "host:box1"], "lab": ["host:gpu01", "host:gpu03", "host:gpu05"],
                               "gpu": ["host:gpu01", "host:gpu03", "host:gpu05"]}
    stride0 = tmp_path / "zero.ini"
    stride0.write_text("[gpu]\ngpu[1:4:0]\n")
    bad = dfo("inventory", "import", str(stride0))
    assert bad.returncode == 2 and "host range '[1:4:0]' in 'gpu[1:4:0]': the stride must be a whole number above 0" in bad.stderr


def test_import_reads_the_json_of_ansible_inventory_list(tmp_path):
    listing = {"_meta": {"hostvars": {"pve1": {"ansible_host": "10.1.2.6", "ansible_user": "ops"},
                                      "pve2": {"ansible_host": "10.1.2.7", "ansible_port": 2222}}},
               "all": {"children": ["ungrouped", "proxmox"]},
               "proxmox": {"hosts": ["pve1", "pve2"]}, "ungrouped": {}}
    source = tmp_path / "listing.json"
    source.write_text(json.dumps(listing))
    shown = dfo("inventory", "import", str(source))
    assert shown.returncode == 0, shown.stderr
    inventory = parse_inventory(shown.stdout)
    assert {name: (h.address, h.port, h.user) for name, h in inventory.hosts.items()} == {
        "pve1": ("10.1.2.6", None, "ops"), "pve2": ("10.1.2.7", 2222, None)}
    assert "# Ansible groups: proxmox" in shown.stdout

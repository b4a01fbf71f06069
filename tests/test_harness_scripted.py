"""The scripted in-memory Target (tests/harness/scripted.py): it answers only what a test scripted, records what
dfo sent, and lets dfo's own logic run over answers no real machine here can give cheaply: a Proxmox host of
forty containers, a wedged driver, a container whose nvidia-smi hangs."""

from __future__ import annotations

import pytest

from harness.scripted import NotScripted, Reply, ScriptedStream, ScriptedTarget
from orchestrator import gpu
from orchestrator.discover import discover, render
from orchestrator.errors import CommandFailed, CommandTimeout

SMI = r"pct exec {vmid} -- timeout -k 2 \d+ nvidia-smi --query-gpu="
H200 = "{index}, NVIDIA H200, 0, 143771, 0\n"


def test_an_unscripted_command_fails_the_test_naming_it_and_every_call_is_recorded():
    target = ScriptedTarget("pve1").on(r"^pct list$", Reply("VMID Status Lock Name\n"), times=1)
    assert target.run(["pct", "list"]).stdout.startswith("VMID")
    with pytest.raises(NotScripted, match=r"pve1: no rule answers: pct list"):  # times=1: used up
        target.run(["pct", "list"])
    with pytest.raises(CommandFailed, match="exited 3"):
        target.on("^false$", Reply(exit_code=3)).run(["false"], check=True)
    target.put_bytes(b"secret", "/ws/.dfo/secrets/r1.env")
    assert target.sent() == ["pct list", "pct list", "false", "put /ws/.dfo/secrets/r1.env"]
    assert target.files["/ws/.dfo/secrets/r1.env"] == (b"secret", 0o600)


def test_a_stream_gives_its_output_then_its_exit_and_keeps_what_dfo_wrote():
    target = ScriptedTarget().on_stream("agent", lambda call: ScriptedStream(b'{"t": "hello"}\n', exit_code=0))
    with target.stream(["python3", "dfo_agent.py"]) as stream:
        stream.write(b'{"cmd": "follow"}\n')
        assert stream.read() == b'{"t": "hello"}\n' and stream.exit_code() == 0 and stream.read() == b""
    assert bytes(target.streams[0].written) == b'{"cmd": "follow"}\n'
    silent = ScriptedStream()
    with pytest.raises(CommandTimeout):
        silent.read(timeout=0.01)


def test_gpu_errors_map_to_their_kind_and_fix_from_the_real_texts_and_exit_codes():
    target = ScriptedTarget("ct200")
    target.on("nvidia-smi", Reply("No devices were found\n", exit_code=6), times=1)
    target.on("nvidia-smi", Reply("Failed to initialize NVML: Driver/library version mismatch\n", exit_code=18), times=1)
    target.on("nvidia-smi", CommandTimeout("no answer"), times=1)
    kinds = []
    for _ in range(3):
        with pytest.raises(gpu.NvidiaSmiError) as caught:
            gpu.query_gpus(target, timeout=15)
        kinds.append(caught.value.kind)
    assert kinds == ["no_devices", "mismatch", "timeout"]
    assert "wedged driver" in str(caught.value)


def test_discover_of_a_host_of_forty_containers_lists_every_one_and_says_which_it_could_not_check():
    """40 running containers with a GPU each (by devN passthrough), but container 205's nvidia-smi hangs and
    container 210 runs a driver whose library does not match: every container is in the inventory, the two
    with what went wrong inside and the GPU its config passes."""
    target = ScriptedTarget("pve1")
    listing = "VMID       Status     Lock         Name\n" + "".join(f"{v}        running                 ct{v}\n"
                                                                 for v in range(200, 240))
    target.on(r"^pct list$", Reply(listing))
    for index, vmid in enumerate(range(200, 240)):
        target.on(rf"^pct config {vmid}$", Reply(f"arch: amd64\ncores: 8\ndev0: /dev/nvidia{index % 8}\n"
                                                 f"hostname: gpu-{vmid}\nmemory: 65536\n"))
        if vmid == 205:
            target.on(SMI.format(vmid=vmid), Reply(exit_code=124))  # timeout(1) ended a hung nvidia-smi
        elif vmid == 210:
            target.on(SMI.format(vmid=vmid), Reply("Failed to initialize NVML: Driver/library version mismatch\n",
                                                   exit_code=18))
        else:
            target.on(SMI.format(vmid=vmid), Reply(H200.format(index=index % 8)))
    found = discover(target, "pve1", "10.1.2.6")
    assert [item.name for item in found.containers] == [f"gpu-{vmid}" for vmid in range(200, 240)]
    assert [item.gpus for item in found.containers][:9] == [[0], [1], [2], [3], [4], [5], [6], [7], [0]]
    text = render(found, when="2026-12-03")
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if line.startswith("      gpu-")}
    assert len(lines) == 40
    assert "# guessed: nvidia-smi failed inside: pve1/205: nvidia-smi did not answer within 15s" in lines["gpu-205"]
    assert "gpus: [5]}" in lines["gpu-205"] and "GPU 5 from its config" in lines["gpu-205"]
    assert "# guessed: nvidia-smi failed inside: pve1/210: NVIDIA driver/library version mismatch" in lines["gpu-210"]
    assert "guessed" not in lines["gpu-211"] and "nvidia-smi: 1 x NVIDIA H200" in lines["gpu-211"]
    assert len(target.sent(r"^pct config ")) == 40 and len(target.sent("nvidia-smi")) == 40

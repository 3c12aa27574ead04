"""A real kernel's shared IOMMU group and PCIe error recovery, as devplugd serves them.

One boot of a QEMU guest (TCG) with an SR-IOV NVMe PF and 2 VFs on vfio-pci (rp0) and a
3-function multifunction NVMe (rp1, one IOMMU group), both on default-speed root ports, with
QEMU's monitor; tests/guest/scenario_health.py runs devplugd (``--uevent-source kernel``) and the
kubelet stand-in there and records every step. What must hold (docs/configuration.md "IOMMU
groups", docs/events.md "PCIe error recovery"; shared/docs/real-kernel-devices.md sections 1 and 2):

- the group is one device, named by its lowest address; Allocate gives ``/dev/vfio/vfio`` and
  the one group node, and the env lists all 3 functions; with one function on nvme the group is
  offered nowhere, back on vfio-pci it returns; the node opens, a second open gets EBUSY;
- a non-fatal error on rp0 (BEGIN_RECOVERY then SUCCESSFUL_RECOVERY on PF and VFs): the stand-in
  sees the VFs Unhealthy, then Healthy, in that order; the PF is never offered;
- a fatal error on rp1 (recovery fails on a default port: FAILED_RECOVERY): the group's device
  Unhealthy, and still so 2 s later.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import report_line
from tests.guest import GuestResult, MultifunctionNvme, SriovNvme, guest_python

PORTS = [SriovNvme(2), MultifunctionNvme(3)]
VFIO_CONTAINER = "/dev/vfio/vfio"
STEPS = [
    "started: VFs on vfio-pci, the group on nvme",
    "the 3 functions to vfio-pci",
    "{mf1} to nvme",
    "{mf1} back to vfio-pci",
    "non-fatal UNSUP on the PF's root port",
    "fatal MALF_TLP on the group's default-speed root port",
]


def health_sequence(messages: list[dict[str, Any]], device: str, before: str = "Healthy") -> list[str]:
    """The health ``device`` had (``before``), then the health the messages gave it in turn,
    repeats dropped. Per device: the daemon
    folds the uevents as they come, so under TCG (BEGIN_RECOVERY about 1 ms apart per function)
    one list can show the first VF Unhealthy and the next not yet, which is what the kernel said."""
    sequence = [before]
    for message in messages:
        health = message["devices"].get(device, "absent")
        if sequence[-1] != health:
            sequence.append(health)
    return sequence


def first_ms(messages: list[dict[str, Any]], devices: list[str], health: str) -> float:
    """When a message first had every one of ``devices`` at ``health``."""
    return next(m["at_ms"] for m in messages if all(m["devices"].get(d) == health for d in devices))


def test_a_shared_group_is_one_device_and_pcie_errors_reach_the_kubelet(
    short_tmp: Path, request: pytest.FixtureRequest, qemu_guest: Callable[..., GuestResult],
) -> None:
    share = short_tmp / "share"
    share.mkdir()
    guest = qemu_guest(guest_python("-m", "tests.guest.scenario_health"), ports=PORTS, share=share,
                         monitor=True, timeout=240)
    result = json.loads((share / "result.json").read_text())
    daemon_log = (share / "daemon.log").read_text(errors="replace")
    steps = {step["name"]: step for step in result["steps"]}
    mf, vfs, pf = result["mf"], result["vfs"], result["pf"]
    names = [name.format(mf1=mf[1]) for name in STEPS]
    context = f"{guest.describe()}\n--- daemon log (tail) ---\n{daemon_log[-4000:]}"
    assert [step["name"] for step in result["steps"]] == names, context
    for step in result["steps"]:
        assert step["settled"], f"{step['name']}: wanted {step['wanted']}, saw {step['seen']}\n{step}\n{context}"

    started, bound, moved, back, non_fatal, fatal = (steps[name] for name in names)
    non_fatal_vfs = non_fatal["messages"]["vfs"]
    first_unhealthy_ms = next(m["at_ms"] for m in non_fatal_vfs if "Unhealthy" in m["devices"].values())
    unhealthy_ms = first_ms(non_fatal_vfs, vfs, "Unhealthy")
    healthy_ms = first_ms(non_fatal_vfs, vfs, "Healthy")
    fatal_ms = first_ms(fatal["messages"]["mf"], [mf[0]], "Unhealthy")
    report_line(request, f"guest health: boot {guest.boot_seconds:.1f} s, daemon READY {result['ready_s']:.1f} s, "
                         f"group offered {bound['settle_ms']['mf']} ms after the binds, gone "
                         f"{moved['settle_ms']['mf']} ms after nvme, back {back['settle_ms']['mf']} ms; non-fatal "
                         f"injection -> a VF Unhealthy {first_unhealthy_ms} ms, both {unhealthy_ms} ms -> Healthy {healthy_ms} ms; fatal -> "
                         f"Unhealthy {fatal_ms} ms; command {guest.command_seconds:.1f} s, QEMU wall "
                         f"{guest.wall_seconds:.1f} s{' (poweroff hung, killed)' if guest.poweroff_hung else ''}")

    # The multifunction slot is one IOMMU group; the stand-in holds one device for it.
    assert len(set(result["mf_groups"])) == 1 and result["mf_group"] == result["mf_groups"][0], result
    group = result["mf_group"]
    assert started["seen"] == {"vfs": {vf: "Healthy" for vf in vfs}, "mf": {}}, started
    assert bound["seen"]["mf"] == {mf[0]: "Healthy"}, bound
    for message in bound["messages"]["mf"]:  # never a function of the group on its own
        assert set(message["devices"]) <= {mf[0]}, bound["messages"]["mf"]
    resource = result["resources"]["mf"]
    for step in (bound, back):
        allocation = step["allocation"]
        assert allocation["host_paths"] == sorted([VFIO_CONTAINER, f"/dev/vfio/{group}"]), allocation
        env = allocation["envs"]
        assert env["PCIDEVICE_DEVPLUGD_TEST_MF"].split(",") == mf, env
        assert env["PCI_RESOURCE_" + resource.upper().replace("/", "_").replace(".", "_")].split(",") == mf, env
        info = json.loads(env["PCIDEVICE_DEVPLUGD_TEST_MF_INFO"])
        assert sorted(info) == mf, info  # docs/configuration.md: every function in PCIDEVICE_* and _INFO
        assert all(entry["vfio"]["dev-mount"] == f"/dev/vfio/{group}" for entry in info.values()), info
    assert moved["drivers"][mf[1]] == "nvme" and moved["seen"]["mf"] == {}, moved
    assert back["drivers"][mf[1]] == "vfio-pci" and back["seen"]["mf"] == {mf[0]: "Healthy"}, back
    opened = back["group_open"]
    assert opened["first_open"] == "ok" and opened["viable"], opened
    assert opened["second_open"] == "EBUSY", opened

    # Non-fatal on rp0: the kernel's BEGIN then SUCCESSFUL on PF and VFs; the stand-in sees the
    # VFs (the pool; the PF stays on nvme, never offered) Unhealthy, then Healthy, in that order.
    kinds = [(event["name"], event["error_event"]) for event in non_fatal["uevents"]]
    assert [name for name, kind in kinds if kind == "BEGIN_RECOVERY"] == [pf, *vfs], kinds
    assert [name for name, kind in kinds if kind == "SUCCESSFUL_RECOVERY"] == [pf, *vfs], kinds
    for vf in vfs:
        assert health_sequence(non_fatal_vfs, vf) == ["Healthy", "Unhealthy", "Healthy"], (vf, non_fatal_vfs)
    assert unhealthy_ms < healthy_ms, non_fatal_vfs
    for step in result["steps"]:
        assert pf not in step["seen"]["vfs"] and pf not in step["seen"]["mf"], step
    assert non_fatal["seen"]["mf"] == {mf[0]: "Healthy"}, non_fatal  # another port: untouched

    # Fatal on rp1's default-speed port: recovery fails; Unhealthy, and it stays so.
    fatal_kinds = {(event["name"], event["error_event"]) for event in fatal["uevents"]}
    assert {(function, "FAILED_RECOVERY") for function in mf} <= fatal_kinds, fatal["uevents"]
    assert not any(kind == "SUCCESSFUL_RECOVERY" for _, kind in fatal_kinds), fatal["uevents"]
    assert health_sequence(fatal["messages"]["mf"], mf[0]) == ["Healthy", "Unhealthy"], fatal["messages"]["mf"]
    assert fatal["seen_after"]["mf"] == {mf[0]: "Unhealthy"}, fatal
    assert fatal["seen_after"]["vfs"] == {vf: "Healthy" for vf in vfs}, fatal

    assert result["daemon_alive"] and result["daemon_exit"] == 0, daemon_log[-3000:]
    assert "Traceback" not in daemon_log, daemon_log[-3000:]
    assert "guest health: done" in guest.output

"""Real SR-IOV from a real kernel: a QEMU guest (TCG) with two emulated NVMe SR-IOV PFs behind an
emulated VT-d runs devplugd and the kubelet stand-in against its own ``/sys`` and ``/dev``.

tests/guest/scenario_sriov.py writes ``sriov_numvfs`` (0 -> N -> 0 -> N), binds VFs to vfio-pci
through ``driver_override``, unbinds and rebinds them (last, half of them unbind, bind, unbind
back to back); after each step the kubelet stand-in must hold exactly the vfio-bound VFs,
healthy, and Allocate must hand out ``/dev/vfio/<group>`` for the group the kernel's
``iommu_group`` link names (a real character device in the guest).

Twice: with ``--uevent-source kernel`` (the daemon's own netlink socket), and with ``auto`` in a
guest running a real systemd-udevd, the production path on a real host: ``auto`` must pick
``udev``, and every step must hold through udev's added latency (0.2-125 ms; vfio-pci binds
~110 ms) and its reordering of events across devices.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import report_line
from tests.guest import GuestResult, guest_python

PF_VFS = [4, 8]  # sriov_totalvfs of the two PFs
VFIO_CONTAINER = "/dev/vfio/vfio"
# --uevent-source -> what the daemon's startup log line must say it listens to
SOURCES = {"kernel": "uevents: kernel (netlink uevent group 1", "auto": "uevents: udev (libudev monitor, udev group"}

# step name -> how many VFs of each PF are bound to vfio-pci after it
STEPS = {
    "started, no VFs": [0, 0],
    "VFs created, only the last bound": [1, 1],
    "all VFs bound to vfio-pci": PF_VFS,
    "every other VF unbound": [n // 2 for n in PF_VFS],
    "unbound VFs bound again": PF_VFS,
    "sriov_numvfs 0": [0, 0],
    "VFs created again, only the last bound": [1, 1],
    "all new VFs bound to vfio-pci": PF_VFS,
    "every other VF unbound, bound and unbound again at once": [n // 2 for n in PF_VFS],
}


def describe(step: dict[str, Any]) -> str:
    return f"step {step['name']!r}: sysfs says {step['expected']}, the kubelet saw {step['seen']}"


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_kubelet_sees_exactly_the_vfio_bound_vfs_of_a_real_kernel(
    short_tmp: Path, request: pytest.FixtureRequest, source: str, qemu_guest: Callable[..., GuestResult],
) -> None:
    share = short_tmp / "share"
    share.mkdir()
    udevd = source != "kernel"
    # about a minute on a quiet machine; the timeout leaves room for a loaded one (TCG is CPU-bound)
    guest = qemu_guest(guest_python("-m", "tests.guest.scenario_sriov"), pfs=PF_VFS, share=share, timeout=300,
                         env={"UEVENT_SOURCE": source}, udevd=udevd)
    result = json.loads((share / "result.json").read_text())
    daemon_log = (share / "daemon.log").read_text(errors="replace")
    settle = [step["settle_s"] for step in result["steps"] if step["settle_s"] is not None]
    delivery = result["udev_delivery"]
    udev = (f", udevd start+trigger+settle {guest.udevd_seconds:.1f} s, udev passed on {delivery['matched']} "
            f"uevents ({delivery['late']} reordered across devices, lag median {delivery['lag_median_ms']} ms, "
            f"max {delivery['lag_max_ms']} ms)") if udevd else ""
    report_line(request, f"guest SR-IOV ({source}): boot {guest.boot_seconds:.1f} s{udev}, daemon READY "
                         f"{result['ready_s']:.1f} s, steps settled in {', '.join(f'{s:.2f}' for s in settle)} s, "
                         f"command {guest.command_seconds:.1f} s, QEMU wall {guest.wall_seconds:.1f} s")

    assert SOURCES[source] in daemon_log, f"--uevent-source {source}: the daemon said\n{daemon_log[:3000]}"

    assert len(result["pfs"]) == 2, result
    groups_before: set[str] = set()
    for step, counts in zip(result["steps"], STEPS.values()):
        assert step["settled"], f"{describe(step)}\n{step.get('daemon_threads')}\n{daemon_log[-3000:]}"
        resources = [result["resources"][pf] for pf in result["pfs"]]
        assert [len(step["expected"][resource]) for resource in resources] == counts, describe(step)
        for resource in resources:
            expected = step["expected"][resource]
            assert step["seen"][resource] == {device: "Healthy" for device in expected}, describe(step)
            for device, group in expected.items():
                assert step["allocations"][resource][device] == sorted([VFIO_CONTAINER, f"/dev/vfio/{group}"])
                assert step["vfio_nodes"][group], f"/dev/vfio/{group} is not a character device in the guest"
        if step["name"] == "all VFs bound to vfio-pci":
            groups_before = {group for resource in resources for group in step["expected"][resource].values()}
    assert [step["name"] for step in result["steps"]] == list(STEPS)
    assert len(groups_before) == sum(PF_VFS)  # one IOMMU group per VF, as the emulated VT-d gives

    first_offered = result["offered_first"]
    assert result["preferred"][0] == first_offered[-1] and len(set(result["preferred"])) == 2
    assert set(result["preferred"]) <= set(first_offered)
    assert result["daemon_alive"] and result["daemon_exit"] == 0, daemon_log[-3000:]
    assert "Traceback" not in daemon_log, daemon_log[-3000:]

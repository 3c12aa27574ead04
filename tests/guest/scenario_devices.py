"""Run inside the QEMU guest (tests/test_guest_devices.py boots it): the harness's newer pieces.

The guest has an SR-IOV NVMe PF (rp0), a 3-function multifunction NVMe on a 2.5GT/s x1 port
(rp1), two NVMe behind a pcie-pci-bridge on a default port (rp2), a real systemd-udevd, and
QEMU's monitor reachable through the share. In order:

1. ``info pci`` through the monitor relay.
2. IOMMU groups: the multifunction slot is one group of 3, the bridge and its NVMe one group of
   3, the PF and each VF groups of their own.
3. The multifunction group to vfio-pci function by function (``/dev/vfio/<group>`` exists from
   the first bind on, one node for all three), back off (the node goes) and back to nvme.
4. AER through QEMU: non-fatal ``UNSUP`` on rp0 with the PF on nvme and 2 VFs on vfio-pci;
   fatal ``MALF_TLP`` on rp1 (slow link: recovery succeeds); fatal on rp2 (default link:
   recovery fails). The uevents are read by a listener on the kernel's and udev's groups.

It asserts nothing: ``result.json`` in the share has what was seen and the test decides.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tests.guest.devices import (
    PCI_DEVICES,
    VFIO_DRIVER,
    bind,
    driver_of,
    functions_below,
    group_functions,
    iommu_group_of,
    nvme_pfs,
    ports,
    set_num_vfs,
    unbind,
    vfio_node,
    vfs_of,
    write,
)
from tests.guest.listener import KERNEL, UDEV, Uevent, UeventListener, recovery
from tests.guest.monitor import FATAL, NON_FATAL, hmp, inject_aer

RECOVERY_TIMEOUT = 15.0  # a fatal one waits 1 s (success) or 2 s (failure) in the kernel, TCG is slow


def vfio_nodes() -> list[str]:
    return sorted(name for name in os.listdir("/dev/vfio") if name != "vfio")


def groups_report(topology: list[dict[str, Any]]) -> dict[str, Any]:
    report = {}
    for port in topology:
        below = functions_below(port["address"])
        report[port["id"]] = {
            "kind": port["kind"], "below": below,
            "groups": {function: iommu_group_of(function) for function in below},
            "group_members": {function: group_functions(iommu_group_of(function)) for function in below},
            "drivers": {function: driver_of(function) for function in below},
        }
    return report


def bind_group(functions: list[str]) -> dict[str, Any]:
    """Each function to vfio-pci in turn, noting /dev/vfio after each; then all off and back to nvme."""
    group = iommu_group_of(functions[0])
    before = vfio_nodes()
    after_each = []
    for function in functions:
        bind(function, VFIO_DRIVER)
        after_each.append(vfio_nodes())
    drivers_bound = [driver_of(function) for function in functions]
    for function in functions:
        unbind(function)
    time.sleep(0.2)
    after_unbind = vfio_nodes()
    for function in functions:
        bind(function, "nvme")
    return {"group": group, "before": before, "after_each": after_each, "drivers_bound": drivers_bound,
            "after_unbind": after_unbind, "node_exists_after_unbind": vfio_node(group).exists(),
            "drivers_after": [driver_of(function) for function in functions]}


def event_record(event: Uevent, origin: float) -> dict[str, Any]:
    return {"source": event.source, "seqnum": event.seqnum, "action": event.action, "name": event.name,
            "subsystem": event.subsystem, "error_event": event.properties.get("ERROR_EVENT"),
            "online": event.properties.get("DEVICE_ONLINE"), "id_path": event.properties.get("ID_PATH"),
            "at_ms": round((event.received - origin) * 1000, 1)}


def inject(listener: UeventListener, port: str, error: str, outcome: str, functions: list[str]) -> dict[str, Any]:
    """Inject ``error`` on ``port``; wait until udev has passed on ``outcome`` for every function
    (udev's copy comes after the kernel's)."""
    start = len(listener.snapshot())

    def done(events: list[Uevent]) -> bool:
        return {event.name for event in recovery(events[start:], outcome, source="udev")} >= set(functions)

    reply = inject_aer(port, error)
    try:
        events = listener.wait_for(done, RECOVERY_TIMEOUT)[start:]
        timed_out = False
    except AssertionError:
        events, timed_out = listener.snapshot()[start:], True
    time.sleep(0.3)  # stragglers (the kernel sends nothing more after the outcome; check that)
    events = listener.snapshot()[start:]
    return {"port": port, "error": error, "reply": reply.text.strip(),
            "round_trip_ms": round((reply.replied_at - reply.requested_at) * 1000, 1), "timed_out": timed_out,
            "events": [event_record(event, reply.requested_at) for event in events
                       if event.properties.get("ERROR_EVENT") or event.subsystem == "nvme"]}


def lags(events: list[Uevent]) -> list[float]:
    """Kernel -> udev lag (ms) per SEQNUM seen on both groups."""
    kernel = {event.seqnum: event.received for event in events if event.source == "kernel"}
    return sorted(round((event.received - kernel[event.seqnum]) * 1000, 1)
                  for event in events if event.source == "udev" and event.seqnum in kernel)


def run(share: Path) -> None:
    started = time.monotonic()
    topology = ports()
    by_kind = {port["kind"]: port for port in topology}
    report: dict[str, Any] = {"topology": topology, "udev_control": Path("/run/udev/control").exists()}
    info = hmp("info pci")
    report["info_pci"] = {"text": info.text, "round_trip_ms": round((info.replied_at - info.requested_at) * 1000, 1)}

    pf = nvme_pfs()[0]
    write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "0")
    set_num_vfs(pf, 2)
    report["groups"] = groups_report(topology)

    with UeventListener(KERNEL | UDEV) as listener:
        mf = functions_below(by_kind["multifunction"]["address"])
        report["multifunction_vfio"] = bind_group(mf)
        for vf in vfs_of(pf):
            bind(vf, VFIO_DRIVER)
        time.sleep(0.3)  # udev's copies of the bind events (about 110 ms behind)
        report["bind_lags_ms"] = lags(listener.snapshot())
        sriov = [pf, *vfs_of(pf)]
        bridge_nvme = [f for f in functions_below(by_kind["bridge"]["address"]) if driver_of(f) == "nvme"]
        report["aer"] = [
            inject(listener, by_kind["sriov"]["id"], NON_FATAL, "SUCCESSFUL_RECOVERY", sriov),
            inject(listener, by_kind["multifunction"]["id"], FATAL, "SUCCESSFUL_RECOVERY", mf),
            inject(listener, by_kind["bridge"]["id"], FATAL, "FAILED_RECOVERY", bridge_nvme),
        ]
        report["all_lags_ms"] = lags(listener.snapshot())
        report["overflows"] = listener.overflows
        report["udev_id_path"] = next((event.properties.get("ID_PATH") for event in listener.snapshot()
                                       if event.source == "udev" and event.name == pf), None)
    report["script_seconds"] = round(time.monotonic() - started, 2)
    (share / "result.json").write_text(json.dumps(report, indent=1))
    print("guest devices: done", flush=True)


if __name__ == "__main__":
    run(Path(os.environ["GUEST_SHARE"]))

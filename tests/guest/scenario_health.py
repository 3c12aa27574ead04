"""Run inside the QEMU guest (tests/test_real_kernel_health.py boots it): devplugd and the kubelet
stand-in against a real kernel's shared IOMMU group and its PCIe error recovery.

The guest has an SR-IOV NVMe PF with 2 VFs (rp0) and a 3-function multifunction NVMe (rp1, one
IOMMU group), both on default-speed root ports, and QEMU's monitor reachable through the share.
The daemon runs with ``--uevent-source kernel`` and two pciDevice pools: ``vfs`` (the PF's VFs,
by ``rootDevices``; the PF stays on nvme and is not offered) and ``mf`` (the 3 functions, by
``pciAddresses``). In order:

1. the 3 functions to vfio-pci: ``mf`` must hold one device (the lowest address), Allocate of it
   the container and the one group node, the env naming all 3;
2. one function to nvme (the group is not viable): ``mf`` empty; back to vfio-pci: it returns;
   the group node opens from this process (as a workload's would), a second open gets EBUSY;
3. non-fatal ``UNSUP`` on rp0: the VFs Unhealthy, then Healthy;
4. fatal ``MALF_TLP`` on rp1 (default link: recovery fails): the group's device Unhealthy, and
   still so 2 s later. Last: after a failed recovery the guest may hang in poweroff.

It asserts nothing: each step's stand-in view, ListAndWatch messages (with arrival times
relative to the step's action) and the kernel's recovery uevents go to ``result.json``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.guest.devices import (
    NVME_DRIVER,
    PCI_DEVICES,
    VFIO_DRIVER,
    bind,
    driver_of,
    functions_below,
    iommu_group_of,
    ports,
    set_num_vfs,
    vfio_node,
    vfs_of,
    write,
)
from tests.guest.listener import KERNEL, Uevent, UeventListener
from tests.guest.monitor import FATAL, NON_FATAL, Reply, inject_aer
from tests.guest.scenario_sriov import PREFIX, Scenario

STEP_TIMEOUT = 30.0
QUIET = 0.5  # a step's view must hold this long
STILL_UNHEALTHY_AFTER = 2.0  # after a failed fatal recovery: nothing may make it Healthy again
VFIO_GROUP_GET_STATUS = 0x3B67  # _IO(VFIO_TYPE ';', VFIO_BASE 100 + 3)
VFIO_GROUP_FLAGS_VIABLE = 1
View = dict[str, str]  # device ID -> health


class HealthScenario(Scenario):
    """scenario_sriov's daemon and stand-in with this scenario's two pools."""

    def __init__(self, share: Path, pf: str, mf: list[str]) -> None:
        super().__init__(share, [pf])
        self.pf, self.mf = pf, mf
        self.resources = {"vfs": f"{PREFIX}/vfs", **({"mf": f"{PREFIX}/mf"} if mf else {})}

    def config(self) -> dict[str, Any]:
        """``vfs``: the PF's VFs; ``mf`` (without ``mf``, none: benchmarks/guest_aer.py): the group."""
        pools = [{"resourceName": "vfs", "resourcePrefix": PREFIX, "deviceType": "pciDevice",
                  "selectors": {"rootDevices": [self.pf]}}]
        if self.mf:
            pools.append({"resourceName": "mf", "resourcePrefix": PREFIX, "deviceType": "pciDevice",
                          "selectors": {"pciAddresses": self.mf}})
        return {"resourceList": pools}

    def view(self, pool: str) -> View:
        return {device: health for device, (health, _) in self.kubelet.state(self.resources[pool]).devices.items()}

    def wait_view(self, pool: str, wanted: View, timeout: float = STEP_TIMEOUT) -> float | None:
        """When the stand-in's view of ``pool`` first equalled ``wanted``, if it then held QUIET s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.kubelet.wait_for(lambda _: self.view(pool) == wanted, max(0.0, deadline - time.monotonic()))
            except AssertionError:
                return None
            matched = time.monotonic()
            time.sleep(QUIET)
            if self.view(pool) == wanted:
                return matched
        return None

    def messages_since(self, pool: str, start: int, origin: float) -> list[dict[str, Any]]:
        """The ListAndWatch messages of ``pool`` from index ``start`` on: devices, health, arrival
        in ms after ``origin``."""
        state = self.kubelet.state(self.resources[pool])
        return [{"at_ms": round((at - origin) * 1000, 1), "devices": {d: h for d, (h, _) in message.items()}}
                for message, at in zip(state.messages[start:], state.received_at[start:])]

    def allocate(self, pool: str, device: str) -> dict[str, Any]:
        response = self.kubelet.allocate(self.resources[pool], [device], timeout=20).container_responses[0]
        return {"host_paths": sorted(spec.host_path for spec in response.devices), "envs": dict(response.envs)}


def open_group_twice(group: str) -> dict[str, Any]:
    """Open ``/dev/vfio/<group>`` as a workload would, then again while the first is held."""
    node = vfio_node(group)
    record: dict[str, Any] = {"node": str(node)}
    first = os.open(node, os.O_RDWR)
    try:
        record["first_open"] = "ok"
        status = fcntl.ioctl(first, VFIO_GROUP_GET_STATUS, struct.pack("=II", 8, 0))
        record["viable"] = bool(struct.unpack("=II", status)[1] & VFIO_GROUP_FLAGS_VIABLE)
        try:
            second = os.open(node, os.O_RDWR)
        except OSError as exc:
            record["second_open"] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        else:
            os.close(second)
            record["second_open"] = "ok"
    finally:
        os.close(first)
    return record


def kernel_recovery(events: list[Uevent], origin: float) -> list[dict[str, Any]]:
    return [{"name": event.name, "error_event": event.properties["ERROR_EVENT"],
             "at_ms": round((event.received - origin) * 1000, 1)}
            for event in events if event.source == "kernel" and "ERROR_EVENT" in event.properties]


def first_at(messages: list[dict[str, Any]], predicate: Callable[[View], bool], after: int = 0) -> int | None:
    return next((i for i in range(after, len(messages)) if predicate(messages[i]["devices"])), None)


def run(share: Path) -> None:
    topology = {port["kind"]: port for port in ports()}
    sriov, multi = topology["sriov"], topology["multifunction"]
    pf = functions_below(sriov["address"])[0]
    mf = functions_below(multi["address"])
    write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "0")
    set_num_vfs(pf, 2)
    vfs = vfs_of(pf)
    for vf in vfs:
        bind(vf, VFIO_DRIVER)
    scenario = HealthScenario(share, pf, mf)
    group = iommu_group_of(mf[0])
    steps: list[dict[str, Any]] = []
    report: dict[str, Any] = {"pf": pf, "vfs": vfs, "mf": mf, "mf_group": group,
                              "mf_groups": [iommu_group_of(f) for f in mf], "steps": steps,
                              "resources": scenario.resources}

    def refresh(record: dict[str, Any]) -> None:
        """The step's messages and recovery uevents so far, in ms after its action."""
        origin = record["origin"]
        record["messages"] = {pool: scenario.messages_since(pool, start, origin)
                              for pool, start in record["message_starts"].items()}
        record["uevents"] = kernel_recovery(listener.snapshot()[record["uevents_from"]:], origin)

    def step(name: str, action: Callable[[], Reply | None], wanted: dict[str, View],
             through: tuple[str, View] | None = None) -> dict[str, Any]:
        """Act, then (``through``: until a message of that pool showed that view) until the
        stand-in's views are ``wanted``."""
        starts = {pool: len(scenario.kubelet.state(resource).messages) for pool, resource in scenario.resources.items()}
        events_from = len(listener.snapshot())
        started = time.monotonic()
        reply = action()
        origin = reply.requested_at if reply is not None else started
        passed = True
        if through is not None:
            pool, view = through
            state = scenario.kubelet.state(scenario.resources[pool])

            def shown(_: Any) -> bool:
                return any({d: h for d, (h, _) in m.items()} == view for m in state.messages[starts[pool]:])

            try:
                scenario.kubelet.wait_for(shown, STEP_TIMEOUT)
            except AssertionError:
                passed = False
        settled = {pool: scenario.wait_view(pool, view) for pool, view in wanted.items()}
        record: dict[str, Any] = {
            "name": name, "wanted": wanted, "through": through, "passed_through": passed,
            "seen": {pool: scenario.view(pool) for pool in scenario.resources},
            "settled": passed and all(at is not None for at in settled.values()),
            "settle_ms": {pool: None if at is None else round((at - origin) * 1000, 1) for pool, at in settled.items()},
            "origin": origin, "message_starts": starts, "uevents_from": events_from,
            "drivers": {f: driver_of(f) for f in [pf, *vfs, *mf]},
        }
        refresh(record)
        if reply is not None:
            record["reply"] = reply.text.strip()
            record["round_trip_ms"] = round((reply.replied_at - reply.requested_at) * 1000, 1)
        steps.append(record)
        print(f"step {name}: settled={record['settled']} {record['settle_ms']}", flush=True)
        if not record["settled"] and scenario.process is not None:
            record["daemon_threads"] = scenario.stuck_report(scenario.process)
        return record

    healthy_vfs = {vf: "Healthy" for vf in vfs}
    with UeventListener(KERNEL) as listener, scenario.daemon() as daemon:
        try:
            report["ready_s"] = scenario.ready_s
            ok = step("started: VFs on vfio-pci, the group on nvme", lambda: None, {"vfs": healthy_vfs, "mf": {}})["settled"]

            def bind_group() -> None:
                for function in mf:
                    bind(function, VFIO_DRIVER)

            if ok:
                record = step("the 3 functions to vfio-pci", bind_group, {"mf": {mf[0]: "Healthy"}})
                ok = record["settled"]
                if ok:
                    record["allocation"] = scenario.allocate("mf", mf[0])
            if ok:
                ok = step(f"{mf[1]} to nvme", lambda: bind(mf[1], NVME_DRIVER), {"mf": {}})["settled"]
            if ok:
                record = step(f"{mf[1]} back to vfio-pci", lambda: bind(mf[1], VFIO_DRIVER), {"mf": {mf[0]: "Healthy"}})
                ok = record["settled"]
                if ok:
                    record["allocation"] = scenario.allocate("mf", mf[0])
                    record["group_open"] = open_group_twice(group)
            if ok:
                record = step("non-fatal UNSUP on the PF's root port", lambda: inject_aer(sriov["id"], NON_FATAL),
                              {"vfs": healthy_vfs, "mf": {mf[0]: "Healthy"}},
                              through=("vfs", {vf: "Unhealthy" for vf in vfs}))
                ok = record["settled"]
            if ok:
                record = step("fatal MALF_TLP on the group's default-speed root port",
                              lambda: inject_aer(multi["id"], FATAL), {"mf": {mf[0]: "Unhealthy"}})
                time.sleep(STILL_UNHEALTHY_AFTER)
                record["after_s"] = STILL_UNHEALTHY_AFTER
                record["seen_after"] = {pool: scenario.view(pool) for pool in scenario.resources}
                refresh(record)
        finally:
            report["daemon_alive"] = daemon.poll() is None
            (share / "result.json").write_text(json.dumps(report, indent=1))
    report["daemon_exit"] = daemon.returncode
    (share / "result.json").write_text(json.dumps(report, indent=1))
    print("guest health: done", flush=True)


if __name__ == "__main__":
    run(Path(os.environ["GUEST_SHARE"]))

"""Run inside the QEMU guest (tests/test_real_kernel_usb.py boots it): devplugd's usbDevice pools
and a udev-selected devNode pool against real USB hotplug and a real systemd-udevd.

The guest has an empty qemu-xhci (``run_in_guest(usb=True)``), a real udevd and QEMU's monitor.
The daemon runs with ``--uevent-source udev`` and four pools (docs/configuration.md's usbDevice and
``selectors.udev`` examples): ``usb_kbd`` (vendor 0627), ``usb_serial`` (0403:6001),
``usb_disk`` (driver usb-storage), ``ftdi_tty`` (tty nodes whose udev properties say FTDI with
serial FTDI0042, mounted at their ``/dev/serial/by-id`` link) and ``port4_tty`` (the tty whose
ancestors are an FTDI interface on the device udev's ID_PATH puts on port 4: parentProperties). In order, each step waiting until
the kubelet stand-in shows the spec's answer (``WANTED``) and holds it for QUIET s:

1. the daemon starts with FTDI0042 (port 2) already plugged and udev settled: its scan offers
   it, and ftdi_tty's selector matches on udev's database; Allocate both; the other pools empty;
2. the keyboard (KBD0001, port 1): Allocate it;
3. the storage STOR4242 (port 3, bus 2): Allocate it once ``sda1`` is there (>1 s after), and
   the CDI spec must come to list the same nodes;
4. the FTDI without a serial (port 4): ``port-1-4``; Allocate it;
5. ``device_del`` of FTDI0042: gone from ``usb_serial`` and ``ftdi_tty``;
6. FTDI0042 again on port 2 (now through events): the same IDs back; Allocate both again;
7. FTDI0042 unplugged while the kubelet's checkpoint names it: listed Unhealthy (the vanished
   rule); then the checkpoint without it: gone;
8. everything unplugged: every pool empty.

It asserts nothing: each step's views, the latency from ``device_add``/``device_del`` to the
stand-in's first message that shows the change (its arrival stamps), the Allocate answers with the
nodes sysfs has at that moment (``tests.guest.usb.device_nodes``), udev's symlinks and a summary
of the uevents go to ``result.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.guest.listener import KERNEL, UDEV, Uevent, UeventListener
from tests.guest.monitor import Reply
from tests.guest.scenario_sriov import PREFIX, Scenario
from tests.guest.usb import (
    DISK,
    FTDI,
    FTDI_NO_SERIAL,
    KEYBOARD,
    UsbDevice,
    describe,
    device_nodes,
    plug,
    unplug,
    usb_sysfs_name,
    wait_bound,
    wait_gone,
)
from tests.kubelet import FakeKubelet
from tests.waiting import wait_until

STEP_TIMEOUT = 20.0  # TCG: a plug settles in 1-2 s; a missing device costs this much once
QUIET = 0.5
MAX_FAILED = 2
POOLS: dict[str, dict[str, Any]] = {
    "usb_kbd": {"deviceType": "usbDevice", "selectors": {"vendors": ["0627"]}},
    "usb_serial": {"deviceType": "usbDevice", "selectors": {"vendors": ["0403"], "products": ["6001"]}},
    "usb_disk": {"deviceType": "usbDevice", "selectors": {"drivers": ["usb-storage"]}},
    "ftdi_tty": {"deviceType": "devNode", "containerPath": "by-id",
                 "selectors": {"udev": {"subsystems": ["tty"],
                                        "properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "FTDI0042"}}}},
    # The tty on port 4 (the serial-less FTDI: no earlier pool takes it, first match wins), by its
    # ancestors, each key from a different one: the interface's kernel uevent (DEVTYPE), the
    # usb-serial port's (DRIVER), udev's database entry of the usb_device (ID_PATH; the file is
    # c189:N, the usb_device having a node).
    "port4_tty": {"deviceType": "devNode",
                  "selectors": {"udev": {"subsystems": ["tty"],
                                         "parentProperties": {"DEVTYPE": "usb_interface", "DRIVER": "ftdi_sio",
                                                              "ID_PATH": "pci-*-usb-0:4"}}}},
}
View = dict[str, str]  # device ID -> health


class UsbScenario(Scenario):
    """scenario_sriov's daemon and stand-in with USB pools; ``name`` keeps two apart in one guest
    (benchmarks/guest_usb.py runs a ``udev`` and a ``kernel`` one side by side)."""

    def __init__(self, share: Path, *, uevent_source: str = "udev", name: str = "usb",
                 pools: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(share, [])
        self.pools = POOLS if pools is None else pools
        self.work = Path(f"/tmp/devplugd-{name}")
        self.kubelet = FakeKubelet(self.work / "device-plugins")
        self.uevent_source = uevent_source
        self.log_name = "daemon.log" if name == "usb" else f"daemon-{name}.log"
        self.resources = {pool: f"{PREFIX}/{pool}" for pool in self.pools}

    def config(self) -> dict[str, Any]:
        return {"resourceList": [{"resourceName": pool, "resourcePrefix": PREFIX, **entry}
                                 for pool, entry in self.pools.items()]}

    def view(self, pool: str) -> View:
        return {device: health for device, (health, _) in self.kubelet.state(self.resources[pool]).devices.items()}

    def views(self) -> dict[str, View]:
        return {pool: self.view(pool) for pool in self.pools}

    def message_counts(self) -> dict[str, int]:
        return {pool: len(self.kubelet.state(resource).messages) for pool, resource in self.resources.items()}

    def wait_views(self, wanted: dict[str, View], timeout: float = STEP_TIMEOUT) -> float | None:
        """When the stand-in first showed ``wanted`` for every pool, if it then held QUIET s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return None  # a dead daemon would cost every later step the whole timeout
            try:
                self.kubelet.wait_for(lambda _: self.views() == wanted, min(1.0, max(0.0, deadline - time.monotonic())))
            except AssertionError:
                continue
            matched = time.monotonic()
            time.sleep(QUIET)
            if self.views() == wanted:
                return matched
        return None

    def first_message(self, pool: str, start: int, device: str, health: str | None) -> float | None:
        """Arrival (stand-in's ``time.monotonic()``) of the first message of ``pool`` from index
        ``start`` that lists ``device`` with ``health`` (None: without ``device``)."""
        state = self.kubelet.state(self.resources[pool])
        return next((at for message, at in zip(state.messages[start:], state.received_at[start:])
                     if (message[device][0] if device in message else None) == health), None)

    def allocate(self, pool: str, device: str) -> dict[str, Any]:
        """Allocate ``device`` alone: its specs and envs, with what sysfs shows at that moment."""
        response = self.kubelet.allocate(self.resources[pool], [device], timeout=20).container_responses[0]
        return {"specs": sorted(({"host": spec.host_path, "container": spec.container_path,
                                  "permissions": spec.permissions} for spec in response.devices),
                                key=lambda spec: spec["host"]),
                "envs": dict(response.envs)}


def tty_of(device: UsbDevice) -> str | None:
    """The ttyUSBn below the FTDI's interface, from sysfs."""
    nodes = [Path(node).name for node in device_nodes(usb_sysfs_name(device)) if "/ttyUSB" in node]
    return nodes[0] if nodes else None


def by_id_links() -> dict[str, str]:
    """udev's ``/dev/*/by-id`` symlinks and their targets (resolved)."""
    links = {}
    for root in (Path("/dev/serial/by-id"), Path("/dev/input/by-id"), Path("/dev/disk/by-id")):
        if root.is_dir():
            for link in sorted(root.iterdir()):
                links[str(link)] = os.path.realpath(link)
    return links


def cdi_nodes(scenario: UsbScenario, pool: str) -> dict[str, list[str]]:
    """The pool's CDI spec: device name -> its deviceNodes' host paths."""
    found: dict[str, list[str]] = {}
    for spec in (scenario.work / "cdi").glob(f"*-{pool}.json"):
        try:
            document = json.loads(spec.read_text())
        except (OSError, ValueError):
            continue  # being replaced: the next look sees the new one
        for device in document.get("devices", []):
            nodes = device.get("containerEdits", {}).get("deviceNodes", [])
            found[device["name"]] = sorted(node.get("hostPath", node["path"]) for node in nodes)
    return found


def wait_cdi(scenario: UsbScenario, pool: str, nodes: list[str], timeout: float = 10.0) -> dict[str, Any]:
    """The pool's CDI spec once some device in it has exactly ``nodes`` (or after ``timeout``)."""
    started = time.monotonic()
    with contextlib.suppress(AssertionError):  # the host's test judges what the spec held
        wait_until(lambda: nodes in cdi_nodes(scenario, pool).values(), timeout, interval=0.05)
    return {"devices": cdi_nodes(scenario, pool), "waited_s": round(time.monotonic() - started, 2)}


def uevent_summary(events: list[Uevent], origin: float) -> list[str]:
    """USB-related uevents after ``origin``: source, ms after it, action, subsystem, devpath tail."""
    return [f"{event.source} +{(event.received - origin) * 1000:.0f}ms {event.action} {event.subsystem} "
            f"{event.devpath.split('/usb', 1)[-1]}"
            for event in events if event.received >= origin and "/usb" in event.devpath]


def run(share: Path) -> None:
    scenario = UsbScenario(share)
    steps: list[dict[str, Any]] = []
    report: dict[str, Any] = {"resources": scenario.resources, "steps": steps, "uevent_source": scenario.uevent_source}
    wanted: dict[str, View] = {pool: {} for pool in POOLS}

    def step(name: str, action: Callable[[], Reply | None], change: Callable[[], dict[str, View]],
             listed: tuple[str, str, str | None] | None = None) -> dict[str, Any]:
        """Act, wait for the stand-in to show ``wanted`` updated with ``change()`` (called after
        the action: a tty's name is known once the device is bound); ``listed``: (pool, device
        ID, its health or None for absent): the first message showing that gives the latency.
        After MAX_FAILED unsettled steps the rest are skipped: each would wait the whole timeout."""
        if sum(not done["settled"] for done in steps) >= MAX_FAILED:
            steps.append({"name": name, "settled": False, "skipped": True, "seen": scenario.views(), "allocations": {}})
            return steps[-1]
        starts = scenario.message_counts()
        events_from = len(listener.snapshot())
        started = time.monotonic()
        reply = action()
        origin = reply.requested_at if reply is not None else started
        wanted.update(change())
        settled_at = scenario.wait_views(dict(wanted))
        record: dict[str, Any] = {
            "name": name, "wanted": dict(wanted), "seen": scenario.views(), "settled": settled_at is not None,
            "settle_ms": None if settled_at is None else round((settled_at - origin) * 1000, 1),
            "allocations": {}, "daemon_alive": scenario.process is not None and scenario.process.poll() is None,
        }
        if listed is not None:
            pool, device, health = listed
            at = scenario.first_message(pool, starts[pool], device, health)
            record["latency_ms"] = None if at is None else round((at - origin) * 1000, 1)
            kernel_first = next((e.received for e in listener.snapshot()[events_from:] if e.source == "kernel"), None)
            record["kernel_uevent_ms"] = None if kernel_first is None else round((kernel_first - origin) * 1000, 1)
        record["uevents"] = uevent_summary(listener.snapshot()[events_from:], origin)
        steps.append(record)
        print(f"step {name}: settled={record['settled']} {record['settle_ms']} ms, latency "
              f"{record.get('latency_ms')} ms", flush=True)
        return record

    def allocate(record: dict[str, Any], pool: str, device: str, usb: UsbDevice | None) -> None:
        if not record["settled"]:
            return
        answer = scenario.allocate(pool, device)
        if usb is not None:
            answer["sysfs"] = describe(usb_sysfs_name(usb))
        record["allocations"][f"{pool} {device}"] = answer

    def plugged(device: UsbDevice) -> Callable[[], Reply]:
        def action() -> Reply:
            reply = plug(device)
            wait_bound(device)
            return reply
        return action

    def unplugged(*devices: UsbDevice) -> Callable[[], Reply]:
        def action() -> Reply:
            replies = [unplug(device) for device in devices]
            for device in devices:
                wait_gone(device)
            return replies[0]
        return action

    def ftdi_plugged() -> dict[str, View]:
        tty = tty_of(FTDI)
        return {"usb_serial": {**wanted["usb_serial"], "serial-FTDI0042": "Healthy"},
                "ftdi_tty": {tty: "Healthy"} if tty else {}}

    def ftdi_checks(record: dict[str, Any]) -> None:
        record["tty"] = tty_of(FTDI)
        allocate(record, "usb_serial", "serial-FTDI0042", FTDI)
        if record["tty"]:
            allocate(record, "ftdi_tty", record["tty"], None)
        record["links"] = by_id_links()

    with UeventListener(KERNEL | UDEV) as listener:
        # FTDI0042 is there before the daemon starts: its scan must find it, and the ftdi_tty
        # selector must match on udev's database (the properties no kernel uevent file has).
        plug(FTDI)
        wait_bound(FTDI)
        settle = subprocess.run(["udevadm", "settle", "-t", "30"], capture_output=True, text=True, check=False)
        report["before_start"] = {"tty": tty_of(FTDI), "settle": settle.returncode, "links": by_id_links()}
        with scenario.daemon() as daemon:
            try:
                report["ready_s"] = scenario.ready_s
                ftdi_checks(step("started with FTDI0042 plugged", lambda: None, ftdi_plugged))
                record = step("keyboard KBD0001 on port 1", plugged(KEYBOARD),
                              lambda: {"usb_kbd": {"serial-KBD0001": "Healthy"}},
                              ("usb_kbd", "serial-KBD0001", "Healthy"))
                allocate(record, "usb_kbd", "serial-KBD0001", KEYBOARD)
                record = step("storage STOR4242 on port 3", plugged(DISK),
                              lambda: {"usb_disk": {"serial-STOR4242": "Healthy"}},
                              ("usb_disk", "serial-STOR4242", "Healthy"))
                disk = usb_sysfs_name(DISK)
                try:  # the partition comes after the SCSI scan, more than a second after the plug
                    wait_until(lambda: any(node.endswith("1") for node in device_nodes(disk))
                               and Path("/dev/sda1").exists(), STEP_TIMEOUT, "sda1")
                except AssertionError as error:
                    record["partition_error"] = str(error)
                allocate(record, "usb_disk", "serial-STOR4242", DISK)
                record["cdi"] = wait_cdi(scenario, "usb_disk", device_nodes(disk))
                record["links"] = by_id_links()
                def nameless_plugged() -> dict[str, View]:
                    tty = tty_of(FTDI_NO_SERIAL)
                    return {"usb_serial": {**wanted["usb_serial"], "port-1-4": "Healthy"},
                            "port4_tty": {tty: "Healthy"} if tty else {}}

                record = step("FTDI without a serial on port 4", plugged(FTDI_NO_SERIAL), nameless_plugged,
                              ("usb_serial", "port-1-4", "Healthy"))
                record["tty"] = tty_of(FTDI_NO_SERIAL)
                allocate(record, "usb_serial", "port-1-4", FTDI_NO_SERIAL)
                if record["tty"]:
                    allocate(record, "port4_tty", record["tty"], None)
                step("device_del FTDI0042", unplugged(FTDI),
                     lambda: {"usb_serial": {"port-1-4": "Healthy"}, "ftdi_tty": {}},
                     ("usb_serial", "serial-FTDI0042", None))
                ftdi_checks(step("FTDI0042 again on port 2", plugged(FTDI), ftdi_plugged,
                                 ("usb_serial", "serial-FTDI0042", "Healthy")))
                held = {scenario.resources["usb_serial"]: ["serial-FTDI0042"]}

                def unplug_held() -> Reply:
                    scenario.kubelet.write_checkpoint(held)  # a pod holds it (it was allocated above)
                    return unplugged(FTDI)()

                step("FTDI0042 unplugged while a pod holds it", unplug_held,
                     lambda: {"usb_serial": {"serial-FTDI0042": "Unhealthy", "port-1-4": "Healthy"},
                              "ftdi_tty": {}},
                     ("usb_serial", "serial-FTDI0042", "Unhealthy"))
                step("the pod went away", lambda: scenario.kubelet.write_checkpoint({}),
                     lambda: {"usb_serial": {"port-1-4": "Healthy"}})
                step("everything unplugged", unplugged(KEYBOARD, DISK, FTDI_NO_SERIAL),
                     lambda: {pool: {} for pool in POOLS}, ("usb_serial", "port-1-4", None))
            finally:
                report["daemon_alive"] = daemon.poll() is None
                report["overflows"] = listener.overflows
                (share / "result.json").write_text(json.dumps(report, indent=1))
    report["daemon_exit"] = daemon.returncode
    (share / "result.json").write_text(json.dumps(report, indent=1))
    print("guest usb: done", flush=True)


if __name__ == "__main__":
    run(Path(os.environ["GUEST_SHARE"]))

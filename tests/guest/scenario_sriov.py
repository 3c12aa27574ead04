"""Run inside the QEMU guest (tests/test_real_kernel_sriov.py boots it): devplugd and the kubelet
stand-in against the guest kernel's real SR-IOV, vfio and uevents.

The guest has NVMe PFs with SR-IOV (QEMU's emulated controller) behind an emulated VT-d. This
script drives the kernel the way an operator does — ``sriov_numvfs``, ``driver_override`` plus
``drivers_probe`` to bind VFs to vfio-pci, ``driver/unbind`` — and after each step records what
sysfs says should be offered (the vfio-bound VFs and their real ``iommu_group`` links) and what
the kubelet stand-in was sent, including the Allocate answer for every offered device. It
asserts nothing: ``result.json`` in the share carries every step and the test decides.

``UEVENT_SOURCE`` in the environment is the daemon's ``--uevent-source`` (default ``kernel``;
the test also runs ``auto`` in a guest with a real systemd-udevd, where it must pick ``udev``).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.guest.devices import (  # benchmarks/guest_bind.py imports these from here too
    PCI_DEVICES,
    VFIO_DRIVER,
    driver_of,
    iommu_group_of,
    nvme_pfs,
    set_num_vfs,
    unbind,
    vfs_of,
    write,
)
from tests.guest.listener import KERNEL, UDEV, UeventListener, udev_delivery
from tests.kubelet import FakeKubelet

__all__ = ["PCI_DEVICES", "Scenario", "bind_vfio", "nvme_pfs", "run", "set_num_vfs", "unbind", "vfs_of", "write"]

PREFIX = "devplugd.test"
STEP_TIMEOUT = 30.0  # TCG is slow; a step normally settles in well under a second
READY_TIMEOUT = 120.0  # the daemon's imports over 9p under TCG take most of this
QUIET = 0.5  # a step's expected view must hold this long (no late stray message)
UEVENT_SOURCE = os.environ.get("UEVENT_SOURCE", "kernel")
Expected = dict[str, dict[str, str]]  # resource -> {VF address: IOMMU group}


def bind_vfio(vf: str) -> None:
    """driver_override then drivers_probe: with autoprobe off, a plain ``bind`` write fails.
    Unlike ``tests.guest.devices.bind`` it does not wait: the daemon must notice by itself."""
    write(PCI_DEVICES / vf / "driver_override", VFIO_DRIVER)
    write(Path("/sys/bus/pci/drivers_probe"), vf)


class Scenario:
    """The daemon and the kubelet stand-in, with each step's expected and seen views."""

    def __init__(self, share: Path, pfs: list[str]) -> None:
        self.share = share
        self.pfs = pfs
        self.resources = {pf: f"{PREFIX}/nvme{index}" for index, pf in enumerate(pfs)}
        self.steps: list[dict[str, Any]] = []
        self.ready_s = 0.0
        self.process: subprocess.Popen[bytes] | None = None
        self.work = Path("/tmp/devplugd-guest")
        self.kubelet = FakeKubelet(self.work / "device-plugins")
        self.uevent_source = UEVENT_SOURCE
        self.log_name = "daemon.log"  # in the share

    def config(self) -> dict[str, Any]:
        """One pool per PF: the first by rootDevices (packed), the rest by class, first match wins."""
        first, *_ = self.pfs
        return {"resourceList": [
            {"resourceName": "nvme0", "resourcePrefix": PREFIX, "deviceType": "pciDevice",
             "allocationPolicy": "packed", "selectors": {"rootDevices": [first]}},
            {"resourceName": "nvme1", "resourcePrefix": PREFIX, "deviceType": "pciDevice",
             "selectors": {"classes": ["0108"]}},
        ]}

    @contextmanager
    def daemon(self) -> Iterator[subprocess.Popen[bytes]]:
        self.work.mkdir(parents=True, exist_ok=True)
        config = self.work / "config.json"
        config.write_text(json.dumps(self.config()))
        self.kubelet.start()
        log = open(self.share / self.log_name, "wb")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(self.work / "notify.sock"))
        spawned = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "daemon", "run", "--config", str(config),
             "--device-plugin-dir", str(self.work / "device-plugins"),
             "--plugins-registry-dir", str(self.work / "plugins_registry"),
             "--devinfo-dir", str(self.work / "devinfo"), "--control-socket", str(self.work / "control.sock"),
             "--cdi-dir", str(self.work / "cdi"), "--state-dir", str(self.work / "state"),
             "--uevent-source", self.uevent_source, "--registration", "kubelet", "--log-level", "debug"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NOTIFY_SOCKET": str(self.work / "notify.sock")})
        self.process = process
        try:
            self.ready_s = self._wait_ready(notify, process, spawned)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
            notify.close()
            self.kubelet.close()

    @staticmethod
    def _drain(notify: socket.socket) -> None:
        notify.settimeout(None)
        try:
            while notify.recv(4096):
                pass
        except OSError:
            return

    @staticmethod
    def _wait_ready(notify: socket.socket, process: subprocess.Popen[bytes], spawned: float) -> float:
        """Seconds until the daemon's sd_notify READY=1 (its pools served): steps start after it."""
        notify.settimeout(1.0)
        while time.monotonic() - spawned < READY_TIMEOUT:
            if process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {process.returncode} before READY=1")
            try:
                message = notify.recv(4096)
            except TimeoutError:
                continue
            if b"READY=1" in message.split(b"\n"):
                ready_s = time.monotonic() - spawned
                # systemd keeps reading STATUS= updates; a full datagram queue would block the daemon
                threading.Thread(target=Scenario._drain, args=(notify,), daemon=True).start()
                return ready_s
        raise RuntimeError(f"no READY=1 from the daemon within {READY_TIMEOUT} s")

    def expected(self) -> Expected:
        """From sysfs: each pool's vfio-bound VFs and their groups (the PFs stay with nvme)."""
        return {self.resources[pf]: {vf: iommu_group_of(vf) for vf in vfs_of(pf) if driver_of(vf) == VFIO_DRIVER}
                for pf in self.pfs}

    def seen(self) -> dict[str, dict[str, str]]:
        return {resource: {device: health for device, (health, _) in self.kubelet.state(resource).devices.items()}
                for resource in self.resources.values()}

    def _matches(self, expected: Expected) -> bool:
        seen = self.seen()
        return all(set(seen[resource]) == set(devices) for resource, devices in expected.items())

    def stuck_report(self, process: subprocess.Popen[bytes]) -> dict[str, str]:
        """Where each of the daemon's threads waits in the kernel (for a step that never settled)."""
        report = {}
        for task in sorted(Path(f"/proc/{process.pid}/task").iterdir(), key=lambda p: int(p.name)):
            name = (task / "comm").read_text().strip()
            state = next(line for line in (task / "status").read_text().splitlines() if line.startswith("State"))
            report[f"{task.name} {name}"] = f"{state.split(':', 1)[1].strip()} wchan={(task / 'wchan').read_text()}"
        return report

    def step(self, name: str, action: Callable[[], None]) -> bool:
        started = time.monotonic()
        action()
        acted = time.monotonic()
        expected = self.expected()
        settled_at = self._wait_settled(expected)
        record: dict[str, Any] = {
            "name": name, "expected": expected, "seen": self.seen(), "settled": settled_at is not None,
            "action_s": round(acted - started, 3),
            "settle_s": None if settled_at is None else round(settled_at - acted, 3),
            "allocations": {}, "vfio_nodes": {},
        }
        for resource, devices in expected.items():
            if devices and record["settled"]:
                record["allocations"][resource] = self.allocate_each(resource, sorted(devices))
            for group in devices.values():
                node = Path(f"/dev/vfio/{group}")
                record["vfio_nodes"][group] = node.exists() and stat.S_ISCHR(node.stat().st_mode)
        self.steps.append(record)
        print(f"step {name}: settled={record['settled']} in {record['settle_s']} s", flush=True)
        if not record["settled"] and self.process is not None:
            record["daemon_threads"] = self.stuck_report(self.process)
        return bool(record["settled"])

    def _wait_settled(self, expected: Expected) -> float | None:
        """When the kubelet's view first matched ``expected``, if it then held for QUIET s."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                self.kubelet.wait_for(lambda _: self._matches(expected), max(0.0, deadline - time.monotonic()))
            except AssertionError:
                return None
            matched_at = time.monotonic()
            time.sleep(QUIET)
            if self._matches(expected):
                return matched_at
        return None

    def allocate_each(self, resource: str, devices: list[str]) -> dict[str, list[str]]:
        """Allocate every device alone, as the kubelet would for one-device containers: its specs' host paths."""
        answers = {}
        for device in devices:
            response = self.kubelet.allocate(resource, [device], timeout=20)
            answers[device] = sorted(spec.host_path for spec in response.container_responses[0].devices)
        return answers

    def save(self, **extra: Any) -> None:
        document = {"pfs": self.pfs, "resources": self.resources, "steps": self.steps, "ready_s": self.ready_s,
                    "uevent_source": UEVENT_SOURCE, **extra}
        (self.share / "result.json").write_text(json.dumps(document, indent=1))


def run(share: Path) -> None:
    pfs = nvme_pfs()
    scenario = Scenario(share, pfs)
    total_vfs = {pf: int((PCI_DEVICES / pf / "sriov_totalvfs").read_text()) for pf in pfs}
    for pf in pfs:  # controlled binding: nvme would grab each new VF and fail on it 0.5 s later
        write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "0")

    def create_all() -> None:
        """Every VF, then the last of each PF bound: once the kubelet sees those, the daemon has
        folded every earlier add uevent, so the other (unbound) VFs were seen and left out."""
        for pf in pfs:
            set_num_vfs(pf, total_vfs[pf])
        for pf in pfs:
            bind_vfio(vfs_of(pf)[-1])

    def bind_all() -> None:
        for pf in pfs:
            for vf in vfs_of(pf):
                if driver_of(vf) != VFIO_DRIVER:
                    bind_vfio(vf)

    def destroy_all() -> None:
        for pf in pfs:
            set_num_vfs(pf, 0)

    unbound: list[str] = []

    def unbind_some() -> None:
        unbound.clear()
        for pf in pfs:
            vfs = vfs_of(pf)
            unbound.extend(vfs[1::2])
        for vf in unbound:
            unbind(vf)

    def rebind_some() -> None:
        for vf in unbound:
            write(Path("/sys/bus/pci/drivers_probe"), vf)  # driver_override still says vfio-pci

    def flap_some() -> None:
        """Every other VF unbound, bound and unbound again back to back: per device the uevents
        must be folded in order, whatever udev does to their order across devices."""
        unbound.clear()
        for pf in pfs:
            unbound.extend(vfs_of(pf)[1::2])
        for vf in unbound:
            unbind(vf)
        rebind_some()
        for vf in unbound:
            unbind(vf)

    preferred: list[str] = []
    offered: list[str] = []
    # Under udevd: how much udev reordered and delayed the events this run went through.
    listener = UeventListener(KERNEL | UDEV) if UEVENT_SOURCE != "kernel" else None
    delivery = {}
    with scenario.daemon() as daemon:
        try:
            steps = [
                ("started, no VFs", lambda: None),
                ("VFs created, only the last bound", create_all),
                ("all VFs bound to vfio-pci", bind_all),
                ("every other VF unbound", unbind_some),
                ("unbound VFs bound again", rebind_some),
                ("sriov_numvfs 0", destroy_all),
                ("VFs created again, only the last bound", create_all),
                ("all new VFs bound to vfio-pci", bind_all),
                ("every other VF unbound, bound and unbound again at once", flap_some),
            ]
            for name, action in steps:
                if not scenario.step(name, action):
                    return  # what follows would only repeat the failure
            first = scenario.resources[pfs[0]]
            offered = sorted(scenario.expected()[first])
            preferred = scenario.kubelet.preferred_allocation(first, offered, [offered[-1]], 2)
        finally:
            alive = daemon.poll() is None
            if listener is not None:
                delivery = udev_delivery(listener.snapshot())
                listener.close()
            scenario.save(daemon_alive=alive, udev_delivery=delivery)
    scenario.save(daemon_alive=alive, daemon_exit=daemon.returncode, preferred=preferred, offered_first=offered,
                  udev_delivery=delivery)


if __name__ == "__main__":
    run(Path(os.environ["GUEST_SHARE"]))

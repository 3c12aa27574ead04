"""Hotplug on the fake host for the real daemon: uevents sent in the kernel's wire format to
the daemon's ``--uevent-source unix:`` socket, and VFs of PF ``0000:3b:00.0`` made and removed
in the fake sysfs with the uevents the kernel would send."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fakesysfs import FakeHost
from tests.uevents import kernel_message
from tests.waiting import wait_until

PF = "0000:3b:00.0"


class Seam:
    """Sends uevents in the kernel's wire format to the daemon's ``unix:`` uevent socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def wait_ready(self, timeout: float = 10) -> None:
        wait_until(self.path.exists, timeout, "the daemon never bound its uevent socket", interval=0.01)

    def send(self, action: str, devpath: str, subsystem: str, **properties: str) -> None:
        self.socket.sendto(kernel_message(action, devpath, SUBSYSTEM=subsystem, **properties), str(self.path))

    def send_message(self, message: bytes) -> None:
        """One datagram as given (a message already in the kernel's format)."""
        self.socket.sendto(message, str(self.path))


def run_with_seam(run_daemon: Callable[..., Any], seam: Seam, config: dict[str, Any], **options: Any) -> Any:
    """Start the daemon (the ``run_daemon`` fixture) with ``seam`` as its uevent source; return
    once it listens there."""
    daemon = run_daemon(config, "--uevent-source", f"unix:{seam.path}", **options)
    seam.wait_ready()
    return daemon


def vf_address(index: int) -> str:
    return f"0000:3b:{2 + index // 8:02x}.{index % 8}"


def create_vfs(host: FakeHost, seam: Seam | None, first: int, count: int, driver: str = "vfio-pci") -> list[str]:
    """Make VFs ``first..first+count-1`` of PF in sysfs, then send their add uevents (when the
    daemon runs: ``seam``)."""
    pf_dir = host.device_dir(PF)
    addresses = []
    for index in range(first, first + count):
        address = vf_address(index)
        vf_dir = host.add_pci(address, device="154c", driver=None, numa_node=0, bridge=pf_dir.parent.name)
        (vf_dir / "physfn").symlink_to(f"../{PF}")
        (pf_dir / f"virtfn{index}").symlink_to(f"../{address}")
        host.set_iommu_group(address, 200 + index)
        host.bind(address, driver)
        addresses.append(address)
    (pf_dir / "sriov_numvfs").write_text(f"{first + count}\n")
    for address in addresses if seam is not None else ():
        seam.send("add", host.devpath(address), "pci", PCI_SLOT_NAME=address)
    return addresses


def remove_vf(host: FakeHost, seam: Seam, index: int) -> str:
    """Take VF ``index`` of PF out of sysfs (its ``virtfn`` link too), then send its remove
    uevent; its address."""
    address = vf_address(index)
    devpath = host.devpath(address)
    (host.device_dir(PF) / f"virtfn{index}").unlink()
    host.remove_pci(address)
    seam.send("remove", devpath, "pci")
    return address

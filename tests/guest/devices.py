"""Helpers for scripts that run inside the guest: PCI functions, drivers, IOMMU groups, ports.

All of them read or write the guest kernel's sysfs directly (they run in the chroot, as root).
The binding recipe is the measured one (shared/docs/real-kernel-sriov.md): with
``sriov_drivers_autoprobe`` 0 a plain ``drivers/X/bind`` write fails with ENODEV, so ``bind``
writes ``driver_override`` and then ``/sys/bus/pci/drivers_probe``.

    from tests.guest.devices import bind, group_functions, iommu_group_of, ports, unbind
    mf = next(port for port in ports() if port["kind"] == "multifunction")
    functions = functions_below(mf["address"])          # ['0000:03:00.0', '0000:03:00.1', ...]
    group = iommu_group_of(functions[0])
    for function in group_functions(group):
        bind(function, "vfio-pci")                      # /dev/vfio/<group> appears at the first
    bind(functions[0], "nvme")                          # back to the nvme driver

Ports (``ports()``) come from ``share/.guest/topology.json``, written by run_in_guest: qdev id
(what ``tests.guest.monitor.inject_aer`` takes), address, kind, ``slow_link``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tests.waiting import wait_until

PCI_DEVICES = Path("/sys/bus/pci/devices")
IOMMU_GROUPS = Path("/sys/kernel/iommu_groups")
DRIVERS_PROBE = Path("/sys/bus/pci/drivers_probe")
VFIO_DRIVER = "vfio-pci"
NVME_DRIVER = "nvme"
NVME_CLASS = "0x010802"
BIND_TIMEOUT = 10.0
_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def write(path: Path, text: str) -> None:
    """One write(2) of ``text`` (sysfs attributes take a value per write); errors raise OSError."""
    with open(path, "w") as sysfs_file:
        sysfs_file.write(text)


def driver_of(address: str) -> str | None:
    """The bound driver's name, or None (also when the link goes while it is read: an unbind)."""
    try:
        return os.path.basename(os.readlink(PCI_DEVICES / address / "driver"))
    except FileNotFoundError:
        return None


def iommu_group_of(address: str) -> str:
    """The function's IOMMU group number (changes between boots: never hard-code it)."""
    return os.path.basename(os.readlink(PCI_DEVICES / address / "iommu_group"))


def group_functions(group: str) -> list[str]:
    """Every PCI function in IOMMU group ``group``, bridges included, by address."""
    return sorted(path.name for path in (IOMMU_GROUPS / group / "devices").iterdir())


def vfio_node(group: str) -> Path:
    """``/dev/vfio/<group>``: exists while at least one function of the group is on vfio-pci."""
    return Path("/dev/vfio") / group


def vfs_of(pf: str) -> list[str]:
    """The PF's VFs in ``virtfnN`` order."""
    links = sorted((p for p in (PCI_DEVICES / pf).iterdir() if p.name.startswith("virtfn")),
                   key=lambda p: int(p.name[6:]))
    return [os.path.basename(os.readlink(link)) for link in links]


def set_num_vfs(pf: str, count: int) -> None:
    """``sriov_numvfs``: from N to M != 0 the kernel refuses (EBUSY): go through 0."""
    write(PCI_DEVICES / pf / "sriov_numvfs", str(count))


def nvme_pfs() -> list[str]:
    """The NVMe SR-IOV PFs (class 0x010802, ``sriov_totalvfs``, not themselves VFs), by address."""
    return sorted(
        path.name for path in PCI_DEVICES.iterdir()
        if (path / "class").read_text().strip() == NVME_CLASS
        and (path / "sriov_totalvfs").exists() and not (path / "physfn").exists()
    )


def unbind(address: str) -> None:
    """Unbind the function from its driver (nothing when it has none). ``driver_override`` stays:
    a later ``drivers_probe`` write binds the same driver again. Blocks while user space holds a
    vfio device fd of it (vfio-pci waits for the release)."""
    driver = driver_of(address)
    if driver is not None:
        write(PCI_DEVICES / address / "driver" / "unbind", address)


def bind(address: str, driver: str, *, wait: bool = True, timeout: float = BIND_TIMEOUT) -> None:
    """Bind the function to ``driver`` (``vfio-pci``, ``nvme``...), unbinding it from another first:
    ``driver_override`` then ``drivers_probe``. ``wait``: until sysfs shows the driver (raises
    AssertionError), and for vfio-pci until ``/dev/vfio/<group>`` exists. A refused probe raises
    OSError (e.g. EINVAL binding nvme while the group is held through vfio)."""
    current = driver_of(address)
    if current == driver:
        return
    if current is not None:
        unbind(address)
    write(PCI_DEVICES / address / "driver_override", driver)
    write(DRIVERS_PROBE, address)
    if not wait:
        return
    wait_until(lambda: driver_of(address) == driver, timeout, f"{address} bound to {driver}", interval=0.005)
    if driver == VFIO_DRIVER:
        node = vfio_node(iommu_group_of(address))
        wait_until(node.exists, timeout, f"{node} after binding {address}", interval=0.005)


def clear_override(address: str) -> None:
    """Empty ``driver_override``: the function is matched by ID again on the next probe."""
    write(PCI_DEVICES / address / "driver_override", "\n")


def functions_below(port: str) -> list[str]:
    """Every PCI function in the hierarchy below the bridge or port at ``port`` (its secondary bus
    and further), in the kernel's bus-walk order (depth first, by address): the order AER
    recovery sends its uevents in."""
    below: list[str] = []
    for child in sorted(path.name for path in (PCI_DEVICES / port).iterdir() if _ADDRESS.match(path.name)):
        below.append(child)
        below.extend(functions_below(child))
    return below


def ports() -> list[dict[str, Any]]:
    """The root ports run_in_guest made: ``{"id": "rp0", "address": "0000:00:01.0", "kind":
    "sriov"|"multifunction"|"bridge", "slow_link": bool, ...}``, in qdev-id order."""
    document: list[dict[str, Any]] = json.loads((Path(os.environ["GUEST_SHARE"]) / ".guest" / "topology.json")
                                               .read_text())
    return document


"""What the pci and auxnet handlers both read of a PCI function (or of a scalable function below
one) from a sysfs root, the way the kernel lays it out:

* the shape of a PCI address (``0000:3b:02.1``), by which device paths name functions;
* a netdev's link type, from its ARPHRD ``net/<ifname>/type`` (names in ``_linktypes``);
* ``numa_node`` (unreadable or negative: no topology, as upstream);
* the PCIe root complex a function sits below, from its ``bus/pci/devices/<address>`` link, and
  the DRA attribute that publishes it;
* RDMA character devices, from ``class/infiniband_{cm,mad,verbs}`` (or a device's own copies of
  those directories) in rdmamap's order, ``/dev/infiniband/rdma_cm`` after them when it exists,
  and the uevent subsystems they come and go with.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from os.path import join

from daemon.core import SysfsError, UEvent, list_dir, read_int, read_text

from ._linktypes import link_type_name

log = logging.getLogger("devplugd.handlers")

PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")  # domain:bus:device.function
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # the DRA attribute of pcie_root_of's answer
_ROOT_COMPLEX = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")  # a root complex's directory under /sys/devices

RDMA_SUBSYSTEMS = frozenset({"infiniband", "infiniband_verbs", "infiniband_mad", "infiniband_cm"})
RDMA_CM = "/dev/infiniband/rdma_cm"
# rdmamap's order: for each class and name prefix, the first entry whose ibdev is the device.
_RDMA_CHAR_CLASSES = (
    ("infiniband_cm", "ucm"),
    ("infiniband_mad", "issm"),
    ("infiniband_mad", "umad"),
    ("infiniband_verbs", "uverbs"),
)


def netdev_link_type(net_dir: str) -> str:
    """The link type name (``ether``, ``infiniband``, ...) of the netdev at ``net_dir``, from its
    ARPHRD ``type``; ``""`` when it has none."""
    arphrd = read_int(join(net_dir, "type"))
    return "" if arphrd is None else link_type_name(arphrd)


def read_numa_node(device_dir: str) -> int | None:
    """``numa_node``; like upstream, a missing, negative or unreadable value means no topology,
    not no device (an unreadable one is logged)."""
    try:
        numa = read_int(join(device_dir, "numa_node"))
    except SysfsError as error:
        address = os.path.basename(device_dir)
        log.warning("no NUMA node for %s: %s", address, error, extra={"PCI_ADDR": address})
        return None
    return numa if numa is not None and numa >= 0 else None


def pcie_root_of(bus_entry: str) -> str | None:
    """The root complex a function sits below (``pci0000:00``), from one readlink of its
    ``bus/pci/devices/<address>`` entry: the first component of the target under ``devices/``
    (``../../../devices/pci0000:00/0000:00:02.0/0000:3b:00.0``), as the DRA helper
    (``deviceattribute.GetPCIeRootAttributeByPCIBusID``) reads it; ``None`` when the target is
    not below a ``pci<domain>:<bus>`` directory (a Hyper-V guest's functions sit below VMBus)."""
    try:
        target = os.readlink(bus_entry)
    except OSError:
        return None
    # bus_entry is <sysfs>/bus/pci/devices/<address>: the target is resolved lexically from there
    sysfs_devices = os.path.normpath(join(bus_entry, "..", "..", "..", "..", "devices"))
    resolved = os.path.normpath(join(os.path.dirname(bus_entry), target))
    if not resolved.startswith(sysfs_devices + "/"):
        return None
    root = resolved[len(sysfs_devices) + 1:].split("/", 1)[0]
    return root if _ROOT_COMPLEX.fullmatch(root) else None


def rdma_cm_present(dev_root: str) -> bool:
    """Whether ``/dev/infiniband/rdma_cm`` (rdma_ucm's node, every RDMA device's last) is there."""
    return os.path.exists(dev_root + RDMA_CM[len("/dev"):])


def lists_rdma_cm(char_devices: Iterable[tuple[str, ...]]) -> bool:
    """Whether these RDMA devices' character device lists were read with ``rdma_cm`` there."""
    return any(paths[-1:] == (RDMA_CM,) for paths in char_devices)


def read_rdma_char_devices(sysfs_root: str, dev_root: str, below: str | None = None) -> dict[str, tuple[str, ...]]:
    """RDMA device name -> its character devices, as rdmamap's GetRdmaCharDevices lists them:
    ucm, issm, umad, uverbs, then ``/dev/infiniband/rdma_cm`` when that node exists.

    ``below``: a device directory, whose RDMA devices' character devices are read from its own
    ``infiniband_verbs/``, ``infiniband_mad/`` and ``infiniband_cm/`` (the kernel parents them to
    the RDMA device's parent), instead of from every entry of ``<sysfs>/class``: the same answer
    for that device's RDMA devices at the cost of its few entries."""
    owners: dict[tuple[str, str], dict[str, str]] = {}
    rdma_devices: set[str] = set()
    for class_name, prefix in _RDMA_CHAR_CLASSES:
        class_dir = join(below, class_name) if below is not None else join(sysfs_root, "class", class_name)
        first_by_owner: dict[str, str] = {}
        for entry in list_dir(class_dir):
            if prefix not in entry:
                continue
            owner = read_text(join(class_dir, entry, "ibdev"))
            if owner and owner not in first_by_owner:
                first_by_owner[owner] = entry
        owners[(class_name, prefix)] = first_by_owner
        rdma_devices.update(first_by_owner)
    rdma_cm = rdma_cm_present(dev_root)
    result: dict[str, tuple[str, ...]] = {}
    for rdma_device in rdma_devices:
        paths = [f"/dev/infiniband/{owners[key][rdma_device]}" for key in _RDMA_CHAR_CLASSES
                 if rdma_device in owners[key]]
        if rdma_cm:
            paths.append(RDMA_CM)
        result[rdma_device] = tuple(paths)
    return result


def is_pcie_error_report(event: UEvent) -> bool:
    """A PCIe error recovery uevent (``change`` with ``ERROR_EVENT``, the kernel sends it for
    every function below the port it recovers). It says nothing of a device's properties, and
    during a fatal reset the kernel holds the device locks below the port for seconds: a handler
    that does not follow recovery ignores it rather than read sysfs then."""
    return event.action == "change" and event.subsystem == "pci" and "ERROR_EVENT" in event.properties

"""Reading PCI functions from a sysfs root, the way the kernel lays them out.

Everything comes from ``<sysfs>/bus/pci/devices/<address>`` (a symlink into ``devices/pci…``,
whose target names the PCIe root complex):
``vendor``, ``device``, ``class``, ``numa_node``, ``acpi_index``, the ``driver`` and
``iommu_group`` links, SR-IOV (``sriov_totalvfs``, ``sriov_numvfs``, ``physfn``, ``virtfnN``),
``net/<ifname>/type``, ``uio/uioN`` and ``infiniband/<rdma dev>`` (for an InfiniBand link, its
default partition key ``ports/1/pkeys/0``); vDPA devices from ``<sysfs>/bus/vdpa/devices``
(each a directory of its parent function, bound to ``vhost_vdpa`` or ``virtio_vdpa``, with its
``vhost-vdpa-<n>`` char device beside ``driver`` when bound to vhost); RDMA character devices from
``<sysfs>/class/infiniband_{verbs,mad,cm}``; default routes from ``<proc>/net/route`` (IPv4) and
``<proc>/net/ipv6_route`` (IPv6).
A device whose entries cannot be read is skipped with a log line naming the path. What the
auxnet handler reads the same way (link types, NUMA node, PCIe root, RDMA character devices) is
read by ``daemon.handlers._functions``; the records made are ``_facts``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from os.path import join
from types import MappingProxyType

from daemon.core import PathLike, SysfsError, link_name, list_dir, read_hex_id, read_int, read_text
from daemon.handlers._functions import (
    PCI_ADDRESS,
    netdev_link_type,
    pcie_root_of,
    read_numa_node,
    read_rdma_char_devices,
)

from ._facts import PciDevice, PciFacts, VdpaDevice

log = logging.getLogger("devplugd.pci")

_NO_VDPA: Mapping[str, VdpaDevice] = MappingProxyType({})
NOIOMMU_GROUP_NAME = "vfio-noiommu"
IPV6_ANY = "0" * 32  # ``::`` as /proc/net/ipv6_route prints it
RTF_UP = 0x0001  # route flag (linux/route.h): the route is usable
LOOPBACK = "lo"
VHOST_VDPA_PREFIX = "vhost-vdpa-"


def read_default_route_interfaces(proc_root: str) -> frozenset[str]:
    """Interfaces with a default route: IPv4 (``/proc/net/route``) or IPv6 (``/proc/net/ipv6_route``).
    A file that is missing (a kernel without IPv6) has none; a line that is not a route is skipped;
    SysfsError naming the file when it cannot be read."""
    return _ipv4_default_routes(proc_root) | _ipv6_default_routes(proc_root)


def _ipv4_default_routes(proc_root: str) -> frozenset[str]:
    """Interfaces with an IPv4 default route in the main table: after a header line, the
    interface, the destination and, eighth, the mask, both ``00000000``."""
    interfaces = set()
    for line in read_proc_text(join(proc_root, "net", "route")).splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            interfaces.add(fields[0])
    return frozenset(interfaces)


def _ipv6_default_routes(proc_root: str) -> frozenset[str]:
    """Interfaces with an IPv6 default route (``::/0``) that is up. Each line, in hex but the last:
    destination, its prefix length, source, its prefix length, next hop, metric, references, use,
    flags, the interface. Left out: loopback, and routes without RTF_UP (the unreachable default
    routes the kernel keeps on ``lo``)."""
    interfaces = set()
    for line in read_proc_text(join(proc_root, "net", "ipv6_route")).splitlines():
        fields = line.split()
        if len(fields) != 10 or fields[0] != IPV6_ANY or fields[1] != "00" or fields[9] == LOOPBACK:
            continue
        try:
            flags = int(fields[8], 16)
        except ValueError:
            continue
        if flags & RTF_UP:
            interfaces.add(fields[9])
    return frozenset(interfaces)


def read_proc_text(path: str) -> str:
    """The whole text of a procfs table (a route table, a mount table: a sysfs-sized read would
    cut a long one short); ``""`` when it does not exist. Names are bytes to the kernel: they are
    decoded as ``os.listdir`` decodes them, so they compare equal to sysfs entries. SysfsError
    naming the path when it cannot be read."""
    try:
        with open(path, "rb") as table:
            data = table.read()
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as error:
        raise SysfsError(f"{path}: cannot read: {error.strerror or error}") from error
    return os.fsdecode(data)


class _PfNetdevCache:
    """PF address -> (its first netdev, that netdev's link type), read once per scan."""

    def __init__(self, devices_dir: str) -> None:
        self._devices_dir = devices_dir
        self._known: dict[str, tuple[str | None, str]] = {}

    def get(self, pf_address: str, pf_dir: str) -> tuple[str | None, str]:
        known = self._known.get(pf_address)
        if known is None:
            names = list_dir(join(pf_dir, "net"))
            netdev = names[0] if names else None
            known = (netdev, netdev_link_type(f"{pf_dir}/net/{netdev}") if netdev else "")
            self._known[pf_address] = known
        return known


def _vf_index(pf_dir: str, address: str) -> int:
    for name in list_dir(pf_dir):
        if name.startswith("virtfn") and name[6:].isdigit() and link_name(join(pf_dir, name)) == address:
            return int(name[6:])
    return -1


def read_device(
    address: str,
    device_dir: str,
    entries: frozenset[str],
    vf_positions: Mapping[str, tuple[str, int]],
    default_route_ifaces: frozenset[str],
    pf_netdevs: _PfNetdevCache,
    vdpa_devices: Mapping[str, VdpaDevice] = _NO_VDPA,
) -> PciDevice:
    """One PCI function; raises SysfsError (naming the path) when it cannot be used."""
    if not entries:
        raise SysfsError(f"{device_dir}: device directory is missing or empty")
    vendor = read_hex_id(f"{device_dir}/vendor", 4)
    device = read_hex_id(f"{device_dir}/device", 4)
    class_code = read_hex_id(f"{device_dir}/class", 6)
    if vendor is None or device is None or class_code is None:
        missing = [n for n, v in (("vendor", vendor), ("device", device), ("class", class_code)) if v is None]
        raise SysfsError(f"{device_dir}: missing {', '.join(missing)}")
    numa = read_numa_node(device_dir) if "numa_node" in entries else None
    is_pf = "sriov_totalvfs" in entries
    num_vfs = (read_int(f"{device_dir}/sriov_numvfs") or 0) if is_pf else 0

    pf_address: str | None = None
    pf_netdev: str | None = None
    pf_link_type = ""
    vf_index = -1
    if "physfn" in entries:
        pf_dir = f"{device_dir}/physfn"
        pf_address = link_name(pf_dir)
        position = vf_positions.get(address)
        if position is not None and link_name(f"{pf_dir}/virtfn{position[1]}") == address:
            vf_index = position[1]
        else:
            vf_index = _vf_index(pf_dir, address)
        if pf_address is not None:
            pf_netdev, pf_link_type = pf_netdevs.get(pf_address, pf_dir)
    netdevs = tuple(list_dir(f"{device_dir}/net")) if "net" in entries else ()
    link_type = netdev_link_type(f"{device_dir}/net/{netdevs[0]}") if netdevs else pf_link_type

    rdma_devices = tuple(list_dir(f"{device_dir}/infiniband")) if "infiniband" in entries else ()
    pkey = function_pkey(device_dir, link_type, rdma_devices)

    iommu_group: str | None = None
    noiommu = False
    if "iommu_group" in entries:
        iommu_group = link_name(f"{device_dir}/iommu_group")
        noiommu = read_text(f"{device_dir}/iommu_group/name") == NOIOMMU_GROUP_NAME

    return PciDevice(
        address=address,
        vendor=vendor,
        device=device,
        class_code=class_code,
        driver=link_name(f"{device_dir}/driver") if "driver" in entries else None,
        numa_node=numa,
        acpi_index=read_text(f"{device_dir}/acpi_index") if "acpi_index" in entries else None,
        is_pf=is_pf,
        num_vfs=num_vfs,
        pf_address=pf_address,
        vf_index=vf_index,
        pf_netdev=pf_netdev,
        netdevs=netdevs,
        link_type=link_type,
        iommu_group=iommu_group,
        noiommu=noiommu,
        uio_devices=tuple(list_dir(f"{device_dir}/uio")) if "uio" in entries else (),
        rdma_devices=rdma_devices,
        has_default_route=any(name in default_route_ifaces for name in netdevs),
        vfio_cdev=vfio_cdev_of(device_dir) if "vfio-dev" in entries else None,
        pcie_root=pcie_root_of(device_dir),
        pkey=pkey,
        vdpa=vdpa_devices.get(address),
    )


def read_vdpa_devices(sysfs_root: str, addresses: Iterable[str]) -> dict[str, VdpaDevice]:
    """Parent function's address -> its vDPA device, for the functions among ``addresses`` that
    have one, from ``bus/vdpa/devices`` (a vDPA device is a directory of the function it runs on;
    mlx5 makes one per VF). One readlink per vDPA device finds its parent (the link's target ends
    ``<parent>/<name>``); only the wanted ones are read further, so a fold of one function costs
    microseconds per vDPA device on the host, not a read of each. A link that dangles, and a vDPA
    device whose parent is no PCI function, are left out; of two on one function, the first by
    name is taken."""
    wanted = set(addresses)
    bus = f"{sysfs_root}/bus/vdpa/devices"
    found: dict[str, VdpaDevice] = {}
    for name in list_dir(bus):
        entry = f"{bus}/{name}"
        try:
            parent = os.path.basename(os.path.dirname(os.readlink(entry)))
        except OSError:
            continue
        if parent not in wanted or parent in found or not PCI_ADDRESS.fullmatch(parent) or not os.path.isdir(entry):
            continue
        vhost = sorted(n for n in list_dir(entry) if n.startswith(VHOST_VDPA_PREFIX) and n[len(VHOST_VDPA_PREFIX):]
                       .isdigit() and os.path.exists(f"{entry}/{n}/dev"))
        found[parent] = VdpaDevice(name=name, driver=link_name(f"{entry}/driver"), vhost_node=next(iter(vhost), None))
    return found


def function_pkey(device_dir: str, link_type: str, rdma_devices: tuple[str, ...]) -> int | None:
    """A function's default partition key: of its first RDMA device, for an InfiniBand link only."""
    if link_type != "infiniband" or not rdma_devices:
        return None
    return read_default_pkey(f"{device_dir}/infiniband/{rdma_devices[0]}")


def read_default_pkey(rdma_dir: str) -> int | None:
    """The default partition key of an RDMA device (``ports/1/pkeys/0``, which the kernel prints
    ``0x%04x``); ``None`` when it is missing or not a 16-bit hex number (logged: the function is
    still served, only a ``pKeys`` selector cannot match it)."""
    path = f"{rdma_dir}/ports/1/pkeys/0"
    try:
        text = read_text(path)
    except SysfsError as error:
        log.warning("no default partition key: %s", error)
        return None
    if text is None:
        return None
    try:
        value = int(text, 16)
    except ValueError:
        value = -1
    if not 0 <= value <= 0xFFFF:
        log.warning("%s: %r is not a partition key; pKeys selectors will not match it", path, text[:40])
        return None
    return value


def vfio_cdev_of(device_dir: str) -> str | None:
    """``vfioN`` of ``vfio-dev/vfioN`` when it is a character device (it has ``dev``). Linux
    6.1-6.5 make ``vfio-dev/vfioN`` for every vfio-pci function without one (the VFIO cdev came
    in 6.6): there is no ``/dev/vfio/devices/vfioN`` to hand out, and nothing to warn about."""
    name = next(iter(list_dir(f"{device_dir}/vfio-dev")), None)
    return name if name is not None and os.path.exists(f"{device_dir}/vfio-dev/{name}/dev") else None


@dataclass(frozen=True, slots=True)
class VfioBinding:
    """A function's driver and IOMMU group as sysfs shows them right now."""

    driver: str | None
    iommu_group: str | None
    noiommu: bool


def read_vfio_binding(
    sysfs_root: str, address: str, *, known_group: str | None = None, known_noiommu: bool = False
) -> VfioBinding | None:
    """The driver and group links of one function, read afresh (``None`` if the function is gone).
    Allocate uses it so that a group that changed since the last uevent is never handed out: it
    runs for every vfio device of every Allocate, so the common case is two readlinks.

    Whether a group is a no-IOMMU one (its ``name``) is read only when the group is not
    ``known_group`` (then it is ``known_noiommu``): no-IOMMU mode is the platform's (there is
    no IOMMU for the device), which does not change while the host runs, so the same group
    keeps the mode it was read with."""
    device_dir = f"{sysfs_root}/bus/pci/devices/{address}"
    driver = link_name(f"{device_dir}/driver")
    group = link_name(f"{device_dir}/iommu_group")
    if driver is None and group is None and not os.path.isdir(device_dir):
        return None
    if group is not None and group == known_group:
        noiommu = known_noiommu
    else:
        noiommu = group is not None and read_text(f"{device_dir}/iommu_group/name") == NOIOMMU_GROUP_NAME
    return VfioBinding(driver=driver, iommu_group=group, noiommu=noiommu)


def pci_devpath(sysfs_root: str, address: str) -> str:
    """The uevent-style DEVPATH of a function (``/devices/pci0000:00/.../<address>``)."""
    real = os.path.realpath(f"{sysfs_root}/bus/pci/devices/{address}")
    root = os.path.realpath(sysfs_root)
    return real[len(root):] if real.startswith(root + "/") else f"/devices/{address}"


def _listing(device_dir: str) -> frozenset[str]:
    try:
        return frozenset(os.listdir(device_dir))
    except OSError:
        return frozenset()


def vf_positions_of(devices_dir: str, pf_address: str, names: Iterable[str]) -> dict[str, tuple[str, int]]:
    """VF address -> (PF address, VF index), from the PF's ``virtfnN`` links."""
    positions = {}
    for name in names:
        if name.startswith("virtfn") and name[6:].isdigit():
            vf_address = link_name(f"{devices_dir}/{pf_address}/{name}")
            if vf_address:
                positions[vf_address] = (pf_address, int(name[6:]))
    return positions


def read_devices(
    sysfs_root: str,
    proc_root: str,
    addresses: list[str],
    vf_positions: Mapping[str, tuple[str, int]] | None = None,
) -> dict[str, PciDevice | None]:
    """Read ``addresses`` (``None`` for each that is gone or unusable, with a log line).

    VF indices come from ``vf_positions`` when given (checked with one readlink each), else
    from the ``virtfnN`` links of the PFs among ``addresses`` (one readlink per VF instead of a
    search per VF), else from a search of the VF's PF.
    """
    devices_dir = f"{sysfs_root}/bus/pci/devices"
    listings = {address: _listing(f"{devices_dir}/{address}") for address in addresses}
    if vf_positions is None:
        vf_positions = {}
        for address, names in listings.items():
            vf_positions.update(vf_positions_of(devices_dir, address, names))
    default_route_ifaces = read_default_route_interfaces(proc_root)
    pf_netdevs = _PfNetdevCache(devices_dir)
    vdpa_devices = read_vdpa_devices(sysfs_root, addresses)
    result: dict[str, PciDevice | None] = {}
    for address in addresses:
        try:
            result[address] = read_device(
                address, f"{devices_dir}/{address}", listings[address], vf_positions, default_route_ifaces, pf_netdevs,
                vdpa_devices,
            )
        except SysfsError as error:
            if listings[address]:
                log.warning("skipping PCI device %s: %s", address, error, extra={"PCI_ADDR": address})
            result[address] = None
    return result


def scan_pci(sysfs_root: PathLike, dev_root: PathLike, proc_root: PathLike) -> PciFacts:
    """Read every PCI function under ``sysfs_root``; skip (and log) the unreadable ones."""
    sysfs, dev, proc = os.fspath(sysfs_root), os.fspath(dev_root), os.fspath(proc_root)
    addresses = list_dir(join(sysfs, "bus", "pci", "devices"))
    read = read_devices(sysfs, proc, addresses)
    devices = {address: device for address, device in read.items() if device is not None}
    rdma = owned_rdma_char_devices(sysfs, dev, devices.values())
    return PciFacts(devices=MappingProxyType(devices), rdma_char_devices=MappingProxyType(rdma))


def owned_rdma_char_devices(sysfs_root: str, dev_root: str, devices: Iterable[PciDevice]) -> dict[str, tuple[str, ...]]:
    """The character devices of the functions' own RDMA devices (not an SF's below them: what a
    fold keeps up to date), from all of ``class/infiniband_*``."""
    owned = {name for device in devices for name in device.rdma_devices}
    return {name: paths for name, paths in read_rdma_char_devices(sysfs_root, dev_root).items() if name in owned}

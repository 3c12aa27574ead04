"""Scalable functions (SFs) on the auxiliary bus, read from a sysfs root as the kernel lays them out.

``<sysfs>/bus/auxiliary/devices/<name>`` links every auxiliary device to its directory; names are
``<module>.<type>.<id>`` (``drivers/base/auxiliary.c``). An SF is a device of type ``sf`` directly
below its PCI PF (mlx5: ``<pf>/mlx5_core.sf.4``) with ``sfnum``, the devlink SF number: the ``#``
index of ``pfNames``/``rootDevices``, which is not the ``<id>`` of its name. While its driver
(``mlx5_core.sf``) is bound it has its netdev ``net/<ifname>`` and its RDMA device
``infiniband/<ibdev>`` below it; unbound, neither. The other auxiliary devices (the PF's own
``mlx5_core.eth.0`` and ``mlx5_core.rdma-rep.0``, an SF's own ``mlx5_core.eth.4``) are not SFs.

The PF's name is its uplink representor: the netdev in ``<pf>/net/`` whose ``phys_port_name`` is
``p<n>`` and that has a ``phys_switch_id`` (a read that fails means none, as the kernel's
EOPNOTSUPP on a legacy-mode PF does). The SF representors ``pf<n>sf<m>`` sit beside it with the
same switch id, but their port names are not ``p<n>``. Without an uplink: the PF's first netdev.

A device whose directory is gone when read (its PF vanished under the reader) reads as ``None``;
one whose entries are there but unusable raises ``SysfsError`` naming the path.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from daemon.core import LinkState, SysfsError, link_name, list_dir, read_hex_id, read_int, read_text
from daemon.handlers._functions import (
    PCI_ADDRESS,
    netdev_link_type,
    pcie_root_of,
    read_numa_node,
    read_rdma_char_devices,
)

log = logging.getLogger("devplugd.auxnet")

AUX_DEVICES = "/bus/auxiliary/devices"
SF_TYPE = "sf"
# <module>.<type>.<id>: the module part may hold dots (the regex is greedy), the id is decimal
AUX_NAME = re.compile(r"(\S+)\.([^.\s]+)\.([0-9]+)", re.ASCII)
UPLINK_PORT_NAME = re.compile(r"p[0-9]+", re.ASCII)
NETWORK_CLASS = "02"

_EMPTY: Mapping[str, LinkState] = MappingProxyType({})


def aux_type(name: str) -> str | None:
    """The type of an auxiliary device name (``sf`` of ``mlx5_core.sf.4``); ``None`` when the
    name is not ``<a>.<b>.<int>``."""
    match = AUX_NAME.fullmatch(name)
    return match.group(2) if match else None


@dataclass(frozen=True, slots=True)
class ParentPf:
    """The PCI PF an SF belongs to: what the selectors match and the topology come from it."""

    address: str
    vendor: str
    device: str
    class_code: str
    driver: str | None
    numa_node: int | None
    name: str | None  # the uplink representor, else the first netdev
    link_type: str  # of ``name`` ("" without one)
    pcie_root: str | None

    @property
    def offers_sfs(self) -> bool:
        """Whether the SR-IOV plugin lists this PF's SFs: a network function bound to a driver,
        with a netdev."""
        return self.driver is not None and self.class_code.startswith(NETWORK_CLASS) and self.name is not None


@dataclass(frozen=True, slots=True)
class ScalableFunction:
    name: str  # the auxiliary device name, which is the device ID: ``mlx5_core.sf.4``
    devpath: str  # below the sysfs root: ``/devices/pci0000:00/0000:00:02.0/0000:03:00.0/mlx5_core.sf.4``
    pf_address: str
    sfnum: int
    driver: str | None
    netdevs: tuple[str, ...]
    netdev_link_type: str  # of its first netdev ("" without one)
    rdma_devices: tuple[str, ...]
    # its RDMA devices' character devices (rdmamap's order), read from its own directory
    rdma_char_devices: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def aux_type(self) -> str:
        return SF_TYPE

    @property
    def netdev(self) -> str | None:
        return self.netdevs[0] if self.netdevs else None

    def link_type(self, pf: ParentPf) -> str:
        """Its own netdev's link type, else its PF's (as upstream, when the netdev is in a pod)."""
        return self.netdev_link_type or pf.link_type


@dataclass(frozen=True)
class AuxFacts:
    """SFs by name, the PFs they belong to (exactly those that have one), and link states (from
    rtnetlink, kept across rescans)."""

    sfs: Mapping[str, ScalableFunction]
    pfs: Mapping[str, ParentPf]
    links: Mapping[str, LinkState] = field(default_factory=lambda: _EMPTY)


def sf_in(devpath: str) -> tuple[str, str] | None:
    """The SF a devpath is at or below, as (its name, its devpath): a component of type ``sf``
    right below a PCI function."""
    parts = devpath.split("/")
    for index in range(2, len(parts)):
        if aux_type(parts[index]) == SF_TYPE and PCI_ADDRESS.fullmatch(parts[index - 1]):
            return parts[index], "/".join(parts[: index + 1])
    return None


def read_sf(sysfs_root: str, dev_root: str, devpath: str) -> ScalableFunction | None:
    """The SF at ``devpath``; ``None`` when its directory is gone (before or while it was read)."""
    directory = sysfs_root + devpath
    name = os.path.basename(devpath)
    sfnum = read_int(f"{directory}/sfnum")
    if sfnum is None:
        if not os.path.isdir(directory):
            return None
        raise SysfsError(f"{directory}/sfnum: missing (an auxiliary device of type sf without an SF number)")
    netdevs = tuple(list_dir(f"{directory}/net"))
    rdma_devices = tuple(list_dir(f"{directory}/infiniband"))
    char_devices = read_rdma_char_devices(sysfs_root, dev_root, below=directory) if rdma_devices else {}
    sf = ScalableFunction(
        name=name,
        devpath=devpath,
        pf_address=os.path.basename(os.path.dirname(devpath)),
        sfnum=sfnum,
        driver=link_name(f"{directory}/driver"),
        netdevs=netdevs,
        netdev_link_type=netdev_link_type(f"{directory}/net/{netdevs[0]}") if netdevs else "",
        rdma_devices=rdma_devices,
        rdma_char_devices=tuple((rdma, char_devices[rdma]) for rdma in rdma_devices if rdma in char_devices),
    )
    return sf if os.path.isdir(directory) else None


def _readable(path: str) -> str | None:
    """A netdev attribute, or ``None`` when it is missing or its read fails (EOPNOTSUPP)."""
    try:
        return read_text(path)
    except SysfsError:
        return None


def pf_name(device_dir: str) -> tuple[str | None, str]:
    """The PF's name (its uplink representor, else its first netdev) and that netdev's link type."""
    netdevs = list_dir(f"{device_dir}/net")
    for netdev in netdevs:
        net_dir = f"{device_dir}/net/{netdev}"
        port_name = _readable(f"{net_dir}/phys_port_name")
        if port_name and UPLINK_PORT_NAME.fullmatch(port_name) and _readable(f"{net_dir}/phys_switch_id"):
            return netdev, netdev_link_type(net_dir)
    if not netdevs:
        return None, ""
    return netdevs[0], netdev_link_type(f"{device_dir}/net/{netdevs[0]}")


def read_pf(sysfs_root: str, address: str) -> ParentPf | None:
    """The PF at ``address``; ``None`` when it is gone (before or while it was read)."""
    bus_entry = f"{sysfs_root}/bus/pci/devices/{address}"
    vendor = read_hex_id(f"{bus_entry}/vendor", 4)
    device = read_hex_id(f"{bus_entry}/device", 4)
    class_code = read_hex_id(f"{bus_entry}/class", 6)
    if vendor is None or device is None or class_code is None:
        if not os.path.isdir(bus_entry):
            return None
        missing = [n for n, v in (("vendor", vendor), ("device", device), ("class", class_code)) if v is None]
        raise SysfsError(f"{bus_entry}: missing {', '.join(missing)}")
    name, link_type = pf_name(bus_entry)
    pf = ParentPf(address=address, vendor=vendor, device=device, class_code=class_code,
                  driver=link_name(f"{bus_entry}/driver"), numa_node=read_numa_node(bus_entry), name=name,
                  link_type=link_type, pcie_root=pcie_root_of(bus_entry))
    return pf if os.path.isdir(bus_entry) else None


def read_sf_logged(sysfs_root: str, dev_root: str, devpath: str, *,
                   gone_level: int | None) -> ScalableFunction | None:
    """``read_sf``, the reason logged when it cannot be used; ``gone_level``: the level to say at
    that its directory is gone (``None``: not worth a line: it was not known)."""
    name = os.path.basename(devpath)
    try:
        sf = read_sf(sysfs_root, dev_root, devpath)
    except SysfsError as error:
        log.warning("auxiliary device %s left out: %s", name, error, extra={"AUX_DEVICE": name})
        return None
    if sf is None and gone_level is not None:
        log.log(gone_level, "auxiliary device %s left out: %s%s is gone", name, sysfs_root, devpath,
                extra={"AUX_DEVICE": name})
    return sf


def read_pf_logged(sysfs_root: str, address: str, sf_names: list[str]) -> ParentPf | None:
    """``read_pf``; when it cannot be used, the SFs that go with it are named in the log."""
    try:
        pf = read_pf(sysfs_root, address)
        reason = f"{sysfs_root}/bus/pci/devices/{address} is gone (it vanished while it was read?)"
    except SysfsError as error:
        pf, reason = None, str(error)
    if pf is None:
        log.warning("auxiliary devices %s left out: their PF %s cannot be read: %s", ", ".join(sf_names), address,
                    reason, extra={"PCI_ADDR": address})
    return pf


def listed_sfs(sysfs_root: str) -> dict[str, str]:
    """Name -> devpath of every SF the auxiliary bus lists."""
    bus = sysfs_root + AUX_DEVICES
    found: dict[str, str] = {}
    for name in list_dir(bus):
        kind = aux_type(name)
        if kind is None:
            log.debug("auxiliary device %s left out: its name is not <module>.<type>.<id>", name)
        if kind != SF_TYPE:
            continue
        try:
            target = os.readlink(f"{bus}/{name}")
        except OSError:
            continue
        devpath = os.path.normpath(os.path.join(AUX_DEVICES, target))
        if PCI_ADDRESS.fullmatch(os.path.basename(os.path.dirname(devpath))):
            found[name] = devpath
    return found


def sfs_below(sysfs_root: str, pf_devpath: str) -> dict[str, str]:
    """Name -> devpath of the SFs in a PCI function's directory."""
    return {name: f"{pf_devpath}/{name}" for name in list_dir(sysfs_root + pf_devpath) if aux_type(name) == SF_TYPE}


def with_pfs(sysfs_root: str, sfs: dict[str, ScalableFunction], pfs: dict[str, ParentPf], addresses: set[str],
             reread: frozenset[str] = frozenset()) -> None:
    """Bring ``pfs`` (in place) to hold exactly the PFs of ``sfs`` among ``addresses``: a PF
    without SFs leaves, a PF new to ``pfs`` (or in ``reread``) is read; the SFs of a PF that
    cannot be read leave ``sfs`` (logged)."""
    for address in sorted(addresses):
        members = sorted(name for name, sf in sfs.items() if sf.pf_address == address)
        if not members:
            pfs.pop(address, None)
            continue
        if address in pfs and address not in reread:
            continue
        pf = read_pf_logged(sysfs_root, address, members)
        if pf is None:
            pfs.pop(address, None)
            for name in members:
                del sfs[name]
        else:
            pfs[address] = pf


def scan_aux(sysfs_root: str, dev_root: str) -> AuxFacts:
    sfs: dict[str, ScalableFunction] = {}
    for name, devpath in listed_sfs(sysfs_root).items():
        # listed on the bus but gone: its PF vanished while the bus was read
        sf = read_sf_logged(sysfs_root, dev_root, devpath, gone_level=logging.WARNING)
        if sf is not None:
            sfs[name] = sf
    pfs: dict[str, ParentPf] = {}
    with_pfs(sysfs_root, sfs, pfs, {sf.pf_address for sf in sfs.values()})
    return AuxFacts(sfs=MappingProxyType(sfs), pfs=MappingProxyType(pfs))

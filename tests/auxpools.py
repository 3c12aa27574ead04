"""auxNetDevice pools on a fake host: an AuxNetHandler driven like the daemon drives it
(configure, scan, fold each uevent, build, Allocate) over a tests/auxsysfs.py tree, and the
uevents the kernel sends, in its order, for each change made to that tree.

The kernel's order (``drivers/base/core.c``, ``dd.c``): a device's ``add`` comes before its
driver's probe; what the probe makes (the SF's own auxiliary devices, its netdev, its RDMA device
and their user devices; here in name order) sends its ``add`` (and ``bind``) events before the
device's own ``bind``; an unbind or a removal takes the children away (``unbind``, ``remove``)
before the device's own ``unbind`` and ``remove``. The events are built from the tree as it is (``AuxTree.uevent``: the
devpath, the ``uevent`` file's properties), before a removal and after an addition, as a reader
of the kernel's events later than the change sees them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from daemon.core import (
    ConfiguredPool,
    ContainerAllocation,
    DeviceInfo,
    Event,
    HandlerContext,
    ResourcePool,
    UEvent,
)
from daemon.handlers.auxnet import AuxNetHandler
from tests.auxsysfs import AuxTree
from tests.fakesysfs import FakeHost
from tests.handlerpools import allocate_as_daemon, build_by_name, configure_pools, pool_of

PREFIX = "nvidia.com"
PF_A, PF_B = "0000:03:00.0", "0000:04:00.0"
SF = {"auxTypes": ["sf"]}
ALL = {"resourceName": "all", "selectors": SF}
# the bound SFs of each PF in ``standard_tree`` (mlx5_core.sf.5 of PF A is not bound)
A_SFS = frozenset({"mlx5_core.sf.2", "mlx5_core.sf.3", "mlx5_core.sf.4"})
B_SFS = frozenset({"mlx5_core.sf.6", "mlx5_core.sf.7"})


def pool(name: str, *selectors: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """An auxNetDevice pool entry whose selector objects are ``auxTypes: ["sf"]`` and ``selectors``."""
    return {"resourceName": name, "selectors": [{**SF, **s} for s in selectors] if selectors else SF, **fields}


def device_dirs(directory: Path) -> list[Path]:
    """The device directories at and below ``directory`` (a ``uevent`` file and a
    ``subsystem`` link), parents first, in name order."""
    found: list[Path] = []
    if (directory / "uevent").is_file() and (directory / "subsystem").is_symlink():
        found.append(directory)
    for child in sorted(directory.iterdir()) if directory.is_dir() else []:
        if child.is_dir() and not child.is_symlink() and child.name not in ("power", "subsystem"):
            found.extend(device_dirs(child))
    return found


def subsystem_of(directory: Path) -> str:
    return os.path.basename(os.path.realpath(directory / "subsystem"))


def _event(tree: AuxTree, action: str, directory: Path) -> UEvent:
    return tree.uevent(action, directory, subsystem_of(directory))


def _probe_events(tree: AuxTree, sf_dir: Path) -> list[UEvent]:
    """What the SF driver's probe sends: its children's adds, their binds, then the SF's bind."""
    children = device_dirs(sf_dir)[1:]
    events = [_event(tree, "add", child) for child in children]
    events += [_event(tree, "bind", child) for child in reversed(children) if (child / "driver").is_symlink()]
    return [*events, _event(tree, "bind", sf_dir)]


def _teardown_events(tree: AuxTree, sf_dir: Path) -> list[UEvent]:
    """What an unbind of the SF's driver sends for its children (deepest first), taken before."""
    events: list[UEvent] = []
    for child in reversed(device_dirs(sf_dir)[1:]):
        if (child / "driver").is_symlink():
            events.append(_event(tree, "unbind", child))
        events.append(_event(tree, "remove", child))
    return events


def add_sf(tree: AuxTree, pf: str, sfnum: int, **options: Any) -> tuple[str, list[UEvent]]:
    """``AuxTree.add_sf`` and its events: the representor's add, the SF's add, its probe's."""
    name = tree.add_sf(pf, sfnum, **options)
    sf = tree.sfs[name]
    events = []
    if sf.representor is not None:
        events.append(_event(tree, "add", tree.host.device_dir(pf) / "net" / sf.representor))
    sf_dir = tree.aux_dir(name)
    events.append(_event(tree, "add", sf_dir))
    if (sf_dir / "driver").is_symlink():
        events += _probe_events(tree, sf_dir)
    return name, events


def bind_sf(tree: AuxTree, name: str) -> list[UEvent]:
    tree.bind_sf(name)
    return _probe_events(tree, tree.aux_dir(name))


def unbind_sf(tree: AuxTree, name: str) -> list[UEvent]:
    sf_dir = tree.aux_dir(name)
    events = _teardown_events(tree, sf_dir)
    tree.unbind_sf(name)
    return [*events, _event(tree, "unbind", sf_dir)]


def remove_sf(tree: AuxTree, name: str) -> list[UEvent]:
    """``devlink port del``: the SF unbound (if it is), removed, then its representor removed."""
    sf = tree.sfs[name]
    sf_dir = tree.aux_dir(name)
    events = _teardown_events(tree, sf_dir)
    if (sf_dir / "driver").is_symlink():
        events.append(tree.uevent("unbind", sf_dir, "auxiliary"))
    events.append(_event(tree, "remove", sf_dir))
    if sf.representor is not None:
        events.append(_event(tree, "remove", tree.host.device_dir(sf.pf) / "net" / sf.representor))
    tree.remove_sf(name)
    return events


def rename_netdev(tree: AuxTree, parent: Path, old: str, new: str) -> UEvent:
    """A netdev renamed (as udev renames it): its directory, its class link, its ``move`` uevent."""
    net = parent / "net"
    os.rename(net / old, net / new)
    (tree.sys / "class" / "net" / old).unlink()
    tree.link(tree.sys / "class" / "net" / new, net / new)
    uevent = net / new / "uevent"
    uevent.write_text(uevent.read_text().replace(f"INTERFACE={old}\n", f"INTERFACE={new}\n"))
    moved = _event(tree, "move", net / new)
    return UEvent(moved.action, moved.devpath, moved.subsystem, moved.devname,
                  MappingProxyType({**moved.properties, "DEVPATH_OLD": moved.devpath.rsplit("/", 1)[0] + "/" + old}))


def pci_event(tree: AuxTree, action: str, address: str) -> UEvent:
    properties = {"PCI_SLOT_NAME": address}
    driver = tree.host.device_dir(address) / "driver"
    if action == "bind" and driver.is_symlink():
        properties = {"DRIVER": driver.resolve().name, **properties}
    return UEvent(action, tree.host.devpath(address), "pci", None, MappingProxyType(properties))


class AuxPools:
    """An AuxNetHandler on ``host`` with an AuxTree to change it, and the facts folded so far."""

    def __init__(self, host: FakeHost, tree: AuxTree | None = None) -> None:
        self.host = host
        self.tree = tree or AuxTree(host)
        self.handler = AuxNetHandler(HandlerContext(host.sys, host.dev, host.proc, host.root / "devinfo"))
        self.facts: Any = None

    def configure(self, *entries: dict[str, Any], prefix: str = PREFIX) -> list[ConfiguredPool[Any]]:
        return configure_pools(self.handler, entries, prefix, "auxNetDevice")

    def build(self, facts: Any, *entries: dict[str, Any]) -> dict[str, dict[str, DeviceInfo]]:
        """The devices of each pool (by resource name without the prefix) from ``facts``."""
        return build_by_name(self.handler, facts, self.configure(*entries))

    def ids(self, *entries: dict[str, Any]) -> dict[str, set[str]]:
        """The device IDs of each pool from a fresh scan."""
        return {name: set(devices) for name, devices in self.build(self.handler.scan(), *entries).items()}

    def start(self) -> None:
        self.facts = self.handler.scan()

    def fold(self, events: Iterable[Event]) -> None:
        for event in events:
            self.facts = self.handler.fold(self.facts, event)

    def scanned(self) -> Any:
        """A fresh scan, with the link states folded so far (rtnetlink's, not sysfs's)."""
        return replace(self.handler.scan(), links=self.facts.links)

    def pool(self, entry: dict[str, Any], facts: Any = None) -> ResourcePool:
        (configured,) = self.configure(entry)
        return pool_of(self.handler, configured, facts)

    def allocate(self, pool: ResourcePool, device_ids: list[str]) -> ContainerAllocation:
        return allocate_as_daemon(self.handler, pool, device_ids)


def standard_tree(tree: AuxTree) -> None:
    """Two PFs with SFs, laid out in this order so that names and RDMA numbers are fixed (aux ids
    are the lowest free, as mlx5's ida gives them; ``sfnum`` is not the id):

    * PF A ``0000:03:00.0`` (ConnectX-6 Dx ``101d``, NUMA 0, uplink ``enp3s0f0np0``, RDMA
      ``mlx5_0`` with uverbs0): SFs ``mlx5_core.sf.2`` (sfnum 88, ``enp3s0f0s88``, RDMA ``mlx5_2``:
      uverbs1, umad1, issm1), ``.3`` (sfnum 5), ``.4`` (sfnum 3), ``.5`` (sfnum 4, its driver unbound);
    * PF B ``0000:04:00.0`` (BlueField-2 ``a2d6``, NUMA 1, uplink ``p0``): SFs ``mlx5_core.sf.6``
      (sfnum 1, ``en4f0s1``), ``.7`` (sfnum 2, ``en4f0s2``, RDMA ``mlx5_3``: uverbs2, umad2, issm2).
    """
    tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0", numa_node=0)
    tree.add_mlx5_pf(PF_B, uplink="p0", rdma=None, numa_node=1, device="a2d6", bridge="0000:00:03.0")
    tree.add_sf(PF_A, 88, netdev="enp3s0f0s88", rdma="mlx5_2")
    tree.add_sf(PF_A, 5, netdev="enp3s0f0s5")
    tree.add_sf(PF_A, 3, netdev="enp3s0f0s3")
    tree.add_sf(PF_A, 4, netdev="enp3s0f0s4", bound=False)
    tree.add_sf(PF_B, 1, netdev="en4f0s1")
    tree.add_sf(PF_B, 2, netdev="en4f0s2", rdma="mlx5_3")

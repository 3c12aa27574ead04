"""Scalable functions on the auxiliary bus, vDPA devices on VFs and InfiniBand ports with their
partition keys, laid out on a FakeHost as Linux lays them out.

Sources (the kernel's own, not the SR-IOV plugin's fixtures): ``drivers/base/auxiliary.c`` (the
name ``<module>.<name>.<id>``, ``MODALIAS=auxiliary:<name before the last dot>``, driver names
``<module>.<name>``), ``Documentation/ABI/testing/sysfs-bus-auxiliary``, mlx5's
``core/sf/dev/dev.c`` and ``driver.c`` (the SF is ``mlx5_core.sf.<id>`` with ``parent`` = the PF's
PCI device and one attribute ``sfnum``, ``%u``; driver ``mlx5_core.sf``; its probe sets
``mdev->device`` = the SF), ``core/dev.c`` (per mlx5 device the auxiliary devices ``eth``,
``rdma``, ``eth-rep``, ``rdma-rep``, ``vnet`` named ``mlx5_core.<suffix>.<adev_idx>`` under
``mdev->device``; ``adev_idx`` from one ida shared by PFs, VFs and SFs; ``rdma`` only outside
switchdev, ``*-rep`` only in switchdev, ``vnet`` never on a PF), ``en_main.c``/``en_rep.c``
(``SET_NETDEV_DEV(netdev, mdev->device)``: the SF's netdev sits under the SF itself, every
representor under the eswitch manager's PCI device), ``infiniband/hw/mlx5/main.c``
(``ib_dev.dev.parent = mdev->device``), ``net/devlink`` (``phys_port_name`` ``p<port>`` for the
uplink, ``pf<pf>vf<vf>``, ``pf<pf>sf<sfnum>``), ``Documentation/networking/device_drivers/
ethernet/mellanox/mlx5/switchdev.rst`` (the SF's hierarchy, names such as ``mlx5_core.sf.4``
with sfnum 88), ``drivers/vdpa/vdpa.c``, ``drivers/vdpa/mlx5/net/mlx5_vnet.c``,
``drivers/vhost/vdpa.c``, ``drivers/virtio/virtio.c``/``virtio_vdpa.c`` and
``drivers/infiniband/core/sysfs.c``, ``uverbs_main.c``, ``user_mad.c``.

What was found where (the places this tree differs from what one might guess):

* A vDPA device of an mlx5 VF sits **directly under the VF's PCI device**, not under the VF's
  ``mlx5_core.vnet.<id>`` auxiliary device: mlx5_vnet.c allocates it with
  ``vdpa_alloc_device(..., mdev->device, ...)`` and for a VF ``mdev->device`` is ``&pdev->dev``;
  the management device (``vdpa mgmtdev show``: ``pci/<vf>``) is that PCI device too. Its name is
  the one given to ``vdpa dev add name …`` (``vdpa%u`` only when none is given), so a reader must
  know vDPA devices by their ``subsystem`` link, not by their names.
* ``vhost_vdpa`` registers **no class**: its char device ``vhost-vdpa-<minor>`` (``v->dev.parent =
  &vdpa->dev``, ``devt`` set, ``cdev_device_add``) is a plain directory in the vDPA device's
  directory, with ``dev``, ``uevent`` and ``power/`` and no ``subsystem`` link; there is no
  ``sys/class/vhost-vdpa`` (a 2021 patch adding one was not merged; checked up to a 2026 tree).
  Its major is dynamic (``alloc_chrdev_region``). devtmpfs makes ``/dev/vhost-vdpa-<minor>``.
* ``virtio_vdpa`` puts its ``virtio<N>`` device **beside** the vDPA device, under the DMA device
  (``vd_dev->vdev.dev.parent = vdpa_get_dma_dev(vdpa)``, for mlx5 ``&mdev->pdev->dev``, the VF),
  not below it; its netdev is ``virtio<N>/net/<ifname>``.
* ``ib_ucm`` (class ``infiniband_cm``, ``ucm<N>``) is gone from current kernels (the Makefile
  builds ``ib_uverbs`` and ``rdma_ucm`` only); ``ucm=True`` lays it as older kernels had it.

Layout (paths below ``sys/``; ``<pf>`` is the PF's directory ``devices/pci0000:00/<bridge>/<pf
address>``). Every link is relative with the text kernfs gives it (``AuxTree.link``): the
shortest relative path, except a link to an ancestor, which goes up one level further and names
it (``<pf>/net/<if>/device -> ../../../<pf address>``), so ``basename(readlink(…/device))`` names
the device as on a real host:

* mlx5 PF (``add_mlx5_pf``): the FakeHost PCI function (vendor ``15b3``, driver ``mlx5_core``)
  plus ``<pf>/mlx5_core.eth.<i>`` and, in switchdev mode, ``mlx5_core.eth-rep.<i>`` and
  ``mlx5_core.rdma-rep.<i>`` (legacy mode: ``mlx5_core.rdma.<i>``), each an auxiliary device as
  below, bound to ``mlx5_core.eth``, ``mlx5_core.eth-rep``, ``mlx5_ib.rdma-rep``,
  ``mlx5_ib.rdma``; the uplink netdev ``<pf>/net/<uplink>`` with ``phys_port_name`` = ``p<port>``
  and, in switchdev mode only, ``phys_switch_id`` (the switch id as ``%*phN``: lowercase hex, no
  separators); the RDMA device ``<pf>/infiniband/<rdma>`` when one is named.
* An auxiliary device ``<parent>/<name>/``: ``uevent`` = ``DRIVER=<driver>`` (only while bound)
  then ``MODALIAS=auxiliary:<name up to its last dot>``; ``subsystem -> …/bus/auxiliary``;
  ``driver -> …/bus/auxiliary/drivers/<driver>`` while bound, with the driver's link back
  ``bus/auxiliary/drivers/<driver>/<name>``; ``power/control`` (``auto``);
  ``bus/auxiliary/devices/<name> -> ../../../devices/…/<name>`` (nested ones too: the bus lists
  ``mlx5_core.eth.2`` of an SF as flatly as the SF).
* An SF (``add_sf``): ``<pf>/mlx5_core.sf.<id>/`` as above with ``sfnum`` (``%u\\n``, the devlink
  sfnum, not ``<id>``). While its driver ``mlx5_core.sf`` is bound it has its own children:
  ``mlx5_core.eth.<id>/`` and ``mlx5_core.rdma.<id>/`` (same ``<id>``), the netdev
  ``net/<ifname>/`` and the RDMA device ``infiniband/<rdma>/`` (with its ``infiniband_verbs/`` and
  ``infiniband_mad/`` class devices beside it, under the SF). Unbound: none of these. Its
  representor ``<pf>/net/<rep>`` (``phys_port_name`` ``pf<pfnum>sf<sfnum>``, the uplink's
  ``phys_switch_id``) stays while the SF exists, bound or not.
* A netdev ``<device>/net/<ifname>/``: ``type`` (ARPHRD: 1 ether, 32 infiniband), ``ifindex``,
  ``uevent`` (``INTERFACE=``, ``IFINDEX=``), ``dev_port``, ``device -> ../../../<device name>``,
  ``subsystem -> …/class/net``, and ``phys_port_name``/``phys_switch_id`` where the kernel
  would give them. A file left out stands for an attribute whose read fails with
  EOPNOTSUPP on a real kernel (``phys_switch_id`` of a legacy-mode or non-switch netdev): treat
  any ``OSError`` as "none". ``class/net/<ifname> -> ../../devices/…/net/<ifname>``.
* An RDMA device (``add_ib``) ``<device>/infiniband/<ibdev>/``: ``uevent`` (``NAME=<ibdev>``),
  ``node_type`` (``1: CA``), ``device -> ../../../<device name>``, ``subsystem -> …/class/infiniband``,
  ``ports/<n>/`` for n = 1.. with ``link_layer`` (``InfiniBand``/``Ethernet``, ``%s\\n``),
  ``state`` (``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``lid`` (``0x%x``; IB only) and
  ``pkeys/<i>`` for every index of the port's table, each ``0x%04x\\n`` (``0x0000`` for an unused
  entry; mlx5 tables have 128 entries on IB ports, 1 on Ethernet ports); ``class/infiniband/
  <ibdev>``. Its user devices beside it (parent = the RDMA device's parent): ``<device>/
  infiniband_verbs/uverbs<u>/`` (``ibdev``, ``dev`` = ``231:<192+u>``, ``uevent`` with
  ``DEVNAME=infiniband/uverbs<u>``), one per device; ``<device>/infiniband_mad/umad<n>/``
  (``231:<n>``) and ``issm<n>/`` (``231:<64+n>``) with ``ibdev`` and ``port``, one pair per port
  (ib_umad numbers ports, so ``n`` and ``u`` part ways on multi-port devices); their class links
  ``class/infiniband_verbs/uverbs<u>`` and ``class/infiniband_mad/{umad,issm}<n>``; the nodes
  ``/dev/infiniband/{uverbs<u>,umad<n>,issm<n>}`` and ``/dev/infiniband/rdma_cm``.
* A vDPA device (``add_vdpa``) ``<vf>/<vdpa>/``: ``uevent`` (``DRIVER=<driver>`` while bound, the
  vdpa bus adds nothing), ``driver_override`` (``(null)``), ``subsystem -> …/bus/vdpa``,
  ``driver -> …/bus/vdpa/drivers/{vhost_vdpa,virtio_vdpa}`` and its link back,
  ``bus/vdpa/devices/<vdpa> -> ../../../devices/…/<vf>/<vdpa>``; for an mlx5 VF also
  ``<vf>/mlx5_core.vnet.<id>`` bound to ``mlx5_vdpa.vnet`` (the management device's driver),
  which makes one vDPA device per VF (a second ``vdpa dev add`` is refused with ENOSPC).
  Bound to ``vhost_vdpa``: ``<vf>/<vdpa>/vhost-vdpa-<m>/`` with ``dev`` (``<major>:<m>``) and
  ``uevent`` (``MAJOR``, ``MINOR``, ``DEVNAME=vhost-vdpa-<m>``), ``dev/char/<major>:<m>``, the
  node ``/dev/vhost-vdpa-<m>``. Bound to ``virtio_vdpa``: ``<vf>/virtio<n>/`` with ``device``
  (``0x0001``), ``vendor`` (``0x15b3``), ``modalias`` (``virtio:d00000001v000015B3``), ``uevent``
  (``DRIVER=virtio_net``, ``MODALIAS=…``), ``subsystem -> …/bus/virtio``, ``driver -> …/bus/
  virtio/drivers/virtio_net``, ``bus/virtio/devices/virtio<n>`` and its netdev ``net/<ifname>``.
* Numbers (the mlx5 ``adev_idx``, ``vdpa<n>``, ``vhost-vdpa-<m>``, ``virtio<n>``, ``uverbs<u>``)
  are the lowest free ones, as the kernel's idas give them, unless a caller names them.

Removal (``remove_sf``, ``remove_vdpa``, ``remove_function``) takes away a device, everything
below it and every link into it, as the kernel's teardown leaves the tree; ``vanish`` removes
only a directory and leaves every link into it dangling: the tree of a PF that disappears while
a reader walks it (its SFs' bus links then resolve to nothing).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from daemon.core import UEvent
from tests.fakesysfs import ETHER, INFINIBAND, FakeHost, write_file

MELLANOX = "15b3"
CX6DX_PF = "101d"  # ConnectX-6 Dx
CX6DX_VF = "101e"
MLX5_CORE = "mlx5_core"
SF_DRIVER = "mlx5_core.sf"
VNET_DRIVER = "mlx5_vdpa.vnet"
VHOST_VDPA = "vhost_vdpa"
VIRTIO_VDPA = "virtio_vdpa"
VIRTIO_NET = "virtio_net"
VIRTIO_ID_NET = 1
VHOST_VDPA_MAJOR = 236  # dynamic on a real kernel (alloc_chrdev_region); any free major
IB_UVERBS_MAJOR = 231
IB_UVERBS_BASE_MINOR = 192
IB_UMAD_MAJOR = 231
IB_UMAD_NUM_FIXED_MINOR = 64
IB_UCM_MAJOR = 231
IB_UCM_BASE_MINOR = 224
DEFAULT_SWITCH_ID = "12d1b30003078a24"  # system image GUID 248a:0703:00b3:d112, as a little-endian u64's bytes
INFINIBAND_LINK = "InfiniBand"
ETHERNET_LINK = "Ethernet"

# mlx5's driver for each auxiliary device suffix (KBUILD_MODNAME + "." + the driver's name).
MLX5_AUX_DRIVERS = MappingProxyType({
    "eth": "mlx5_core.eth",
    "eth-rep": "mlx5_core.eth-rep",
    "rdma": "mlx5_ib.rdma",
    "rdma-rep": "mlx5_ib.rdma-rep",
    "vnet": VNET_DRIVER,
    "sf": SF_DRIVER,
})

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_MLX5_AUX = re.compile(r"^mlx5_core\.[a-z-]+\.(\d+)$")
_VDPA_NAME = r"^vdpa(\d+)$"
_DEFAULT = "<default>"  # a sentinel for "name it as the kernel and udev would"


def aux_modalias(name: str) -> str:
    """``auxiliary:`` and the name up to its last dot, as auxiliary_uevent() prints it."""
    return "auxiliary:" + name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Sf:
    """What an SF's probe makes (kept to make it again on a bind)."""

    pf: str
    sfnum: int
    adev_id: int
    netdev: str | None
    rdma: str | None
    representor: str | None


@dataclass
class Vdpa:
    """A vDPA device and what its driver's probe made."""

    function: str  # the VF's PCI address
    name: str
    netdev: str | None  # the virtio_net netdev when bound to virtio_vdpa
    vendor_id: int
    virtio: str | None = None  # virtio_vdpa's virtio<n> (beside the vDPA device) while bound to it


@dataclass
class AuxTree:
    """SFs, vDPA devices and RDMA ports on ``host``; keep one per FakeHost (it remembers what a
    probe made, to make it again on a bind)."""

    host: FakeHost
    vhost_major: int = VHOST_VDPA_MAJOR
    sfs: dict[str, Sf] = field(default_factory=dict)
    vdpas: dict[str, Vdpa] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for bus in ("auxiliary", "vdpa", "virtio"):
            for below in ("devices", "drivers"):
                (self.sys / "bus" / bus / below).mkdir(parents=True, exist_ok=True)

    @property
    def sys(self) -> Path:
        return self.host.sys

    # -- paths -------------------------------------------------------------------------------
    def aux_dir(self, name: str) -> Path:
        return (self.sys / "bus" / "auxiliary" / "devices" / name).resolve()

    def vdpa_dir(self, name: str) -> Path:
        return (self.sys / "bus" / "vdpa" / "devices" / name).resolve()

    def devpath_of(self, directory: Path, *below: str) -> str:
        """The uevent DEVPATH of a device directory (or of ``below`` it)."""
        return "/" + "/".join((directory.relative_to(self.sys.resolve()).as_posix(), *below))

    def aux_devpath(self, name: str, *below: str) -> str:
        return self.devpath_of(self.aux_dir(name), *below)

    def uevent(self, action: str, directory: Path, subsystem: str) -> UEvent:
        """The uevent the kernel sends for ``directory`` now, its properties read from its
        ``uevent`` file (call it before a ``remove``: the kernel sends what the device had)."""
        properties: dict[str, str] = {}
        for line in (directory / "uevent").read_text().splitlines():
            key, _, value = line.partition("=")
            properties[key] = value
        return UEvent(action, self.devpath_of(directory), subsystem, properties.get("DEVNAME"),
                      MappingProxyType(properties))

    def aux_uevent(self, action: str, name: str) -> UEvent:
        return self.uevent(action, self.aux_dir(name), "auxiliary")

    # -- generic pieces ----------------------------------------------------------------------
    def link(self, link: Path, target: Path) -> None:
        """A symlink with the text sysfs gives it (kernfs_get_target_path()): up from the link's
        directory until an ancestor of the target's parent, then down. It differs from the
        shortest relative path when the target is an ancestor of the link: a netdev's ``device``
        reads ``../../../0000:03:00.0``, not ``../..``, so its basename names the device."""
        root = self.sys.resolve()
        link.parent.mkdir(parents=True, exist_ok=True)
        base = list(link.parent.resolve().relative_to(root).parts)
        parts = target.resolve().relative_to(root).parts
        ups = 0
        while base and tuple(base) != parts[:-1][: len(base)]:
            base.pop()
            ups += 1
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("../" * ups + "/".join(parts[len(base):]))

    def _bus_device(self, directory: Path, bus: str, uevent_tail: Sequence[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _write_uevent(directory, None, uevent_tail)
        write_file(directory / "power" / "control", "auto\n")
        self.link(directory / "subsystem", self.sys / "bus" / bus)
        self.link(self.sys / "bus" / bus / "devices" / directory.name, directory)

    def _bind(self, directory: Path, bus: str, driver: str) -> None:
        self._unbind(directory)
        driver_dir = self.sys / "bus" / bus / "drivers" / driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        self.link(directory / "driver", driver_dir)
        self.link(driver_dir / directory.name, directory)
        _set_uevent_driver(directory, driver)

    def _unbind(self, directory: Path) -> None:
        link = directory / "driver"
        if link.is_symlink():
            (link.resolve() / directory.name).unlink(missing_ok=True)
            link.unlink()
        _set_uevent_driver(directory, None)

    def _class_device(self, directory: Path, class_name: str, parent: Path) -> None:
        self.link(directory / "subsystem", self.sys / "class" / class_name)
        self.link(directory / "device", parent)
        self.link(self.sys / "class" / class_name / directory.name, directory)

    def _char_device(self, directory: Path, devname: str, major: int, minor: int) -> None:
        write_file(directory / "dev", f"{major}:{minor}\n")
        self.link(self.sys / "dev" / "char" / f"{major}:{minor}", directory)
        self.host.add_dev_node(devname)

    def add_aux(self, parent: Path, name: str, *, driver: str | None) -> Path:
        """An auxiliary device ``name`` under the device directory ``parent``."""
        directory = parent / name
        self._bus_device(directory, "auxiliary", [f"MODALIAS={aux_modalias(name)}"])
        if driver is not None:
            self.bind_aux(name, driver)
        return directory

    def bind_aux(self, name: str, driver: str) -> None:
        self._bind(self.aux_dir(name), "auxiliary", driver)

    def unbind_aux(self, name: str) -> None:
        self._unbind(self.aux_dir(name))

    def add_netdev_at(self, parent: Path, ifname: str, *, arphrd: int = ETHER, phys_port_name: str | None = None,
                   phys_switch_id: str | None = None, dev_port: int = 0) -> Path:
        """A netdev under the device directory ``parent`` (the files ``FakeHost.add_netdev``
        writes, and those a real netdev has besides)."""
        directory = parent / "net" / ifname
        ifindex = 1 + max((int(index.read_text()) for index in (self.sys / "class" / "net").glob("*/ifindex")), default=1)
        write_file(directory / "type", f"{arphrd}\n")
        write_file(directory / "ifindex", f"{ifindex}\n")
        write_file(directory / "dev_port", f"{dev_port}\n")
        write_file(directory / "uevent", f"INTERFACE={ifname}\nIFINDEX={ifindex}\n")
        if phys_port_name is not None:
            write_file(directory / "phys_port_name", f"{phys_port_name}\n")
        if phys_switch_id is not None:
            write_file(directory / "phys_switch_id", f"{phys_switch_id}\n")
        self._class_device(directory, "net", parent)
        return directory

    def _lowest_free(self, taken: set[int]) -> int:
        number = 0
        while number in taken:
            number += 1
        return number

    def _taken(self, directory: Path, pattern: str) -> set[int]:
        compiled = re.compile(pattern)
        names = os.listdir(directory) if directory.is_dir() else []
        return {int(match.group(1)) for name in names if (match := compiled.match(name))}

    def next_adev_id(self) -> int:
        """mlx5_adev_idx_alloc(): the lowest id no mlx5 auxiliary device has."""
        return self._lowest_free(self._taken(self.sys / "bus" / "auxiliary" / "devices", _MLX5_AUX.pattern))

    # -- removal -----------------------------------------------------------------------------
    def _remove_tree(self, directory: Path) -> None:
        """``directory``, its children and every link into it; the nodes of its char devices."""
        if not directory.exists():
            return
        for uevent in directory.rglob("uevent"):
            devname = next((line[8:] for line in uevent.read_text().splitlines() if line.startswith("DEVNAME=")), None)
            if devname is not None:
                (self.host.dev / devname).unlink(missing_ok=True)
        inside = directory.resolve()
        for base in (self.sys / "bus", self.sys / "class", self.sys / "dev"):
            for dirpath, dirnames, filenames in os.walk(base):
                for entry in (*dirnames, *filenames):
                    link = Path(dirpath) / entry
                    if link.is_symlink() and _within(Path(os.path.realpath(link)), inside):
                        link.unlink()
        shutil.rmtree(directory)

    def remove_function(self, address: str) -> None:
        """A PCI function removed as the kernel removes it: its SFs, vDPA devices, auxiliary
        and class devices first, then the function (``FakeHost.remove_pci``)."""
        directory = self.host.device_dir(address)
        for name, sf in list(self.sfs.items()):
            if sf.pf == address:
                self.remove_sf(name)
        for name, vdpa in list(self.vdpas.items()):
            if vdpa.function == address:
                self.remove_vdpa(name)
        for child in list(directory.iterdir()):
            if child.is_dir() and not child.is_symlink() and child.name not in ("net", "power"):
                self._remove_tree(child)
        if (directory / "net").is_dir():
            for netdev in list((directory / "net").iterdir()):
                self._remove_tree(netdev)
        self.host.remove_pci(address)

    def vanish(self, address: str) -> None:
        """The PCI function's directory gone at once, every link into it left dangling: what a
        reader sees when the function disappears between two of its reads."""
        shutil.rmtree(self.host.device_dir(address))

    # -- mlx5 PFs and SFs --------------------------------------------------------------------
    def add_mlx5_pf(
        self,
        address: str,
        *,
        uplink: str | None = "enp3s0f0np0",
        switchdev: bool = True,
        port: int = 0,
        switch_id: str = DEFAULT_SWITCH_ID,
        rdma: str | None = "mlx5_0",
        device: str = CX6DX_PF,
        total_vfs: int = 8,
        numa_node: int = 0,
        bridge: str | None = "0000:00:02.0",
    ) -> int:
        """An mlx5 PF (``FakeHost.add_pf``) with what mlx5_core and mlx5_ib make for it; returns its
        ``adev_idx``. ``switchdev``: its eswitch is in switchdev mode (SFs need it)."""
        adev_id = self.next_adev_id()
        self.host.add_pf(address, netdev=None, total_vfs=total_vfs, vendor=MELLANOX, device=device,
                         driver=MLX5_CORE, numa_node=numa_node, bridge=bridge)
        directory = self.host.device_dir(address)
        for suffix in ("eth", "eth-rep", "rdma-rep") if switchdev else ("eth", "rdma"):
            self.add_aux(directory, f"mlx5_core.{suffix}.{adev_id}", driver=MLX5_AUX_DRIVERS[suffix])
        if uplink is not None:
            self.add_netdev_at(directory, uplink, phys_port_name=f"p{port}",
                            phys_switch_id=switch_id if switchdev else None)
        if rdma is not None:
            self.add_ib(address, rdma, link_layer=ETHERNET_LINK)
        return adev_id

    def _uplink_switch_id(self, pf: str) -> str | None:
        net = self.host.device_dir(pf) / "net"
        for netdev in sorted(net.iterdir()) if net.is_dir() else []:
            name = netdev / "phys_port_name"
            if name.exists() and re.fullmatch(r"p\d+", name.read_text().strip()):
                switch_id = netdev / "phys_switch_id"
                return switch_id.read_text().strip() if switch_id.exists() else None
        return None

    def add_sf(
        self,
        pf: str,
        sfnum: int,
        *,
        netdev: str | None,
        rdma: str | None = None,
        bound: bool = True,
        pfnum: int = 0,
        representor: str | None = _DEFAULT,
        adev_id: int | None = None,
    ) -> str:
        """An SF of the PF ``pf`` (``devlink port add … flavour pcisf pfnum <pfnum> sfnum <sfnum>``,
        then activated); returns its auxiliary name ``mlx5_core.sf.<id>``. ``bound``: its driver
        ``mlx5_core.sf`` probed it (netdev, RDMA device and its own auxiliary devices exist).
        ``representor``: its eswitch representor on the PF (``pf<pfnum>sf<sfnum>`` unless named;
        ``None``: none, as when another host is the eswitch manager)."""
        adev_id = self.next_adev_id() if adev_id is None else adev_id
        name = f"mlx5_core.sf.{adev_id}"
        if representor == _DEFAULT:
            representor = f"pf{pfnum}sf{sfnum}"
        pf_dir = self.host.device_dir(pf)
        directory = self.add_aux(pf_dir, name, driver=None)
        write_file(directory / "sfnum", f"{sfnum}\n")
        if representor is not None:
            self.add_netdev_at(pf_dir, representor, phys_port_name=f"pf{pfnum}sf{sfnum}",
                            phys_switch_id=self._uplink_switch_id(pf))
        self.sfs[name] = Sf(pf, sfnum, adev_id, netdev, rdma, representor)
        if bound:
            self.bind_sf(name)
        return name

    def bind_sf(self, name: str) -> None:
        """``mlx5_core.sf`` binds the SF: its probe makes its eth and rdma auxiliary devices, its
        netdev and its RDMA device (all under the SF)."""
        sf = self.sfs[name]
        directory = self.aux_dir(name)
        self.bind_aux(name, SF_DRIVER)
        for suffix in ("eth",) + (("rdma",) if sf.rdma is not None else ()):
            self.add_aux(directory, f"mlx5_core.{suffix}.{sf.adev_id}", driver=MLX5_AUX_DRIVERS[suffix])
        if sf.netdev is not None:
            self.add_netdev_at(directory, sf.netdev)
        if sf.rdma is not None:
            self.add_ib(name, sf.rdma, link_layer=ETHERNET_LINK)

    def unbind_sf(self, name: str) -> None:
        """The SF's driver unbound: what its probe made goes, the SF itself stays."""
        directory = self.aux_dir(name)
        for child in list(directory.iterdir()):
            if child.is_dir() and not child.is_symlink() and child.name != "power":
                self._remove_tree(child)
        self.unbind_aux(name)

    def remove_sf(self, name: str) -> None:
        """``devlink port del``: the SF (unbound first, as the kernel does) and its representor."""
        sf = self.sfs.pop(name)
        directory = self.aux_dir(name)
        self._remove_tree(directory)
        if sf.representor is not None:
            self._remove_tree(self.host.device_dir(sf.pf) / "net" / sf.representor)

    # -- vDPA ---------------------------------------------------------------------------------
    def add_vdpa(
        self,
        function: str,
        *,
        name: str | None = None,
        driver: str | None = VHOST_VDPA,
        netdev: str | None = None,
        vendor_id: int = int(MELLANOX, 16),
        mlx5_vnet: bool = True,
    ) -> str:
        """``vdpa dev add [name <name>] mgmtdev pci/<function>``; returns the vDPA device's name.
        ``driver``: the vdpa bus driver that binds it (``vhost_vdpa``, ``virtio_vdpa``, ``None``);
        ``netdev``: virtio_net's netdev when bound to virtio_vdpa; ``mlx5_vnet``: lay the VF's
        ``mlx5_core.vnet.<id>`` (bound to ``mlx5_vdpa.vnet``) if it has none."""
        directory = self.host.device_dir(function)
        if mlx5_vnet and any(vdpa.function == function for vdpa in self.vdpas.values()):
            raise ValueError(f"mlx5_vdpa makes one vDPA device per management device ({function}): -ENOSPC")
        if mlx5_vnet and not any(_MLX5_AUX.match(child.name) and ".vnet." in child.name
                                 for child in directory.iterdir()):
            self.add_aux(directory, f"mlx5_core.vnet.{self.next_adev_id()}", driver=VNET_DRIVER)
        if name is None:
            name = f"vdpa{self._lowest_free(self._taken(self.sys / 'bus' / 'vdpa' / 'devices', _VDPA_NAME))}"
        vdpa_dir = directory / name
        self._bus_device(vdpa_dir, "vdpa", [])
        write_file(vdpa_dir / "driver_override", "(null)\n")
        self.vdpas[name] = Vdpa(function, name, netdev, vendor_id)
        if driver is not None:
            self.bind_vdpa(name, driver)
        return name

    def bind_vdpa(self, name: str, driver: str) -> None:
        """Bind the vDPA device to ``vhost_vdpa`` or ``virtio_vdpa`` (unbinding the other first)."""
        self.unbind_vdpa(name)
        vdpa = self.vdpas[name]
        directory = self.vdpa_dir(name)
        self._bind(directory, "vdpa", driver)
        if driver == VHOST_VDPA:
            minor = self._lowest_free({
                int(child.name.rsplit("-", 1)[1])
                for device in (self.sys / "bus" / "vdpa" / "devices").iterdir() if device.exists()
                for child in device.resolve().iterdir() if child.name.startswith("vhost-vdpa-")
            })
            char_dir = directory / f"vhost-vdpa-{minor}"
            write_file(char_dir / "uevent", f"MAJOR={self.vhost_major}\nMINOR={minor}\nDEVNAME=vhost-vdpa-{minor}\n")
            write_file(char_dir / "power" / "control", "auto\n")
            self._char_device(char_dir, f"vhost-vdpa-{minor}", self.vhost_major, minor)
        elif driver == VIRTIO_VDPA:
            index = self._lowest_free(self._taken(self.sys / "bus" / "virtio" / "devices", r"^virtio(\d+)$"))
            virtio_dir = directory.parent / f"virtio{index}"
            vdpa.virtio = virtio_dir.name
            modalias = f"virtio:d{VIRTIO_ID_NET:08X}v{vdpa.vendor_id:08X}"
            self._bus_device(virtio_dir, "virtio", [f"MODALIAS={modalias}"])
            write_file(virtio_dir / "device", f"0x{VIRTIO_ID_NET:04x}\n")
            write_file(virtio_dir / "vendor", f"0x{vdpa.vendor_id:04x}\n")
            write_file(virtio_dir / "modalias", f"{modalias}\n")
            write_file(virtio_dir / "status", "0x0000000f\n")
            self._bind(virtio_dir, "virtio", VIRTIO_NET)
            if vdpa.netdev is not None:
                self.add_netdev_at(virtio_dir, vdpa.netdev)

    def virtio_dir(self, name: str) -> Path | None:
        """The virtio device virtio_vdpa made for the vDPA device ``name`` (beside it), if any."""
        virtio = self.vdpas[name].virtio
        return None if virtio is None else self.vdpa_dir(name).parent / virtio

    def unbind_vdpa(self, name: str) -> None:
        """The vDPA device's driver unbound: its char device or its virtio device goes."""
        directory = self.vdpa_dir(name)
        virtio = self.virtio_dir(name)
        if virtio is not None:
            self._remove_tree(virtio)
            self.vdpas[name].virtio = None
        for child in list(directory.iterdir()):
            if child.name.startswith("vhost-vdpa-"):
                self._remove_tree(child)
        self._unbind(directory)

    def remove_vdpa(self, name: str) -> None:
        """``vdpa dev del <name>``."""
        self.unbind_vdpa(name)
        self._remove_tree(self.vdpa_dir(name))
        del self.vdpas[name]

    # -- InfiniBand ---------------------------------------------------------------------------
    def owner_dir(self, owner: str) -> Path:
        """The directory of a PCI function (by address) or an auxiliary device (by name)."""
        return self.host.device_dir(owner) if _PCI_ADDRESS.match(owner) else self.aux_dir(owner)

    def add_ib(
        self,
        owner: str,
        ibdev: str,
        *,
        link_layer: str = INFINIBAND_LINK,
        ports: int = 1,
        pkeys: Sequence[int] = (0xFFFF,),
        pkey_table_len: int | None = None,
        index: int | None = None,
        ucm: bool = False,
    ) -> Path:
        """An RDMA device ``ibdev`` of ``owner`` (a PCI address or an auxiliary device name) with
        ``ports`` ports, each with ``pkeys`` at indices 0.. of a table of ``pkey_table_len``
        entries (128 on an InfiniBand port, 1 on an Ethernet one, as mlx5 reports them), its
        ``uverbs<index>`` (the lowest free one unless given) and per port ``umad<n>``/``issm<n>``
        (the lowest free ``n``: ib_umad numbers ports)."""
        if any(not 0 <= pkey <= 0xFFFF for pkey in pkeys):
            raise ValueError(f"a partition key is 16 bits: {list(pkeys)}")
        table_len = pkey_table_len if pkey_table_len is not None else (128 if link_layer == INFINIBAND_LINK else 1)
        if len(pkeys) > table_len:
            raise ValueError(f"{len(pkeys)} keys do not fit a table of {table_len}")
        parent = self.owner_dir(owner)
        directory = parent / "infiniband" / ibdev
        write_file(directory / "uevent", f"NAME={ibdev}\n")
        write_file(directory / "node_type", "1: CA\n")
        self._class_device(directory, "infiniband", parent)
        for port in range(1, ports + 1):
            port_dir = directory / "ports" / str(port)
            write_file(port_dir / "link_layer", f"{link_layer}\n")
            write_file(port_dir / "state", "4: ACTIVE\n")
            write_file(port_dir / "phys_state", "5: LinkUp\n")
            write_file(port_dir / "lid", f"0x{port if link_layer == INFINIBAND_LINK else 0:x}\n")
            for pkey_index in range(table_len):
                pkey = pkeys[pkey_index] if pkey_index < len(pkeys) else 0
                write_file(port_dir / "pkeys" / str(pkey_index), f"0x{pkey:04x}\n")
        if index is None:
            index = self._lowest_free(self._taken(self.sys / "class" / "infiniband_verbs", r"^uverbs(\d+)$"))
        user_devices: list[tuple[str, str, int, int, int | None]] = [
            ("infiniband_verbs", f"uverbs{index}", IB_UVERBS_MAJOR, IB_UVERBS_BASE_MINOR + index, None)]
        umad_taken = self._taken(self.sys / "class" / "infiniband_mad", r"^umad(\d+)$")
        for port in range(1, ports + 1):  # ib_umad numbers ports, not devices
            umad = self._lowest_free(umad_taken)
            umad_taken.add(umad)
            user_devices += [("infiniband_mad", f"umad{umad}", IB_UMAD_MAJOR, umad, port),
                             ("infiniband_mad", f"issm{umad}", IB_UMAD_MAJOR, IB_UMAD_NUM_FIXED_MINOR + umad, port)]
        if ucm:
            user_devices.append(("infiniband_cm", f"ucm{index}", IB_UCM_MAJOR, IB_UCM_BASE_MINOR + index, None))
        for class_name, device_name, major, minor, port_number in user_devices:
            user_dir = parent / class_name / device_name
            write_file(user_dir / "ibdev", f"{ibdev}\n")
            if port_number is not None:
                write_file(user_dir / "port", f"{port_number}\n")
            write_file(user_dir / "uevent", f"MAJOR={major}\nMINOR={minor}\nDEVNAME=infiniband/{device_name}\n")
            self._class_device(user_dir, class_name, parent)
            self._char_device(user_dir, f"infiniband/{device_name}", major, minor)
        self.host.add_dev_node("infiniband/rdma_cm")
        return directory

    def add_ipoib(self, address: str, ifname: str, *, port: int = 1) -> Path:
        """The IPoIB netdev of a PCI function's InfiniBand port (ARPHRD_INFINIBAND, ``dev_port`` =
        port - 1): ipoib parents it to the RDMA device's parent, the PCI function."""
        return self.add_netdev_at(self.host.device_dir(address), ifname, arphrd=INFINIBAND, dev_port=port - 1)


def _within(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


_UEVENT_HEAD = ("MAJOR=", "MINOR=", "DEVNAME=", "DEVMODE=", "DEVUID=", "DEVGID=", "DEVTYPE=")


def _write_uevent(directory: Path, driver: str | None, tail: Sequence[str]) -> None:
    lines = ([f"DRIVER={driver}"] if driver is not None else []) + list(tail)
    write_file(directory / "uevent", "".join(f"{line}\n" for line in lines))


def _set_uevent_driver(directory: Path, driver: str | None) -> None:
    """``DRIVER=`` where dev_uevent() puts it: after the node's and the type's lines, before the
    bus's."""
    lines = [line for line in (directory / "uevent").read_text().splitlines() if not line.startswith("DRIVER=")]
    if driver is not None:
        at = next((i for i, line in enumerate(lines) if not line.startswith(_UEVENT_HEAD)), len(lines))
        lines.insert(at, f"DRIVER={driver}")
    write_file(directory / "uevent", "".join(f"{line}\n" for line in lines))

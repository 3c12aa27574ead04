"""A fake host in the kernel's own layout, for what the kernel here cannot make (PCI, SR-IOV).

Paths and symlinks are laid out as Linux lays them out, with relative links computed the way the
kernel's sysfs shows them:

* ``sys/devices/pci0000:00/<bridge>/<address>/`` holds ``vendor``, ``device``, ``class``
  (``0x``-prefixed), ``numa_node``, ``modalias``, ``uevent``;
* ``sys/bus/pci/devices/<address> -> ../../../devices/pci0000:00/<bridge>/<address>``;
* ``<device>/driver -> ../../../../bus/pci/drivers/<driver>`` and the driver's link back;
* ``<device>/iommu_group -> ../../../../kernel/iommu_groups/<n>`` (with ``name`` =
  ``vfio-noiommu`` in no-IOMMU mode) and ``iommu_groups/<n>/devices/<address>``;
* SR-IOV: PF ``sriov_totalvfs``/``sriov_numvfs``, ``virtfnN -> ../<vf>``, VF ``physfn -> ../<pf>``;
* ``<device>/net/<ifname>/type`` (ARPHRD) and ``sys/class/net/<ifname> -> ../../devices/…/net/<ifname>``;
* RDMA: ``<device>/infiniband/<rdma dev>`` and ``sys/class/infiniband_{verbs,mad}/…/ibdev``;
* ``proc/net/route`` for IPv4 default routes, ``proc/net/ipv6_route`` for IPv6 ones; ``dev/`` for
  nodes the daemon checks exist;
* block devices (``add_block_device``, ``add_partition``) and NVMe native multipath
  (``add_nvme_multipath_namespace``): the controller below the function with the hidden path, the
  head under ``devices/virtual/nvme-subsystem/``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ETHER = 1
INFINIBAND = 32
NVME_CHAR_MAJOR = 240  # dynamic, as the kernel gives the nvme class (the fake needs one)


def relative_link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def write_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@dataclass
class FakeHost:
    """A fake ``/sys``, ``/dev`` and ``/proc`` under ``root``."""

    root: Path

    def __post_init__(self) -> None:
        for directory in (self.sys / "bus" / "pci" / "devices", self.sys / "bus" / "pci" / "drivers",
                          self.sys / "kernel" / "iommu_groups", self.sys / "class" / "net", self.dev,
                          self.proc / "net"):
            directory.mkdir(parents=True, exist_ok=True)
        route = self.proc / "net" / "route"
        if not route.exists():
            write_file(route, "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n")
        route6 = self.proc / "net" / "ipv6_route"
        if not route6.exists():
            write_file(route6, "")  # the kernel's has no header line

    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

    def device_dir(self, address: str) -> Path:
        return (self.sys / "bus" / "pci" / "devices" / address).resolve()

    def devpath(self, address: str, *below: str) -> str:
        """The uevent DEVPATH of a PCI function (or of ``below`` it, e.g. ``net``, ``eth0``)."""
        relative = self.device_dir(address).relative_to(self.sys.resolve())
        return "/" + "/".join((relative.as_posix(), *below))

    def remove_netdev(self, address: str, ifname: str) -> None:
        shutil.rmtree(self.device_dir(address) / "net" / ifname)
        (self.sys / "class" / "net" / ifname).unlink(missing_ok=True)
        if not any((self.device_dir(address) / "net").iterdir()):
            (self.device_dir(address) / "net").rmdir()

    # -- PCI functions ------------------------------------------------------------------------
    def add_pci(
        self,
        address: str,
        *,
        vendor: str = "8086",
        device: str = "1572",
        class_code: str = "020000",
        driver: str | None = "i40e",
        numa_node: int = 0,
        bridge: str | None = "0000:00:02.0",
    ) -> Path:
        """A PCI function behind ``bridge`` (``None``: on the root bus itself, as an xHCI
        controller at ``0000:00:14.0`` is)."""
        root_bus = self.sys / "devices" / "pci0000:00"
        directory = root_bus / bridge / address if bridge is not None else root_bus / address
        directory.mkdir(parents=True, exist_ok=True)
        write_file(directory / "vendor", f"0x{vendor}\n")
        write_file(directory / "device", f"0x{device}\n")
        write_file(directory / "class", f"0x{class_code}\n")
        write_file(directory / "numa_node", f"{numa_node}\n")
        write_file(directory / "modalias", f"pci:v0000{vendor.upper()}d0000{device.upper()}sv00008086sd00000000"
                                       f"bc{class_code[:2].upper()}sc{class_code[2:4].upper()}i{class_code[4:].upper()}\n")
        write_file(directory / "uevent", f"PCI_CLASS={class_code.upper().lstrip('0') or '0'}\n"
                                     f"PCI_ID={vendor.upper()}:{device.upper()}\nPCI_SLOT_NAME={address}\n")
        relative_link(self.sys / "bus" / "pci" / "devices" / address, directory)
        if driver is not None:
            self.bind(address, driver)
        return directory

    def bind(self, address: str, driver: str) -> None:
        directory = self.device_dir(address)
        self.unbind(address)
        driver_dir = self.sys / "bus" / "pci" / "drivers" / driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        relative_link(directory / "driver", driver_dir)
        relative_link(driver_dir / address, directory)

    def unbind(self, address: str) -> None:
        directory = self.device_dir(address)
        driver_link = directory / "driver"
        if driver_link.is_symlink():
            driver_dir = driver_link.resolve()
            (driver_dir / address).unlink(missing_ok=True)
            driver_link.unlink()

    def add_pf(self, address: str, *, netdev: str | None, total_vfs: int = 64, **kwargs: object) -> Path:
        directory = self.add_pci(address, **kwargs)  # type: ignore[arg-type]
        write_file(directory / "sriov_totalvfs", f"{total_vfs}\n")
        write_file(directory / "sriov_numvfs", "0\n")
        if netdev is not None:
            self.add_netdev(address, netdev)
        return directory

    def add_vfs(
        self,
        pf_address: str,
        vf_addresses: list[str],
        *,
        driver: str | None = "iavf",
        device: str = "154c",
        netdev_names: list[str] | None = None,
        iommu_groups: list[int] | None = None,
        numa_node: int = 0,
        vendor: str = "8086",
    ) -> None:
        pf_dir = self.device_dir(pf_address)
        bridge = pf_dir.parent.name
        for index, vf_address in enumerate(vf_addresses):
            vf_dir = self.add_pci(vf_address, vendor=vendor, device=device, driver=None, numa_node=numa_node,
                                  bridge=bridge)
            relative_link(vf_dir / "physfn", pf_dir)
            relative_link(pf_dir / f"virtfn{index}", vf_dir)
            if iommu_groups is not None:
                self.set_iommu_group(vf_address, iommu_groups[index])
            if driver is not None:
                self.bind(vf_address, driver)
            if netdev_names is not None and netdev_names[index]:
                self.add_netdev(vf_address, netdev_names[index])
        write_file(pf_dir / "sriov_numvfs", f"{len(vf_addresses)}\n")

    def remove_pci(self, address: str) -> None:
        directory = self.device_dir(address)
        self.unbind(address)
        (self.sys / "bus" / "pci" / "devices" / address).unlink()
        for name in os.listdir(directory / "net") if (directory / "net").is_dir() else []:
            (self.sys / "class" / "net" / name).unlink(missing_ok=True)
        shutil.rmtree(directory)

    # -- attributes ----------------------------------------------------------------------------
    def add_netdev(self, address: str, ifname: str, *, arphrd: int = ETHER) -> None:
        net_dir = self.device_dir(address) / "net" / ifname
        write_file(net_dir / "type", f"{arphrd}\n")
        write_file(net_dir / "ifindex", "1\n")
        relative_link(self.sys / "class" / "net" / ifname, net_dir)

    def set_iommu_group(self, address: str, group: int, *, noiommu: bool = False) -> None:
        group_dir = self.sys / "kernel" / "iommu_groups" / str(group)
        (group_dir / "devices").mkdir(parents=True, exist_ok=True)
        if noiommu:
            write_file(group_dir / "name", "vfio-noiommu\n")
        directory = self.device_dir(address)
        relative_link(directory / "iommu_group", group_dir)
        relative_link(group_dir / "devices" / address, directory)

    def add_vfio_cdev(self, address: str, index: int, *, node: bool = True, cdev: bool = True) -> None:
        """``<function>/vfio-dev/vfio<index>`` as a kernel with IOMMUFD shows a vfio-pci function
        (``dev`` = MAJ:MIN, the class link), with ``/dev/vfio/devices/vfio<index>`` and
        ``/dev/iommu`` unless ``node`` is false. ``cdev=False``: as Linux 6.1-6.5 show it, a
        class device without ``dev`` (no VFIO cdev before 6.6) and no nodes."""
        cdev_dir = self.device_dir(address) / "vfio-dev" / f"vfio{index}"
        if not cdev:
            cdev_dir.mkdir(parents=True, exist_ok=True)
            relative_link(self.sys / "class" / "vfio-dev" / f"vfio{index}", cdev_dir)
            return
        # made aside and renamed into place: the kernel's sysfs shows the entry with its ``dev`` at once
        building = self.root / ".building" / f"{address}-vfio{index}"
        write_file(building / "dev", f"511:{index}\n")
        cdev_dir.parent.mkdir(parents=True, exist_ok=True)
        building.rename(cdev_dir)
        relative_link(self.sys / "class" / "vfio-dev" / f"vfio{index}", cdev_dir)
        if node:
            self.add_dev_node(f"vfio/devices/vfio{index}")
            self.add_dev_node("iommu")

    def add_uio(self, address: str, index: int) -> None:
        (self.device_dir(address) / "uio" / f"uio{index}").mkdir(parents=True, exist_ok=True)

    def add_rdma(self, address: str, rdma_device: str, index: int) -> None:
        """An RDMA device of the function with its user devices: the kernel parents them to the
        RDMA device's parent, the function (``<function>/infiniband_verbs/uverbsN``), and links
        them from ``class/<class>/`` (the layout tests/auxsysfs.py documents)."""
        (self.device_dir(address) / "infiniband" / rdma_device).mkdir(parents=True, exist_ok=True)
        for class_name, prefix in (("infiniband_verbs", "uverbs"), ("infiniband_mad", "umad"),
                                   ("infiniband_mad", "issm"), ("infiniband_cm", "ucm")):
            device = self.device_dir(address) / class_name / f"{prefix}{index}"
            write_file(device / "ibdev", f"{rdma_device}\n")
            relative_link(self.sys / "class" / class_name / f"{prefix}{index}", device)
            self.add_dev_node(f"infiniband/{prefix}{index}")
        self.add_dev_node("infiniband/rdma_cm")

    def set_file(self, address: str, name: str, content: str) -> None:
        write_file(self.device_dir(address) / name, content)

    def add_default_route(self, ifname: str) -> None:
        with open(self.proc / "net" / "route", "a") as route:
            route.write(f"{ifname}\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")

    def add_default_route6(self, ifname: str, *, flags: int = 0x0003) -> None:
        """An IPv6 default route (``::/0``) through ``ifname``, as ``/proc/net/ipv6_route`` prints
        it: destination, prefix length, source, prefix length, next hop, metric, refcount, use,
        flags (RTF_UP|RTF_GATEWAY by default), the interface right-aligned in 8 columns."""
        with open(self.proc / "net" / "ipv6_route", "a") as route:
            route.write(f"{'0' * 32} 00 {'0' * 32} 00 fe80{'0' * 27}1 00000400 00000001 00000000 {flags:08x} "
                        f"{ifname:>8}\n")

    def add_dev_node(self, relative: str) -> Path:
        """A placeholder for a node the daemon only checks for (the kernel here cannot make PCI
        nodes). Tests of real nodes use the real /dev."""
        path = self.dev / relative
        write_file(path, "")
        return path

    # -- block devices -------------------------------------------------------------------------
    def add_block_device(self, directory: Path, numbers: str | None, *, partition: int | None = None) -> Path:
        """A block device at ``directory`` as the kernel shows it: ``dev`` = ``MAJ:MIN`` (none for
        a hidden disk, ``numbers`` None: no device number since Linux 5.15), ``subsystem`` ->
        ``class/block``, ``class/block/<name>`` -> it, ``holders/``; a whole disk also has
        ``slaves/`` and ``sys/block/<name>``, a partition its number in ``partition``."""
        directory.mkdir(parents=True, exist_ok=True)
        if numbers is not None:
            write_file(directory / "dev", numbers + "\n")
        (directory / "holders").mkdir(exist_ok=True)
        relative_link(directory / "subsystem", self.sys / "class" / "block")
        relative_link(self.sys / "class" / "block" / directory.name, directory)
        if partition is not None:
            write_file(directory / "partition", f"{partition}\n")
        else:
            (directory / "slaves").mkdir(exist_ok=True)
            relative_link(self.sys / "block" / directory.name, directory)
        return directory

    def add_partition(self, disk: Path, number: int, numbers: str) -> Path:
        """Partition ``number`` of the disk at ``disk`` (``nvme1n1`` -> ``nvme1n1p<number>``), nested in it."""
        return self.add_block_device(disk / f"{disk.name}p{number}", numbers, partition=number)

    def add_nvme_multipath_namespace(self, address: str, *, subsystem: int, controller: int, numbers: str,
                                     nsid: int = 1, path_links: bool = True) -> Path:
        """A namespace of a multi-controller NVMe subsystem under native multipath
        (``nvme_core.multipath=Y``), as Linux lays it out; the head's directory:

        * the function's controller ``<function>/nvme/nvme<C>`` (class ``nvme``) and below it the
          hidden path ``nvme<S>c<C>n<N>``, a block device without a device number;
        * the subsystem ``devices/virtual/nvme-subsystem/nvme-subsys<S>`` (class
          ``nvme-subsystem``) with a link to each of its controllers;
        * the head ``nvme<S>n<N>`` in it, the block device that is mounted (``numbers``), and in
          its ``multipath/`` a link to each path (Linux 6.15 on; ``path_links=False``: as older
          kernels show it, without).

        Call it again with another function and controller for the same ``subsystem`` and
        ``nsid``: a second path to the same head."""
        controller_dir = self.device_dir(address) / "nvme" / f"nvme{controller}"
        if not controller_dir.is_dir():
            write_file(controller_dir / "dev", f"{NVME_CHAR_MAJOR}:{controller}\n")
            relative_link(controller_dir / "subsystem", self.sys / "class" / "nvme")
            relative_link(self.sys / "class" / "nvme" / controller_dir.name, controller_dir)
        path = self.add_block_device(controller_dir / f"nvme{subsystem}c{controller}n{nsid}", None)
        subsystem_dir = self.sys / "devices" / "virtual" / "nvme-subsystem" / f"nvme-subsys{subsystem}"
        if not subsystem_dir.is_dir():
            subsystem_dir.mkdir(parents=True)
            relative_link(subsystem_dir / "subsystem", self.sys / "class" / "nvme-subsystem")
            relative_link(self.sys / "class" / "nvme-subsystem" / subsystem_dir.name, subsystem_dir)
        relative_link(subsystem_dir / controller_dir.name, controller_dir)
        head = subsystem_dir / f"nvme{subsystem}n{nsid}"
        if not head.is_dir():
            self.add_block_device(head, numbers)
        if path_links:
            relative_link(head / "multipath" / path.name, path)
        return head

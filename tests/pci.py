"""PCI helpers for tests on the fake host: a PciHandler driven like the daemon drives it, and
emulated-NVMe SR-IOV functions (as QEMU's emulated NVMe controller shows up)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.core import ContainerAllocation, HandlerContext, ResourcePool, default_allocation
from daemon.handlers.pci import PciHandler
from tests import trees
from tests.fakesysfs import FakeHost
from tests.handlerpools import configure_pools

NVME_CLASS = "010802"


class Pci:
    """A PciHandler on a fake host, with helpers to configure pools and allocate from them."""

    def __init__(self, host: FakeHost, devinfo_dir: Path, handler: PciHandler | None = None) -> None:
        self.host = host
        self.devinfo_dir = devinfo_dir
        self.handler = handler or PciHandler(HandlerContext(host.sys, host.dev, host.proc, devinfo_dir))

    def configure(self, *entries: dict[str, Any], prefix: str = "intel.com") -> list[Any]:
        return configure_pools(self.handler, entries, prefix)

    def pools(self, *entries: dict[str, Any], prefix: str = "intel.com") -> dict[str, ResourcePool]:
        configured = self.configure(*entries, prefix=prefix)
        built = self.handler.build(self.handler.scan(), configured)
        return {p.resource: trees.pool(p, built[p.resource]) for p in configured}

    def pool(self, entry: dict[str, Any], prefix: str = "intel.com") -> ResourcePool:
        (only,) = self.pools(entry, prefix=prefix).values()
        return only

    def allocate(self, pool: ResourcePool, device_ids: list[str]) -> ContainerAllocation:
        return self.handler.post_allocate(pool, device_ids, default_allocation(pool, device_ids))


def nvme_vfs(pf: str, count: int) -> list[str]:
    """The addresses of an emulated-NVMe PF's first ``count`` VFs: functions 1.. of its slot."""
    return [f"{pf[:-1]}{index + 1}" for index in range(count)]


def add_nvme_pf(host: FakeHost, pf: str, vf_drivers: list[str | None], *, first_group: int = 10) -> list[str]:
    """An emulated-NVMe PF (nvme driver, no netdev, bridge ``0000:00:0<bus digit>.0``) with one VF
    per entry of ``vf_drivers`` (``None``: unbound), VF i in IOMMU group ``first_group + i``; the
    VFs' addresses."""
    host.add_pf(pf, netdev=None, vendor="1b36", device="0010", class_code=NVME_CLASS, driver="nvme",
                bridge=f"0000:00:0{pf[6]}.0", total_vfs=8)
    addresses = nvme_vfs(pf, len(vf_drivers))
    host.add_vfs(pf, addresses, driver=None, vendor="1b36", device="0010",
                 iommu_groups=[first_group + index for index in range(len(vf_drivers))])
    for address, driver in zip(addresses, vf_drivers):
        host.set_file(address, "class", f"0x{NVME_CLASS}\n")
        if driver is not None:
            host.bind(address, driver)
    return addresses

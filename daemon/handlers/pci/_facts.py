"""What the pci handler knows of the host: one record per PCI function (``PciDevice``, with its
vDPA device), and the facts a scan or a fold makes of them (``PciFacts``: the functions, their
RDMA character devices, link and recovery states, and the lineage of folds that an incremental
pool build follows). Reading them from sysfs is ``_discovery``'s; folding events, ``_folding``'s.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from daemon.core import LinkState

VDPA_TYPES_BY_DRIVER: Mapping[str, str] = MappingProxyType({"vhost_vdpa": "vhost", "virtio_vdpa": "virtio"})


@dataclass(frozen=True, slots=True)
class VdpaDevice:
    """A function's vDPA device: its name, its vDPA bus driver, and the ``vhost-vdpa-<n>`` char
    device ``vhost_vdpa`` made for it (``/dev/vhost-vdpa-<n>``)."""

    name: str
    driver: str | None
    vhost_node: str | None

    @property
    def vdpa_type(self) -> str | None:
        """``vhost`` or ``virtio`` (the ``vdpaType`` it matches), from its driver."""
        return VDPA_TYPES_BY_DRIVER.get(self.driver or "")


@dataclass(frozen=True, slots=True)
class PciDevice:
    """What the daemon knows about one PCI function."""

    address: str
    vendor: str
    device: str
    class_code: str
    driver: str | None
    numa_node: int | None
    acpi_index: str | None
    is_pf: bool
    num_vfs: int
    pf_address: str | None
    vf_index: int
    pf_netdev: str | None
    netdevs: tuple[str, ...]
    link_type: str
    iommu_group: str | None
    noiommu: bool
    uio_devices: tuple[str, ...]
    rdma_devices: tuple[str, ...]
    has_default_route: bool
    vfio_cdev: str | None = None  # "vfioN" of ``vfio-dev/vfioN``: the device's own VFIO node (IOMMUFD)
    # ``pci<domain>:<bus>``: the root complex's directory under ``<sysfs>/devices`` it sits below
    pcie_root: str | None = None
    # an InfiniBand function's default partition key: port 1, index 0 of its first RDMA device
    pkey: int | None = None
    vdpa: VdpaDevice | None = None

    @property
    def netdev(self) -> str | None:
        return self.netdevs[0] if self.netdevs else None

    @property
    def base_class(self) -> str:
        return self.class_code[:2]


_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class PciFacts:
    """The PCI part of the host: devices by address, RDMA char devices, link states, and the
    devices in PCIe error recovery (address -> ``"recovering"`` from BEGIN_RECOVERY until
    SUCCESSFUL_RECOVERY, ``"failed"`` after FAILED_RECOVERY until a ``bind`` or ``remove``).
    Like link states, recovery states come from events, not from sysfs: a rescan keeps them; so
    are the functions lent to vfio-pci for DRA claims (``lent``: the claims' checkpoint says so,
    through ``daemon.core.Lent``), which a pool judges by the driver they go back to.

    ``token`` names this version of the facts. ``lineage`` lists the recent folds that led here,
    each as (token of the facts before it, devices changed, interfaces changed), so the pool
    build can redo only what changed since the version it last built; a full scan starts a new
    lineage.
    """

    devices: Mapping[str, PciDevice]
    rdma_char_devices: Mapping[str, tuple[str, ...]]
    links: Mapping[str, LinkState] = field(default_factory=lambda: _EMPTY)
    recovery: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    # functions DRA claims hold on vfio-pci (vfioOnDemand) -> the driver each goes back to
    lent: Mapping[str, str | None] = field(default_factory=lambda: _EMPTY)
    token: int = field(default_factory=lambda: secrets.randbits(63))
    lineage: tuple[tuple[int, frozenset[str], frozenset[str]], ...] = ()

    def changes_since(self, token: int) -> tuple[frozenset[str], frozenset[str]] | None:
        """(devices, interfaces) changed since the version ``token``; ``None`` if unknown."""
        if token == self.token:
            return frozenset(), frozenset()
        for index in range(len(self.lineage) - 1, -1, -1):  # newest first: usually the last step
            if self.lineage[index][0] == token:
                addresses = frozenset().union(*(step[1] for step in self.lineage[index:]))
                links = frozenset().union(*(step[2] for step in self.lineage[index:]))
                return addresses, links
        return None


def copy_map(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict copy; a ``MappingProxyType`` over a dict is copied by the dict's own ``copy``
    (C speed), where ``dict(proxy)`` goes key by key: 35 µs instead of 330 µs for 4096."""
    if isinstance(mapping, (dict, MappingProxyType)):
        return mapping.copy()
    return dict(mapping)

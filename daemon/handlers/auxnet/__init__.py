"""Pools of auxiliary network devices (``deviceType: auxNetDevice``): Mellanox/NVIDIA scalable
functions (``mlx5_core.sf.<n>`` on the auxiliary bus), compatible with the SR-IOV network device
plugin's pools of that type.

``{"resourceName": "bf_sfs", "deviceType": "auxNetDevice", "selectors": {"auxTypes": ["sf"],
"pfNames": ["p0#1-4"]}}`` offers each SF its selectors admit (see ``_selectors``; ``auxTypes`` is
required and may only be ``["sf"]``), first pool and selector in file order winning. The device
ID is the auxiliary device name, the NUMA node its PF's. Allocate gives the RDMA character devices
(``isRdma``) and ``/dev/vhost-net`` with ``/dev/net/tun`` (``needVhostNet``), plus
``PCIDEVICE_<PREFIX>_<NAME>`` (the IDs) and its ``_INFO`` JSON as upstream writes them; no
device-info file (upstream writes none for this type). What this handler shares with the pci
handler's netDevice pools (those envs and providers, the ``pfNames``/``rootDevices`` rule, the
sysfs readers of a function) is in ``daemon/handlers/_*.py``, beside both.

Unlike upstream, SFs come and go with the kernel's events: an SF created and bound to its driver
joins its pool, unbound (no netdev, no RDMA device left) or removed it leaves; a PF's driver
bound or unbound, or its uplink renamed, is read again (see ``_folding``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from daemon.core import (
    AttributeValue,
    ConfiguredPool,
    ContainerAllocation,
    DeviceMap,
    Event,
    Explanation,
    HandlerContext,
    LinkChanged,
    LinkSnapshot,
    Offered,
    PoolEntry,
    ResourcePool,
    Resync,
    UEvent,
)
from daemon.handlers._functions import PCIE_ROOT, RDMA_SUBSYSTEMS, is_pcie_error_report
from daemon.handlers._sriov_allocation import AllocationEnvs, vhost_net_available

from ._discovery import AuxFacts, scan_aux
from ._explain import explain as explain_sf
from ._explain import why_empty as why_pool_empty
from ._folding import fold_links, fold_uevent
from ._pools import AuxDetails, AuxPoolSpec, build_pools
from ._selectors import parse_selector

if TYPE_CHECKING:
    from daemon.core import DeviceDescriber, Explainer, Handler, PostAllocator


AUX_NET_DEVICE = "auxNetDevice"

__all__ = ["AUX_NET_DEVICE", "AuxDetails", "AuxFacts", "AuxNetHandler", "AuxPoolSpec"]


class AuxNetHandler:
    name: ClassVar[str] = "auxnet"
    device_types: ClassVar[frozenset[str]] = frozenset({AUX_NET_DEVICE})
    # auxiliary: SFs added, bound, unbound, removed (and their own eth/rdma devices); net: their
    # netdevs and the PF's (its name); pci: the PF's driver; RDMA: SF RDMA devices and char devices
    subsystems: ClassVar[frozenset[str]] = frozenset({"auxiliary", "net", "pci", *RDMA_SUBSYSTEMS})
    wants_links: ClassVar[bool] = True

    def __init__(self, context: HandlerContext) -> None:
        self._context = context
        self._sysfs_root = os.fspath(context.sysfs_root)
        self._dev_root = os.fspath(context.dev_root)
        self._envs = AllocationEnvs()

    def parse_pool(self, entry: PoolEntry) -> AuxPoolSpec:
        return AuxPoolSpec(tuple(parse_selector(selector) for selector in entry.selectors))

    def scan(self) -> AuxFacts:
        return scan_aux(self._sysfs_root, self._dev_root)

    def fold(self, facts: AuxFacts, event: Event) -> AuxFacts:
        if isinstance(event, Resync):  # link states do not live in sysfs: keep them
            return replace(self.scan(), links=facts.links)
        if isinstance(event, UEvent):
            if is_pcie_error_report(event):  # SFs' health is their netdev's carrier, not PCIe recovery
                return facts
            return fold_uevent(facts, event, self._sysfs_root, self._dev_root)
        if isinstance(event, (LinkChanged, LinkSnapshot)):
            return fold_links(facts, event)
        return facts

    def build(self, facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]]) -> dict[str, DeviceMap]:
        return build_pools(facts, pools, vhost_net_available(self._dev_root))

    # PostAllocator: the default answer has the specs; add PCIDEVICE_* and its _INFO.
    def post_allocate(
        self, pool: ResourcePool, device_ids: Sequence[str], allocation: ContainerAllocation
    ) -> ContainerAllocation:
        entry: PoolEntry = pool.pool_config.entry
        details: dict[str, AuxDetails] = {device_id: pool.devices[device_id].details for device_id in device_ids}
        allocation.envs.update(self._envs.envs(entry.resource_prefix, entry.resource_name, device_ids, details))
        return allocation

    # Explainer: why an SF is or is not in a pool (devplugd explain).
    def explain(self, facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]], device: str,
                offered: Offered) -> Explanation | None:
        return explain_sf(facts, pools, device, offered)

    def why_empty(self, facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]], resource: str) -> str:
        return why_pool_empty(facts, pools, resource)

    # DeviceDescriber: what a DRA ResourceSlice says of an SF, from its record alone.
    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        record: AuxDetails = pool.devices[device_id].details
        sf, pf = record.sf, record.pf
        attributes: dict[str, AttributeValue] = {}
        if pf.pcie_root is not None:
            attributes[PCIE_ROOT] = pf.pcie_root
        attributes.update({"vendor": pf.vendor, "deviceId": pf.device, "auxType": sf.aux_type,
                           "pfPciAddress": pf.address, "sfnum": sf.sfnum})
        if pf.name is not None:
            attributes["pfName"] = pf.name
        if sf.netdev is not None:
            attributes["netdev"] = sf.netdev
        if link_type := sf.link_type(pf):
            attributes["linkType"] = link_type
        if sf.rdma_devices:
            attributes["rdmaDevice"] = sf.rdma_devices[0]
        return attributes


if TYPE_CHECKING:
    # mypy checks here that AuxNetHandler keeps the handler contract and the hooks it opts into.
    _handler: type[Handler[AuxFacts, AuxPoolSpec]] = AuxNetHandler
    _post_allocator: type[PostAllocator] = AuxNetHandler
    _describer: type[DeviceDescriber] = AuxNetHandler
    _explainer: type[Explainer] = AuxNetHandler

"""From PCI facts and pool configs to the devices of each resource, redoing only what changed.

Each device goes to the first pool and selector (in file order) that admits it, exactly as the
SR-IOV plugin assigns devices; since that depends on the device alone, a fold that changed a few
devices (or the links they depend on) only moves those few. The builder keeps what it built last
and patches it; anything it cannot account for (new pools, an unknown lineage) is a full build.
``pciDevice`` pools take any function a selector admits (the selector's drivers, ``vfio-pci``
by default), except a PF with VFs enabled and a NIC carrying a default route (IPv4 or IPv6).
Health: a device is Unhealthy while it is in PCIe error recovery (or after a failed one: see
``_folding``), and when its own link, or (``checkHealthOnPf``, default on) its PF's link, is
administratively up without carrier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType

from daemon.core import (
    HEALTHY,
    PCIE_ERROR,
    UNHEALTHY,
    ConfiguredPool,
    DeviceInfo,
    DeviceMap,
    Fault,
    LinkState,
    carrier_lost,
)
from daemon.handlers._sriov_allocation import vhost_net_available

from ._allocation import PciDetails, device_specs_and_info, iommufd_specs
from ._ddp import read_ddp_profile
from ._facts import PciDevice, PciFacts, copy_map
from ._groups import apply_groups, group_index
from ._selectors import ACCELERATOR, PCI_DEVICE, PciSelector

log = logging.getLogger("devplugd.pci")

NETWORK_CLASS = "02"
ACCELERATOR_CLASS = "12"


@dataclass(frozen=True)
class PciPoolSpec:
    device_type: str
    selectors: tuple[PciSelector, ...]
    check_health_on_pf: bool = True
    allocation_policy: str | None = None  # "packed" or "spread": GetPreferredAllocation is offered
    # through DRA: a device goes to vfio-pci for the claim that asks (VfioConfig), and back after
    vfio_on_demand: bool = False


# why a device is not considered for a pool at all (constants: the build asks for every device)
NO_DRIVER = "it is bound to no driver"
NOT_AN_ACCELERATOR = "deviceType accelerator takes processing accelerators (class 12) only"
NOT_A_NIC = "deviceType netDevice takes network functions (class 02) only"
PF_WITH_VFS = "a PF with VFs enabled is not offered (its VFs are)"
DEFAULT_ROUTE = "it carries the host's default route (the uplink is never offered)"
NO_IOMMU_GROUP = "it is bound to vfio-pci but has no iommu_group link"


def ineligibility(device: PciDevice, device_type: str) -> str | None:
    """Why upstream would not consider ``device`` for a pool of ``device_type`` at all, or
    ``None``: it would."""
    if device.driver is None:
        return NO_DRIVER
    if device_type == ACCELERATOR:
        return None if device.base_class == ACCELERATOR_CLASS else NOT_AN_ACCELERATOR
    if device_type != PCI_DEVICE and device.base_class != NETWORK_CLASS:  # pciDevice: any function
        return NOT_A_NIC
    if device.is_pf and device.num_vfs > 0:  # a PF whose VFs others may use
        return PF_WITH_VFS
    if device.has_default_route:
        return DEFAULT_ROUTE
    return None


def eligible(device: PciDevice, device_type: str) -> bool:
    return ineligibility(device, device_type) is None


def fault(device: PciDevice, links: Mapping[str, LinkState], check_on_pf: bool,
          recovery: Mapping[str, str] = MappingProxyType({})) -> Fault | None:
    """Why ``device`` is Unhealthy, or ``None``: in PCIe error recovery (``recovery``: address ->
    state) whatever its links say, or a watched link up without carrier."""
    if (recovering := recovery.get(device.address)) is not None:
        if recovering == "failed":
            return Fault(PCIE_ERROR, "failed", "its PCIe error recovery failed")
        return Fault(PCIE_ERROR, "recovering", "it is in PCIe error recovery")
    watched = [device.netdevs[0]] if device.netdevs else []
    if check_on_pf and device.pf_netdev:
        watched.append(device.pf_netdev)
    for ifname in watched:
        state = links.get(ifname)
        if state is not None and state.carrier_lost:
            return carrier_lost(ifname)
    return None


def unhealthy_reason(device: PciDevice, links: Mapping[str, LinkState], check_on_pf: bool,
                     recovery: Mapping[str, str] = MappingProxyType({})) -> str | None:
    """Why ``device`` is Unhealthy, in words, or ``None``."""
    found = fault(device, links, check_on_pf, recovery)
    return found.reason if found is not None else None


def _depends_on(device: PciDevice) -> set[str]:
    names = {device.netdevs[0]} if device.netdevs else set()
    if device.pf_netdev:
        names.add(device.pf_netdev)
    return names


@dataclass
class _Built:
    pools: tuple[ConfiguredPool[PciPoolSpec], ...]
    token: int
    vhost_available: bool
    placed: dict[str, str] = field(default_factory=dict)  # address -> resource
    functions: dict[str, Mapping[str, DeviceInfo]] = field(default_factory=dict)  # resource -> one per function
    devices: dict[str, Mapping[str, DeviceInfo]] = field(default_factory=dict)  # resource -> devices offered
    link_users: dict[str, set[str]] = field(default_factory=dict)  # ifname -> addresses
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # IOMMU group -> addresses
    group_of: dict[str, str] = field(default_factory=dict)  # address -> IOMMU group
    shared_groups: set[str] = field(default_factory=set)  # the groups of several functions
    grouped: set[str] = field(default_factory=set)  # resources whose devices are not their functions


class PoolBuilder:
    """Builds (and rebuilds incrementally) the devices of the PCI pools."""

    def __init__(self, dev_root: str) -> None:
        self._dev_root = dev_root
        self._last: _Built | None = None

    def build(self, facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> dict[str, DeviceMap]:
        pools = tuple(pools)
        vhost_available = vhost_net_available(self._dev_root)
        last = self._last
        changes = None
        if last is not None and last.pools == pools and last.vhost_available == vhost_available:
            changes = facts.changes_since(last.token)
        if last is None or changes is None:
            last = self._full(facts, pools, vhost_available)
        else:
            addresses, links = changes
            affected = set(addresses)
            for ifname in links:
                affected |= last.link_users.get(ifname, set())
            self._patch(last, facts, self._with_group_members(last, facts, affected))
            last.token = facts.token
        self._last = last
        return dict(last.devices)

    def _full(self, facts: PciFacts, pools: tuple[ConfiguredPool[PciPoolSpec], ...], vhost_available: bool) -> _Built:
        built = _Built(pools=pools, token=facts.token, vhost_available=vhost_available)
        fresh: dict[str, dict[str, DeviceInfo]] = {pool.resource: {} for pool in pools}
        place = self._placer(facts, pools, vhost_available)
        for device in facts.devices.values():
            self._track_links(built, device)
            placed = place(device)
            if placed is not None:
                resource, info = placed
                built.placed[device.address] = resource
                fresh[resource][device.address] = info
        built.functions = {resource: MappingProxyType(devices) for resource, devices in fresh.items()}
        built.groups = group_index(facts.devices.values())
        built.group_of = {address: group for group, members in built.groups.items() for address in members}
        built.shared_groups = {group for group, members in built.groups.items() if len(members) > 1}
        built.devices = dict(built.functions)
        self._apply_groups(built, facts, set(built.functions))
        return built

    @staticmethod
    def _with_group_members(built: _Built, facts: PciFacts, affected: set[str]) -> set[str]:
        """``affected`` with every function of the groups they were and are in (a sibling's
        driver decides whether a group is viable), the group index brought up to date."""
        groups: set[str] = set()
        for address in affected:
            old_group = built.group_of.pop(address, None)
            if old_group is not None:
                groups.add(old_group)
                built.groups[old_group] = tuple(member for member in built.groups[old_group] if member != address)
            device = facts.devices.get(address)
            if device is not None and device.iommu_group is not None and not device.noiommu:
                groups.add(device.iommu_group)
                built.groups[device.iommu_group] = (*built.groups.get(device.iommu_group, ()), address)
                built.group_of[address] = device.iommu_group
        expanded = set(affected)
        for group in groups:
            members = built.groups.get(group, ())
            expanded.update(members)
            if not members:
                built.groups.pop(group, None)
            if len(members) > 1:
                built.shared_groups.add(group)
            else:
                built.shared_groups.discard(group)
        return expanded

    @staticmethod
    def _apply_groups(built: _Built, facts: PciFacts, touched: set[str]) -> None:
        """The offered devices of ``touched`` resources (and of every resource a group of several
        functions changes now or changed last time) from their per-function placements."""
        shared = [built.groups[group] for group in built.shared_groups]
        on_demand = frozenset(pool.resource for pool in built.pools if pool.spec.vfio_on_demand)
        changed = apply_groups(built.functions, shared, facts.devices, built.placed, on_demand)
        for resource in touched | built.grouped | changed.keys():
            if resource in built.functions:
                built.devices[resource] = (
                    MappingProxyType(changed[resource]) if resource in changed else built.functions[resource]
                )
        built.grouped = set(changed)

    def _patch(self, built: _Built, facts: PciFacts, affected: set[str]) -> None:
        place = self._placer(facts, built.pools, built.vhost_available)
        touched: dict[str, dict[str, DeviceInfo]] = {}

        def pool_for_edit(resource: str) -> dict[str, DeviceInfo]:
            if resource not in touched:
                touched[resource] = copy_map(built.functions[resource])
            return touched[resource]

        for address in affected:
            old_resource = built.placed.pop(address, None)
            if old_resource is not None:
                pool_for_edit(old_resource).pop(address, None)
            for users in built.link_users.values():
                users.discard(address)
            device = facts.devices.get(address)
            if device is None:
                continue
            self._track_links(built, device)
            placed = place(device)
            if placed is not None:
                resource, info = placed
                built.placed[address] = resource
                pool_for_edit(resource)[address] = info
        for resource, devices in touched.items():
            built.functions[resource] = MappingProxyType(devices)
        self._apply_groups(built, facts, set(touched))

    @staticmethod
    def _track_links(built: _Built, device: PciDevice) -> None:
        for ifname in _depends_on(device):
            built.link_users.setdefault(ifname, set()).add(device.address)

    def _placer(
        self, facts: PciFacts, pools: tuple[ConfiguredPool[PciPoolSpec], ...], vhost_available: bool
    ) -> Callable[[PciDevice], tuple[str, DeviceInfo] | None]:
        ddp_profile = lru_cache(maxsize=None)(read_ddp_profile)

        def place(device: PciDevice) -> tuple[str, DeviceInfo] | None:
            judged = lent_as_at_home(device, facts.lent)
            for pool in pools:
                spec: PciPoolSpec = pool.spec
                if judged is not device and not spec.vfio_on_demand:
                    continue  # a function a claim holds on vfio-pci stays in its vfioOnDemand pool
                if ineligibility(judged, spec.device_type) is not None:
                    continue
                for selector in spec.selectors:
                    if selector.refusing_key(judged, ddp_profile) is None:
                        info = _device_info(device, pool, selector, facts, vhost_available, self._dev_root)
                        return None if info is None else (pool.resource, info)
            return None

        return place


def lent_as_at_home(device: PciDevice, lent: Mapping[str, str | None]) -> PciDevice:
    """The function as a pool judges it: on the driver it goes back to while a DRA claim holds
    it on vfio-pci (``PciFacts.lent``), so the rebinding (no driver, then vfio-pci) neither
    takes it out of its ``vfioOnDemand`` pool nor gives it to a pool of vfio-pci functions; the
    function itself (every other record)."""
    if device.address not in lent:
        return device
    return replace(device, driver=lent[device.address])


def unusable_reason(device: PciDevice) -> str | None:
    """Why a device a selector admitted cannot be offered, or ``None``."""
    return NO_IOMMU_GROUP if device.driver == "vfio-pci" and device.iommu_group is None else None


def _device_info(
    device: PciDevice, pool: ConfiguredPool[PciPoolSpec], selector: PciSelector, facts: PciFacts, vhost_available: bool,
    dev_root: str,
) -> DeviceInfo | None:
    if (unusable := unusable_reason(device)) is not None:
        log.warning("skipping %s in %s: %s", device.address, pool.resource, unusable,
                    extra={"PCI_ADDR": device.address, "RESOURCE": pool.resource})
        return None
    specs, info, rdma_device = device_specs_and_info(
        device,
        is_rdma=selector.is_rdma,
        need_vhost_net=selector.need_vhost_net,
        vhost_available=vhost_available,
        rdma_char_devices=facts.rdma_char_devices,
        additional_info=pool.entry.additional_info,
        vdpa_type=selector.vdpa_type,
    )
    if device.driver == "vfio-pci" and device.vfio_cdev is not None:
        specs += iommufd_specs(device, dev_root, pool.resource)
    spec: PciPoolSpec = pool.spec
    numa = device.numa_node
    found = fault(device, facts.links, spec.check_health_on_pf, facts.recovery)
    return DeviceInfo(
        health=HEALTHY if found is None else UNHEALTHY,
        fault=found,
        numa_nodes=(numa,) if numa is not None and not pool.entry.exclude_topology else (),
        specs=specs,
        details=PciDetails(device=device, info=info, rdma_device=rdma_device,
                           vdpa=device.vdpa if selector.vdpa_type is not None else None),
    )

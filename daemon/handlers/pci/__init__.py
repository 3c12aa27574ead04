"""PCI functions for ``netDevice`` and ``accelerator`` pools, compatible with the SR-IOV network
device plugin (its selectors, first-match-wins rule, env vars, ``_INFO`` and device-info files),
and for ``pciDevice`` pools of any function handed whole to a vfio workload.

Every PCI pool may set ``allocationPolicy`` (``packed`` or ``spread``) to be offered the
kubelet's GetPreferredAllocation. At Allocate the driver and IOMMU group of each vfio device are
read again, so a group that changed since the last uevent is never handed out stale."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from daemon.core import (
    DRA_API,
    HEALTH_LOST,
    HEALTH_RESTORED,
    AllocationError,
    ConfigError,
    ConfiguredPool,
    ContainerAllocation,
    DeviceChanged,
    DeviceInfo,
    DeviceMap,
    Event,
    Explanation,
    HandlerContext,
    Lent,
    LinkChanged,
    LinkSnapshot,
    Loan,
    Offered,
    PoolEntry,
    ResourcePool,
    Resync,
    SysfsError,
    UEvent,
)
from daemon.handlers._functions import RDMA_SUBSYSTEMS, is_pcie_error_report
from daemon.handlers._sriov_allocation import AllocationEnvs

from ._allocation import (
    VFIO_DRIVER,
    PciDetails,
    first_per_host_path,
    kubevirt_env_name,
    vfio_specs,
    with_vfio_binding,
)
from ._attributes import pci_attributes
from ._devinfo import DevinfoFiles
from ._discovery import pci_devpath, read_vfio_binding, scan_pci
from ._enablement import read_only_problem, refuse_if_read_only
from ._explain import explain as explain_function
from ._explain import why_empty as why_pool_empty
from ._facts import PciFacts
from ._folding import ERROR_EVENTS, fold_lent, fold_links, fold_uevent, recovery_concerns
from ._groups import functions_beside
from ._pools import PciPoolSpec, PoolBuilder
from ._preferred import POLICIES, preferred_devices
from ._rebind import bind_to_vfio, check, give_back, lend, plan
from ._selectors import ACCELERATOR, NET_DEVICE, PCI_DEVICE, parse_selector

if TYPE_CHECKING:
    from daemon.core import (
        AttributeValue,
        DeviceDescriber,
        Explainer,
        Handler,
        Lender,
        PoolLifecycle,
        PostAllocator,
        PreferredAllocator,
        SideFileReleaser,
    )

log = logging.getLogger("devplugd.pci")

# The entry point's: what this handler shares with auxnet is in daemon/handlers/_*.py, beside it.
__all__ = ["PciHandler"]


class PciHandler:
    name: ClassVar[str] = "pci"
    device_types: ClassVar[frozenset[str]] = frozenset({NET_DEVICE, ACCELERATOR, PCI_DEVICE})
    # vfio-dev: a function's own VFIO node (IOMMUFD) appearing after its vfio-pci bind; vdpa: a
    # VF's vDPA device added, bound to vhost_vdpa or virtio_vdpa, unbound, removed
    subsystems: ClassVar[frozenset[str]] = frozenset({"pci", "net", "uio", "vfio-dev", "vdpa", *RDMA_SUBSYSTEMS})
    wants_links: ClassVar[bool] = True

    def __init__(self, context: HandlerContext) -> None:
        self._context = context
        self._devinfo = DevinfoFiles(context.devinfo_dir)
        self._envs = AllocationEnvs()
        self._sysfs_root = os.fspath(context.sysfs_root)
        self._dev_root = os.fspath(context.dev_root)
        self._proc_root = os.fspath(context.proc_root)
        self._builder = PoolBuilder(self._dev_root)

    def parse_pool(self, entry: PoolEntry) -> PciPoolSpec:
        policy = entry.raw.get("allocationPolicy", str, "") or None
        if policy is not None and policy not in POLICIES:
            raise ConfigError(
                entry.raw.path_of("allocationPolicy"),
                f"unknown allocation policy {policy!r} (expected one of: {', '.join(POLICIES)})",
            )
        return PciPoolSpec(
            device_type=entry.device_type,
            selectors=tuple(parse_selector(selector, entry.device_type) for selector in entry.selectors),
            check_health_on_pf=entry.raw.get("checkHealthOnPf", bool, True),
            allocation_policy=policy,
            vfio_on_demand=_vfio_on_demand(entry),
        )

    def scan(self) -> PciFacts:
        return scan_pci(self._sysfs_root, self._dev_root, self._proc_root)

    def fold(self, facts: PciFacts, event: Event) -> PciFacts:
        if isinstance(event, Resync):  # a full scan; link and recovery states do not live in sysfs: keep them
            scanned = self.scan()
            recovery = {a: state for a, state in facts.recovery.items() if a in scanned.devices}
            lent = {a: home for a, home in facts.lent.items() if a in scanned.devices}
            return replace(scanned, links=facts.links, recovery=MappingProxyType(recovery), lent=MappingProxyType(lent))
        if isinstance(event, DeviceChanged):  # found changed at Allocate: read it as a kernel change says
            event = event.as_uevent()
        if isinstance(event, UEvent):
            return fold_uevent(facts, event, self._sysfs_root, self._dev_root, self._proc_root)
        if isinstance(event, (LinkChanged, LinkSnapshot)):
            return fold_links(facts, event, self._sysfs_root)
        if isinstance(event, Lent):
            return fold_lent(facts, event)
        return facts

    # The event loop's hints (see daemon.core.Handler): PCIe error recovery.
    def fold_may_block(self, facts: PciFacts, event: Event) -> bool:
        """A uevent (or a change found at Allocate) of a function in error recovery: its sysfs
        reads may wait for the kernel's device locks (seconds during a fatal reset), so the loop
        folds it in a worker thread."""
        if isinstance(event, DeviceChanged):
            event = event.as_uevent()
        return isinstance(event, UEvent) and recovery_concerns(facts, event)

    def health_step(self, event: Event) -> str | None:
        """BEGIN_RECOVERY and FAILED_RECOVERY take a device's health away; SUCCESSFUL_RECOVERY,
        a ``bind`` (re-probe) and a ``remove`` may give it back: the loop publishes the tree
        between them, so a recovery of 0.3 ms still shows the kubelet the device Unhealthy."""
        if not isinstance(event, UEvent) or event.subsystem != "pci":
            return None
        if is_pcie_error_report(event):
            error_event = event.properties["ERROR_EVENT"]
            if error_event not in ERROR_EVENTS:
                return None
            return HEALTH_RESTORED if ERROR_EVENTS[error_event] is None else HEALTH_LOST
        return HEALTH_RESTORED if event.action in ("bind", "remove") else None

    def build(self, facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> dict[str, DeviceMap]:
        return self._builder.build(facts, pools)

    # PostAllocator: the default answer has the specs; add the envs and the device-info files.
    def post_allocate(
        self, pool: ResourcePool, device_ids: Sequence[str], allocation: ContainerAllocation
    ) -> ContainerAllocation:
        entry: PoolEntry = pool.pool_config.entry
        # every function handed out, by address: a device's own first, then its group's others
        functions: dict[str, PciDetails] = {}
        owner: dict[str, str] = {}  # function address -> the device ID it is handed out under
        for device_id in device_ids:
            for record in pool.devices[device_id].details.functions:
                functions[record.device.address] = record
                owner[record.device.address] = device_id
        current = {address: self._current_vfio(pool.resource, record)
                   for address, record in functions.items() if record.device.driver == VFIO_DRIVER}
        reread = {address for address, record in current.items() if record is not functions[address]}
        for address in reread:
            self._check_group_whole(current[address], functions)
        if reread:
            stale_specs = {spec for record in functions.values() for spec in vfio_specs(record.device)}
            functions.update(current)
            fresh_specs = [spec for record in functions.values() for spec in vfio_specs(record.device)]
            kept = [spec for spec in allocation.specs if spec not in stale_specs]
            allocation.specs[:] = first_per_host_path(fresh_specs + kept)
            allocation.reread |= {owner[address] for address in reread}
        addresses = list(functions)
        allocation.envs.update(self._envs.envs(entry.resource_prefix, entry.resource_name, addresses, functions))
        if entry.device_type == PCI_DEVICE or all(r.device.driver == VFIO_DRIVER for r in functions.values()):
            allocation.envs[kubevirt_env_name(pool.resource)] = ",".join(addresses)
        if entry.device_type == NET_DEVICE:
            for record in functions.values():
                self._devinfo.write(pool.resource, record)
        return allocation

    def _current_vfio(self, resource: str, details: PciDetails) -> PciDetails:
        """``details`` checked against the driver and group links as they are now: the same
        object when nothing changed; fresh details (and a change reported, so the tree catches
        up) when the group changed; AllocationError when the device is no longer usable."""
        address = details.device.address
        try:
            binding = read_vfio_binding(self._sysfs_root, address, known_group=details.device.iommu_group,
                                        known_noiommu=details.device.noiommu)
        except SysfsError as error:
            raise AllocationError(f"{address}: {error}") from error
        if binding is None:
            raise AllocationError(f"{address}: the device is gone from sysfs")
        if binding.driver != VFIO_DRIVER or binding.iommu_group is None:
            now = f"bound to {binding.driver}" if binding.driver else "not bound to a driver"
            raise AllocationError(f"{address}: no longer usable through vfio ({now}, "
                                  f"IOMMU group {binding.iommu_group or 'none'})")
        if (binding.iommu_group, binding.noiommu) == (details.device.iommu_group, details.device.noiommu):
            return details
        log.warning("%s: IOMMU group changed from %s to %s since it was last read; handing out the new one",
                    address, details.device.iommu_group, binding.iommu_group,
                    extra={"PCI_ADDR": address, "RESOURCE": resource})
        self._context.host_changes.device_changed(self.name, pci_devpath(self._sysfs_root, address), "pci",
                                                  f"IOMMU group changed to {binding.iommu_group}")
        return with_vfio_binding(details, binding)

    def _check_group_whole(self, record: PciDetails, functions: Mapping[str, PciDetails]) -> None:
        """A function found in another group than its record says: refuse the request when that
        group now holds functions this request does not hand out (another device, perhaps another
        pod's), so a group is never split between two allocations."""
        group = record.device.iommu_group
        if group is None or record.device.noiommu:
            return
        others = functions_beside(self._sysfs_root, group, functions, record.device.address)
        if others:
            raise AllocationError(f"{record.device.address}: its IOMMU group changed to {group}, which also holds "
                                  f"{', '.join(others)}; not handing out part of a group (try again once the "
                                  "pool has caught up)")

    # Explainer: why a function is or is not in a pool (devplugd explain).
    def explain(self, facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]], device: str,
                offered: Offered) -> Explanation | None:
        return explain_function(facts, pools, device, offered)

    def why_empty(self, facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]], resource: str) -> str:
        return why_pool_empty(facts, pools, resource)

    # PreferredAllocator: offered only when the pool sets an allocation policy.
    def offers_preferred_allocation(self, pool: ResourcePool) -> bool:
        spec: PciPoolSpec = pool.pool_config.spec
        return spec.allocation_policy is not None

    def preferred_allocation(
        self, pool: ResourcePool, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        spec: PciPoolSpec = pool.pool_config.spec
        if spec.allocation_policy is None:
            raise AllocationError(f"{pool.resource} has no allocationPolicy")
        facts = {device_id: info.details.device for device_id, info in pool.devices.items()}
        return preferred_devices(spec.allocation_policy, facts, available, must_include, size)

    # DeviceDescriber: what a DRA ResourceSlice says of a device, from its record alone.
    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        return pci_attributes(pool.devices[device_id].details)

    # Lender: a vfioOnDemand pool's device goes to vfio-pci for the claim that asks (_rebind.py).
    def lends(self, pool: ConfiguredPool[PciPoolSpec]) -> bool:
        return pool.spec.vfio_on_demand

    def plan_loan(self, pool: ResourcePool, device_id: str) -> Loan:
        return plan(self._sysfs_root, self.name, pool.resource, device_id, pool.devices[device_id])

    def check_loan(self, loan: Loan) -> None:
        if loan.parts:  # before anything is checkpointed or written (_enablement.py)
            refuse_if_read_only(self._sysfs_root, loan.parts[0][0])
        check(self._sysfs_root, self._proc_root, loan)

    def lend(self, pool: ResourcePool, loan: Loan, backend: str) -> DeviceInfo:
        return lend(self._sysfs_root, self._dev_root, loan, pool.devices[loan.device_id], backend)

    def keep_lent(self, loan: Loan) -> None:
        bind_to_vfio(self._sysfs_root, loan)

    def give_back(self, loan: Loan) -> None:
        give_back(self._sysfs_root, loan)

    # The host_problems hint (daemon/hostcheck.py), said at start and at each reload: vfioOnDemand
    # pools on a host whose sysfs is read-only for us (_enablement.py).
    def host_problems(self, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> list[str]:
        problem = read_only_problem(self._sysfs_root, [pool.resource for pool in pools if pool.spec.vfio_on_demand])
        return [problem] if problem is not None else []

    # PoolLifecycle: device-info files are cleaned when pools start and stop, as upstream does.
    def pools_started(self, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> None:
        self._remove_devinfo(pools)

    def pools_stopped(self, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> None:
        self._remove_devinfo(pools)

    # SideFileReleaser: a DRA claim unprepared takes its devices' device-info files with it.
    def release_side_files(self, pool: ResourcePool, device_ids: Sequence[str]) -> None:
        """Remove the device-info file of every function handed out under ``device_ids`` (a
        device no longer in the pool: the file named by its ID, its lowest function's address)."""
        if pool.pool_config.entry.device_type != NET_DEVICE:
            return
        for device_id in device_ids:
            info = pool.devices.get(device_id)
            self._devinfo.remove(pool.resource, [r.device.address for r in info.details.functions]
                                 if info is not None else [device_id])

    def _remove_devinfo(self, pools: Sequence[ConfiguredPool[PciPoolSpec]]) -> None:
        for pool in pools:
            if pool.entry.device_type == NET_DEVICE:
                self._devinfo.remove_pool(pool.resource)


def _vfio_on_demand(entry: PoolEntry) -> bool:
    """The pool's ``vfioOnDemand`` (false when not set): only a DRA pool of whole functions
    (``pciDevice``, ``accelerator``) can rebind them, and its selectors must name the host
    drivers the functions are on until a claim takes them."""
    on_demand = entry.raw.get("vfioOnDemand", bool, False)
    if not on_demand:
        return False
    where = entry.raw.path_of("vfioOnDemand")
    if entry.allocation_api != DRA_API:
        raise ConfigError(where, f"only a pool served through DRA (\"allocationApi\": \"{DRA_API}\") can bind its "
                                 "devices to vfio-pci on demand: a claim asks for it, the device plugin API cannot")
    if entry.device_type not in (PCI_DEVICE, ACCELERATOR):
        raise ConfigError(where, f"deviceType {entry.device_type} cannot bind to vfio-pci on demand (only "
                                 f"{PCI_DEVICE} and {ACCELERATOR} pools hand out whole functions)")
    for selector in entry.selectors:
        if not selector.string_list("drivers"):
            raise ConfigError(selector.path_of("drivers"), "a vfioOnDemand pool's selector must name the host drivers "
                                                           "its functions are on (e.g. [\"nvme\"]); without, it would "
                                                           "take vfio-pci functions only")
    return True


if TYPE_CHECKING:
    # mypy checks here that PciHandler keeps the handler contract and the hooks it opts into.
    _handler: type[Handler[PciFacts, PciPoolSpec]] = PciHandler
    _post_allocator: type[PostAllocator] = PciHandler
    _preferred_allocator: type[PreferredAllocator] = PciHandler
    _lifecycle: type[PoolLifecycle[PciPoolSpec]] = PciHandler
    _releaser: type[SideFileReleaser] = PciHandler
    _describer: type[DeviceDescriber] = PciHandler
    _lender: type[Lender] = PciHandler

    _explainer: type[Explainer] = PciHandler

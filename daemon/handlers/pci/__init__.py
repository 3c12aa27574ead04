"""PCI functions for ``netDevice`` and ``accelerator`` pools, compatible with the SR-IOV network
device plugin: its selectors, first-match-wins rule, env vars, ``_INFO`` and device-info files."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from daemon.core import (
    HEALTHY,
    ConfiguredPool,
    ContainerAllocation,
    DeviceInfo,
    DeviceMap,
    Event,
    HandlerContext,
    PoolEntry,
    ResourcePool,
    Resync,
)

from ._allocation import (
    PciDetails,
    allocation_envs,
    device_specs_and_info,
    remove_devinfo_files,
    write_devinfo_file,
)
from ._ddp import read_ddp_profile
from ._discovery import PciDevice, PciFacts, scan_pci
from ._selectors import ACCELERATOR, NET_DEVICE, PciSelector, parse_selector

log = logging.getLogger("devplugd.pci")

NETWORK_CLASS = "02"
ACCELERATOR_CLASS = "12"


@dataclass(frozen=True)
class PciPoolSpec:
    device_type: str
    selectors: tuple[PciSelector, ...]


def _eligible(device: PciDevice, device_type: str) -> bool:
    """Whether upstream would consider ``device`` for a pool of ``device_type`` at all."""
    if device.driver is None:
        return False
    if device_type == ACCELERATOR:
        return device.base_class == ACCELERATOR_CLASS
    return (
        device.base_class == NETWORK_CLASS
        and not (device.is_pf and device.num_vfs > 0)
        and not device.has_default_route
    )


class PciHandler:
    name: ClassVar[str] = "pci"
    device_types: ClassVar[frozenset[str]] = frozenset({NET_DEVICE, ACCELERATOR})
    subsystems: ClassVar[frozenset[str]] = frozenset({"pci", "net", "infiniband", "uio"})

    def __init__(self, context: HandlerContext) -> None:
        self._context = context

    def parse_pool(self, entry: PoolEntry) -> PciPoolSpec:
        return PciPoolSpec(
            device_type=entry.device_type,
            selectors=tuple(parse_selector(selector, entry.device_type) for selector in entry.selectors),
        )

    def scan(self) -> PciFacts:
        return scan_pci(self._context.sysfs_root, self._context.dev_root, self._context.proc_root)

    def fold(self, facts: PciFacts, event: Event) -> PciFacts:
        return self.scan() if isinstance(event, Resync) else facts

    def build(self, facts: PciFacts, pools: Sequence[ConfiguredPool]) -> dict[str, DeviceMap]:
        """Assign each device to the first pool and selector (in file order) that matches it."""
        ddp_profile = lru_cache(maxsize=None)(read_ddp_profile)
        dev_root = self._context.dev_root
        vhost_available = (dev_root / "vhost-net").exists() and (dev_root / "net" / "tun").exists()
        taken: set[str] = set()
        result: dict[str, DeviceMap] = {}
        for pool in pools:
            spec: PciPoolSpec = pool.spec
            candidates = [d for d in facts.devices.values() if _eligible(d, spec.device_type)]
            devices: dict[str, DeviceInfo] = {}
            for selector in spec.selectors:
                for device in candidates:
                    if device.address in taken or not selector.matches(device, ddp_profile):
                        continue
                    taken.add(device.address)
                    info = self._device_info(device, pool, selector, facts, vhost_available)
                    if info is not None:
                        devices[device.address] = info
            result[pool.resource] = devices
        return result

    def _device_info(
        self,
        device: PciDevice,
        pool: ConfiguredPool,
        selector: PciSelector,
        facts: PciFacts,
        vhost_available: bool,
    ) -> DeviceInfo | None:
        if device.driver == "vfio-pci" and device.iommu_group is None:
            log.warning(
                "skipping %s in %s: bound to vfio-pci but has no iommu_group link",
                device.address, pool.resource, extra={"PCI_ADDR": device.address, "RESOURCE": pool.resource},
            )
            return None
        specs, info, rdma_device = device_specs_and_info(
            device,
            is_rdma=selector.is_rdma,
            need_vhost_net=selector.need_vhost_net,
            vhost_available=vhost_available,
            rdma_char_devices=facts.rdma_char_devices,
            additional_info=pool.entry.additional_info,
        )
        numa = device.numa_node
        return DeviceInfo(
            health=HEALTHY,
            numa_nodes=(numa,) if numa is not None and not pool.entry.exclude_topology else (),
            specs=specs,
            details=PciDetails(device=device, info=info, rdma_device=rdma_device),
        )

    # PostAllocator: the default answer has the specs; add the envs and the device-info files.
    def post_allocate(
        self, pool: ResourcePool, device_ids: Sequence[str], allocation: ContainerAllocation
    ) -> ContainerAllocation:
        entry: PoolEntry = pool.pool_config.entry
        details = {device_id: pool.devices[device_id].details for device_id in device_ids}
        allocation.envs.update(allocation_envs(entry.resource_prefix, entry.resource_name, device_ids, details))
        if entry.device_type == NET_DEVICE:
            for device_id in device_ids:
                write_devinfo_file(self._context.devinfo_dir, pool.resource, details[device_id])
        return allocation

    # PoolLifecycle: device-info files are cleaned when pools start and stop, as upstream does.
    def pools_started(self, pools: Sequence[ConfiguredPool]) -> None:
        self._remove_devinfo(pools)

    def pools_stopped(self, pools: Sequence[ConfiguredPool]) -> None:
        self._remove_devinfo(pools)

    def _remove_devinfo(self, pools: Sequence[ConfiguredPool]) -> None:
        for pool in pools:
            if pool.entry.device_type == NET_DEVICE:
                remove_devinfo_files(self._context.devinfo_dir, pool.resource)

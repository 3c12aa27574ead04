"""PCI functions for ``netDevice`` and ``accelerator`` pools, compatible with the SR-IOV network
device plugin: its selectors, first-match-wins rule, env vars, ``_INFO`` and device-info files."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

from daemon.core import (
    ConfiguredPool,
    ContainerAllocation,
    DeviceMap,
    Event,
    HandlerContext,
    LinkChanged,
    LinkSnapshot,
    PoolEntry,
    ResourcePool,
    Resync,
    UEvent,
)

from ._allocation import allocation_envs, remove_devinfo_files, write_devinfo_file
from ._discovery import PciFacts, scan_pci
from ._folding import RDMA_SUBSYSTEMS, fold_links, fold_uevent
from ._pools import PciPoolSpec, PoolBuilder
from ._selectors import ACCELERATOR, NET_DEVICE, parse_selector

log = logging.getLogger("devplugd.pci")


class PciHandler:
    name: ClassVar[str] = "pci"
    device_types: ClassVar[frozenset[str]] = frozenset({NET_DEVICE, ACCELERATOR})
    subsystems: ClassVar[frozenset[str]] = frozenset({"pci", "net", "uio", *RDMA_SUBSYSTEMS})
    wants_links: ClassVar[bool] = True

    def __init__(self, context: HandlerContext) -> None:
        self._context = context
        self._sysfs_root = os.fspath(context.sysfs_root)
        self._dev_root = os.fspath(context.dev_root)
        self._proc_root = os.fspath(context.proc_root)
        self._builder = PoolBuilder(self._dev_root)

    def parse_pool(self, entry: PoolEntry) -> PciPoolSpec:
        return PciPoolSpec(
            device_type=entry.device_type,
            selectors=tuple(parse_selector(selector, entry.device_type) for selector in entry.selectors),
            check_health_on_pf=entry.raw.get("checkHealthOnPf", bool, True),
        )

    def scan(self) -> PciFacts:
        return scan_pci(self._sysfs_root, self._dev_root, self._proc_root)

    def fold(self, facts: PciFacts, event: Event) -> PciFacts:
        if isinstance(event, Resync):  # a full scan; link states do not live in sysfs: keep them
            return replace(self.scan(), links=facts.links)
        if isinstance(event, UEvent):
            return fold_uevent(facts, event, self._sysfs_root, self._dev_root, self._proc_root)
        if isinstance(event, (LinkChanged, LinkSnapshot)):
            return fold_links(facts, event)
        return facts

    def build(self, facts: PciFacts, pools: Sequence[ConfiguredPool]) -> dict[str, DeviceMap]:
        return self._builder.build(facts, pools)

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

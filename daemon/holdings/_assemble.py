"""The next DeviceTree, from the previous one, the handlers' builds, the config and who holds
what: a pure function of them (logging aside), so the event loop only routes events and asks.

Each pool takes one road (``ResourcePool.road``): DRA when its config says ``allocationApi:
dra``; the device-plugin API otherwise, except while its ResourceSlices from a time it was a DRA
pool are still on the API server (withheld: served neither way until they are deleted).

A device that was in a pool of the previous tree and is gone from its handler's build (removed,
or unbound from the driver the pool selects) leaves the pool at once, unless a pod holds it
through the kubelet (its checkpoint) or a claim is prepared for it: then it stays, its last
record marked ``Unhealthy`` (``ResourcePool.vanished``), so the pod's
``allocatedResourcesStatus`` (or the DRA health stream) shows the failure instead of the device
silently disappearing; it leaves once the checkpoint (or the claim) lets it go, and a device that
comes back is the handler's fresh record again. While the checkpoint cannot be read, every such
device is kept.

An unchanged pool keeps its object from the previous tree, so consumers tell "unchanged" by
identity.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from daemon.checkpoint import Allocations
from daemon.core import UNHEALTHY, ConfiguredPool, DeviceInfo, DeviceMap, ResourcePool
from daemon.core._config import DRA_API, DaemonConfig
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD, DeviceTree

from ._holder import DeviceKey
from ._holdings import HeldSnapshot

log = logging.getLogger("devplugd.holdings")

# handler name -> its devices per resource (``None``: its build failed, keep its last pools)
Builds = Mapping[str, Mapping[str, DeviceMap] | None]


class Assembly:
    """One tree to assemble: ``needs_checkpoint`` says whether the kubelet's checkpoint must be
    read for it (a DRA pool, or a device gone), then ``tree(held)`` makes it."""

    def __init__(self, previous: DeviceTree, builds: Builds, config: DaemonConfig) -> None:
        self._previous = previous
        self._kept: list[ResourcePool] = []  # pools of a handler whose build failed
        # (handler, pool config, devices, IDs gone since the previous tree)
        self._fresh: list[tuple[str, ConfiguredPool[Any], DeviceMap, frozenset[str]]] = []
        for name, built in builds.items():
            configured = config.pools_of(name)
            if built is None:
                self._kept.extend(previous.pools[p.resource] for p in configured if p.resource in previous.pools)
                continue
            for pool_config in configured:
                devices = built.get(pool_config.resource, {})
                gone = _gone(previous.pools.get(pool_config.resource), name, devices)
                self._fresh.append((name, pool_config, devices, gone))

    @property
    def needs_checkpoint(self) -> bool:
        return any(gone or pool_config.entry.allocation_api == DRA_API for _, pool_config, _, gone in self._fresh)

    def tree(self, held: HeldSnapshot, arrival: float | None = None) -> DeviceTree:
        previous = self._previous
        pools = list(self._kept)
        in_use: Allocations | None = None
        for name, pool_config, devices, gone in self._fresh:
            vanished: frozenset[str] = frozenset()
            if gone:
                if in_use is None:
                    in_use = _in_use(held)
                devices, vanished = _keep_held(previous.pools[pool_config.resource], devices, gone,
                                               None if held.kubelet is None else in_use)
            pools.append(_pool(previous, name, pool_config, devices, held, vanished))
        return DeviceTree.build(previous.version + 1, pools, arrival)


def _in_use(held: HeldSnapshot) -> Allocations:
    """Who has a device through either API (a device that vanishes while one has it stays)."""
    return {**(held.kubelet or {}), **{key: holder.describe() for key, holder in held.claims.items()}}


def _road(pool_config: ConfiguredPool[Any], held: HeldSnapshot) -> str:
    if pool_config.entry.allocation_api == DRA_API:
        return DRA_ROAD
    return WITHHELD_ROAD if pool_config.resource in held.withheld else DEVICE_PLUGIN_ROAD


def _of(holders: Mapping[DeviceKey, object], resource: str, devices: DeviceMap) -> frozenset[str]:
    if not holders:
        return frozenset()
    return frozenset(d for (r, d) in holders if r == resource and d in devices)


def _pool(previous: DeviceTree, handler: str, pool_config: ConfiguredPool[Any], devices: DeviceMap,
          held: HeldSnapshot, vanished: frozenset[str]) -> ResourcePool:
    resource = pool_config.resource
    road = _road(pool_config, held)
    leased = _of(held.leases, resource, devices)
    claimed = _of(held.claims, resource, devices)
    kubelet_held: frozenset[str] = frozenset()
    if road == DRA_ROAD:  # the devices pods hold through the device-plugin API (all: unknown)
        kubelet_held = frozenset(devices) if held.kubelet is None else _of(held.kubelet, resource, devices)
    lost_book = held.lost_book(road)
    old = previous.pools.get(resource)
    if old is not None and old.pool_config is pool_config and (old.leased, old.vanished, old.road, old.claimed,
            old.kubelet_held, old.lost_book) == (leased, vanished, road, claimed, kubelet_held, lost_book) and (
            old.devices is devices or old.devices == devices):
        return old  # unchanged: keep the same object (and its cached listing)
    if not isinstance(devices, MappingProxyType):
        devices = MappingProxyType(dict(devices))  # the tree never shares a mutable map
    return ResourcePool(resource, handler, pool_config, devices, leased, vanished, road, claimed, kubelet_held,
                        lost_book)


def _gone(old: ResourcePool | None, handler: str, devices: DeviceMap) -> frozenset[str]:
    """The devices of the previous tree's pool (kept vanished ones too) that its handler's build
    no longer has; none for a pool that is new or now served by another handler."""
    if old is None or old.handler != handler or old.devices is devices:
        return frozenset()
    return frozenset(old.devices.keys() - devices.keys())


def _keep_held(old: ResourcePool, devices: DeviceMap, gone: frozenset[str],
               in_use: Allocations | None) -> tuple[DeviceMap, frozenset[str]]:
    """``devices`` with the gone devices something holds (all of them when the checkpoint
    cannot be read) put back, ``Unhealthy``; and their IDs."""
    resource = old.resource
    kept = gone if in_use is None else frozenset(d for d in gone if (resource, d) in in_use)
    for device_id in sorted(kept - old.vanished):
        holder = in_use.get((resource, device_id)) if in_use is not None else None
        log.warning("%s: device %s vanished while allocated (%s); listed Unhealthy until the kubelet releases it",
                    resource, device_id, holder or "the kubelet's checkpoint cannot be read",
                    extra={"RESOURCE": resource, "DEVICE_ID": device_id})
    for device_id in sorted((gone & old.vanished) - kept):
        log.info("%s: vanished device %s is no longer allocated; it leaves the list", resource, device_id,
                 extra={"RESOURCE": resource, "DEVICE_ID": device_id})
    if not kept:
        return devices, frozenset()
    merged = dict(devices)
    for device_id in sorted(kept):
        merged[device_id] = _unhealthy(old.devices[device_id])
    return merged, kept


def _unhealthy(info: DeviceInfo) -> DeviceInfo:
    return info if info.health == UNHEALTHY else dataclasses.replace(info, health=UNHEALTHY)


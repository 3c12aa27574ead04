"""The immutable DeviceTree: resource name -> device ID -> DeviceInfo, with a version number.

A new event builds a new tree; whoever holds an old one keeps a consistent view (an Allocate
in flight, a ListAndWatch stream about to send). Nothing here is ever mutated after creation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

_EMPTY_MAP: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device node to expose in the container (cgroup permissions: any of r, w, m)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount into the container."""

    container_path: str
    host_path: str
    read_only: bool = False


def frozen_map(items: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """A read-only copy of ``items`` (shared empty map when there is nothing)."""
    return MappingProxyType(dict(items)) if items else _EMPTY_MAP


@dataclass(frozen=True)
class DeviceInfo:
    """Everything the daemon says about one device of one resource.

    ``specs``, ``mounts``, ``envs`` and ``annotations`` are what the default Allocate answer
    merges for the devices of a request. ``numa_nodes`` is empty when no topology is advertised.
    ``details`` is the handler's own record of the device (for its Allocator); the core never
    looks inside it, but it takes part in equality so a changed device is seen as changed.
    """

    health: str = HEALTHY
    numa_nodes: tuple[int, ...] = ()
    specs: tuple[DeviceSpec, ...] = ()
    mounts: tuple[Mount, ...] = ()
    envs: Mapping[str, str] = field(default_factory=lambda: _EMPTY_MAP)
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY_MAP)
    details: Any = None


Listing = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ResourcePool:
    """One resource: its handler, its pool config and its devices by ID.

    ``pool_config`` is the handler's parsed pool entry (opaque to the core). ``leased`` are the
    devices under a host lease: they stay in ``devices`` but the kubelet does not see them.
    """

    resource: str
    handler: str
    pool_config: Any
    devices: Mapping[str, DeviceInfo]
    leased: frozenset[str] = frozenset()

    @cached_property
    def listing(self) -> Listing:
        """What a ListAndWatch message carries: (ID, health, NUMA nodes), sorted by ID, without
        the devices under a host lease."""
        return tuple(
            (device_id, info.health, info.numa_nodes)
            for device_id, info in sorted(self.devices.items())
            if device_id not in self.leased
        )

    @cached_property
    def healthy_count(self) -> int:
        return sum(1 for info in self.devices.values() if info.health == HEALTHY)


@dataclass(frozen=True)
class ResourceDiff:
    """Device IDs added, removed and changed (any field of DeviceInfo) between two pools."""

    added: frozenset[str]
    removed: frozenset[str]
    changed: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff_pools(old: ResourcePool | None, new: ResourcePool | None) -> ResourceDiff:
    """The device-level difference between two versions of one resource (``None``: absent)."""
    old_devices: Mapping[str, DeviceInfo] = old.devices if old is not None else {}
    new_devices: Mapping[str, DeviceInfo] = new.devices if new is not None else {}
    old_ids = old_devices.keys()
    new_ids = new_devices.keys()
    return ResourceDiff(
        added=frozenset(new_ids - old_ids),
        removed=frozenset(old_ids - new_ids),
        changed=frozenset(i for i in old_ids & new_ids if old_devices[i] != new_devices[i]),
    )


@dataclass(frozen=True)
class DeviceTree:
    """A version-numbered snapshot of every resource pool."""

    version: int
    pools: Mapping[str, ResourcePool]

    @classmethod
    def empty(cls) -> DeviceTree:
        return cls(version=0, pools=MappingProxyType({}))

    @classmethod
    def build(cls, version: int, pools: Iterable[ResourcePool]) -> DeviceTree:
        return cls(version=version, pools=MappingProxyType({p.resource: p for p in pools}))

    def changed_listings(self, older: DeviceTree) -> frozenset[str]:
        """Resources whose kubelet-visible list (IDs, health, topology) differs from ``older``,
        including resources that appeared or disappeared."""
        changed = set(self.pools.keys() ^ older.pools.keys())
        for resource in self.pools.keys() & older.pools.keys():
            new_pool, old_pool = self.pools[resource], older.pools[resource]
            if new_pool is not old_pool and new_pool.listing != old_pool.listing:
                changed.add(resource)
        return frozenset(changed)

    def changed_resources(self, older: DeviceTree) -> dict[str, ResourceDiff]:
        """Per resource, the device-level diff from ``older`` (only resources with a change)."""
        result: dict[str, ResourceDiff] = {}
        for resource in self.pools.keys() | older.pools.keys():
            new_pool, old_pool = self.pools.get(resource), older.pools.get(resource)
            if new_pool is old_pool:
                continue
            resource_diff = diff_pools(old_pool, new_pool)
            if resource_diff or (new_pool is None) != (old_pool is None):
                result[resource] = resource_diff
        return result

"""The immutable DeviceTree: resource name -> device ID -> DeviceInfo, with a version number.

A new event builds a new tree; whoever holds an old one keeps a consistent view (an Allocate
in flight, a ListAndWatch stream about to send). Nothing here is ever mutated after creation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import ConfiguredPool

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# The road a pool's devices take (ResourcePool.road): one at a time, never two
DEVICE_PLUGIN_ROAD = "devicePlugin"  # ListAndWatch to the kubelet
DRA_ROAD = "dra"  # ResourceSlices on the API server, claims prepared by the kubelet's DRA manager
WITHHELD_ROAD = "withheld"  # moved back to the device-plugin API; its slices are still being deleted

_EMPTY_MAP: Mapping[str, str] = MappingProxyType({})


# Why a device is Unhealthy (Fault.cause): the names its DRA taint keys carry (<driver>/<cause>)
CARRIER_LOST = "carrier-lost"  # a watched link is up without carrier
PCIE_ERROR = "pcie-error"  # in PCIe error recovery, or it failed
VANISHED_FAULT = "vanished"  # gone from the host while something held it
UNNAMED_FAULT = "unhealthy"  # Unhealthy for a reason its handler did not name


@dataclass(frozen=True, slots=True)
class Fault:
    """Why a device is Unhealthy: ``cause`` (one of the names above), ``detail`` a word that
    says where without parsing (the link's name, ``recovering`` or ``failed``; ``""``: none),
    and ``reason`` the sentence a person reads (``link ens1f0v2 is up without carrier``)."""

    cause: str
    detail: str = ""
    reason: str = ""


def carrier_lost(ifname: str) -> Fault:
    """The fault of a watched link up without carrier, said one way whichever handler watches it."""
    return Fault(CARRIER_LOST, ifname, f"link {ifname} is up without carrier")


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


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Everything the daemon says about one device of one resource.

    ``specs``, ``mounts``, ``envs`` and ``annotations`` are what the default Allocate answer
    merges for the devices of a request. ``numa_nodes`` is empty when no topology is advertised.
    ``details`` is the handler's own record of the device (for its Allocator); the core never
    looks inside it, but it takes part in equality so a changed device is seen as changed.
    ``fault`` says why an Unhealthy device is (``None``: Healthy, or a handler that does not say).
    """

    health: str = HEALTHY
    fault: Fault | None = None
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
    ``vanished`` are devices the handler no longer has that the kubelet's checkpoint shows
    allocated to a pod: they stay in ``devices`` (their last record, ``Unhealthy``) so the pod's
    ``allocatedResourcesStatus`` shows the failure, until the checkpoint lets them go. Nobody
    can be given one (Allocate refuses Unhealthy IDs) and CDI specs leave them out.

    ``road`` is how the pool is served (``DEVICE_PLUGIN_ROAD``, ``DRA_ROAD``, ``WITHHELD_ROAD``).
    ``claimed`` are devices prepared for DRA ResourceClaims: a device-plugin pool (moved back from
    DRA) leaves them out of the kubelet's list until they are unprepared. ``kubelet_held`` (DRA
    pools only) are devices the kubelet's device-plugin checkpoint still shows allocated to pods
    (the pool was moved to DRA while they ran): they stay out of the ResourceSlices until released.
    ``lost_book`` (``"lease"``, ``"claim"`` or ``""``) is a book that could not be read and so
    holds every device of the pool (see ``daemon.holdings``): none is offered anew on any road.
    """

    resource: str
    handler: str
    pool_config: ConfiguredPool[Any]
    devices: Mapping[str, DeviceInfo]
    leased: frozenset[str] = frozenset()
    vanished: frozenset[str] = frozenset()
    road: str = DEVICE_PLUGIN_ROAD
    claimed: frozenset[str] = frozenset()
    kubelet_held: frozenset[str] = frozenset()
    lost_book: str = ""

    def listed(self, device_id: object) -> bool:
        """Whether the kubelet's list has the device: it is in the pool and no host lease, claim
        or lost book holds it."""
        return not self.lost_book and device_id in self.devices and (
            device_id not in self.leased and device_id not in self.claimed)

    @cached_property
    def listing(self) -> Listing:
        """What a ListAndWatch message carries: (ID, health, NUMA nodes) of each ``listed``
        device, sorted by ID."""
        listed = self.listed
        return tuple(
            (device_id, info.health, info.numa_nodes)
            for device_id, info in sorted(self.devices.items()) if listed(device_id)
        )

    @cached_property
    def healthy_count(self) -> int:
        return sum(1 for info in self.devices.values() if info.health == HEALTHY)


class ResourceDiff:
    """What changed in one resource between two trees: computed lazily, at most once each.

    ``added``, ``removed`` and ``changed`` are device IDs (``changed``: any field of DeviceInfo,
    or whether a host lease, a claim or the kubelet's checkpoint holds it); ``listing_changed`` is
    whether the kubelet's list (IDs, health, topology, held devices left out) differs, which is
    all a ListAndWatch stream needs.
    ``old`` or ``new`` is ``None`` when the resource is absent from that tree.
    """

    __slots__ = ("old", "new", "_devices")

    def __init__(self, old: ResourcePool | None, new: ResourcePool | None) -> None:
        self.old = old
        self.new = new
        self._devices: tuple[frozenset[str], frozenset[str], frozenset[str]] | None = None

    @property
    def listing_changed(self) -> bool:
        if self.old is None or self.new is None:
            return self.old is not self.new
        return self.old is not self.new and self.old.listing != self.new.listing

    def _device_sets(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        if self._devices is None:
            old_devices: Mapping[str, DeviceInfo] = self.old.devices if self.old is not None else {}
            new_devices: Mapping[str, DeviceInfo] = self.new.devices if self.new is not None else {}
            old_holds = _holds(self.old)
            new_holds = _holds(self.new)
            lost_changed = (self.old.lost_book if self.old else "") != (self.new.lost_book if self.new else "")
            self._devices = (
                frozenset(new_devices.keys() - old_devices.keys()),
                frozenset(old_devices.keys() - new_devices.keys()),
                frozenset(
                    device_id for device_id in old_devices.keys() & new_devices.keys()
                    if old_devices[device_id] != new_devices[device_id] or lost_changed
                    or any((device_id in old) != (device_id in new) for old, new in zip(old_holds, new_holds))
                ),
            )
        return self._devices

    @property
    def added(self) -> frozenset[str]:
        return self._device_sets()[0]

    @property
    def removed(self) -> frozenset[str]:
        return self._device_sets()[1]

    @property
    def changed(self) -> frozenset[str]:
        return self._device_sets()[2]

    def __bool__(self) -> bool:
        """Whether anything a reader can see changed: the resource came or went, or a device did."""
        if (self.old is None) != (self.new is None):
            return True
        if self.old is not None and self.new is not None and (
                self.old.road != self.new.road or self.old.lost_book != self.new.lost_book):
            return True
        return bool(self.added or self.removed or self.changed)


def _holds(pool: ResourcePool | None) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    if pool is None:
        return frozenset(), frozenset(), frozenset()
    return pool.leased, pool.claimed, pool.kubelet_held


class TreeDiff:
    """The one diff between two trees that every consumer uses.

    ``resources`` holds a ResourceDiff for each resource whose pool is not the very same object
    in both trees (a tree keeps an unchanged pool's object, so this costs one identity check per
    resource); what changed inside is worked out only when asked.
    """

    __slots__ = ("old", "new", "resources")

    def __init__(self, old: DeviceTree, new: DeviceTree) -> None:
        self.old = old
        self.new = new
        self.resources: Mapping[str, ResourceDiff] = {
            resource: ResourceDiff(old.pools.get(resource), new.pools.get(resource))
            for resource in new.pools.keys() | old.pools.keys()
            if old.pools.get(resource) is not new.pools.get(resource)
        }

    @property
    def listings_changed(self) -> frozenset[str]:
        """Resources whose kubelet-visible list changed, or that appeared or went away."""
        return frozenset(resource for resource, diff in self.resources.items() if diff.listing_changed)

    @property
    def changed(self) -> frozenset[str]:
        """Resources with any change a reader can see (devices, their fields, leases)."""
        return frozenset(resource for resource, diff in self.resources.items() if diff)


@dataclass(frozen=True)
class DeviceTree:
    """A version-numbered snapshot of every resource pool. ``arrival`` is when the oldest event
    it answers reached the event loop (monotonic seconds; ``None``: it answers none): the streams
    that send it measure their reaction time from there."""

    version: int
    pools: Mapping[str, ResourcePool]
    arrival: float | None = field(default=None, compare=False)

    @classmethod
    def empty(cls) -> DeviceTree:
        return cls(version=0, pools=MappingProxyType({}))

    @classmethod
    def build(cls, version: int, pools: Iterable[ResourcePool], arrival: float | None = None) -> DeviceTree:
        return cls(version=version, pools=MappingProxyType({p.resource: p for p in pools}), arrival=arrival)

    def diff(self, older: DeviceTree) -> TreeDiff:
        """What changed from ``older`` to this tree."""
        return TreeDiff(older, self)

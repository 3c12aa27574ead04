"""The public face of devplugd's core: everything a handler may use, and nothing else.

Handlers import from ``daemon.core`` only; the modules behind it are private to the core.
"""

from ._config import ConfiguredPool, PoolEntry
from ._events import (
    ConfigChanged,
    Event,
    KubeletSocketCreated,
    LeasesChanged,
    LinkChanged,
    LinkSnapshot,
    LinkState,
    PluginSocketRemoved,
    Resync,
    UEvent,
)
from ._handler import (
    AllocationError,
    Allocator,
    ContainerAllocation,
    ContainerPreStarter,
    DeviceMap,
    Handler,
    HandlerContext,
    HostChanges,
    PoolLifecycle,
    PostAllocator,
    PreferredAllocator,
    UseDefault,
    default_allocation,
)
from ._jsonpath import ConfigError, ConfigObject
from ._sysfs import SysfsError, link_name, list_dir, read_hex_id, read_int, read_text
from ._tree import HEALTHY, UNHEALTHY, DeviceInfo, DeviceSpec, Mount, ResourcePool, frozen_map

__all__ = [
    "HEALTHY",
    "UNHEALTHY",
    "AllocationError",
    "Allocator",
    "ConfigChanged",
    "ConfigError",
    "ConfigObject",
    "ConfiguredPool",
    "ContainerAllocation",
    "ContainerPreStarter",
    "DeviceInfo",
    "DeviceMap",
    "DeviceSpec",
    "Event",
    "Handler",
    "HandlerContext",
    "HostChanges",
    "KubeletSocketCreated",
    "LeasesChanged",
    "LinkChanged",
    "LinkSnapshot",
    "LinkState",
    "Mount",
    "PluginSocketRemoved",
    "PoolEntry",
    "PoolLifecycle",
    "PostAllocator",
    "PreferredAllocator",
    "ResourcePool",
    "Resync",
    "SysfsError",
    "UEvent",
    "UseDefault",
    "default_allocation",
    "frozen_map",
    "link_name",
    "list_dir",
    "read_hex_id",
    "read_int",
    "read_text",
]

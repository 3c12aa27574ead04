"""The public face of devplugd's core for handlers: the handler contract and the model it
works on (events, devices and pools, allocation answers, config entries, sysfs and udev readers).

Handlers import from ``daemon.core`` only, never from the modules behind it. The daemon's own
parts (the event loop, the notifier and its mailboxes, config loading, the handler registry, the
tree and its diff, the roads) import what only they use from the core module that defines it
(``daemon.core._notifier``, ``daemon.core._tree``, ...): this face stays the contract a handler
author reads, and grows only with it.
"""

from ._allocation import AllocationError, ContainerAllocation, UseDefault, default_allocation
from ._config import DRA_API, ConfiguredPool, PoolEntry
from ._events import DeviceChanged, Event, Lent, LinkChanged, LinkSnapshot, LinkState, Resync, UEvent
from ._explain import (
    LEFT_OUT,
    REFUSED,
    TOOK,
    Explainer,
    Explanation,
    Mismatch,
    Offered,
    PoolVerdict,
    first_pool_wins,
    refused_by_selectors,
    wanted,
)
from ._handler import (
    HEALTH_LOST,
    HEALTH_RESTORED,
    VFIO_IOMMUFD,
    VFIO_LEGACY,
    VFIO_PREFER_IOMMUFD,
    Allocator,
    AttributeValue,
    ContainerPreStarter,
    DeviceDescriber,
    DeviceMap,
    DeviceSharer,
    Handler,
    HandlerContext,
    Lender,
    Loan,
    PoolLifecycle,
    PostAllocator,
    PreferredAllocator,
    SideFileReleaser,
)
from ._jsonpath import ConfigError, ConfigObject
from ._names import device_list_env_name
from ._sysfs import PathLike, SysfsError, link_name, list_dir, read_hex_id, read_int, read_text
from ._tree import (
    HEALTHY,
    PCIE_ERROR,
    UNHEALTHY,
    DeviceInfo,
    DeviceSpec,
    Fault,
    Mount,
    ResourcePool,
    carrier_lost,
)
from ._udev import device_properties, read_uevent_file, set_by_udev

__all__ = [
    "DRA_API",
    "HEALTHY",
    "HEALTH_LOST",
    "HEALTH_RESTORED",
    "LEFT_OUT",
    "PCIE_ERROR",
    "REFUSED",
    "TOOK",
    "UNHEALTHY",
    "VFIO_IOMMUFD",
    "VFIO_LEGACY",
    "VFIO_PREFER_IOMMUFD",
    "AllocationError",
    "Allocator",
    "AttributeValue",
    "ConfigError",
    "ConfigObject",
    "ConfiguredPool",
    "ContainerAllocation",
    "ContainerPreStarter",
    "DeviceChanged",
    "DeviceDescriber",
    "DeviceInfo",
    "DeviceMap",
    "DeviceSharer",
    "DeviceSpec",
    "Event",
    "Explainer",
    "Explanation",
    "Fault",
    "Handler",
    "HandlerContext",
    "Lender",
    "Lent",
    "LinkChanged",
    "LinkSnapshot",
    "LinkState",
    "Loan",
    "Mismatch",
    "Mount",
    "Offered",
    "PathLike",
    "PoolEntry",
    "PoolLifecycle",
    "PoolVerdict",
    "PostAllocator",
    "PreferredAllocator",
    "ResourcePool",
    "Resync",
    "SideFileReleaser",
    "SysfsError",
    "UEvent",
    "UseDefault",
    "carrier_lost",
    "default_allocation",
    "device_list_env_name",
    "device_properties",
    "first_pool_wins",
    "link_name",
    "list_dir",
    "read_hex_id",
    "read_int",
    "read_text",
    "read_uevent_file",
    "refused_by_selectors",
    "set_by_udev",
    "wanted",
]

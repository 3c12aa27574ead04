"""Event records: what sources put on the bus and the event loop routes.

Every record is a small frozen dataclass. Sources create them; nobody mutates them. The event
loop (``daemon/loop.py``) decides who hears each one: device events go to the handlers that
declared interest; kubelet events come from inotify on their own channel to the device-plugin
endpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Resync:
    """Rebuild facts from a full scan.

    ``handler`` names one handler, or is ``None`` for all of them. The daemon's first scan is a
    ``Resync(None, "start")`` sent over the bus like any other event; a source that may have lost
    events sends one for the handlers it feeds, so a lost event never leaves a wrong list behind.
    """

    handler: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class KubeletSocketCreated:
    """``kubelet.sock`` appeared in the device-plugin directory: a kubelet (re)started."""

    path: str


@dataclass(frozen=True, slots=True)
class PluginSocketRemoved:
    """A socket file in a directory we serve in was removed (the kubelet cleans sockets)."""

    path: str


@dataclass(frozen=True, slots=True)
class UEvent:
    """One kernel uevent (``ACTION@DEVPATH`` plus its ``KEY=VALUE`` properties).

    ``devpath`` is relative to the sysfs root (``/devices/pci0000:00/...``); ``subsystem`` and
    ``devname`` (``DEVNAME``, a node name relative to /dev) are copied out of ``properties``.
    """

    action: str
    devpath: str
    subsystem: str
    devname: str | None = None
    properties: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class DeviceChanged:
    """A handler found one of its devices differ from its facts outside ``fold`` (at Allocate,
    say: a vfio function's IOMMU group changed with no uevent). The event loop folds it into that
    handler's facts only, which read the device at ``devpath`` (relative to the sysfs root) again,
    so the tree (ListAndWatch, CDI, the host API) catches up."""

    handler: str
    devpath: str
    subsystem: str
    reason: str

    def as_uevent(self) -> UEvent:
        """The kernel's word for the same: a ``change`` uevent of the device (what a handler
        that reads a device again for a change folds it as)."""
        return UEvent("change", self.devpath, self.subsystem)


@dataclass(frozen=True, slots=True)
class LinkState:
    """What rtnetlink says about one network interface."""

    ifindex: int
    admin_up: bool  # IFF_UP
    lower_up: bool  # IFF_LOWER_UP: the carrier is there

    @property
    def carrier_lost(self) -> bool:
        """Administratively up but without carrier: the link is down under us."""
        return self.admin_up and not self.lower_up


@dataclass(frozen=True, slots=True)
class LinkChanged:
    """RTM_NEWLINK / RTM_DELLINK for one interface (``state`` is ``None`` when it was deleted)."""

    ifname: str
    state: LinkState | None


@dataclass(frozen=True, slots=True)
class LinkSnapshot:
    """Every interface after a full dump (at start, and after the socket lost messages)."""

    links: Mapping[str, LinkState]


@dataclass(frozen=True, slots=True)
class ConfigChanged:
    """Reload the config file (SIGHUP, or the file or its ConfigMap symlink changed)."""

    reason: str


@dataclass(frozen=True, slots=True)
class LeasesChanged:
    """A host lease was granted or released: the kubelet's lists must follow."""

    reason: str


@dataclass(frozen=True, slots=True)
class ClaimsChanged:
    """The DRA side changed who may have which device: a claim was prepared or unprepared, or a
    pool's ResourceSlices were withdrawn (it may be served to the kubelet now)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Lent:
    """Every part of a handler's devices that DRA claims hold on another driver than their own
    (a PCI function rebound to vfio-pci for a claim that asked for it), each with the driver it
    goes back to (``None``: it had none), as the claims' checkpoint says: the whole set each
    time. The event loop folds it into that handler's facts alone; the handler judges a lent
    part by the driver it goes back to, so the part stays the device of its pool while the
    rebinding moves it through no driver and vfio-pci, and a pool that takes vfio-pci functions
    does not get it."""

    handler: str
    parts: tuple[tuple[str, str | None], ...]
    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointChanged:
    """The kubelet's ``kubelet_internal_checkpoint`` was written, replaced or removed: a device
    kept listed because a pod held it when it vanished may be free now."""

    path: str


Event = (
    Resync | KubeletSocketCreated | PluginSocketRemoved | UEvent | DeviceChanged | LinkChanged | LinkSnapshot
    | ConfigChanged | LeasesChanged | ClaimsChanged | Lent | CheckpointChanged
)

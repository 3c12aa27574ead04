"""The handler contract: what a device family implements to plug into the daemon.

It carries the contract of Intel's device plugin framework into an event-driven daemon:

* every handler is a ``Handler``: it parses its pools' config, scans its devices into *facts*
  (its own immutable record of the host) and builds, from facts and pools, the devices of each
  resource as ``DeviceInfo`` (health, topology, device specs, mounts, envs, annotations);
* the optional protocols below are opt-in by implementing them: ``Allocator`` (with
  ``UseDefault`` to fall back to the core's default answer), ``PostAllocator``,
  ``PreferredAllocator``, ``ContainerPreStarter``, and ``PoolLifecycle`` for work done when pools
  start and stop serving.

The core finds handlers through the ``devplugd.handlers`` entry-point group and never imports
one by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

from ._config import ConfiguredPool, PoolEntry
from ._events import Event, UEvent
from ._tree import DeviceInfo, DeviceSpec, Mount, ResourcePool

log = logging.getLogger("devplugd.handlers")


class HostChanges:
    """How a handler says it saw the host differ from its facts outside ``fold`` (at Allocate,
    say): the kernel loop then folds a ``change`` uevent for that device, as if the kernel had
    sent one, so the tree (ListAndWatch, CDI, host API) catches up. Connected to the bus once the
    daemon serves; until then (and in unit tests) reports are dropped."""

    def __init__(self) -> None:
        self._send: Callable[[Event], None] | None = None

    def connect(self, send: Callable[[Event], None]) -> None:
        self._send = send

    def device_changed(self, devpath: str, subsystem: str) -> None:
        if self._send is not None:
            self._send(UEvent("change", devpath, subsystem, None, MappingProxyType({"DEVPLUGD_RECHECK": "1"})))


@dataclass(frozen=True)
class HandlerContext:
    """Where a handler reads the host from and writes its side files to."""

    sysfs_root: Path
    dev_root: Path
    proc_root: Path
    devinfo_dir: Path
    host_changes: HostChanges = field(default_factory=HostChanges)


@dataclass
class ContainerAllocation:
    """The answer for one container request (becomes a ContainerAllocateResponse)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    specs: list[DeviceSpec] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    # devices whose record in the tree was found out of date and read afresh for this answer:
    # their CDI spec may still say the old thing, so they get no CDI name
    reread: set[str] = field(default_factory=set)


class UseDefault(Exception):
    """Raised by ``Allocator.allocate`` to ask for the core's default answer."""


class AllocationError(Exception):
    """The handler cannot answer this Allocate; the message names the device and the reason."""


DeviceMap = Mapping[str, DeviceInfo]


class Handler(Protocol):
    """A device family. Implementations must not keep mutable state between calls that the
    tree depends on: facts go in, facts and devices come out."""

    name: ClassVar[str]
    # the config ``deviceType`` values this handler serves
    device_types: ClassVar[frozenset[str]]
    # the uevent subsystems it folds (an empty set: every subsystem)
    subsystems: ClassVar[frozenset[str]]
    # whether rtnetlink link events (LinkChanged, LinkSnapshot) are folded into its facts
    wants_links: ClassVar[bool]

    def parse_pool(self, entry: PoolEntry) -> Any:
        """Parse one ``resourceList`` entry of one of ``device_types``; raise ConfigError."""
        ...

    def scan(self) -> Any:
        """Read the whole host and return facts. Runs in a worker thread."""
        ...

    def fold(self, facts: Any, event: Event) -> Any:
        """Return facts updated by one event: the same object when it does not concern us, and a
        full rescan for ``Resync`` (then it runs in a worker thread). The result must equal
        what ``scan`` would give for the same host."""
        ...

    def build(self, facts: Any, pools: Sequence[ConfiguredPool]) -> dict[str, DeviceMap]:
        """The devices of each of ``pools`` (keyed by resource name) from ``facts``."""
        ...


@runtime_checkable
class Allocator(Protocol):
    def allocate(self, pool: ResourcePool, device_ids: Sequence[str]) -> ContainerAllocation:
        """Answer a container request, or raise UseDefault."""
        ...


@runtime_checkable
class PostAllocator(Protocol):
    def post_allocate(
        self, pool: ResourcePool, device_ids: Sequence[str], allocation: ContainerAllocation
    ) -> ContainerAllocation:
        """Adjust the default (or Allocator's) answer: add envs, write side files."""
        ...


@runtime_checkable
class PreferredAllocator(Protocol):
    def offers_preferred_allocation(self, pool: ResourcePool) -> bool: ...

    def preferred_allocation(
        self,
        pool: ResourcePool,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
    ) -> list[str]: ...


@runtime_checkable
class ContainerPreStarter(Protocol):
    def pre_start_container(self, pool: ResourcePool, device_ids: Sequence[str]) -> None: ...


@runtime_checkable
class PoolLifecycle(Protocol):
    def pools_started(self, pools: Sequence[ConfiguredPool]) -> None:
        """Called once before the first tree is served (e.g. clean stale side files)."""
        ...

    def pools_stopped(self, pools: Sequence[ConfiguredPool]) -> None:
        """Called when these pools stop being served (shutdown, or removed by a reload)."""
        ...


def tell_lifecycle(handlers: Mapping[str, Handler], pools: Sequence[ConfiguredPool], *, started: bool) -> None:
    """Call ``pools_started`` (or ``pools_stopped``) of each PoolLifecycle handler with its share
    of ``pools``. A handler that fails is logged; the others still hear of their pools."""
    for name, handler in handlers.items():
        mine = [pool for pool in pools if pool.handler == name]
        if not mine or not isinstance(handler, PoolLifecycle):
            continue
        try:
            if started:
                handler.pools_started(mine)
            else:
                handler.pools_stopped(mine)
        except Exception:
            log.exception("handler %s failed on pools %s", name, "started" if started else "stopped")


def default_allocation(pool: ResourcePool, device_ids: Sequence[str]) -> ContainerAllocation:
    """The union of the devices' specs (first per host path), mounts (first per container path),
    envs and annotations, in request order."""
    allocation = ContainerAllocation()
    seen_hosts: set[str] = set()
    seen_mounts: set[str] = set()
    for device_id in device_ids:
        info = pool.devices[device_id]
        for spec in info.specs:
            if spec.host_path not in seen_hosts:
                seen_hosts.add(spec.host_path)
                allocation.specs.append(spec)
        for mount in info.mounts:
            if mount.container_path not in seen_mounts:
                seen_mounts.add(mount.container_path)
                allocation.mounts.append(mount)
        for key, value in info.envs.items():
            allocation.envs.setdefault(key, value)
        for key, value in info.annotations.items():
            allocation.annotations.setdefault(key, value)
    return allocation

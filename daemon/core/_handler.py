"""The handler contract: what a device family implements to plug into the daemon.

It carries the contract of Intel's device plugin framework into an event-driven daemon:

* every handler is a ``Handler``: it parses its pools' config, scans its devices into *facts*
  (its own immutable record of the host) and builds, from facts and pools, the devices of each
  resource as ``DeviceInfo`` (health, topology, device specs, mounts, envs, annotations);
* the optional protocols below are opt-in by implementing them: ``Allocator`` (with
  ``UseDefault`` to fall back to the core's default answer), ``PostAllocator``,
  ``PreferredAllocator``, ``ContainerPreStarter``, ``PoolLifecycle`` for work done when pools
  start and stop serving, ``SideFileReleaser`` for the side files of devices whose DRA claim
  was unprepared, ``Lender`` for pools whose devices go to vfio-pci for the DRA claim that asks
  (and back), and ``Explainer`` (``_explain.py``) to say why a device is or is not in a pool;
* two optional hints for the event loop, looked up by name: ``fold_may_block(facts, event)``
  (True: fold this event in a worker thread, its reads may wait on the kernel) and
  ``health_step(event)`` (``HEALTH_LOST`` / ``HEALTH_RESTORED`` / ``None``: the loop never folds a
  restoring event in the batch of a losing one, so every Unhealthy state gets its own tree);
  and one for loading a config, ``host_problems(pools)`` (what keeps its pools from working on
  this host, each said as an error at start and at each reload: ``daemon.hostcheck``).

The core finds handlers through the ``devplugd.handlers`` entry-point group and never imports
one by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from ._allocation import AllocationError, ContainerAllocation, HandlerFailed, UseDefault, default_allocation
from ._config import ConfiguredPool, PoolEntry
from ._events import DeviceChanged, Event
from ._tree import DeviceInfo, ResourcePool

log = logging.getLogger("devplugd.core")


class HostChanges:
    """How a handler says it saw the host differ from its facts outside ``fold`` (at Allocate,
    say): a ``DeviceChanged`` event goes to the bus, and the event loop folds it into that
    handler's facts alone, so the tree (ListAndWatch, CDI, host API) catches up. Connected to the
    bus once the daemon serves; until then (and in unit tests) reports are dropped."""

    def __init__(self) -> None:
        self._send: Callable[[Event], None] | None = None

    def connect(self, send: Callable[[Event], None]) -> None:
        self._send = send

    def device_changed(self, handler: str, devpath: str, subsystem: str, reason: str) -> None:
        """``handler``'s device at ``devpath`` (relative to the sysfs root) is not what its facts
        say, for ``reason``: read it again."""
        if self._send is not None:
            self._send(DeviceChanged(handler, devpath, subsystem, reason))


@dataclass(frozen=True)
class HandlerContext:
    """Where a handler reads the host from and writes its side files to."""

    sysfs_root: Path
    dev_root: Path
    proc_root: Path
    devinfo_dir: Path
    host_changes: HostChanges = field(default_factory=HostChanges)
    # udev's database (``/run/udev/data``) when the uevents come from udev; ``None``: the kernel's
    # own properties only (no udevd, or ``--uevent-source kernel``)
    udev_data: Path | None = None


DeviceMap = Mapping[str, DeviceInfo]

# What ``health_step`` says of an event: it makes a device Unhealthy, or may make one Healthy again
HEALTH_LOST = "lost"
HEALTH_RESTORED = "restored"


FactsT = TypeVar("FactsT")
SpecT = TypeVar("SpecT")


class Handler(Protocol[FactsT, SpecT]):
    """A device family, generic over its facts (its own immutable record of the host) and its
    parsed pool spec. Implementations must not keep mutable state between calls that the tree
    depends on: facts go in, facts and devices come out.

    Every hook may fail: the core logs the failure with its event and contains it (a pool that
    fails to parse is a refused config, a failed scan, fold or build keeps the handler's last
    devices, a failed allocation hook refuses that one request)."""

    name: ClassVar[str]
    # the config ``deviceType`` values this handler serves
    device_types: ClassVar[frozenset[str]]
    # the uevent subsystems it folds (an empty set: every subsystem)
    subsystems: ClassVar[frozenset[str]]
    # whether rtnetlink link events (LinkChanged, LinkSnapshot) are folded into its facts
    wants_links: ClassVar[bool]

    def parse_pool(self, entry: PoolEntry) -> SpecT:
        """Parse one ``resourceList`` entry of one of ``device_types``; raise ConfigError."""
        ...

    def scan(self) -> FactsT:
        """Read the whole host and return facts. Runs in a worker thread."""
        ...

    def fold(self, facts: FactsT, event: Event) -> FactsT:
        """Return facts updated by one event: the same object when it does not concern us, and a
        full rescan for ``Resync`` (then it runs in a worker thread). The result must equal
        what ``scan`` would give for the same host."""
        ...

    def build(self, facts: FactsT, pools: Sequence[ConfiguredPool[SpecT]]) -> Mapping[str, DeviceMap]:
        """The devices of each of ``pools`` (keyed by resource name) from ``facts``."""
        ...


# What the core holds: handlers of every family side by side.
AnyHandler = Handler[Any, Any]


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


# A DRA device attribute value: ResourceSlice attributes are exactly one of int, bool, string
AttributeValue = int | bool | str


@runtime_checkable
class DeviceDescriber(Protocol):
    """What a DRA ResourceSlice says of a device beyond the core's own attributes (``id``,
    ``resourceName``, ``numaNode``): name -> value, names unprefixed (the driver's domain) or
    with a ``domain/`` prefix (``resource.kubernetes.io/pciBusID``). Strings at most 64
    characters; called on the event loop, so it must not read the host."""

    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]: ...


@runtime_checkable
class DeviceSharer(Protocol):
    """Devices of a pool that are shares of one device (a devNode pool's ``count`` copies of
    one node): through DRA they are published as that one device, which many claims may hold
    at once, a share each (KEP-5075 consumable capacity)."""

    def shares(self, pool: ResourcePool) -> Mapping[str, Sequence[str]]:
        """The shared device's ID -> the IDs of its shares in the pool, in order (none: no sharing)."""
        ...


# the IOMMU backends a claim may ask a device on vfio-pci to be handed out through
VFIO_LEGACY = "legacy"  # the group: /dev/vfio/vfio and /dev/vfio/<group>
VFIO_IOMMUFD = "iommufd"  # the device's own node and /dev/iommu; refused where the kernel has none
VFIO_PREFER_IOMMUFD = "preferIommufd"  # IOMMUFD where the kernel has it, else the group
VFIO_BACKENDS = (VFIO_LEGACY, VFIO_IOMMUFD, VFIO_PREFER_IOMMUFD)


@dataclass(frozen=True)
class Loan:
    """What handing one device to vfio-pci for a DRA claim takes: each of its parts that is not
    on vfio-pci already (for PCI, the functions of its IOMMU group but the bridges), in the order
    they are rebound, with the driver it goes back to (``None``: it had none). No parts: the
    device is on vfio-pci already, nothing moves and nothing goes back."""

    handler: str  # the Lender's name: the loan is given back by it, whatever became of the pool
    resource: str
    device_id: str
    parts: tuple[tuple[str, str | None], ...]

    def to_json(self) -> dict[str, Any]:
        return {"handler": self.handler, "resource": self.resource, "device_id": self.device_id,
                "parts": [{"part": part, "driver": driver} for part, driver in self.parts]}

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> Loan:
        handler, resource, device_id = item.get("handler"), item.get("resource"), item.get("device_id")
        parts = item.get("parts")
        if not all(isinstance(value, str) for value in (handler, resource, device_id)) or not isinstance(parts, list):
            raise ValueError("a loan needs 'handler', 'resource' and 'device_id' (strings) and 'parts' (a list)")
        pairs: list[tuple[str, str | None]] = []
        for entry in parts:
            if (not isinstance(entry, Mapping) or not isinstance(entry.get("part"), str)
                    or not isinstance(entry.get("driver"), (str, type(None)))):
                raise ValueError("a loan's part needs 'part' (a string) and 'driver' (a string or null)")
            pairs.append((entry["part"], entry["driver"]))
        return cls(str(handler), str(resource), str(device_id), tuple(pairs))


@runtime_checkable
class Lender(Protocol):
    """A handler whose pools may hand a device to vfio-pci for the DRA claim that asks for it
    and give it back to its own driver afterwards (``vfioOnDemand``). The calls block on the
    kernel: the DRA preparer makes them in a worker thread, and records each loan in its
    checkpoint before ``lend`` and until ``give_back`` returned."""

    def lends(self, pool: ConfiguredPool[Any]) -> bool:
        """Whether the pool's config lets its devices go to vfio-pci on demand."""
        ...

    def plan_loan(self, pool: ResourcePool, device_id: str) -> Loan:
        """The loan of ``device_id``: its parts not on vfio-pci, read from the host as it is now
        (a few links: cheap enough for the event loop); AllocationError when the device cannot
        be lent whole (its group holds a part the pool does not offer)."""
        ...

    def check_loan(self, loan: Loan) -> None:
        """(blocks: a worker thread) AllocationError naming the part and the reason when a part
        of ``loan`` may not leave its driver (it carries the host's default route, a block device
        of it is mounted or held)."""
        ...

    def lend(self, pool: ResourcePool, loan: Loan, backend: str) -> DeviceInfo:
        """Rebind every part of ``loan`` to vfio-pci (those already there stay); the device as it
        is then, with the device specs of ``backend`` (one of ``VFIO_BACKENDS``). AllocationError
        or OSError: a part could not be rebound (some may be: ``give_back`` undoes it)."""
        ...

    def keep_lent(self, loan: Loan) -> None:
        """(at start) Rebind to vfio-pci every part of a prepared claim's loan that is not on it
        (a reboot gave the parts back to their own drivers while the claim stayed prepared).
        AllocationError or OSError: a part could not be rebound."""
        ...

    def give_back(self, loan: Loan) -> None:
        """Give every part of ``loan`` back to its driver (those already there stay). Tries every
        part; AllocationError or OSError naming those that stay on vfio-pci."""
        ...


@runtime_checkable
class ContainerPreStarter(Protocol):
    def pre_start_container(self, pool: ResourcePool, device_ids: Sequence[str]) -> None: ...


@runtime_checkable
class SideFileReleaser(Protocol):
    def release_side_files(self, pool: ResourcePool, device_ids: Sequence[str]) -> None:
        """Remove the side files ``post_allocate`` wrote for these devices: the DRA claim they
        were prepared for is unprepared. Device-plugin allocations never end this way (the
        kubelet does not say when a pod lets go); their files go when the pool stops."""
        ...


@runtime_checkable
class PoolLifecycle(Protocol[SpecT]):
    """Generic over the handler's pool spec: it hears of its own pools (``Handler[..., SpecT]``)."""

    def pools_started(self, pools: Sequence[ConfiguredPool[SpecT]]) -> None:
        """Called once before the first tree is served (e.g. clean stale side files)."""
        ...

    def pools_stopped(self, pools: Sequence[ConfiguredPool[SpecT]]) -> None:
        """Called when these pools stop being served (shutdown, or removed by a reload)."""
        ...


def tell_lifecycle(handlers: Mapping[str, AnyHandler], pools: Sequence[ConfiguredPool[Any]], *, started: bool) -> None:
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


@dataclass(frozen=True)
class Hooks:
    """A handler and the optional protocols it implements, looked up once: ``isinstance`` on a
    runtime-checkable protocol walks the protocol's members on every call (7-15 µs each on
    Python 3.11), and every Allocate and every new tree would ask again."""

    handler: AnyHandler
    allocator: Allocator | None = None
    post_allocator: PostAllocator | None = None
    preferred: PreferredAllocator | None = None
    pre_starter: ContainerPreStarter | None = None
    describer: DeviceDescriber | None = None
    releaser: SideFileReleaser | None = None
    sharer: DeviceSharer | None = None
    lender: Lender | None = None

    @classmethod
    def of(cls, handler: AnyHandler) -> Hooks:
        return cls(
            handler,
            allocator=handler if isinstance(handler, Allocator) else None,
            post_allocator=handler if isinstance(handler, PostAllocator) else None,
            preferred=handler if isinstance(handler, PreferredAllocator) else None,
            pre_starter=handler if isinstance(handler, ContainerPreStarter) else None,
            describer=handler if isinstance(handler, DeviceDescriber) else None,
            releaser=handler if isinstance(handler, SideFileReleaser) else None,
            sharer=handler if isinstance(handler, DeviceSharer) else None,
            lender=handler if isinstance(handler, Lender) else None,
        )

    @property
    def name(self) -> str:
        return self.handler.name

    def lends(self, pool: ConfiguredPool[Any]) -> bool:
        """Whether ``pool``'s devices may go to vfio-pci for the DRA claim that asks (``Lender``)."""
        return self.lender is not None and self.lender.lends(pool)


def allocate_container(hooks: Hooks, pool: ResourcePool, device_ids: Sequence[str]) -> ContainerAllocation:
    """The handler's answer (its Allocator, else the default), then its PostAllocator.

    Raises AllocationError (the handler's refusal), OSError (the host failed it) or HandlerFailed.
    """
    hook = "allocate"
    try:
        allocation: ContainerAllocation | None = None
        if hooks.allocator is not None:
            try:
                allocation = hooks.allocator.allocate(pool, device_ids)
            except UseDefault:
                allocation = None
        if allocation is None:
            allocation = default_allocation(pool, device_ids)
        if hooks.post_allocator is not None:
            hook = "post_allocate"
            allocation = hooks.post_allocator.post_allocate(pool, device_ids, allocation)
    except (AllocationError, OSError):
        raise
    except Exception as error:
        raise HandlerFailed(f"handler {hooks.name} failed in {hook} for {pool.resource}: "
                            f"{type(error).__name__}: {error}") from error
    return allocation

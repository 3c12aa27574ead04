"""The event loop: take events off the bus, fold them into the handlers' facts, build the next
DeviceTree, and publish it to the notifier — the one road to everything that reads the tree.

Everything waiting on the bus is handled as one batch, so a burst (256 VFs from one
``sriov_numvfs`` write) becomes one new tree, not 256:

* ``Resync`` rescans a handler (or all) in a worker thread, once per handler however many
  Resyncs the batch holds, before the batch's other events are folded;
* a ``UEvent`` is folded into the facts of each handler whose ``subsystems`` include it
  (an empty set means every subsystem); link events go to handlers that set ``wants_links``;
* ``ConfigChanged`` reloads the config once per batch, validated by the running handlers; on
  error the old config keeps being served;
* ``LeasesChanged`` (a host lease granted or released) and ``ClaimsChanged`` (a DRA claim
  prepared or unprepared, a pool's slices withdrawn) only ask for a new tree: held devices leave
  the kubelet's lists and the ResourceSlices;
* ``CheckpointChanged`` (the kubelet's checkpoint rewritten) asks for a new tree only while a
  pool keeps a vanished device (below) or a pool is served through DRA (the devices pods still
  hold through the device-plugin API stay out of its slices).

Each pool takes one road (``ResourcePool.road``): DRA when its config says ``allocationApi:
dra``; the device-plugin API otherwise, except while its ResourceSlices from a time it was a DRA
pool are still on the API server (withheld: served neither way until they are deleted).

Then every handler builds its pools from its facts (in a worker thread after a rescan or a
reload, when a build is a full one), the loop assembles an immutable DeviceTree and publishes it.
A handler hook that raises is logged with the event and keeps the handler's last good devices.

A device that was in a pool of the previous tree and is gone from its handler's build (removed,
or unbound from the driver the pool selects) leaves the pool at once, unless the kubelet's
checkpoint shows it allocated in that pool or it is prepared for a DRA claim: then it stays,
its last record marked ``Unhealthy`` (``ResourcePool.vanished``), so the pod's
``allocatedResourcesStatus`` (or the DRA health stream) shows the failure instead of the device
silently disappearing; it leaves once the checkpoint (or the claim) lets it go, and a
device that comes back is the handler's fresh record again. The checkpoint is read (in a worker
thread: with many pods it is large) only when a device is gone or kept, and again only after it
changed; one that cannot be read keeps every such device, Unhealthy, until it can.

Two optional handler hints bend the batching above (see ``daemon.core.Handler``):

* ``health_step(event)``: a batch ends before an event that may make a device Healthy again
  (``HEALTH_RESTORED``: SUCCESSFUL_RECOVERY, a re-probe) when it already holds one that made a
  device Unhealthy (``HEALTH_LOST``: BEGIN_RECOVERY), so the tree with the Unhealthy device is
  published before the next batch folds the recovery: a PCIe recovery of 0.3 ms still reaches
  every consumer. The burst of a recovery (BEGIN on every function, then SUCCESSFUL on every
  one) waiting on the bus together is two trees, not one per uevent (uevents the kernel sends a
  millisecond apart may give a few more: each a tree the kernel had said so far, none hidden);
* ``fold_may_block(facts, event)``: that fold runs in a worker thread (a uevent of a PCI device
  under a fatal reset, whose sysfs reads wait seconds for the kernel's device locks). The loop
  awaits it, so events stay in order; trio, and so the kubelet's streams, Allocate and the
  watchdog, keep running meanwhile. The check is the handler's, so the usual inline fold of a
  few microseconds stays inline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import trio

from daemon.checkpoint import Allocations, read_allocations
from daemon.core import (
    DEVICE_PLUGIN_ROAD,
    DRA_API,
    DRA_ROAD,
    HEALTH_LOST,
    HEALTH_RESTORED,
    UNHEALTHY,
    WITHHELD_ROAD,
    AnyHandler,
    CheckpointChanged,
    ClaimsChanged,
    ConfigChanged,
    ConfigFileError,
    ConfiguredPool,
    DaemonConfig,
    DeviceChanged,
    DeviceInfo,
    DeviceMap,
    DeviceTree,
    Event,
    LeasesChanged,
    LinkChanged,
    LinkSnapshot,
    Notifier,
    ResourcePool,
    Resync,
    UEvent,
    tell_lifecycle,
)
from daemon.metrics import CHANGED, FAILED, UNCHANGED, Metrics, metrics_outcome
from daemon.service import ServiceManager

log = logging.getLogger("devplugd.kernel")  # logger names are in every log line: kept as they were

# (facts, pools, devices) a handler's last build came from and gave
_Built = tuple[object, tuple[ConfiguredPool[Any], ...], Mapping[str, DeviceMap]]


def describe(event: Event) -> str:
    if isinstance(event, UEvent):
        return f"uevent {event.action} {event.devpath}"
    if isinstance(event, Resync):
        return f"resync ({event.reason})"
    return type(event).__name__


def describe_batch(batch: Sequence[Event]) -> str:
    shown = ", ".join(describe(event) for event in batch[:3])
    return shown + (f" and {len(batch) - 3} more" if len(batch) > 3 else "")


class EventLoop:
    def __init__(
        self,
        handlers: Mapping[str, AnyHandler],
        config: DaemonConfig,
        notifier: Notifier,
        reload_config: Callable[[], DaemonConfig],
        service: ServiceManager | None = None,
        lease_holders: Callable[[], Mapping[tuple[str, str], object]] = dict,
        device_plugin_dir: Path | None = None,
        claim_holders: Callable[[], Mapping[tuple[str, str], object]] = dict,
        dra_withheld: Callable[[], frozenset[str]] = frozenset,
        metrics: Metrics | None = None,
    ) -> None:
        self._handlers = handlers
        self._config = config
        self._notifier = notifier
        self._reload_config = reload_config
        self._service = service or ServiceManager()
        self._metrics = metrics or Metrics()
        self._lease_holders = lease_holders
        self._claim_holders = claim_holders
        self._dra_withheld = dra_withheld  # resources whose slices are still to be deleted
        self._device_plugin_dir = device_plugin_dir  # where the kubelet's checkpoint is; None: no kubelet
        self._checkpoint_changes = 0  # CheckpointChanged events so far
        self._checkpoint: tuple[int, Allocations | None] | None = None  # (changes, what it said) at the last read
        # the optional hints, looked up once (see the module docstring)
        self._may_block: dict[str, Callable[[object, Event], bool]] = {
            name: hook for name, handler in handlers.items()
            if (hook := getattr(handler, "fold_may_block", None)) is not None
        }
        self._health_steps: list[tuple[str, Callable[[Event], str | None]]] = [
            (name, hook) for name, handler in handlers.items()
            if (hook := getattr(handler, "health_step", None)) is not None
        ]
        self._facts: dict[str, object] = {}
        self._built: dict[str, _Built] = {}
        self.first_tree_published = trio.Event()
        self.reloads = 0
        self.batches = 0  # batches of events handled so far
        self._batch_handled = trio.Event()

    @property
    def config(self) -> DaemonConfig:
        return self._config

    async def run(self, events: trio.MemoryReceiveChannel[Event]) -> None:
        carried: Event | None = None  # the event that ended the last batch early: it starts the next
        while True:
            if carried is None:
                try:
                    event = await events.receive()
                except trio.EndOfChannel:
                    return
            else:  # let the consumers run once before the next tree replaces the one just published
                await trio.lowlevel.checkpoint()
                event, carried = carried, None
            arrival = time.monotonic()  # the batch's reaction time counts from here
            batch = [event]
            lost_health = self._health_step(event) == HEALTH_LOST
            while True:
                try:
                    event = events.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                step = self._health_step(event)
                if step == HEALTH_RESTORED and lost_health:
                    carried = event
                    break
                lost_health |= step == HEALTH_LOST
                batch.append(event)
            changed, full_build = await self._route(batch)
            if changed:
                await self._publish(batch, arrival, in_thread=full_build)
            self.batches += 1
            self._batch_handled.set()
            self._batch_handled = trio.Event()

    def _health_step(self, event: Event) -> str | None:
        if not isinstance(event, UEvent):
            return None
        for name, hook in self._health_steps:
            try:
                step = hook(event)
            except Exception:
                self._metrics.handler_error(name, "health_step")
                log.exception("a handler failed to tell the health step of %s", describe(event),
                              extra={"EVENT": describe(event)})
                continue
            if step is not None:
                return step
        return None

    async def wait_for_batches(self, count: int) -> None:
        """Until ``count`` batches of events have been handled since the loop started."""
        while self.batches < count:
            await self._batch_handled.wait()

    async def _route(self, batch: list[Event]) -> tuple[bool, bool]:
        """Apply a batch of events; return whether a new tree may be due, and whether its build is
        likely a full one (after a rescan or a reload)."""
        changed = False
        rescans: dict[str, Resync] = {}
        for event in batch:
            if isinstance(event, Resync):
                for name in self._handlers if event.handler is None else [event.handler]:
                    rescans.setdefault(name, event)
        for name, resync in rescans.items():
            if name in self._handlers:
                changed |= await self._rescan(name, resync)
        reload_reasons: list[str] = []
        for event in batch:
            if isinstance(event, UEvent):
                outcomes = [await self._fold(name, event) for name, handler in self._handlers.items()
                            if not handler.subsystems or event.subsystem in handler.subsystems]
                changed |= self._count_kernel_event("uevent", outcomes)
            elif isinstance(event, DeviceChanged):
                if event.handler in self._handlers:
                    changed |= await self._fold(event.handler, event) == CHANGED
            elif isinstance(event, (LinkChanged, LinkSnapshot)):
                outcomes = [await self._fold(name, event) for name, handler in self._handlers.items()
                            if getattr(handler, "wants_links", False)]
                changed |= self._count_kernel_event("rtnetlink", outcomes)
            elif isinstance(event, ConfigChanged):
                reload_reasons.append(event.reason)
            elif isinstance(event, (LeasesChanged, ClaimsChanged)):
                changed = True
            elif isinstance(event, CheckpointChanged):
                self._checkpoint_changes += 1
                changed |= any(pool.vanished or pool.road == DRA_ROAD for pool in self._notifier.tree.pools.values())
        reloaded = bool(reload_reasons) and self._reload(reload_reasons)
        return changed or reloaded, bool(rescans) or reloaded

    def _count_kernel_event(self, source: str, outcomes: list[str]) -> bool:
        """Count one event by the outcomes of its folds; whether any handler's facts changed."""
        self._metrics.kernel_event(source, metrics_outcome(outcomes))
        return CHANGED in outcomes

    async def _rescan(self, name: str, event: Resync) -> bool:
        handler = self._handlers[name]
        facts = self._facts.get(name)
        self._metrics.resyncs.labels(name).inc()
        try:
            if facts is None:
                self._facts[name] = await trio.to_thread.run_sync(handler.scan)
            else:
                self._facts[name] = await trio.to_thread.run_sync(handler.fold, facts, event)
        except Exception:
            self._metrics.handler_error(name, "scan")
            log.exception("handler %s failed to scan (%s); keeping its last devices", name, event.reason,
                          extra={"EVENT": describe(event)})
            return False
        return True

    async def _fold(self, name: str, event: Event) -> str:
        """Fold ``event`` into the handler's facts: inline (microseconds), or in a worker thread
        when the handler says it may block. CHANGED, UNCHANGED or FAILED (logged)."""
        facts = self._facts.get(name)
        if facts is None:
            return UNCHANGED  # the first scan, still to come, will see what this event saw
        fold = self._handlers[name].fold
        try:
            if self._fold_may_block(name, facts, event):
                folded = await trio.to_thread.run_sync(fold, facts, event)
            else:
                folded = fold(facts, event)
        except Exception:
            self._metrics.handler_error(name, "fold")
            log.exception("handler %s failed on %s; keeping its last devices", name, describe(event),
                          extra={"EVENT": describe(event)})
            return FAILED
        self._facts[name] = folded
        return UNCHANGED if folded is facts else CHANGED

    def _fold_may_block(self, name: str, facts: object, event: Event) -> bool:
        may_block = self._may_block.get(name)
        if may_block is None:
            return False
        try:
            return may_block(facts, event)
        except Exception:  # be safe: a thread costs a little, a blocked loop costs the watchdog
            self._metrics.handler_error(name, "fold_may_block")
            log.exception("handler %s failed to tell whether %s may block; folding it in a thread", name,
                          describe(event), extra={"EVENT": describe(event)})
            return True

    def _reload(self, reasons: list[str]) -> bool:
        log.info("reloading the config (%s)", "; ".join(dict.fromkeys(reasons)), extra={"EVENT": "reload"})
        self._service.reloading()
        try:
            return self._apply_config()
        finally:
            self._service.reloaded()

    def _apply_config(self) -> bool:
        try:
            config = self._reload_config()
        except ConfigFileError as error:
            self._metrics.config_reloads.labels("refused").inc()
            log.error("config reload refused, still serving the previous config: %s", error,
                      extra={"CONFIG_PATH": error.json_path, "EVENT": "reload"})
            return False
        old_resources = {pool.resource: pool for pool in self._config.pools}
        new_resources = {pool.resource: pool for pool in config.pools}
        tell_lifecycle(self._handlers, [p for r, p in old_resources.items() if r not in new_resources], started=False)
        tell_lifecycle(self._handlers, [p for r, p in new_resources.items() if r not in old_resources], started=True)
        for warning in config.warnings:
            log.warning("config %s: %s", config.source, warning)
        log.info("config reloaded: %d pools (%d added, %d removed)", len(config.pools),
                 len(new_resources.keys() - old_resources.keys()), len(old_resources.keys() - new_resources.keys()),
                 extra={"EVENT": "reload"})
        self._config = config
        self.reloads += 1
        self._metrics.config_reloads.labels("ok").inc()
        return True

    def _build(self, name: str, handler: AnyHandler, configured: tuple[ConfiguredPool[Any], ...],
               batch: Sequence[Event]) -> Mapping[str, DeviceMap] | None:
        """The handler's devices per resource (its last build when nothing of it changed);
        ``None`` when the build failed (logged)."""
        facts = self._facts.get(name)
        last = self._built.get(name)
        if last is not None and last[0] is facts and last[1] == configured:
            return last[2]
        try:
            built = handler.build(facts, configured) if name in self._facts else {}
        except Exception:
            self._metrics.handler_error(name, "build")
            log.exception("handler %s failed to build its pools; keeping its last devices", name,
                          extra={"EVENT": describe_batch(batch)})
            return None
        self._built[name] = (facts, configured, built)
        return built

    def _build_all(self, batch: Sequence[Event]) -> dict[str, Mapping[str, DeviceMap] | None]:
        return {name: self._build(name, handler, self._config.pools_of(name), batch)
                for name, handler in self._handlers.items() if self._config.pools_of(name)}

    async def _publish(self, batch: Sequence[Event], arrival: float, *, in_thread: bool) -> None:
        started = time.perf_counter()
        if in_thread:  # a full build of thousands of devices takes tens of milliseconds
            builds = await trio.to_thread.run_sync(self._build_all, batch)
        else:
            builds = self._build_all(batch)
        previous = self._notifier.tree
        pools: list[ResourcePool] = []
        fresh: list[tuple[str, ConfiguredPool[Any], DeviceMap, frozenset[str]]] = []
        for name, built in builds.items():
            configured = self._config.pools_of(name)
            if built is None:
                pools.extend(previous.pools[p.resource] for p in configured if p.resource in previous.pools)
                continue
            for pool_config in configured:
                devices = built.get(pool_config.resource, {})
                gone = _gone(previous.pools.get(pool_config.resource), name, devices)
                fresh.append((name, pool_config, devices, gone))
        any_dra = any(pool_config.entry.allocation_api == DRA_API for _, pool_config, *_ in fresh)
        allocations = await self._allocations() if any_dra or any(gone for *_, gone in fresh) else {}
        holds = _Holds(self._lease_holders(), self._claim_holders(), allocations, self._dra_withheld())
        for name, pool_config, devices, gone in fresh:
            vanished: frozenset[str] = frozenset()
            if gone:
                devices, vanished = _keep_allocated(previous.pools[pool_config.resource], devices, gone,
                                                    holds.in_use())
            pools.append(self._pool(previous, name, pool_config, devices, holds, vanished))
        tree = DeviceTree.build(previous.version + 1, pools)
        self._metrics.tree_build_duration.observe(time.perf_counter() - started)
        self._metrics.event_arrival = arrival  # the streams stamp the lists they queue with it
        try:
            self._notifier.publish(tree)
        finally:
            self._metrics.event_arrival = None
        for resource in sorted(tree.diff(previous).listings_changed):
            pool = tree.pools.get(resource)
            if pool is not None:
                log.info("%s: %d devices (%d healthy)", resource, len(pool.devices), pool.healthy_count,
                         extra={"RESOURCE": resource})
        self.first_tree_published.set()

    async def _allocations(self) -> Allocations | None:
        """What the kubelet's checkpoint says is allocated (``None``: it cannot be read), read
        again only when it changed since the last read."""
        changes = self._checkpoint_changes
        if self._checkpoint is None or self._checkpoint[0] != changes:
            if self._device_plugin_dir is None:
                return {}
            read = await trio.to_thread.run_sync(read_allocations, self._device_plugin_dir)
            self._checkpoint = (changes, read)  # a change during the read: read again next time
        return self._checkpoint[1]

    @staticmethod
    def _pool(previous: DeviceTree, handler: str, pool_config: ConfiguredPool[Any], devices: DeviceMap,
              holds: _Holds, vanished: frozenset[str] = frozenset()) -> ResourcePool:
        resource = pool_config.resource
        leased = holds.of(holds.leases, resource, devices)
        claimed = holds.of(holds.claims, resource, devices)
        road = holds.road(pool_config)
        kubelet_held = holds.kubelet_held(resource, devices) if road == DRA_ROAD else frozenset()
        old = previous.pools.get(resource)
        if old is not None and old.pool_config is pool_config and old.leased == leased and (
            old.vanished == vanished and old.road == road and old.claimed == claimed
            and old.kubelet_held == kubelet_held
        ) and (old.devices is devices or old.devices == devices):
            return old  # unchanged: keep the same object (and its cached listing)
        if not isinstance(devices, MappingProxyType):
            devices = MappingProxyType(dict(devices))  # the tree never shares a mutable map
        return ResourcePool(resource, handler, pool_config, devices, leased, vanished, road, claimed, kubelet_held)


class _Holds:
    """Who holds what, read once per tree: host leases and DRA claims by (resource, device), the
    kubelet's checkpoint (``None``: unreadable), and the pools whose slices are being withdrawn."""

    __slots__ = ("leases", "claims", "allocations", "withheld", "_in_use")

    def __init__(self, leases: Mapping[tuple[str, str], object], claims: Mapping[tuple[str, str], object],
                 allocations: Allocations | None, withheld: frozenset[str]) -> None:
        self.leases = leases
        self.claims = claims
        self.allocations = allocations
        self.withheld = withheld
        self._in_use: Allocations | None = None

    def in_use(self) -> Allocations | None:
        """Who has a device, through either API: a device that vanishes while a pod has it stays
        listed Unhealthy (``None``: the checkpoint cannot be read). Worked out for the first
        device gone in a tree, not for every tree."""
        if self.allocations is None:
            return None
        if self._in_use is None:
            self._in_use = {**self.allocations, **{key: f"claim {claim}" for key, claim in self.claims.items()}}
        return self._in_use

    @staticmethod
    def of(holders: Mapping[tuple[str, str], object], resource: str, devices: DeviceMap) -> frozenset[str]:
        if not holders:
            return frozenset()
        return frozenset(d for (r, d) in holders if r == resource and d in devices)

    def road(self, pool_config: ConfiguredPool[Any]) -> str:
        if pool_config.entry.allocation_api == DRA_API:
            return DRA_ROAD
        return WITHHELD_ROAD if pool_config.resource in self.withheld else DEVICE_PLUGIN_ROAD

    def kubelet_held(self, resource: str, devices: DeviceMap) -> frozenset[str]:
        """The devices pods hold through the device-plugin API (all of them while the checkpoint
        cannot be read: a device is never offered twice)."""
        if self.allocations is None:
            return frozenset(devices)
        return self.of(self.allocations, resource, devices)


def _gone(old: ResourcePool | None, handler: str, devices: DeviceMap) -> frozenset[str]:
    """The devices of the previous tree's pool (kept vanished ones too) that its handler's build
    no longer has; none for a pool that is new or now served by another handler."""
    if old is None or old.handler != handler or old.devices is devices:
        return frozenset()
    return frozenset(old.devices.keys() - devices.keys())


def _keep_allocated(old: ResourcePool, devices: DeviceMap, gone: frozenset[str],
                    allocations: Allocations | None) -> tuple[DeviceMap, frozenset[str]]:
    """``devices`` with the gone devices the kubelet's checkpoint shows allocated in this pool
    (all of them when it cannot be read) put back, ``Unhealthy``; and their IDs."""
    resource = old.resource
    kept = gone if allocations is None else frozenset(d for d in gone if (resource, d) in allocations)
    for device_id in sorted(kept - old.vanished):
        holder = allocations.get((resource, device_id)) if allocations is not None else None
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

"""The event loop: take events off the bus, fold them into the handlers' facts, have the next
DeviceTree assembled, and publish it to the notifier, the one road to everything that reads it.

Everything waiting on the bus is handled as one batch, so a burst (256 VFs from one
``sriov_numvfs`` write) becomes one new tree, not 256:

* ``Resync`` rescans a handler (or all) in a worker thread, once per handler however many
  Resyncs the batch holds, before the batch's other events are folded;
* a ``UEvent`` is folded into the facts of each handler whose ``subsystems`` include it
  (an empty set means every subsystem); link events go to handlers that set ``wants_links``;
  a ``DeviceChanged`` goes to the handler that sent it, a ``Lent`` (the parts DRA claims hold on
  vfio-pci) to the handler it names. Only handlers the config gives pools
  scan and fold: the others' facts would serve nobody (a reload that gives one its first pool
  scans it then);
* ``ConfigChanged`` reloads the config once per batch, validated by the running handlers; on
  error the old config keeps being served;
* ``LeasesChanged`` and ``ClaimsChanged`` (who holds what changed: a host lease, a DRA claim, a
  lost book cleared, a pool's slices withdrawn) only ask for a new tree;
* ``CheckpointChanged`` (the kubelet's checkpoint rewritten) marks it to be read again, and asks
  for a new tree only while a pool keeps a vanished device or a pool is served through DRA.

Then every handler builds its pools from its facts (in a worker thread after a rescan or a
reload, when a build is a full one), and ``daemon.holdings.Assembly`` makes the tree from the
builds, the config and who holds what (the kubelet's checkpoint read, off the loop, only when a
device is gone or a pool is a DRA pool). A handler hook that raises is logged with the event and
keeps the handler's last good devices.

Two optional handler hints cut a batch short (see ``daemon.core.Handler``), so that every
Unhealthy state is published, and published first:

* ``health_step(event)``: a batch ends before an event that may make a device Healthy again
  (``HEALTH_RESTORED``: SUCCESSFUL_RECOVERY, a re-probe) when it already holds one that made a
  device Unhealthy (``HEALTH_LOST``: BEGIN_RECOVERY), so the tree with the Unhealthy device is
  published before the next batch folds the recovery: a PCIe recovery of 0.3 ms still reaches
  every consumer. The burst of a recovery (BEGIN on every function, then SUCCESSFUL on every
  one) waiting on the bus together is two trees, not one per uevent;
* ``fold_may_block(facts, event)``: that fold runs in a worker thread (a uevent of a PCI device
  under a fatal reset, whose sysfs reads wait seconds for the kernel's device locks), awaited so
  that events stay in order while trio, the kubelet's streams, Allocate and the watchdog keep
  running. A batch that already folded a health loss is published before such a fold starts:
  the loss reaches the kubelet at once, the blocked read finishes when the kernel lets it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from daemon.core import (
    HEALTH_LOST,
    HEALTH_RESTORED,
    ConfiguredPool,
    DeviceChanged,
    DeviceMap,
    Event,
    LinkChanged,
    LinkSnapshot,
    Resync,
    UEvent,
)
from daemon.core._config import ConfigFileError, DaemonConfig
from daemon.core._events import CheckpointChanged, ClaimsChanged, ConfigChanged, LeasesChanged, Lent
from daemon.core._handler import AnyHandler, tell_lifecycle
from daemon.core._notifier import Notifier
from daemon.core._tree import DRA_ROAD
from daemon.holdings import Assembly, Holdings
from daemon.metrics import CHANGED, FAILED, UNCHANGED, Metrics, metrics_outcome
from daemon.service import ServiceManager

log = logging.getLogger("devplugd.loop")

# (facts, pools, devices) a handler's last build came from and gave
_Built = tuple[object, tuple[ConfiguredPool[Any], ...], Mapping[str, DeviceMap]]


def describe(event: Event) -> str:
    if isinstance(event, UEvent):
        return f"uevent {event.action} {event.devpath}"
    if isinstance(event, DeviceChanged):
        return f"{event.handler}: {event.devpath} changed ({event.reason})"
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
        holdings: Holdings,
        service: ServiceManager | None = None,
        metrics: Metrics | None = None,
        *,
        capacity: int = 1024,
    ) -> None:
        self._handlers = handlers
        self._config = config
        self._notifier = notifier
        self._reload_config = reload_config
        self._holdings = holdings
        self._service = service or ServiceManager()
        self._metrics = metrics or Metrics()
        self._capacity = capacity  # events taken off the bus ahead of the batch at most
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
        # the newest Lent per handler: folded again into a first scan (a handler given its first
        # pool by a reload starts with no facts, and the claims still hold what they hold)
        self._lent: dict[str, Lent] = {}
        self.first_tree_published = trio.Event()

    @property
    def config(self) -> DaemonConfig:
        return self._config

    def facts_of(self, handler: str) -> object | None:
        """The handler's facts as last folded (``None``: it serves no pool, or has not scanned)."""
        return self._facts.get(handler)

    async def run(self, events: trio.MemoryReceiveChannel[Event]) -> None:
        waiting: deque[tuple[Event, float]] = deque()  # taken off the bus, not handled yet
        while True:
            if not waiting:
                try:
                    waiting.append((await events.receive(), time.monotonic()))
                except trio.EndOfChannel:
                    return
            else:  # let the consumers run once before the next tree replaces the one just published
                await trio.lowlevel.checkpoint()
            while len(waiting) < self._capacity:
                try:
                    waiting.append((events.receive_nowait(), time.monotonic()))
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            batch, arrival = self._next_batch(waiting)
            changed, full_build, unrouted = await self._route(batch)
            waiting.extendleft(reversed([(event, arrival) for event in unrouted]))
            if changed:
                await self._publish(batch, arrival, in_thread=full_build)
            self._metrics.event_batches.inc()

    def _next_batch(self, waiting: deque[tuple[Event, float]]) -> tuple[list[Event], float]:
        """The events up to (not including) one that may restore a health an earlier one took
        away, or a rescan after one (a scan reads what a fatal reset may hold locked for
        seconds); and when the first of them reached the loop."""
        batch: list[Event] = []
        arrival = waiting[0][1]
        lost_health = False
        while waiting:
            step = self._health_step(waiting[0][0])
            if lost_health and (step == HEALTH_RESTORED or isinstance(waiting[0][0], Resync)):
                break
            lost_health |= step == HEALTH_LOST
            event, arrived = waiting.popleft()
            batch.append(event)
            arrival = min(arrival, arrived)
        return batch, arrival

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

    async def _route(self, batch: list[Event]) -> tuple[bool, bool, list[Event]]:
        """Apply a batch of events; return whether a new tree may be due, whether its build is
        likely a full one (after a rescan or a reload), and the events left for the next batch
        (from a fold that may block, when a health loss was folded before it)."""
        changed = False
        rescans: dict[str, Resync] = {}
        active = self._active()
        for event in batch:
            if isinstance(event, Resync):
                for name in active if event.handler is None else [event.handler]:
                    rescans.setdefault(name, event)
        for name, resync in rescans.items():
            if name in active:
                changed |= await self._rescan(name, resync)
        reload_reasons: list[str] = []
        lost_health = False
        unrouted: list[Event] = []
        for index, event in enumerate(batch):
            if isinstance(event, (UEvent, DeviceChanged)):
                wanting = self._wanting(event, active)
                blocking = {name for name in wanting if self._fold_may_block(name, event)}
                if blocking and lost_health and changed:  # publish the loss first: this fold may wait on the kernel
                    unrouted = batch[index:]
                    del batch[index:]
                    break
                outcomes = [await self._fold(name, event, in_thread=name in blocking) for name in wanting]
                if isinstance(event, UEvent):
                    changed |= self._count_kernel_event("uevent", outcomes)
                    lost_health |= self._health_step(event) == HEALTH_LOST
                else:
                    changed |= CHANGED in outcomes
            elif isinstance(event, (LinkChanged, LinkSnapshot)):
                outcomes = [await self._fold(name, event, in_thread=False) for name, handler in self._handlers.items()
                            if name in active and getattr(handler, "wants_links", False)]
                changed |= self._count_kernel_event("rtnetlink", outcomes)
            elif isinstance(event, Lent):
                self._lent[event.handler] = event
                if event.handler in active:
                    changed |= await self._fold(event.handler, event, in_thread=False) == CHANGED
            elif isinstance(event, ConfigChanged):
                reload_reasons.append(event.reason)
            elif isinstance(event, (LeasesChanged, ClaimsChanged)):
                changed = True
            elif isinstance(event, CheckpointChanged):
                self._holdings.checkpoint.mark_changed()
                changed |= any(pool.vanished or pool.road == DRA_ROAD for pool in self._notifier.tree.pools.values())
        reloaded = bool(reload_reasons) and self._reload(reload_reasons)
        if reloaded:
            await self._follow_active(active)
        return changed or reloaded, bool(rescans) or reloaded, unrouted

    def _wanting(self, event: UEvent | DeviceChanged, active: set[str]) -> list[str]:
        """The handlers that fold ``event``: those whose subsystems include a uevent's (an empty
        set: every subsystem); the one that sent a DeviceChanged."""
        if isinstance(event, DeviceChanged):
            return [event.handler] if event.handler in active else []
        return [name for name, handler in self._handlers.items() if name in active
                and (not handler.subsystems or event.subsystem in handler.subsystems)]

    def _active(self) -> set[str]:
        """The handlers the config gives pools: only they scan and fold (the others' facts would
        serve nobody, and reading the host for them costs every event)."""
        return {pool.handler for pool in self._config.pools}

    async def _follow_active(self, before: set[str]) -> None:
        """After a reload: a handler that lost its last pool forgets its facts; one that got its
        first scans the host now (facts it stopped following are stale)."""
        active = self._active()
        for name in before - active:
            self._facts.pop(name, None)
            self._built.pop(name, None)
        for name in sorted(active - before):
            if name in self._handlers:
                self._facts.pop(name, None)
                await self._rescan(name, Resync(name, "its first pool was configured"))

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
                scanned = await trio.to_thread.run_sync(handler.scan)
                lent = self._lent.get(name)
                self._facts[name] = scanned if lent is None else handler.fold(scanned, lent)
            else:
                self._facts[name] = await trio.to_thread.run_sync(handler.fold, facts, event)
        except Exception:
            self._metrics.handler_error(name, "scan")
            log.exception("handler %s failed to scan (%s); keeping its last devices", name, event.reason,
                          extra={"EVENT": describe(event)})
            return False
        return True

    async def _fold(self, name: str, event: Event, *, in_thread: bool) -> str:
        """Fold ``event`` into the handler's facts: inline (microseconds), or in a worker thread
        when the handler says it may block. CHANGED, UNCHANGED or FAILED (logged)."""
        facts = self._facts.get(name)
        if facts is None:
            return UNCHANGED  # the first scan, still to come, will see what this event saw
        fold = self._handlers[name].fold
        try:
            folded = await trio.to_thread.run_sync(fold, facts, event) if in_thread else fold(facts, event)
        except Exception:
            self._metrics.handler_error(name, "fold")
            log.exception("handler %s failed on %s; keeping its last devices", name, describe(event),
                          extra={"EVENT": describe(event)})
            return FAILED
        self._facts[name] = folded
        return UNCHANGED if folded is facts else CHANGED

    def _fold_may_block(self, name: str, event: Event) -> bool:
        may_block = self._may_block.get(name)
        facts = self._facts.get(name)
        if may_block is None or facts is None:
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
        assembly = Assembly(previous, builds, self._config)
        reading = await self._holdings.checkpoint.current() if assembly.needs_checkpoint else None
        tree = assembly.tree(self._holdings.snapshot(reading), arrival)
        self._metrics.tree_build_duration.observe(time.perf_counter() - started)
        self._notifier.publish(tree)
        for resource, diff in sorted(tree.diff(previous).resources.items()):
            pool = diff.new
            if pool is None:
                continue
            # a DRA pool has no kubelet list: its counts say it (sorting thousands of IDs for a
            # list nobody reads cost a few milliseconds of every carrier flip)
            if pool.road == DRA_ROAD and diff.old is not None and diff.old.road == DRA_ROAD:
                if (len(pool.devices), pool.healthy_count) == (len(diff.old.devices), diff.old.healthy_count):
                    continue
            elif not diff.listing_changed:
                continue
            log.info("%s: %d devices (%d healthy)", resource, len(pool.devices), pool.healthy_count,
                     extra={"RESOURCE": resource})
        self.first_tree_published.set()

"""The kernel loop: take events off the bus, route them, build the next DeviceTree, publish it.

Everything waiting on the bus is handled as one batch, so a burst (256 VFs from one
``sriov_numvfs`` write) becomes one new tree, not 256:

* ``Resync`` rescans one handler (or all) in a worker thread;
* a ``UEvent`` is folded into the facts of each handler whose ``subsystems`` include it
  (an empty set means every subsystem); link events go to handlers that set ``wants_links``;
* ``ConfigChanged`` reloads the config once per batch: validated first, and on error the old
  config keeps being served;
* ``LeasesChanged`` (a host lease granted or released) only asks for a new tree: leased devices
  leave the kubelet's lists;
* kubelet events go to the plugin servers.

Then every handler builds its pools from its facts, the core assembles an immutable DeviceTree,
and the notifier wakes only the streams of resources that changed. A handler that raises is
logged with the event and keeps the devices it had in the last good tree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import trio

from daemon.core import (
    ConfigChanged,
    Event,
    Handler,
    KubeletSocketCreated,
    LeasesChanged,
    LinkChanged,
    LinkSnapshot,
    PluginSocketRemoved,
    ResourcePool,
    Resync,
    UEvent,
)
from daemon.core._config import ConfigFileError, DaemonConfig
from daemon.core._handler import tell_lifecycle
from daemon.core._notifier import Notifier
from daemon.core._plugins import PluginManager
from daemon.core._systemd import ServiceManager
from daemon.core._tree import DeviceTree

log = logging.getLogger("devplugd.kernel")


def describe(event: Event) -> str:
    if isinstance(event, UEvent):
        return f"uevent {event.action} {event.devpath}"
    return type(event).__name__


class Kernel:
    def __init__(
        self,
        handlers: Mapping[str, Handler],
        config: DaemonConfig,
        notifier: Notifier,
        plugins: PluginManager,
        load_config: Callable[[], DaemonConfig],
        service: ServiceManager | None = None,
        lease_holders: Callable[[], Mapping[tuple[str, str], object]] = dict,
    ) -> None:
        self._lease_holders = lease_holders
        self._service = service or ServiceManager()
        self.on_published: Callable[[DeviceTree], None] = lambda tree: None
        self._handlers = handlers
        self._config = config
        self._notifier = notifier
        self._plugins = plugins
        self._load_config = load_config
        self._facts: dict[str, Any] = {}
        self._built: dict[str, tuple[Any, tuple[Any, ...], Mapping[str, Any]]] = {}  # name -> (facts, pools, built)
        self.first_tree_published = trio.Event()
        self.reloads = 0

    @property
    def config(self) -> DaemonConfig:
        return self._config

    async def run(self, events: trio.MemoryReceiveChannel[Event]) -> None:
        async for event in events:
            batch = [event]
            while True:
                try:
                    batch.append(events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if await self._route(batch):
                self._publish()

    async def _route(self, batch: list[Event]) -> bool:
        """Apply a batch of events; return whether a new tree may be due."""
        changed = False
        reload_reasons: list[str] = []
        for event in batch:
            if isinstance(event, Resync):
                names = list(self._handlers) if event.handler is None else [event.handler]
                for name in names:
                    changed |= await self._rescan(name, event)
            elif isinstance(event, UEvent):
                for name, handler in self._handlers.items():
                    if not handler.subsystems or event.subsystem in handler.subsystems:
                        changed |= self._fold(name, event)
            elif isinstance(event, (LinkChanged, LinkSnapshot)):
                for name, handler in self._handlers.items():
                    if getattr(handler, "wants_links", False):
                        changed |= self._fold(name, event)
            elif isinstance(event, ConfigChanged):
                reload_reasons.append(event.reason)
            elif isinstance(event, LeasesChanged):
                changed = True
            elif isinstance(event, KubeletSocketCreated):
                self._plugins.kubelet_started()
            elif isinstance(event, PluginSocketRemoved):
                self._plugins.socket_removed(event.path)
        if reload_reasons:
            changed |= self._reload(reload_reasons)
        return changed

    async def _rescan(self, name: str, event: Resync) -> bool:
        handler = self._handlers[name]
        facts = self._facts.get(name)
        try:
            if facts is None:
                self._facts[name] = await trio.to_thread.run_sync(handler.scan)
            else:
                self._facts[name] = await trio.to_thread.run_sync(handler.fold, facts, event)
        except Exception:
            log.exception("handler %s failed to scan (%s); keeping its last devices", name, event.reason,
                          extra={"EVENT": f"resync:{event.reason}"})
            return False
        return True

    def _fold(self, name: str, event: Event) -> bool:
        facts = self._facts.get(name)
        if facts is None:
            return False  # the first scan, still to come, will see what this event saw
        try:
            folded = self._handlers[name].fold(facts, event)
        except Exception:
            log.exception("handler %s failed on %s; keeping its last devices", name, describe(event),
                          extra={"EVENT": describe(event)})
            return False
        self._facts[name] = folded
        return folded is not facts

    def _reload(self, reasons: list[str]) -> bool:
        log.info("reloading the config (%s)", "; ".join(dict.fromkeys(reasons)), extra={"EVENT": "reload"})
        self._service.reloading()
        try:
            return self._apply_config()
        finally:
            self._service.reloaded()

    def _apply_config(self) -> bool:
        try:
            config = self._load_config()
        except ConfigFileError as error:
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
        return True

    def _publish(self) -> None:
        previous = self._notifier.tree
        holders = self._lease_holders()
        pools: list[ResourcePool] = []
        for name, handler in self._handlers.items():
            configured = self._config.pools_of(name)
            if not configured:
                continue
            try:
                facts = self._facts.get(name)
                last = self._built.get(name)
                if last is not None and last[0] is facts and last[1] == configured:
                    built = last[2]  # nothing of this handler changed: skip its build
                else:
                    built = handler.build(facts, configured) if name in self._facts else {}
                    self._built[name] = (facts, configured, built)
            except Exception:
                log.exception("handler %s failed to build its pools; keeping its last devices", name)
                pools.extend(previous.pools[p.resource] for p in configured if p.resource in previous.pools)
                continue
            for pool_config in configured:
                resource = pool_config.resource
                devices = built.get(resource, {})
                leased = frozenset(d for (r, d) in holders if r == resource and d in devices) if holders else frozenset()
                old = previous.pools.get(resource)
                if old is not None and old.pool_config is pool_config and old.leased == leased and (
                    old.devices is devices or old.devices == devices
                ):
                    pools.append(old)  # unchanged: keep the same object (and its cached listing)
                else:
                    if not isinstance(devices, MappingProxyType):
                        devices = MappingProxyType(dict(devices))  # the tree never shares a mutable map
                    pools.append(ResourcePool(resource, name, pool_config, devices, leased))
        tree = DeviceTree.build(previous.version + 1, pools)
        changed = self._notifier.publish(tree)
        for resource in sorted(changed):
            pool = tree.pools.get(resource)
            if pool is not None:
                log.info("%s: %d devices (%d healthy)", resource, len(pool.devices), pool.healthy_count,
                         extra={"RESOURCE": resource})
        self._plugins.sync(tree)
        self.on_published(tree)
        self.first_tree_published.set()

"""The kernel loop: take events off the bus, route them, build the next DeviceTree, publish it.

Each batch of events waiting on the bus is handled together (a burst becomes one new tree):

* ``Resync`` rescans one handler (or all) in a worker thread;
* other device events are folded into the facts of the handlers that declared interest;
* kubelet events go to the plugin servers.

Then every handler builds its pools from its facts, the core assembles an immutable DeviceTree,
and the notifier wakes only the streams of resources that changed. A handler that raises is
logged with the event and keeps the devices it had in the last good tree.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import trio

from daemon.core import Event, Handler, KubeletSocketCreated, PluginSocketRemoved, ResourcePool, Resync
from daemon.core._config import DaemonConfig
from daemon.core._notifier import Notifier
from daemon.core._plugins import PluginManager
from daemon.core._tree import DeviceTree

log = logging.getLogger("devplugd.kernel")


class Kernel:
    def __init__(
        self,
        handlers: Mapping[str, Handler],
        config: DaemonConfig,
        notifier: Notifier,
        plugins: PluginManager,
    ) -> None:
        self._handlers = handlers
        self._config = config
        self._notifier = notifier
        self._plugins = plugins
        self._facts: dict[str, Any] = {}
        self.first_tree_published = trio.Event()

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
        """Apply a batch of events; return whether any handler's facts may have changed."""
        changed = False
        for event in batch:
            if isinstance(event, Resync):
                names = list(self._handlers) if event.handler is None else [event.handler]
                for name in names:
                    changed |= await self._rescan(name, event)
            elif isinstance(event, KubeletSocketCreated):
                self._plugins.kubelet_started()
            elif isinstance(event, PluginSocketRemoved):
                self._plugins.socket_removed(event.path)
        return changed

    async def _rescan(self, name: str, event: Resync) -> bool:
        handler = self._handlers[name]
        try:
            self._facts[name] = await trio.to_thread.run_sync(handler.scan)
        except Exception:
            log.exception("handler %s failed to scan (%s); keeping its last devices", name, event.reason,
                          extra={"EVENT": f"resync:{event.reason}"})
            return False
        return True

    def _publish(self) -> None:
        previous = self._notifier.tree
        pools: list[ResourcePool] = []
        for name, handler in self._handlers.items():
            configured = self._config.pools_of(name)
            if not configured:
                continue
            try:
                built = handler.build(self._facts[name], configured) if name in self._facts else {}
            except Exception:
                log.exception("handler %s failed to build its pools; keeping its last devices", name)
                pools.extend(previous.pools[p.resource] for p in configured if p.resource in previous.pools)
                continue
            for pool_config in configured:
                devices = built.get(pool_config.resource, {})
                old = previous.pools.get(pool_config.resource)
                if old is not None and old.pool_config is pool_config and old.devices == devices:
                    pools.append(old)  # unchanged: keep the same object (and its cached listing)
                else:
                    pools.append(ResourcePool(pool_config.resource, name, pool_config, MappingProxyType(dict(devices))))
        tree = DeviceTree.build(previous.version + 1, pools)
        changed = self._notifier.publish(tree)
        for resource in sorted(changed):
            pool = tree.pools.get(resource)
            if pool is not None:
                log.info("%s: %d devices (%d healthy)", resource, len(pool.devices), pool.healthy_count,
                         extra={"RESOURCE": resource})
        self._plugins.sync(tree)
        self.first_tree_published.set()

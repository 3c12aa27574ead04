"""The kubelet's side of the tree: one ResourceEndpoint task per resource that has devices.

``Endpoints`` is a subscriber of the notifier. Each tree it is offered starts, restarts or
withdraws endpoints and returns: a resource gets its server the first time its pool has a
device, so the kubelet never sees an empty first list from us, and keeps it until the pool
leaves the config or is moved to DRA; it is served again, and registers again, when its options
change, as a reloaded ``allocationPolicy`` does, since the kubelet reads them only at
registration. The ListAndWatch streams are subscribers of the notifier themselves (see
``_servicer.py``). Kubelet events (``kubelet.sock`` created, our sockets removed) come on their
own channel from the inotify source and go to every endpoint, which decides for itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import trio

from daemon.core import Event
from daemon.core._events import KubeletSocketCreated, PluginSocketRemoved
from daemon.core._handler import AnyHandler
from daemon.core._notifier import Notifier
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DeviceTree, TreeDiff
from daemon.holdings import HolderLookup
from daemon.metrics import Metrics
from daemon.settings import Settings
from daemon.sockets import remove_stale_sockets
from daemon.supervise import Backoff, keep_running

from ._endpoint import ResourceEndpoint

log = logging.getLogger("devplugd.deviceplugin")


class Endpoints:
    def __init__(
        self,
        settings: Settings,
        notifier: Notifier,
        handlers: Mapping[str, AnyHandler],
        nursery: trio.Nursery,
        metrics: Metrics | None = None,
        holders: HolderLookup | None = None,
    ) -> None:
        self._settings = settings
        self._holders = holders
        self._metrics = metrics or Metrics()
        self._notifier = notifier
        self._handlers = handlers
        self._nursery = nursery
        self.mode = settings.effective_registration()
        self._endpoints: dict[str, tuple[ResourceEndpoint, trio.CancelScope]] = {}
        self._tree = DeviceTree.empty()
        self._changed = trio.Event()
        self.on_change: Callable[[], None] = lambda: None

    def remove_stale_sockets(self) -> None:
        directory = (
            self._settings.plugins_registry_dir if self.mode == "watcher" else self._settings.device_plugin_dir
        )
        for name in remove_stale_sockets(directory):
            log.info("removed stale socket %s", directory / name)

    @property
    def served_count(self) -> int:
        return sum(1 for endpoint, _ in self._endpoints.values() if endpoint.socket_path is not None)

    @property
    def registered_count(self) -> int:
        return sum(1 for endpoint, _ in self._endpoints.values() if endpoint.registered)

    def settled(self, *, registered: bool) -> bool:
        """Every endpoint serving (and, with ``registered``, registered with the kubelet)."""
        return all(
            endpoint.socket_path is not None and (endpoint.registered or not registered)
            for endpoint, _ in self._endpoints.values()
        )

    async def wait_changed(self) -> None:
        """Until an endpoint starts or stops serving, or registers."""
        await self._changed.wait()

    def _endpoint_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self.on_change()

    def offer(self, tree: DeviceTree) -> None:
        previous, self._tree = self._tree, tree
        self._sync(tree, tree.diff(previous))

    def _sync(self, tree: DeviceTree, diff: TreeDiff) -> None:
        for resource, pool in tree.pools.items():
            if pool.road != DEVICE_PLUGIN_ROAD:
                continue  # served through DRA (or withheld while its slices go): withdrawn below
            current = self._endpoints.get(resource)
            if current is not None and current[0].handler_name != pool.handler:
                log.info("%s moved to handler %s: serving it again", resource, pool.handler,
                         extra={"RESOURCE": resource})
                current[1].cancel()  # its streams (subscribers too) see the pool gone: an empty list
                del self._endpoints[resource]
            if resource in self._endpoints:
                if resource in diff.resources:  # a pool that did not change has the options it had
                    self._endpoints[resource][0].check_options()
                continue
            if not pool.devices:
                continue
            endpoint = ResourceEndpoint(
                resource, pool.handler, self._handlers[pool.handler], self._notifier, self._settings, self.mode,
                self._endpoint_changed, self._metrics, self._holders,
            )
            scope = trio.CancelScope()
            self._endpoints[resource] = (endpoint, scope)
            self._nursery.start_soon(self._run_endpoint, endpoint, scope, name=f"endpoint {resource}")
        for resource in [r for r in self._endpoints if r not in tree.pools or tree.pools[r].road != DEVICE_PLUGIN_ROAD]:
            endpoint, scope = self._endpoints.pop(resource)
            moved = tree.pools.get(resource)
            log.info("withdrawing %s%s", resource, f" (now served through {moved.road})" if moved is not None else "",
                     extra={"RESOURCE": resource})
            scope.cancel()  # its streams (subscribers too) see the pool gone: an empty list
            self._endpoint_changed()

    async def _run_endpoint(self, endpoint: ResourceEndpoint, scope: trio.CancelScope) -> None:
        """The endpoint's life; one that fails (a bug: listen and Register failures are retried
        inside it) is logged and served again after a backoff, never ending the daemon."""
        with scope:
            await keep_running(f"the endpoint of {endpoint.resource}", endpoint.run,
                               Backoff(first=0.5, maximum=10.0), {"RESOURCE": endpoint.resource})

    def kubelet_event(self, event: Event) -> None:
        """Pass a kubelet restart or a socket removal to every endpoint."""
        if isinstance(event, KubeletSocketCreated):
            self._metrics.kubelet_restarts.inc()
        for endpoint, _ in tuple(self._endpoints.values()):
            if isinstance(event, KubeletSocketCreated):
                endpoint.kubelet_started()
            elif isinstance(event, PluginSocketRemoved):
                endpoint.socket_removed(event.path)

"""devplugd's DRA driver, put together: what the rest of the daemon sees of DRA.

``DraDriver`` is a subscriber of the notifier. It starts the first time a tree has a pool on the
DRA road (or withheld from the kubelet while its slices go), or at once when prepared claims are
on disk from an earlier run (the kubelet must be able to unprepare them): only then is the
Kubernetes client imported and the API server dialled, so a host with no DRA pool pays nothing.
Started, it runs until the daemon stops:

* the ``SlicePublisher`` (``_publisher.py``): the DRA pools as ResourceSlices, from each tree;
* the kubelet plugin (``_sockets.py``): ``dra.sock`` with DRAPlugin v1 and v1beta1 (prepare and
  unprepare through ``ClaimPreparer``, ``_prepare.py``) and DRAResourceHealth (``_health.py``),
  and the registration socket in ``plugins_registry``.

The event loop asks it two things for every tree: which devices prepared claims hold
(``holders``) and which pools still have slices (``withheld``); a change to either is sent on
the bus as ``ClaimsChanged``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from daemon.core import DRA_ROAD, WITHHELD_ROAD, AnyHandler, ClaimsChanged, DeviceTree, Event, Hooks, Notifier
from daemon.settings import Settings
from daemon.supervise import Backoff, keep_running

from ._claims import ClaimBook
from ._health import HealthServicer
from ._kube import ApiLink, KubeError, NotFound
from ._prepare import ClaimNotFound, ClaimPreparer
from ._publisher import SlicePublisher
from ._servicer import DraPluginServicer
from ._sockets import DraSockets

log = logging.getLogger("devplugd.dra")


class DraDriver:
    def __init__(
        self,
        settings: Settings,
        handlers: Mapping[str, AnyHandler],
        notifier: Notifier,
        send_event: Callable[[Event], None],
        nursery: trio.Nursery,
        follow_socket_dir: Callable[[Path], None] = lambda directory: None,
        lease_holders: Callable[[], Mapping[tuple[str, str], object]] = dict,
    ) -> None:
        self._settings = settings
        self._nursery = nursery
        self._follow_socket_dir = follow_socket_dir
        hooks = {name: Hooks.of(handler) for name, handler in handlers.items()}

        def changed(reason: str) -> None:
            send_event(ClaimsChanged(reason))

        self.claims = ClaimBook(settings.state_dir)
        self.claims.load()
        self.link = ApiLink(settings)
        self.publisher = SlicePublisher(settings, hooks, self.link, on_change=changed)
        self.preparer = ClaimPreparer(settings.dra_driver, settings.node_name, settings.cdi_dir, self.claims,
                                      lambda: notifier.tree, hooks, self._get_claim, changed,
                                      lease_holders=lease_holders)
        self.health = HealthServicer(notifier, settings.node_name)
        self.sockets = DraSockets(settings, DraPluginServicer(self.preparer), self.health)
        self.started = False

    # -- what the event loop and the host API ask ------------------------------------------------
    def holders(self) -> Mapping[tuple[str, str], str]:
        """(resource, device ID) -> ``<namespace>/<name>`` of the claim it is prepared for."""
        return {key: holder.removeprefix("claim ") for key, holder in self.claims.holders().items()}

    def withheld(self) -> frozenset[str]:
        return self.publisher.withheld()

    def socket_removed(self, path: str) -> None:
        if self.started:
            self.sockets.socket_removed(path)

    def warm_up(self) -> None:
        """Import the Kubernetes client and read the credentials now, in a worker thread, while
        the first scan runs (a pool uses DRA from the start): half a second less to the first
        slice. A failure here is the publisher's to report when it starts."""
        async def connect() -> None:
            with contextlib.suppress(KubeError):
                await self.link.get()
        self._nursery.start_soon(connect, name="DRA: the API server client")

    # -- the subscriber --------------------------------------------------------------------------
    def offer(self, tree: DeviceTree) -> None:
        if not self.started and (self.claims.claims or any(
                pool.road in (DRA_ROAD, WITHHELD_ROAD) for pool in tree.pools.values())):
            self.started = True
            self._nursery.start_soon(self._run, name="the DRA driver")
        if self.started:
            self.publisher.offer(tree)

    async def _get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        kube = await self.link.get()
        try:
            return await trio.to_thread.run_sync(kube.get_claim, namespace, name, abandon_on_cancel=True)
        except NotFound as error:
            raise ClaimNotFound(f"claim {namespace}/{name} is not on the API server") from error

    async def _run(self) -> None:
        settings = self._settings
        log.info("DRA driver %s for node %s: plugin socket %s, registration %s", settings.dra_driver,
                 settings.node_name, settings.dra_socket, settings.dra_registration_socket, extra={"EVENT": "dra"})
        for directory in (settings.dra_socket.parent, settings.plugins_registry_dir):
            self._follow_socket_dir(directory)
        await self.preparer.restore()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.sockets.run)
                nursery.start_soon(keep_running, "the ResourceSlice publisher", self.publisher.run,
                                   Backoff(first=0.5, maximum=10.0))
        finally:
            self.health.close_streams()
            self.link.close()

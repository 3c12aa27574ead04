"""devplugd's DRA driver, put together: what the rest of the daemon sees of DRA.

``DraDriver`` is a subscriber of the notifier. It starts the first time a tree has a pool on the
DRA road (or withheld from the kubelet while its slices go), or at once when prepared claims are
on disk from an earlier run (the kubelet must be able to unprepare them): only then is the
Kubernetes client imported and the API server dialled, so a host with no DRA pool pays nothing.
Started, it runs until the daemon stops:

* ``DraPools`` (``_pools.py``): each tree's DRA pools as the slices they should publish, and
  which device-plugin pools are withheld while their slices go (told to ``Holdings``);
* the ``SlicePublisher`` (``_publisher.py``): the reconciler that makes the API server hold
  those slices, against its view of our slices there (``_view.py``);
* the kubelet plugin (``_sockets.py``): ``dra.sock`` with DRAPlugin v1 and v1beta1 (prepare and
  unprepare through ``ClaimPreparer``, ``_prepare.py``) and DRAResourceHealth (``_health.py``),
  and the registration socket in ``plugins_registry``; each prepared claim's device metadata
  files (KEP-5304, ``_metadata.py``) in the plugin data directory beside ``dra.sock``;
* the ``ClaimStatusWriter`` (``_status.py``): each prepared claim's ``status.devices``, written
  in the background;
* the ``OrphanSweeper`` (``_orphans.py``): at start and every 45 s, each prepared claim read from
  the API server; one gone or replaced is unprepared (the kubelet never will).

Who holds what (the claim book, the withheld pools) is told to ``daemon.holdings``; a change is
posted to the bus as ``ClaimsChanged``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from daemon.core import Event, Lent
from daemon.core._events import ClaimsChanged
from daemon.core._handler import AnyHandler, Hooks
from daemon.core._notifier import Notifier
from daemon.core._tree import DRA_ROAD, WITHHELD_ROAD, DeviceTree
from daemon.holdings import Holdings
from daemon.metrics import Metrics
from daemon.settings import Settings
from daemon.supervise import Backoff, keep_running

from ._claims import ClaimNotFound
from ._devices import pool_shares
from ._kube import ApiLink, KubeError, NotFound
from ._orphans import SWEEP_PERIOD, OrphanSweeper
from ._pools import DraPools
from ._prepared import ClaimBook, lent_parts
from ._publisher import SlicePublisher

if TYPE_CHECKING:
    from ._health import HealthServicer
    from ._prepare import ClaimPreparer
    from ._sockets import DraSockets
    from ._status import ClaimStatusWriter

log = logging.getLogger("devplugd.dra")

# seconds from a claim's reservation, write or removal to the ClaimsChanged that has a new tree
# built: after the kubelet's answer is out (1-2 ms), not while it is made and sent
CLAIMS_CHANGED_DELAY = 0.005


class DraDriver:
    def __init__(
        self,
        settings: Settings,
        handlers: Mapping[str, AnyHandler],
        notifier: Notifier,
        claims: ClaimBook,
        holdings: Holdings,
        post: Callable[[Event], None],
        nursery: trio.Nursery,
        follow_socket_dir: Callable[[Path], None] = lambda directory: None,
        metrics: Metrics | None = None,
    ) -> None:
        self._settings = settings
        self._notifier = notifier
        self._nursery = nursery
        self._follow_socket_dir = follow_socket_dir
        self._holdings = holdings
        self._post = post
        self._metrics = metrics or Metrics()
        self._hooks = {name: Hooks.of(handler) for name, handler in handlers.items()}
        self.claims = claims
        self.link = ApiLink(settings)
        self.publisher = SlicePublisher(settings, self.link, self._metrics, on_server=self._on_server)
        self.pools = DraPools(settings.dra_driver, settings.node_name, self._hooks, self.publisher, self._withheld)
        self.started = False
        # the kubelet plugin, made when the driver starts (see _plugin)
        self.preparer: ClaimPreparer | None = None
        self.status: ClaimStatusWriter | None = None
        self.health: HealthServicer | None = None
        self.sockets: DraSockets | None = None

    def _changed(self, reason: str) -> None:
        self._post(ClaimsChanged(reason))

    def _claim_changed(self, reason: str) -> None:
        """The preparer's word (a claim prepared or unprepared): a change of the claim book, told
        as its own are (deferred while the driver runs, ``CLAIMS_CHANGED_DELAY``)."""
        self.claims.book.notify()

    def _on_server(self, pools: frozenset[str]) -> None:
        self.pools.on_server(pools)

    def _withheld(self, resources: frozenset[str], reason: str) -> None:
        """The pools with slices on the server (the device-plugin ones among them are withheld);
        a new tree is due when the withheld ones changed."""
        if self._holdings.set_withheld(resources) and reason:
            self._changed(reason)

    def socket_removed(self, path: str) -> None:
        if self.sockets is not None:
            self.sockets.socket_removed(path)

    def _plugin(self) -> tuple[ClaimPreparer, ClaimStatusWriter, HealthServicer, DraSockets]:
        """The kubelet plugin: its modules (gRPC services and the generated DRA messages) are
        imported here, when a DRA pool or a prepared claim first needs them."""
        from ._health import HealthServicer
        from ._metadata import DeviceMetadataFiles
        from ._prepare import ClaimPreparer
        from ._servicer import DraPluginServicer
        from ._sockets import DraSockets
        from ._status import ClaimStatusWriter

        settings = self._settings
        status = ClaimStatusWriter(settings.dra_driver, self.link.get, lambda: self._notifier.tree, self._hooks,
                                   settings.sysfs_root, self._metrics)
        # KEP-5304's files in the plugin data directory (dra.sock's), each request's networkData
        # with the hardware address its claim status has
        metadata = DeviceMetadataFiles(settings.dra_driver, settings.dra_plugin_dir / settings.dra_driver,
                                       settings.cdi_dir, self._hooks, hardware_addresses=status.read_addresses)
        preparer = ClaimPreparer(settings.dra_driver, settings.node_name, settings.cdi_dir, self.claims,
                                 lambda: self._notifier.tree, self._hooks, self._get_claim, self._claim_changed,
                                 holders=self._holdings.holder, metrics=self._metrics, status=status,
                                 metadata=metadata, post=self._post)
        health = HealthServicer(self._notifier, settings.node_name, metrics=self._metrics,
                                shares_of=lambda pool: pool_shares(self._hooks, pool))
        return preparer, status, health, DraSockets(settings, DraPluginServicer(preparer), health)

    def lent_at_start(self) -> list[Lent]:
        """What the claim checkpoint holds on vfio-pci, one ``Lent`` per handler, for the first
        scan to fold in: until the claims are restored, a function lent to a claim would look
        like any function on vfio-pci (out of its vfioOnDemand pool, into a pool that selects
        vfio-pci), and the first tree would offer it to the kubelet."""
        return [Lent(handler, tuple(sorted(parts.items())), "the claim checkpoint at start")
                for handler, parts in sorted(lent_parts(self.claims.claims).items())]

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
        if not self.started and (self.claims.claims or self.claims.lost or any(
                pool.road in (DRA_ROAD, WITHHELD_ROAD) for pool in tree.pools.values())):
            self.started = True
            self.preparer, self.status, self.health, self.sockets = self._plugin()
            self._nursery.start_soon(self._run, self.preparer, self.status, self.health, self.sockets,
                                     name="the DRA driver")
        if self.started:
            self.pools.offer(tree)

    async def _get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        kube = await self.link.get()
        try:
            return await trio.to_thread.run_sync(kube.get_claim, namespace, name, abandon_on_cancel=True)
        except NotFound as error:
            raise ClaimNotFound(f"claim {namespace}/{name} is not on the API server") from error

    async def _run(self, preparer: ClaimPreparer, status: ClaimStatusWriter, health: HealthServicer,
                   sockets: DraSockets) -> None:
        settings = self._settings
        log.info("DRA driver %s for node %s: plugin socket %s, registration %s", settings.dra_driver,
                 settings.node_name, settings.dra_socket, settings.dra_registration_socket, extra={"EVENT": "dra"})
        for directory in (settings.dra_socket.parent, settings.plugins_registry_dir):
            self._follow_socket_dir(directory)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.claims.book.defer_changes, CLAIMS_CHANGED_DELAY)
                await nursery.start(status.run)
                await preparer.restore()
                await nursery.start(sockets.run)
                nursery.start_soon(keep_running, "the ResourceSlice publisher", self.publisher.run,
                                   Backoff(first=0.5, maximum=10.0))
                sweeper = OrphanSweeper(self.claims, self._get_claim, preparer.release_orphans)
                nursery.start_soon(keep_running, "the look for claims the kubelet will never unprepare",
                                   sweeper.run, Backoff(first=1.0, maximum=SWEEP_PERIOD))
        finally:
            health.close_streams()
            self.link.close()

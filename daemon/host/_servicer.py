"""The host API (``devplugd.host.v1.Host``) on the control socket: the devices for workloads
that are not pods.

``List`` shows every pool and who holds each device (free, a host lease, a DRA claim, a pod
according to the kubelet's checkpoint, or a book that could not be read), from
``daemon.holdings``. ``Watch`` sends a snapshot, then one delta per device added, removed or
changed, each stamped with the tree version; its stream is a ``TreeStream``, so a slow client is
conflated, never wrong, and never misses a device becoming Unhealthy. ``Allocate`` grants a lease
(``_grant.py``) with the same answer a kubelet Allocate gets, written to disk before it is
returned. ``ClearLost`` is the operator's word that a lost book's devices are free. The three
that write go through the daemon's ``WriteGate``: once it has handed the state over to a new pod,
they are refused (UNAVAILABLE) rather than written over the new pod's books. ``Explain``
says why a device is or is not in each pool (``_explain.py``). All of it
runs on the event loop's one thread; the checkpoint is read in a worker thread, and only after
it changed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import trio
from trio_asyncio import aio_as_trio, trio_as_aio

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon._generated.devplugd.host.v1 import host_pb2_grpc as host_grpc
from daemon.core._explain import Explaining
from daemon.core._notifier import Notifier, devices_scope
from daemon.core._tree import DeviceTree
from daemon.holdings import DurableBook, Holdings, WriteGate, WritesClosed
from daemon.metrics import HOST_WATCH, Metrics
from daemon.sockets import refuse, remove_socket_file, start_unix_server

from ._explain import explain_response
from ._grant import Granter
from ._leases import Lease, LeaseBook
from ._messages import device_message

log = logging.getLogger("devplugd.host")


WATCH_SCOPE = devices_scope(lambda old, new: bool(new.diff(old).resources))  # a Watch follows every device


class HostServicer(host_grpc.HostServicer):
    def __init__(self, notifier: Notifier, granter: Granter, leases: LeaseBook, holdings: Holdings,
                 books: Mapping[str, DurableBook[Any]], metrics: Metrics | None = None,
                 explaining: Explaining | None = None, gate: WriteGate | None = None) -> None:
        self._gate = gate or WriteGate()
        self._metrics = metrics or Metrics()
        self._explaining = explaining
        self._notifier = notifier
        self._granter = granter
        self._leases = leases
        self._holdings = holdings
        self._books = books  # "leases", "claims": what ClearLost may clear

    # -- reading ---------------------------------------------------------------------------------
    async def _read_checkpoint(self) -> None:
        """The kubelet's checkpoint as it is now, read in a worker thread if it changed."""
        if self._holdings.checkpoint.stale:
            await trio_as_aio(self._holdings.checkpoint.current)()

    def _snapshot(self, tree: DeviceTree) -> host.ListResponse:
        holder = self._holdings.holder
        return host.ListResponse(version=tree.version, lost_books=[str(b) for b in self._holdings.lost_books()], pools=[
            host.Pool(resource=resource, allocation_api=pool.road,
                      devices=[device_message(pool, i, holder(pool, i)) for i in sorted(pool.devices)],
                      no_devices="" if pool.devices else self._why_empty(resource))
            for resource, pool in sorted(tree.pools.items())
        ])

    def _why_empty(self, resource: str) -> str:
        why = self._explaining.why_empty(resource) if self._explaining is not None else None
        return why or "no device matches its selectors"

    async def List(
        self, request: host.ListRequest, context: grpc.aio.ServicerContext[host.ListRequest, host.ListResponse]
    ) -> host.ListResponse:
        await self._read_checkpoint()
        return self._snapshot(self._notifier.tree)

    async def Watch(
        self, request: host.WatchRequest, context: grpc.aio.ServicerContext[host.WatchRequest, host.WatchEvent]
    ) -> AsyncIterator[host.WatchEvent]:
        await self._read_checkpoint()
        sent = self._notifier.tree
        with self._notifier.stream(WATCH_SCOPE, sent) as stream, \
                self._metrics.tree_streams.labels(HOST_WATCH).track_inprogress():
            yield host.WatchEvent(version=sent.version, snapshot=self._snapshot(sent))
            while True:  # nothing closes a host stream: it ends when the client goes
                tree = await stream.next()
                assert tree is not None  # no timeout given
                await self._read_checkpoint()
                for event in self._deltas(sent, tree):
                    yield event
                sent = tree

    def _deltas(self, old: DeviceTree, new: DeviceTree) -> list[host.WatchEvent]:
        holder = self._holdings.holder
        events = []
        resources = new.diff(old).resources
        for resource in sorted(resources):
            change = resources[resource]
            kinds = [(device_id, host.Delta.ADDED, change.new) for device_id in change.added]
            kinds += [(device_id, host.Delta.REMOVED, change.old) for device_id in change.removed]
            kinds += [(device_id, host.Delta.CHANGED, change.new) for device_id in change.changed]
            for device_id, kind, pool in sorted(kinds, key=lambda item: item[0]):
                assert pool is not None
                device = device_message(pool, device_id, holder(pool, device_id))
                events.append(host.WatchEvent(version=new.version,
                                              delta=host.Delta(kind=kind, resource=resource, device=device)))
        return events

    async def Leases(
        self, request: host.LeasesRequest, context: grpc.aio.ServicerContext[host.LeasesRequest, host.LeasesResponse]
    ) -> host.LeasesResponse:
        tree = self._notifier.tree
        return host.LeasesResponse(lost=self._leases.book.lost or "", leases=[
            _lease_message(lease, tree) for lease in sorted(self._leases.leases.values(), key=lambda x: x.created)])

    async def Explain(
        self, request: host.ExplainRequest, context: grpc.aio.ServicerContext[host.ExplainRequest,
                                                                              host.ExplainResponse],
    ) -> host.ExplainResponse:
        if not request.device.strip():
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "name a device: a PCI address, a /dev path, "
                         "a USB ID or a device ID")
        if self._explaining is None:
            await refuse(context, grpc.StatusCode.UNIMPLEMENTED, "this daemon does not explain devices")
        await self._read_checkpoint()
        return explain_response(request.device.strip(), self._explaining, self._notifier.tree,
                                self._holdings.holder)

    # -- granting and releasing ------------------------------------------------------------------
    async def Allocate(
        self, request: host.AllocateRequest, context: grpc.aio.ServicerContext[host.AllocateRequest, host.Lease]
    ) -> host.Lease:
        try:
            with self._gate.inside():
                await self._read_checkpoint()
                lease = await self._granter.grant(request, context)
        except WritesClosed as closed:
            self._metrics.host_leases.labels("refused").inc()
            await refuse(context, grpc.StatusCode.UNAVAILABLE, str(closed))
        except Exception:
            self._metrics.host_leases.labels("refused").inc()
            raise
        self._metrics.host_leases.labels("granted").inc()
        return _lease_message(lease, self._notifier.tree)

    async def Release(
        self, request: host.ReleaseRequest, context: grpc.aio.ServicerContext[host.ReleaseRequest, host.ReleaseResponse]
    ) -> host.ReleaseResponse:
        try:
            with self._gate.inside():
                await self._granter.release(request.lease, context)
        except WritesClosed as closed:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, str(closed))
        self._metrics.host_leases.labels("released").inc()
        return host.ReleaseResponse()

    async def ClearLost(
        self, request: host.ClearLostRequest,
        context: grpc.aio.ServicerContext[host.ClearLostRequest, host.ClearLostResponse],
    ) -> host.ClearLostResponse:
        book = self._books.get(request.book)
        if book is None:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"no book {request.book!r} (one of: {', '.join(sorted(self._books))})")
        lost = book.lost
        if self._gate.closed is not None:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, self._gate.closed)
        if not book.clear_lost(request.operator or "an operator"):
            return host.ClearLostResponse(cleared=False, message=f"the {request.book} book is not lost")
        return host.ClearLostResponse(cleared=True, message=f"cleared: {lost}; its devices are offered again")


def _lease_message(lease: Lease, tree: DeviceTree) -> host.Lease:
    pool = tree.pools.get(lease.resource)
    return lease.to_message(missing_devices=[d for d in lease.devices
                                             if pool is None or d not in pool.devices or d in pool.vanished])


async def _start_control_server(socket_path: str, servicer: HostServicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    host_grpc.add_HostServicer_to_server(servicer, server)
    return await start_unix_server(server, socket_path)


async def serve_control_socket(
    socket_path: Path,
    group: str | None,
    servicer: HostServicer,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the host API on ``socket_path`` (mode 0660, owned by ``group`` when given) until
    cancelled; the socket is removed on the way out, if it is still the one we bound."""
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    remove_socket_file(socket_path)
    with trio.CancelScope(shield=True):  # never leave a half-started server behind (see _endpoint)
        server = await aio_as_trio(_start_control_server)(str(socket_path), servicer)
    identity = os.lstat(socket_path).st_ino
    try:
        os.chmod(socket_path, 0o660)
        if group:
            shutil.chown(socket_path, group=group)
        log.info("host API on %s", socket_path)
        task_status.started()
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await aio_as_trio(server.stop)(0.2)
            try:  # never the socket of the instance that took over meanwhile
                if os.lstat(socket_path).st_ino == identity:
                    socket_path.unlink()
            except OSError:
                pass

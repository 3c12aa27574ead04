"""The host API (``devplugd.host.v1.Host``) on the control socket: the devices for workloads
that are not pods.

``List`` shows every pool and who holds each device (free, a host lease, or a pod according to
the kubelet's checkpoint, read only). ``Watch`` sends a snapshot, then one delta per device
added, removed or changed, each stamped with the tree version; it diffs the last tree the client
was sent against the newest one, so a slow client is conflated, never wrong. ``Allocate`` grants
a lease with the same answer a kubelet Allocate gets, written to disk before it is returned;
leased devices leave the kubelet's lists. All of it runs on the event loop's one thread; a grant
is synchronous from the choice to the reservation of its devices, so two clients can never get
the same device, and only the lease file's write (in a worker thread) is awaited.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import grpc
import trio
from trio_asyncio import aio_as_trio

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon._generated.devplugd.host.v1 import host_pb2_grpc as host_grpc
from daemon.cdi import with_cdi_names
from daemon.checkpoint import kubelet_allocations
from daemon.core import (
    HEALTHY,
    AllocationError,
    AnyHandler,
    DeviceTree,
    HandlerFailed,
    Hooks,
    LatestValue,
    Notifier,
    ResourcePool,
    allocate_container,
)
from daemon.metrics import Metrics
from daemon.sockets import refuse, remove_socket_file, start_unix_server

from ._leases import Lease, LeaseBook, LeaseError, NotEnoughFree

log = logging.getLogger("devplugd.host")

MAX_COUNT = 65536

# host leases, the kubelet's checkpoint and DRA claims, by (resource, device ID)
_Holders = tuple[Mapping[tuple[str, str], Lease], Mapping[tuple[str, str], str], Mapping[tuple[str, str], str]]


class HostServicer(host_grpc.HostServicer):
    def __init__(
        self,
        notifier: Notifier,
        handlers: Mapping[str, AnyHandler],
        leases: LeaseBook,
        device_plugin_dir: Path,
        leases_changed: Callable[[], None],
        with_cdi: bool = True,
        claim_holders: Callable[[], Mapping[tuple[str, str], str]] = dict,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._notifier = notifier
        self._hooks = {name: Hooks.of(handler) for name, handler in handlers.items()}
        self._leases = leases
        self._device_plugin_dir = device_plugin_dir
        self._leases_changed = leases_changed
        self._with_cdi = with_cdi
        self._claim_holders = claim_holders  # (resource, device) -> "<namespace>/<name>" of a DRA claim

    # -- reading ---------------------------------------------------------------------------------
    def _holders(self) -> _Holders:
        """Who holds what now: host leases, DRA claims and the kubelet's checkpoint, read once
        per answer."""
        return self._leases.holders(), kubelet_allocations(self._device_plugin_dir), self._claim_holders()

    @staticmethod
    def _device(pool: ResourcePool, device_id: str, holders: _Holders) -> host.Device:
        leases, kubelet, claims = holders
        info = pool.devices[device_id]
        device = host.Device(id=device_id, health=info.health, numa_nodes=info.numa_nodes, holder="free")
        lease = leases.get((pool.resource, device_id))
        if lease is not None:
            device.holder, device.lease, device.owner = "lease", lease.lease, lease.owner
        elif (pool.resource, device_id) in claims:
            device.holder, device.owner = "claim", claims[(pool.resource, device_id)]
        elif (pool.resource, device_id) in kubelet:
            device.holder, device.owner = "kubelet", kubelet[(pool.resource, device_id)]
        return device

    def _snapshot(self, tree: DeviceTree) -> host.ListResponse:
        holders = self._holders()
        return host.ListResponse(version=tree.version, pools=[
            host.Pool(resource=resource, devices=[self._device(pool, i, holders) for i in sorted(pool.devices)],
                      allocation_api=pool.road)
            for resource, pool in sorted(tree.pools.items())
        ])

    async def List(
        self, request: host.ListRequest, context: grpc.aio.ServicerContext[host.ListRequest, host.ListResponse]
    ) -> host.ListResponse:
        return self._snapshot(self._notifier.tree)

    async def Watch(
        self, request: host.WatchRequest, context: grpc.aio.ServicerContext[host.WatchRequest, host.WatchEvent]
    ) -> AsyncIterator[host.WatchEvent]:
        stream = _WatchStream()
        sent = self._notifier.subscribe(stream)
        try:
            yield host.WatchEvent(version=sent.version, snapshot=self._snapshot(sent))
            while True:
                tree = await stream.next_tree()
                for event in self._deltas(sent, tree):
                    yield event
                sent = tree
        finally:
            self._notifier.unsubscribe(stream)

    def _deltas(self, old: DeviceTree, new: DeviceTree) -> list[host.WatchEvent]:
        holders = self._holders()
        events = []
        resources = new.diff(old).resources
        for resource in sorted(resources):
            change = resources[resource]
            kinds = [(device_id, host.Delta.ADDED, change.new) for device_id in change.added]
            kinds += [(device_id, host.Delta.REMOVED, change.old) for device_id in change.removed]
            kinds += [(device_id, host.Delta.CHANGED, change.new) for device_id in change.changed]
            for device_id, kind, pool in sorted(kinds, key=lambda item: item[0]):
                assert pool is not None
                delta = host.Delta(kind=kind, resource=resource, device=self._device(pool, device_id, holders))
                events.append(host.WatchEvent(version=new.version, delta=delta))
        return events

    async def Leases(
        self, request: host.LeasesRequest, context: grpc.aio.ServicerContext[host.LeasesRequest, host.LeasesResponse]
    ) -> host.LeasesResponse:
        tree = self._notifier.tree
        return host.LeasesResponse(leases=[self._lease_message(lease, tree) for lease in
                                           sorted(self._leases.leases.values(), key=lambda x: x.created)])

    @staticmethod
    def _lease_message(lease: Lease, tree: DeviceTree) -> host.Lease:
        pool = tree.pools.get(lease.resource)
        return lease.to_message(missing_devices=[d for d in lease.devices
                                                 if pool is None or d not in pool.devices or d in pool.vanished])

    # -- granting --------------------------------------------------------------------------------
    def _choose(self, pool: ResourcePool, request: host.AllocateRequest) -> list[str]:
        leases, kubelet, claims = self._holders()

        def held_by(device_id: str) -> str | None:
            lease = leases.get((pool.resource, device_id))
            if lease is not None:
                return f"host lease {lease.lease} (owner {lease.owner})"
            if (claim := claims.get((pool.resource, device_id))) is not None:
                return f"the DRA claim {claim}"
            owner = kubelet.get((pool.resource, device_id))
            return f"the kubelet ({owner})" if owner else None

        if request.device_ids:
            chosen = list(dict.fromkeys(request.device_ids))
            if len(chosen) != len(request.device_ids):
                raise LeaseError("a device ID is requested more than once")
            for device_id in chosen:
                if device_id not in pool.devices:
                    raise LeaseError(f"device {device_id!r} is not in {pool.resource}")
                if device_id in pool.vanished:
                    raise LeaseError(f"device {device_id!r} of {pool.resource} is gone "
                                     "(listed Unhealthy while the kubelet's checkpoint shows it allocated)")
                if pool.devices[device_id].health != HEALTHY:
                    raise LeaseError(f"device {device_id!r} of {pool.resource} is {pool.devices[device_id].health}")
                if (holder := held_by(device_id)) is not None:
                    raise LeaseError(f"device {device_id!r} of {pool.resource} is held by {holder}")
            return chosen
        if not 1 <= request.count <= MAX_COUNT:
            raise LeaseError("ask for a count of at least 1 or name the devices")
        free = [i for i in sorted(pool.devices) if pool.devices[i].health == HEALTHY and held_by(i) is None]
        if len(free) < request.count:
            raise NotEnoughFree(f"{request.count} devices of {pool.resource} requested, {len(free)} free")
        candidates = free
        if request.HasField("numa_node"):  # the preferred node's devices first
            on_node = [i for i in free if request.numa_node in pool.devices[i].numa_nodes]
            off_node = [i for i in free if request.numa_node not in pool.devices[i].numa_nodes]
            free = on_node + off_node
            candidates = on_node if len(on_node) >= request.count else free
        hooks = self._hooks[pool.handler]
        if len(candidates) > request.count and hooks.preferred is not None:
            try:
                preferred = hooks.preferred.preferred_allocation(pool, candidates, [], request.count) \
                    if hooks.preferred.offers_preferred_allocation(pool) else []
            except Exception:
                log.exception("handler %s failed to choose devices of %s; taking them in ID order",
                              hooks.name, pool.resource, extra={"RESOURCE": pool.resource})
                preferred = []
            if len(preferred) == request.count and set(preferred) <= set(candidates):
                return preferred  # the pool's allocationPolicy, as the kubelet's requests get it
        return free[: request.count]

    async def Allocate(
        self, request: host.AllocateRequest, context: grpc.aio.ServicerContext[host.AllocateRequest, host.Lease]
    ) -> host.Lease:
        try:
            lease = await self._grant(request, context)
        except Exception:
            self._metrics.host_leases.labels("refused").inc()
            raise
        self._metrics.host_leases.labels("granted").inc()
        return lease

    async def _grant(
        self, request: host.AllocateRequest, context: grpc.aio.ServicerContext[host.AllocateRequest, host.Lease]
    ) -> host.Lease:
        tree = self._notifier.tree
        pool = tree.pools.get(request.resource)
        if pool is None:
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"no resource {request.resource!r}")
        if not request.owner:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "an owner name is required")
        hooks = self._hooks[pool.handler]
        # From the choice to the reservation nothing yields: two clients never get one device.
        try:
            chosen = self._choose(pool, request)
            allocation = allocate_container(hooks, pool, chosen)
        except LeaseError as error:
            log.warning("refused lease of %s to %s: %s", request.resource, request.owner, error,
                        extra={"RESOURCE": request.resource})
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, NotEnoughFree) \
                else grpc.StatusCode.FAILED_PRECONDITION
            await refuse(context, code, str(error))
        except (AllocationError, OSError, HandlerFailed) as error:
            log.error("lease of %s failed: %s", request.resource, error, exc_info=error.__cause__,
                      extra={"RESOURCE": request.resource})
            code = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(error, AllocationError)
                    else grpc.StatusCode.INTERNAL)
            await refuse(context, code, f"lease failed: {error}")
        if self._with_cdi:
            with_cdi_names(allocation, pool, chosen)
        lease = Lease.grant(pool.resource, request.owner, chosen, allocation)
        self._leases.reserve(lease)
        self._leases_changed()  # its devices leave the kubelet's lists now, not after the write
        try:
            await self._leases.add(lease)  # on disk before anyone hears of it
        except OSError as error:
            log.error("lease of %s failed: cannot write %s: %s", request.resource, self._leases.path, error,
                      extra={"RESOURCE": request.resource})
            self._leases_changed()
            await refuse(context, grpc.StatusCode.INTERNAL, f"lease failed: {error}")
        log.info("leased %s of %s to %s as %s", ",".join(chosen), pool.resource, request.owner, lease.lease,
                 extra={"RESOURCE": pool.resource, "EVENT": "lease"})
        return self._lease_message(lease, tree)

    async def Release(
        self, request: host.ReleaseRequest, context: grpc.aio.ServicerContext[host.ReleaseRequest, host.ReleaseResponse]
    ) -> host.ReleaseResponse:
        try:
            lease = await self._leases.remove(request.lease)
        except LeaseError as error:
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"{error} (never granted, or already released)")
        except OSError as error:
            log.error("release of %s failed: cannot write %s: %s", request.lease, self._leases.path, error)
            await refuse(context, grpc.StatusCode.INTERNAL, f"release failed: {error}")
        log.info("released %s (%s of %s, owner %s)", lease.lease, ",".join(lease.devices), lease.resource,
                 lease.owner, extra={"RESOURCE": lease.resource, "EVENT": "release"})
        self._metrics.host_leases.labels("released").inc()
        self._leases_changed()
        return host.ReleaseResponse()


class _WatchStream:
    """The notifier's subscriber for one Watch stream: the newest tree, waiting to be sent."""

    def __init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._latest: LatestValue[DeviceTree] = LatestValue(self._wakeup.set)

    def offer(self, tree: DeviceTree) -> None:
        self._latest.put(tree)

    async def next_tree(self) -> DeviceTree:
        while True:
            full, tree = self._latest.take()
            if full and tree is not None:
                return tree
            self._wakeup.clear()
            await self._wakeup.wait()


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
    cancelled; the socket is removed on the way out."""
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    remove_socket_file(socket_path)
    with trio.CancelScope(shield=True):  # never leave a half-started server behind (see _endpoint)
        server = await aio_as_trio(_start_control_server)(str(socket_path), servicer)
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
            socket_path.unlink(missing_ok=True)

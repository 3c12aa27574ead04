"""The gRPC face of one resource: DevicePlugin.

These coroutines run on the asyncio loop that trio-asyncio hosts inside trio, on the one thread,
so they read the current DeviceTree with plain attribute access. Allocate answers come from the
tree that is current when the call arrives; ListAndWatch streams get their updates through a
one-slot mailbox each (the newest list wins, never a backlog), fed by the resource's endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon.cdi import with_cdi_names
from daemon.core import (
    HEALTHY,
    AllocationError,
    ContainerAllocation,
    HandlerFailed,
    Hooks,
    Notifier,
    ResourcePool,
    allocate_container,
)
from daemon.metrics import Metrics
from daemon.sockets import refuse

log = logging.getLogger("devplugd.server")

MAX_IDS_NAMED = 5
# A stream sends a change at once when it has been quiet for COALESCE_QUIET. Changes that come
# sooner are held until none has come for COALESCE_QUIET (the burst is over), but never longer
# than COALESCE_MAX_DELAY, then the newest list goes: 256 VFs created one by one over half a
# second become a handful of lists, and the final one follows the last change within
# COALESCE_QUIET. Timers run only while a change is waiting, never while idle. A list in which a
# device became Unhealthy is never held nor conflated away (see StreamMailbox).
COALESCE_QUIET = 0.025
COALESCE_MAX_DELAY = 0.25


class _StreamClosed(Exception):
    pass


# Lists a stream holds for the kubelet at most: only lists in which a device became Unhealthy
# pile up (each is kept until sent); a stream this far behind has a kubelet that is not reading.
MAX_PENDING = 64


def _unhealthy(pool: ResourcePool | None) -> frozenset[str]:
    if pool is None or pool.healthy_count == len(pool.devices):  # the common case, cached: O(1)
        return frozenset()
    return frozenset(device_id for device_id, health, _ in pool.listing if health != HEALTHY)


class StreamMailbox:
    """The notifier's subscriber for one ListAndWatch stream.

    Pools wait in order, and the newest replaces a waiting one (conflation), except a pool in
    which a listed device became Unhealthy: that one is *urgent*. It is sent at once, without
    the coalescing delay, and nothing replaces it but a newer urgent pool whose Unhealthy devices
    include all of its own (so nothing Unhealthy is hidden). A PCIe recovery that ends 0.3 ms
    after it began reaches the kubelet as two lists, the Unhealthy one first.

    Each waiting pool carries when the oldest event it answers reached the event loop (a pool
    that replaces others takes the oldest of theirs): ``taken_arrival`` is that of the pool
    ``next_pool`` returned last, for the reaction-time histogram."""

    def __init__(self, pool: ResourcePool | None = None) -> None:
        self._wakeup = asyncio.Event()
        # (pool, unhealthy if urgent, event arrival)
        self._pending: list[tuple[ResourcePool | None, frozenset[str] | None, float | None]] = []
        self._last_offered = pool  # what the next pool is compared with
        self._closed = False
        self._offered_at = 0.0
        self.taken_arrival: float | None = None

    def offer(self, pool: ResourcePool | None, arrival: float | None = None) -> None:
        self._offered_at = time.monotonic()
        previous, self._last_offered = self._last_offered, pool
        unhealthy = _unhealthy(pool)
        was_healthy = {i for i, health, _ in previous.listing if health == HEALTHY} if unhealthy and previous else ()
        urgent = unhealthy if not unhealthy.isdisjoint(was_healthy) else None
        pending = self._pending
        while pending:
            kept = pending[-1][1]
            if kept is not None and (urgent is None or not kept <= urgent):
                break
            # conflated: a plain pool, or an urgent one whose Unhealthy devices are still so
            replaced = pending.pop()[2]
            if replaced is not None and (arrival is None or replaced < arrival):
                arrival = replaced
        pending.append((pool, urgent, arrival))
        if len(pending) > MAX_PENDING:
            del pending[:-MAX_PENDING]
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def _wait(self, timeout: float | None = None) -> None:
        self._wakeup.clear()
        if timeout is None:
            await self._wakeup.wait()
            return
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    async def next_pool(self, last_sent: float) -> ResourcePool | None:
        """The next pool to send: an urgent one at once; otherwise the newest offered, at once if
        the stream has been quiet since ``last_sent`` (monotonic seconds), else once the burst
        is over (see COALESCE_QUIET) or an urgent pool arrives."""
        while not self._pending:
            if self._closed:
                raise _StreamClosed
            await self._wait()
        if self._closed:
            raise _StreamClosed
        first_pending = time.monotonic()
        if self._pending[0][1] is None and first_pending - last_sent < COALESCE_QUIET:
            while self._pending[0][1] is None:
                deadline = min(self._offered_at + COALESCE_QUIET, first_pending + COALESCE_MAX_DELAY)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await self._wait(remaining)
                if self._closed:
                    raise _StreamClosed
        pool, _, self.taken_arrival = self._pending.pop(0)
        return pool


def device_message(device_id: str, health: str, numa_nodes: tuple[int, ...]) -> dp.Device:
    device = dp.Device(ID=device_id, health=health)
    if numa_nodes:
        device.topology.nodes.extend(dp.NUMANode(ID=node) for node in numa_nodes)
    return device


def _framed_device(entry: tuple[str, str, tuple[int, ...]]) -> bytes:
    """One ``Device`` as it sits in a serialized ListAndWatchResponse: field 1 (``devices``,
    length-delimited), its length as a varint, then the message."""
    body: bytes = device_message(*entry).SerializeToString()
    size, prefix = len(body), bytearray(b"\x0a")
    while size > 0x7F:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + body


class ListingMessages:
    """ListAndWatch messages built from per-device encodings kept between lists: one changed
    device costs one new ``Device``, and the message is parsed from the joined encodings in one
    C call instead of copying hundreds of ``Device`` messages into a repeated field (3x cheaper
    for 4096; the same message, field by field)."""

    def __init__(self) -> None:
        self._devices: dict[tuple[str, str, tuple[int, ...]], bytes] = {}

    def response(self, pool: ResourcePool | None) -> dp.ListAndWatchResponse:
        listing = pool.listing if pool is not None else ()
        known = self._devices
        self._devices = {entry: known.get(entry) or _framed_device(entry) for entry in listing}
        response: dp.ListAndWatchResponse = dp.ListAndWatchResponse.FromString(b"".join(self._devices.values()))
        return response


def _name_ids(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:MAX_IDS_NAMED])
    return shown + (f" and {len(ids) - MAX_IDS_NAMED} more" if len(ids) > MAX_IDS_NAMED else "")


def request_problem(pool: ResourcePool | None, resource: str, device_ids: Sequence[str]) -> str | None:
    """Why a container request cannot be allocated, naming the IDs; ``None`` if it can."""
    if not device_ids:
        return "container request has no devices_ids"
    if pool is None:
        return f"resource {resource} has no devices"
    seen: set[str] = set()
    # seen.add() returns None (falsy): each ID's first occurrence is kept out, repeats are listed
    duplicates = [i for i in device_ids if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
    if duplicates:
        return f"device IDs requested more than once for {resource}: {_name_ids(duplicates)}"
    unknown = [i for i in device_ids if i not in pool.devices or i in pool.leased]
    if unknown:
        return f"unknown device IDs for {resource}: {_name_ids(unknown)}"
    unhealthy = [i for i in device_ids if pool.devices[i].health != HEALTHY]
    if unhealthy:
        return f"unhealthy device IDs for {resource}: {_name_ids(unhealthy)}"
    return None


def container_response(allocation: ContainerAllocation) -> dp.ContainerAllocateResponse:
    return dp.ContainerAllocateResponse(
        envs=allocation.envs,
        annotations=allocation.annotations,
        mounts=[
            dp.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        devices=[
            dp.DeviceSpec(container_path=s.container_path, host_path=s.host_path, permissions=s.permissions)
            for s in allocation.specs
        ],
        cdi_devices=[dp.CDIDevice(name=name) for name in allocation.cdi_devices],
    )


class DevicePluginServicer(dp_grpc.DevicePluginServicer):
    """DevicePlugin for one resource. Allocate reads the notifier's current tree; ListAndWatch
    streams hear of changes through ``offer``, which the resource's endpoint calls."""

    def __init__(self, resource: str, hooks: Hooks, notifier: Notifier, with_cdi: bool = False,
                 metrics: Metrics | None = None) -> None:
        self._with_cdi = with_cdi
        self._metrics = metrics or Metrics()
        self.resource = resource
        self._hooks = hooks
        self._notifier = notifier
        self._streams: set[StreamMailbox] = set()
        self._messages = ListingMessages()

    def _pool(self) -> ResourcePool | None:
        return self._notifier.tree.pools.get(self.resource)

    def offer(self, pool: ResourcePool | None) -> None:
        """The resource's list changed: every open stream gets the newest pool."""
        arrival = self._metrics.event_arrival
        for mailbox in self._streams:
            mailbox.offer(pool, arrival)

    def close_streams(self) -> None:
        """End every open ListAndWatch stream (before the server stops or we register again)."""
        for mailbox in tuple(self._streams):
            mailbox.close()

    def options(self) -> dp.DevicePluginOptions:
        pool = self._pool()
        preferred = False
        if self._hooks.preferred is not None and pool is not None:
            try:
                preferred = self._hooks.preferred.offers_preferred_allocation(pool)
            except Exception:
                log.exception("handler %s failed in offers_preferred_allocation for %s; not offering it",
                              self._hooks.name, self.resource, extra={"RESOURCE": self.resource})
        return dp.DevicePluginOptions(
            pre_start_required=self._hooks.pre_starter is not None,
            get_preferred_allocation_available=preferred,
        )

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: grpc.aio.ServicerContext[dp.Empty, dp.DevicePluginOptions]
    ) -> dp.DevicePluginOptions:
        return self.options()

    async def ListAndWatch(
        self, request: dp.Empty, context: grpc.aio.ServicerContext[dp.Empty, dp.ListAndWatchResponse]
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        pool = self._pool()
        mailbox = StreamMailbox(pool)
        self._streams.add(mailbox)
        try:
            last_listing = pool.listing if pool is not None else ()
            yield self._messages.response(pool)
            self._metrics.listandwatch_sent(self.resource, None)
            last_sent = time.monotonic()
            while True:
                pool = await mailbox.next_pool(last_sent)
                listing = pool.listing if pool is not None else ()
                if listing != last_listing:
                    last_listing = listing
                    yield self._messages.response(pool)  # back here once grpc has written it
                    self._metrics.listandwatch_sent(self.resource, mailbox.taken_arrival)
                    last_sent = time.monotonic()
        except _StreamClosed:
            return
        finally:
            self._streams.discard(mailbox)

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[dp.AllocateRequest, dp.AllocateResponse]
    ) -> dp.AllocateResponse:
        self._metrics.allocate_calls.labels(self.resource).inc()
        with self._metrics.allocate_duration.labels(self.resource).time(), \
                self._metrics.allocate_refusals.labels(self.resource).count_exceptions():
            return await self._allocate(request, context)

    async def _allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[dp.AllocateRequest, dp.AllocateResponse]
    ) -> dp.AllocateResponse:
        if not request.container_requests:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"Allocate for {self.resource}: no container_requests")
        pool = self._pool()
        responses = []
        for index, container_request in enumerate(request.container_requests):
            device_ids = list(container_request.devices_ids)
            problem = request_problem(pool, self.resource, device_ids)
            if problem is not None or pool is None:
                log.warning("refused Allocate: container request %d: %s", index, problem,
                            extra={"RESOURCE": self.resource})
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"container request {index}: {problem}")
            try:
                allocation = allocate_container(self._hooks, pool, device_ids)
            except (AllocationError, OSError) as error:
                log.error("Allocate failed for %s: %s", self.resource, error, extra={"RESOURCE": self.resource})
                await refuse(context, grpc.StatusCode.FAILED_PRECONDITION, f"container request {index}: {error}")
            except HandlerFailed as error:
                self._metrics.handler_error(self._hooks.name, "allocate")
                log.error("Allocate failed for %s: %s", self.resource, error, exc_info=error.__cause__,
                          extra={"RESOURCE": self.resource})
                await refuse(context, grpc.StatusCode.INTERNAL, f"container request {index}: {error}")
            if self._with_cdi:
                with_cdi_names(allocation, pool, device_ids)
            responses.append(container_response(allocation))
        return dp.AllocateResponse(container_responses=responses)

    def _hook_refusal(self, hook: str, error: Exception) -> tuple[grpc.StatusCode, str]:
        """The answer to a handler hook that raised (call it in the ``except``): its refusal
        (AllocationError) as it said it; anything else is a bug in the handler, logged."""
        if isinstance(error, AllocationError):
            return grpc.StatusCode.FAILED_PRECONDITION, str(error)
        self._metrics.handler_error(self._hooks.name, hook)
        log.exception("handler %s failed in %s for %s", self._hooks.name, hook, self.resource,
                      extra={"RESOURCE": self.resource})
        return grpc.StatusCode.INTERNAL, f"handler {self._hooks.name} failed in {hook}: {type(error).__name__}: {error}"

    async def GetPreferredAllocation(
        self,
        request: dp.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[dp.PreferredAllocationRequest, dp.PreferredAllocationResponse],
    ) -> dp.PreferredAllocationResponse:
        self._metrics.preferred_calls.labels(self.resource).inc()
        with self._metrics.preferred_refusals.labels(self.resource).count_exceptions():
            return await self._preferred_allocation(request, context)

    async def _preferred_allocation(
        self,
        request: dp.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[dp.PreferredAllocationRequest, dp.PreferredAllocationResponse],
    ) -> dp.PreferredAllocationResponse:
        pool = self._pool()
        preferred = self._hooks.preferred
        if preferred is None or pool is None or not self.options().get_preferred_allocation_available:
            await refuse(context, grpc.StatusCode.UNIMPLEMENTED,
                               f"{self.resource} does not offer GetPreferredAllocation")
        responses = []
        for container_request in request.container_requests:
            try:
                chosen = preferred.preferred_allocation(
                    pool,
                    list(container_request.available_deviceIDs),
                    list(container_request.must_include_deviceIDs),
                    container_request.allocation_size,
                )
            except Exception as error:
                await refuse(context, *self._hook_refusal("preferred_allocation", error))
            responses.append(dp.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return dp.PreferredAllocationResponse(container_responses=responses)

    async def PreStartContainer(
        self,
        request: dp.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[dp.PreStartContainerRequest, dp.PreStartContainerResponse],
    ) -> dp.PreStartContainerResponse:
        pool = self._pool()
        pre_starter = self._hooks.pre_starter
        if pre_starter is not None and pool is not None:
            try:
                pre_starter.pre_start_container(pool, list(request.devices_ids))
            except Exception as error:
                await refuse(context, *self._hook_refusal("pre_start_container", error))
        return dp.PreStartContainerResponse()

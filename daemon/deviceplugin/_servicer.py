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
from typing import NoReturn, TypeVar

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
    LatestValue,
    Notifier,
    ResourcePool,
    allocate_container,
)

log = logging.getLogger("devplugd.server")

MAX_IDS_NAMED = 5
# A stream sends a change at once when it has been quiet for COALESCE_QUIET. Changes that come
# sooner are held until none has come for COALESCE_QUIET (the burst is over), but never longer
# than COALESCE_MAX_DELAY, then the newest list goes: 256 VFs created one by one over half a
# second become a handful of lists, and the final one follows the last change within
# COALESCE_QUIET. Timers run only while a change is waiting, never while idle.
COALESCE_QUIET = 0.025
COALESCE_MAX_DELAY = 0.25

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class _StreamClosed(Exception):
    pass


class StreamMailbox:
    """The notifier's subscriber for one ListAndWatch stream."""

    def __init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._latest: LatestValue[ResourcePool | None] = LatestValue(self._wakeup.set)
        self._closed = False
        self._offered_at = 0.0

    def offer(self, pool: ResourcePool | None) -> None:
        self._offered_at = time.monotonic()
        self._latest.put(pool)

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def next_pool(self, last_sent: float) -> ResourcePool | None:
        """The newest pool offered, at once if the stream has been quiet since ``last_sent``
        (monotonic seconds), else once the burst is over (see COALESCE_QUIET)."""
        while True:
            if self._closed:
                raise _StreamClosed
            full, pool = self._latest.take()
            if full:
                break
            self._wakeup.clear()
            await self._wakeup.wait()
        first_pending = time.monotonic()
        if first_pending - last_sent >= COALESCE_QUIET:
            return pool
        while True:
            deadline = min(self._offered_at + COALESCE_QUIET, first_pending + COALESCE_MAX_DELAY)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.sleep(remaining)
            if self._closed:
                raise _StreamClosed
        full, newer = self._latest.take()
        return newer if full else pool


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

    def __init__(self, resource: str, hooks: Hooks, notifier: Notifier, with_cdi: bool = False) -> None:
        self._with_cdi = with_cdi
        self.resource = resource
        self._hooks = hooks
        self._notifier = notifier
        self._streams: set[StreamMailbox] = set()
        self._messages = ListingMessages()

    def _pool(self) -> ResourcePool | None:
        return self._notifier.tree.pools.get(self.resource)

    def offer(self, pool: ResourcePool | None) -> None:
        """The resource's list changed: every open stream gets the newest pool."""
        for mailbox in self._streams:
            mailbox.offer(pool)

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
        mailbox = StreamMailbox()
        self._streams.add(mailbox)
        pool = self._pool()
        try:
            last_listing = pool.listing if pool is not None else ()
            yield self._messages.response(pool)
            last_sent = time.monotonic()
            while True:
                pool = await mailbox.next_pool(last_sent)
                listing = pool.listing if pool is not None else ()
                if listing != last_listing:
                    last_listing = listing
                    yield self._messages.response(pool)
                    last_sent = time.monotonic()
        except _StreamClosed:
            return
        finally:
            self._streams.discard(mailbox)

    async def _refuse(
        self, context: grpc.aio.ServicerContext[_Request, _Response], code: grpc.StatusCode, message: str
    ) -> NoReturn:
        await context.abort(code, message)
        raise AssertionError("abort raises")  # for type checkers

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[dp.AllocateRequest, dp.AllocateResponse]
    ) -> dp.AllocateResponse:
        if not request.container_requests:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"Allocate for {self.resource}: no container_requests")
        pool = self._pool()
        responses = []
        for index, container_request in enumerate(request.container_requests):
            device_ids = list(container_request.devices_ids)
            problem = request_problem(pool, self.resource, device_ids)
            if problem is not None or pool is None:
                log.warning("refused Allocate: container request %d: %s", index, problem,
                            extra={"RESOURCE": self.resource})
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"container request {index}: {problem}")
            try:
                allocation = allocate_container(self._hooks, pool, device_ids)
            except (AllocationError, OSError) as error:
                log.error("Allocate failed for %s: %s", self.resource, error, extra={"RESOURCE": self.resource})
                await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, f"container request {index}: {error}")
            except HandlerFailed as error:
                log.error("Allocate failed for %s: %s", self.resource, error, exc_info=error.__cause__,
                          extra={"RESOURCE": self.resource})
                await self._refuse(context, grpc.StatusCode.INTERNAL, f"container request {index}: {error}")
            if self._with_cdi:
                with_cdi_names(allocation, self.resource, device_ids)
            responses.append(container_response(allocation))
        return dp.AllocateResponse(container_responses=responses)

    def _hook_refusal(self, hook: str, error: Exception) -> tuple[grpc.StatusCode, str]:
        """The answer to a handler hook that raised (call it in the ``except``): its refusal
        (AllocationError) as it said it; anything else is a bug in the handler, logged."""
        if isinstance(error, AllocationError):
            return grpc.StatusCode.FAILED_PRECONDITION, str(error)
        log.exception("handler %s failed in %s for %s", self._hooks.name, hook, self.resource,
                      extra={"RESOURCE": self.resource})
        return grpc.StatusCode.INTERNAL, f"handler {self._hooks.name} failed in {hook}: {type(error).__name__}: {error}"

    async def GetPreferredAllocation(
        self,
        request: dp.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[dp.PreferredAllocationRequest, dp.PreferredAllocationResponse],
    ) -> dp.PreferredAllocationResponse:
        pool = self._pool()
        preferred = self._hooks.preferred
        if preferred is None or pool is None or not self.options().get_preferred_allocation_available:
            await self._refuse(context, grpc.StatusCode.UNIMPLEMENTED,
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
                await self._refuse(context, *self._hook_refusal("preferred_allocation", error))
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
                await self._refuse(context, *self._hook_refusal("pre_start_container", error))
        return dp.PreStartContainerResponse()

"""The gRPC face of one resource: DevicePlugin.

These coroutines run on the asyncio loop that trio-asyncio hosts inside trio, on the one thread,
so they read the current DeviceTree with plain attribute access. Allocate answers come from the
tree that is current when the call arrives; each ListAndWatch stream subscribes itself to the
notifier (a ``TreeStream``: a one-slot mailbox scoped to this resource, where the newest list
wins and a device gone Unhealthy is never conflated away) and unsubscribes when it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Hashable, Sequence

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon.cdi import with_cdi_names
from daemon.core import HEALTHY, AllocationError, ContainerAllocation, ResourcePool
from daemon.core._allocation import HandlerFailed
from daemon.core._handler import Hooks, allocate_container
from daemon.core._notifier import MailboxClosed, Notifier, Scope, TreeStream
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DeviceTree
from daemon.holdings import KUBELET_ASKS, UNHEALTHY, UNKNOWN, VANISHED, HolderLookup, refusal
from daemon.metrics import LISTANDWATCH, Metrics
from daemon.sockets import refuse
from daemon.wire import framed

log = logging.getLogger("devplugd.deviceplugin")

MAX_IDS_NAMED = 5
# A stream sends a change at once when it has been quiet for COALESCE_QUIET. Changes that come
# sooner are held until none has come for COALESCE_QUIET (the burst is over), but never longer
# than COALESCE_MAX_DELAY, then the newest list goes: 256 VFs created one by one over half a
# second become a handful of lists, and the final one follows the last change within
# COALESCE_QUIET. Timers run only while a change is waiting, never while idle. A list in which a
# device became Unhealthy is never held nor conflated away (see daemon.core._notifier).
COALESCE_QUIET = 0.025
COALESCE_MAX_DELAY = 0.25


def served_pool(tree: DeviceTree, resource: str, handler: str) -> ResourcePool | None:
    """The pool the kubelet is served for ``resource`` in ``tree``: none once it is gone, moved to
    another road or to another handler (its endpoint then says so with an empty list)."""
    pool = tree.pools.get(resource)
    if pool is None or pool.road != DEVICE_PLUGIN_ROAD or pool.handler != handler:
        return None
    return pool


def listing_scope(resource: str, handler: str) -> Scope:
    """What a ListAndWatch stream follows: the devices of its resource's list."""
    def unhealthy(tree: DeviceTree) -> frozenset[Hashable]:
        pool = served_pool(tree, resource, handler)
        if pool is None or pool.healthy_count == len(pool.devices):  # the common case, cached: O(1)
            return frozenset()
        return frozenset(device_id for device_id, health, _ in pool.listing if health != HEALTHY)

    def listed(tree: DeviceTree, device_id: Hashable) -> bool:
        pool = served_pool(tree, resource, handler)
        return pool is not None and pool.listed(device_id)

    def concerns(old: DeviceTree, new: DeviceTree) -> bool:  # a tree keeps an unchanged pool's object
        return old.pools.get(resource) is not new.pools.get(resource)

    return Scope(concerns, unhealthy, listed)


def device_message(device_id: str, health: str, numa_nodes: tuple[int, ...]) -> dp.Device:
    device = dp.Device(ID=device_id, health=health)
    if numa_nodes:
        device.topology.nodes.extend(dp.NUMANode(ID=node) for node in numa_nodes)
    return device


def _framed_device(entry: tuple[str, str, tuple[int, ...]]) -> bytes:
    """One ``Device`` as it sits in a serialized ListAndWatchResponse (field 1, ``devices``)."""
    return framed(1, device_message(*entry).SerializeToString())


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


def request_problem(pool: ResourcePool | None, resource: str, device_ids: Sequence[str],
                    holders: HolderLookup | None = None) -> str | None:
    """Why a container request cannot be allocated, naming the IDs and their holders; ``None``
    if it can. ``holders`` tells who holds a device now (see ``daemon.holdings.refusal``)."""
    if not device_ids:
        return "container request has no devices_ids"
    if pool is None:
        return f"resource {resource} has no devices"
    seen: set[str] = set()
    # seen.add() returns None (falsy): each ID's first occurrence is kept out, repeats are listed
    duplicates = [i for i in device_ids if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
    if duplicates:
        return f"device IDs requested more than once for {resource}: {_name_ids(duplicates)}"
    refused = [(i, why) for i in device_ids if (why := refusal(pool, i, KUBELET_ASKS, holders)) is not None]
    if not refused:
        return None
    unknown = [i for i, why in refused if why.reason == UNKNOWN]
    if unknown:
        return f"unknown device IDs for {resource}: {_name_ids(unknown)}"
    unhealthy = [i for i, why in refused if why.reason in (UNHEALTHY, VANISHED)]
    if unhealthy:
        return f"unhealthy device IDs for {resource}: {_name_ids(unhealthy)}"
    shown = "; ".join(f"{i!r} {why.predicate}" for i, why in refused[:MAX_IDS_NAMED])
    more = f"; and {len(refused) - MAX_IDS_NAMED} more" if len(refused) > MAX_IDS_NAMED else ""
    return f"device IDs of {resource} that cannot be allocated: {shown}{more}"


def fill_container_response(response: dp.ContainerAllocateResponse, allocation: ContainerAllocation) -> None:
    """Write ``allocation`` into ``response``, a message already in its AllocateResponse (filled
    in place: building each message and copying it into the repeated field costs a third more)."""
    response.envs.update(allocation.envs)
    response.annotations.update(allocation.annotations)
    for m in allocation.mounts:
        response.mounts.add(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
    for s in allocation.specs:
        response.devices.add(container_path=s.container_path, host_path=s.host_path, permissions=s.permissions)
    for name in allocation.cdi_devices:
        response.cdi_devices.add(name=name)


class DevicePluginServicer(dp_grpc.DevicePluginServicer):
    """DevicePlugin for one resource. Allocate reads the notifier's current tree; each
    ListAndWatch stream is a subscriber of the notifier (a ``TreeStream`` that wakes only for
    trees in which its resource changed)."""

    def __init__(self, resource: str, hooks: Hooks, notifier: Notifier, with_cdi: bool = False,
                 metrics: Metrics | None = None, holders: HolderLookup | None = None) -> None:
        self._with_cdi = with_cdi
        self._metrics = metrics or Metrics()
        self.resource = resource
        self._hooks = hooks
        self._notifier = notifier
        self._holders = holders
        self._scope = listing_scope(resource, hooks.name)
        self._streams: set[TreeStream] = set()
        self._messages = ListingMessages()
        # the resource's series, looked up once (labels() takes a lock: microseconds a call)
        self._allocate_calls = self._metrics.allocate_calls.labels(resource)
        self._allocate_duration = self._metrics.allocate_duration.labels(resource)
        self._allocate_refusals = self._metrics.allocate_refusals.labels(resource)

    def _pool(self, tree: DeviceTree | None = None) -> ResourcePool | None:
        return served_pool(tree or self._notifier.tree, self.resource, self._hooks.name)

    def close_streams(self) -> None:
        """End every open ListAndWatch stream (before the server stops or we register again)."""
        for stream in tuple(self._streams):
            stream.close()

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
        tree = self._notifier.tree
        pool = self._pool(tree)
        with self._notifier.stream(self._scope, tree) as stream, \
                self._metrics.tree_streams.labels(LISTANDWATCH).track_inprogress():
            self._streams.add(stream)
            try:
                last_listing = pool.listing if pool is not None else ()
                yield self._messages.response(pool)
                self._metrics.listandwatch_sent(self.resource, None)
                last_sent = time.monotonic()
                while True:
                    newer = await stream.next(last_sent=last_sent, quiet=COALESCE_QUIET, max_delay=COALESCE_MAX_DELAY)
                    assert newer is not None  # no timeout given
                    pool = self._pool(newer)
                    listing = pool.listing if pool is not None else ()
                    if listing != last_listing:
                        last_listing = listing
                        yield self._messages.response(pool)  # back here once grpc has written it
                        self._metrics.listandwatch_sent(self.resource, stream.taken_arrival)
                        last_sent = time.monotonic()
            except MailboxClosed:
                return
            finally:
                self._streams.discard(stream)

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[dp.AllocateRequest, dp.AllocateResponse]
    ) -> dp.AllocateResponse:
        # the metrics by hand: prometheus_client's time() and count_exceptions() are two context
        # managers per call, on the one path the kubelet waits on
        started = time.perf_counter()
        self._allocate_calls.inc()
        try:
            return await self._allocate(request, context)
        except Exception:  # a refusal (an aborted call); a cancelled one is not
            self._allocate_refusals.inc()
            raise
        finally:
            self._allocate_duration.observe(time.perf_counter() - started)

    async def _allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[dp.AllocateRequest, dp.AllocateResponse]
    ) -> dp.AllocateResponse:
        if not request.container_requests:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"Allocate for {self.resource}: no container_requests")
        pool = self._pool()
        response = dp.AllocateResponse()
        for index, container_request in enumerate(request.container_requests):
            device_ids = list(container_request.devices_ids)
            problem = request_problem(pool, self.resource, device_ids, self._holders)
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
            fill_container_response(response.container_responses.add(), allocation)
        return response

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

"""Granting and releasing host leases.

A grant is decided on the event loop's one thread and its devices are held (``LeaseBook.reserve``)
in the same step, so two clients never get one device; only the lease file's write (in a worker
thread) is awaited. Which devices may be had is the one rule of ``daemon.holdings``; a count is
filled by the pool's ``allocationPolicy`` when it has one (as the kubelet's
GetPreferredAllocation would be answered), on the asked NUMA node first, else in ID order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NoReturn

import grpc
from trio_asyncio import trio_as_aio

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon.cdi import with_cdi_names
from daemon.core import AllocationError, ResourcePool
from daemon.core._allocation import HandlerFailed
from daemon.core._handler import AnyHandler, Hooks, allocate_container
from daemon.core._notifier import Notifier
from daemon.holdings import KUBELET_HELD, LEASE_ASKS, LOST_BOOK, UNKNOWN, VANISHED, Holdings, Refusal, refusal
from daemon.sockets import refuse

from ._leases import Lease, LeaseBook, LeaseError, NotEnoughFree

log = logging.getLogger("devplugd.host")

MAX_COUNT = 65536

_Context = grpc.aio.ServicerContext[host.AllocateRequest, host.Lease]


class Granter:
    def __init__(self, notifier: Notifier, handlers: Mapping[str, AnyHandler], leases: LeaseBook,
                 holdings: Holdings, why_empty: Callable[[str], str | None] | None = None,
                 with_cdi: bool = True) -> None:
        self._notifier = notifier
        self._why_empty = why_empty  # why a pool has no devices at all, from its handler
        self._hooks = {name: Hooks.of(handler) for name, handler in handlers.items()}
        self._leases = leases
        self._holdings = holdings
        self._with_cdi = with_cdi

    def _problem(self, pool: ResourcePool, device_id: str) -> str | None:
        why = refusal(pool, device_id, LEASE_ASKS, self._holdings.holder)
        if why is None:
            return None
        subject = f"device {device_id!r}" if why.reason == UNKNOWN else f"device {device_id!r} of {pool.resource}"
        return f"{subject} {why.predicate}"

    def choose(self, pool: ResourcePool, request: host.AllocateRequest) -> list[str]:
        """The devices to lease; LeaseError (NotEnoughFree) says why there are none."""
        if request.device_ids:
            chosen = list(dict.fromkeys(request.device_ids))
            if len(chosen) != len(request.device_ids):
                raise LeaseError("a device ID is requested more than once")
            for device_id in chosen:
                if (problem := self._problem(pool, device_id)) is not None:
                    raise LeaseError(problem)
            return chosen
        if not 1 <= request.count <= MAX_COUNT:
            raise LeaseError("ask for a count of at least 1 or name the devices")
        if not pool.devices:
            empty = self._why_empty(pool.resource) if self._why_empty is not None else None
            raise NotEnoughFree(f"{pool.resource} has no devices on this host"
                                + (f": {empty}" if empty else "") + f" ({request.count} requested)")
        refused = {i: why for i in pool.devices if (why := refusal(pool, i, LEASE_ASKS, self._holdings.holder))}
        free = [i for i in sorted(pool.devices) if i not in refused]
        if len(free) < request.count:
            raise NotEnoughFree(f"{request.count} devices of {pool.resource} requested, {len(free)} free"
                                + _not_free(refused))
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

    async def grant(self, request: host.AllocateRequest, context: _Context) -> Lease:
        tree = self._notifier.tree
        pool = tree.pools.get(request.resource)
        if pool is None:
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"no resource {request.resource!r}")
        if not request.owner:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "an owner name is required")
        hooks = self._hooks[pool.handler]
        # From the choice to the reservation nothing yields: two clients never get one device.
        try:
            chosen = self.choose(pool, request)
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
        self._leases.reserve(lease)  # its devices leave the kubelet's lists now, not after the write
        try:
            await trio_as_aio(self._leases.add)(lease)  # on disk before anyone hears of it
        except OSError as error:
            log.error("lease of %s failed: cannot write %s: %s", request.resource, self._leases.path, error,
                      extra={"RESOURCE": request.resource})
            await refuse(context, grpc.StatusCode.INTERNAL, f"lease failed: {error}")
        log.info("leased %s of %s to %s as %s", ",".join(chosen), pool.resource, request.owner, lease.lease,
                 extra={"RESOURCE": pool.resource, "EVENT": "lease"})
        return lease

    async def release(self, lease_id: str, context: grpc.aio.ServicerContext[host.ReleaseRequest,
                                                                             host.ReleaseResponse]) -> Lease:
        try:
            lease: Lease = await trio_as_aio(self._leases.remove)(lease_id)
        except LeaseError as error:
            await _refused(context, grpc.StatusCode.NOT_FOUND, f"{error} (never granted, or already released)")
        except OSError as error:
            log.error("release of %s failed: cannot write %s: %s", lease_id, self._leases.path, error)
            await _refused(context, grpc.StatusCode.INTERNAL, f"release failed: {error}")
        log.info("released %s (%s of %s, owner %s)", lease.lease, ",".join(lease.devices), lease.resource,
                 lease.owner, extra={"RESOURCE": lease.resource, "EVENT": "release"})
        return lease


async def _refused(context: grpc.aio.ServicerContext[host.ReleaseRequest, host.ReleaseResponse],
                   code: grpc.StatusCode, message: str) -> NoReturn:
    await refuse(context, code, message)


_SAID = {KUBELET_HELD: "held by pods", LOST_BOOK: "held by a lost book", VANISHED: "gone"}


def _not_free(refused: Mapping[str, Refusal]) -> str:
    """Why the devices that are not free are not, counted by reason: `` (3 leased, 1 unhealthy)``."""
    reasons: dict[str, int] = {}
    for why in refused.values():
        said = _SAID.get(why.reason, why.reason)
        reasons[said] = reasons.get(said, 0) + 1
    if not reasons:
        return ""
    return " (" + ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())) + ")"

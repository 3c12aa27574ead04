"""What the results of one claim get: the devices they name, each checked by the one
availability rule (``choose``), one allocation per request and pool (``allocate``), and what releases
their side files at Unprepare (``releaser``).

They run for ``ClaimPreparer`` under its lock (``allocate`` and the release in the worker thread
that writes the claim's CDI spec or removes it, and the checkpoint); none writes anything but
what a handler's Allocate writes or releases (netDevice pools' device-info files).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from daemon.core import AllocationError, ContainerAllocation, ResourcePool
from daemon.core._allocation import HandlerFailed
from daemon.core._handler import Hooks, allocate_container
from daemon.core._tree import DeviceTree
from daemon.holdings import HolderLookup, claim_asks, refusal, road_refusal

from ._claims import AllocationResult, ClaimRef, ClaimRefused
from ._claimspecs import Chosen
from ._devices import SharesOf, unhealthy_taint_effect
from ._names import device_name, pool_name
from ._prepared import PreparedClaim, PreparedDevice

log = logging.getLogger("devplugd.dra")

Allocations = list[tuple[list[Chosen], ContainerAllocation]]


def choose(tree: DeviceTree, node: str, cdi_kind: str, ref: ClaimRef, results: Sequence[AllocationResult],
           before_loss: bool, holder: HolderLookup, shares_of: SharesOf = lambda pool: {}) -> list[Chosen]:
    """Each device of the results (one per device and share: its requests merged), checked by
    the one rule; ClaimRefused names the first that cannot be had. A result naming a shared
    device (published as one device with many shares, ``shares_of``) gets as many of its
    shares as it consumed, the first the rule lets this claim have."""
    pools = {pool_name(node, resource): pool for resource, pool in tree.pools.items()}
    names: dict[str, dict[str, str]] = {}  # pool name -> device name -> device ID
    shared: dict[str, dict[str, Sequence[str]]] = {}  # pool name -> shared device's name -> its shares
    taken: set[tuple[str, str]] = set()  # (resource, device or share ID) given to this claim already
    merged: dict[tuple[str, str, str | None], list[AllocationResult]] = {}
    for result in results:
        merged.setdefault((result.pool, result.device, result.share_id), []).append(result)
    chosen: list[Chosen] = []
    for (pool_label, name, share_id), device_results in merged.items():
        pool = pools.get(pool_label)
        if pool is None:
            raise ClaimRefused(f"{ref.label}: pool {pool_label!r} is not a pool of this node ({node})")
        admin_access = all(result.admin_access for result in device_results)
        asker = claim_asks(ref.uid, admin_access=admin_access, prepared_before_loss=before_loss,
                           takes_unhealthy=unhealthy_taint_effect(pool) is not None)
        if road_refusal(pool, asker) is not None:
            raise ClaimRefused(f"{ref.label}: pool {pool_label!r} ({pool.resource}) is not a DRA pool of this "
                               f"node (it is served through {pool.road})")
        ids = names.get(pool_label)
        if ids is None:
            ids = names[pool_label] = {device_name(device_id): device_id for device_id in pool.devices}
        device_id = ids.get(name)
        if device_id is not None:
            if (pool.resource, device_id) in taken:  # results merge by share ID: two of them here
                raise ClaimRefused(f"{ref.label}: device {name!r} ({device_id} of {pool.resource}) is named with "
                                   f"different share IDs, but it is not shared")
            taken.add((pool.resource, device_id))
            if (why := refusal(pool, device_id, asker, holder)) is not None:
                raise ClaimRefused(f"{ref.label}: device {name!r} ({device_id} of {pool.resource}) {why.predicate}")
            device_ids = [device_id]
        else:
            if pool_label not in shared:
                shared[pool_label] = {device_name(base): share_ids for base, share_ids in shares_of(pool).items()}
            shares = shared[pool_label].get(name)
            if shares is None:
                raise ClaimRefused(f"{ref.label}: device {name!r} is not in pool {pool_label!r}")
            wanted = max(result.shares for result in device_results)
            free = [i for i in shares if (pool.resource, i) not in taken and refusal(pool, i, asker, holder) is None]
            if len(free) < wanted:
                reasons = sorted({why.predicate for i in shares if (why := refusal(pool, i, asker, holder))})
                raise ClaimRefused(f"{ref.label}: device {name!r} of {pool.resource} has {len(free)} of its "
                                   f"{len(shares)} shares free, the claim consumes {wanted}; the others "
                                   f"{'; '.join(reasons) or 'are taken by this claim already'}")
            device_ids = free[:wanted]
            taken.update((pool.resource, i) for i in device_ids)
        # the main requests: the pod spec and the kubelet know no subrequest (KEP-4816)
        requests = tuple(dict.fromkeys(result.main_request for result in device_results))
        for device_id in device_ids:  # a share's CDI device is named after the share: unique in the claim
            device = PreparedDevice(pool.resource, device_id, pool_label, name, requests, admin_access,
                                    f"{cdi_kind}={ref.uid}-{device_name(device_id)}", share_id)
            chosen.append(Chosen(pool, device))
    return chosen


def allocate(hooks_of: Mapping[str, Hooks], ref: ClaimRef, chosen: Sequence[Chosen]) -> Allocations:
    """(worker thread) One allocation per (main) request and pool, with the devices it is for;
    ClaimRefused says what failed."""
    by_request: dict[tuple[str, str], list[Chosen]] = {}
    for item in chosen:
        request = item.device.request_names[0] if item.device.request_names else ""
        by_request.setdefault((item.pool.resource, request), []).append(item)
    allocations: Allocations = []
    for (resource, _request), items in by_request.items():
        pool = items[0].pool
        hooks = hooks_of.get(pool.handler)
        if hooks is None:
            raise ClaimRefused(f"{ref.label}: {resource} has no handler {pool.handler!r}")
        device_ids = [item.device.device_id for item in items]
        try:
            allocation = allocate_container(hooks, pool, device_ids)
        except (AllocationError, OSError, HandlerFailed) as error:
            raise ClaimRefused(f"{ref.label}: allocating {', '.join(device_ids)} of {resource} failed: "
                               f"{error}") from error
        if allocation.annotations:
            log.warning("%s: the annotations %s of %s have no place in a CDI spec; left out", ref.label,
                        ", ".join(sorted(allocation.annotations)), resource, extra={"RESOURCE": resource})
        allocations.append((items, allocation))
    return allocations


def releaser(hooks_of: Mapping[str, Hooks], claims: Mapping[str, PreparedClaim], uid: str,
             devices: Sequence[tuple[ResourcePool, PreparedDevice]]) -> Callable[[], None]:
    """What releases the side files of ``devices`` of claim ``uid`` that no other prepared claim
    (of ``claims``) shares, worked out now, to call in a worker thread; a handler that fails is
    logged (a stale side file is rewritten by the next allocation)."""
    shared = {(d.resource, d.device_id) for claim in claims.values() if claim.uid != uid for d in claim.devices}
    by_pool: dict[str, tuple[ResourcePool, list[str]]] = {}
    for pool, device in devices:
        if (device.resource, device.device_id) not in shared:
            by_pool.setdefault(pool.resource, (pool, []))[1].append(device.device_id)
    work = [(resource, pool, device_ids, hooks.releaser) for resource, (pool, device_ids) in by_pool.items()
            if (hooks := hooks_of.get(pool.handler)) is not None and hooks.releaser is not None]

    def release() -> None:
        for resource, pool, device_ids, handler in work:
            try:
                handler.release_side_files(pool, device_ids)
            except Exception:
                log.exception("handler %s failed to release the side files of %s of %s", pool.handler,
                              ", ".join(device_ids), resource, extra={"RESOURCE": resource})
    return release

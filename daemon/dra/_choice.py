"""What the results of one claim get: the devices they name, each checked by the one
availability rule (``choose``), and one allocation per request and pool (``allocate``).

Both run for ``ClaimPreparer`` under its lock; neither writes anything but what a handler's
Allocate writes (netDevice pools' device-info files).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import trio

from daemon.core import AllocationError, ContainerAllocation
from daemon.core._allocation import HandlerFailed
from daemon.core._handler import Hooks, allocate_container
from daemon.core._tree import DeviceTree
from daemon.holdings import HolderLookup, claim_asks, refusal, road_refusal

from ._claims import AllocationResult, ClaimRef, ClaimRefused, PreparedDevice
from ._claimspecs import Chosen
from ._names import device_name, pool_name

log = logging.getLogger("devplugd.dra")

Allocations = list[tuple[list[Chosen], ContainerAllocation]]


def choose(tree: DeviceTree, node: str, cdi_kind: str, ref: ClaimRef, results: Sequence[AllocationResult],
           before_loss: bool, holder: HolderLookup) -> list[Chosen]:
    """Each device of the results (one per device: its requests merged), checked by the one
    rule; ClaimRefused names the first that cannot be had."""
    pools = {pool_name(node, resource): pool for resource, pool in tree.pools.items()}
    names: dict[str, dict[str, str]] = {}  # pool name -> device name -> device ID
    merged: dict[tuple[str, str], list[AllocationResult]] = {}
    for result in results:
        merged.setdefault((result.pool, result.device), []).append(result)
    chosen: list[Chosen] = []
    for (pool_label, name), device_results in merged.items():
        pool = pools.get(pool_label)
        if pool is None:
            raise ClaimRefused(f"{ref.label}: pool {pool_label!r} is not a pool of this node ({node})")
        admin_access = all(result.admin_access for result in device_results)
        asker = claim_asks(ref.uid, admin_access=admin_access, prepared_before_loss=before_loss)
        if road_refusal(pool, asker) is not None:
            raise ClaimRefused(f"{ref.label}: pool {pool_label!r} ({pool.resource}) is not a DRA pool of this "
                               f"node (it is served through {pool.road})")
        ids = names.get(pool_label)
        if ids is None:
            ids = names[pool_label] = {device_name(device_id): device_id for device_id in pool.devices}
        device_id = ids.get(name)
        if device_id is None:
            raise ClaimRefused(f"{ref.label}: device {name!r} is not in pool {pool_label!r}")
        if (why := refusal(pool, device_id, asker, holder)) is not None:
            raise ClaimRefused(f"{ref.label}: device {name!r} ({device_id} of {pool.resource}) {why.predicate}")
        # the main requests: the pod spec and the kubelet know no subrequest (KEP-4816)
        requests = tuple(dict.fromkeys(result.main_request for result in device_results))
        share_id = next((result.share_id for result in device_results if result.share_id), None)
        device = PreparedDevice(pool.resource, device_id, pool_label, name, requests, admin_access,
                                f"{cdi_kind}={ref.uid}-{name}", share_id)
        chosen.append(Chosen(pool, device))
    return chosen


async def allocate(hooks_of: Mapping[str, Hooks], ref: ClaimRef, chosen: Sequence[Chosen]) -> Allocations:
    """One allocation per (main) request and pool, with the devices it is for, in a worker
    thread; ClaimRefused says what failed."""
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
            allocation = await trio.to_thread.run_sync(allocate_container, hooks, pool, device_ids)
        except (AllocationError, OSError, HandlerFailed) as error:
            raise ClaimRefused(f"{ref.label}: allocating {', '.join(device_ids)} of {resource} failed: "
                               f"{error}") from error
        if allocation.annotations:
            log.warning("%s: the annotations %s of %s have no place in a CDI spec; left out", ref.label,
                        ", ".join(sorted(allocation.annotations)), resource, extra={"RESOURCE": resource})
        allocations.append((items, allocation))
    return allocations

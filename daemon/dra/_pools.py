"""What the tree's pools ask of the API server: the devices each DRA pool publishes, and which
device-plugin pools are withheld while slices from a time they were DRA pools are still there.

``DraPools`` is the DRA driver's subscriber side: each tree it is offered becomes the slices the
publisher should have (``slice_devices`` of each pool on the DRA road, worked out again only for
a pool that changed, and then only for its devices whose record changed). The publisher tells it
which pools have slices on the server after each round; a pool whose config says
``devicePlugin`` and that still has slices is *withheld* (served neither way) until they are
deleted, and ``on_withheld`` tells the daemon which pools have slices whenever that changes (with the
reason when the withheld ones changed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from daemon.core import ResourcePool
from daemon.core._config import DRA_API
from daemon.core._handler import Hooks
from daemon.core._tree import DRA_ROAD, DeviceTree

from ._devices import Memo, pool_shares, slice_devices, unhealthy_taint_effect
from ._names import pool_name
from ._publisher import SlicePublisher, WantedPool
from ._slices import MAX_DEVICES_PER_SLICE, MAX_TAINTED_DEVICES_PER_SLICE
from ._view import JsonObject

log = logging.getLogger("devplugd.dra")


class DraPools:
    def __init__(self, driver: str, node_name: str, hooks: Mapping[str, Hooks], publisher: SlicePublisher,
                 on_withheld: Callable[[frozenset[str], str], None] = lambda resources, why: None) -> None:
        self._driver = driver
        self._node = node_name
        self._hooks = hooks
        self._publisher = publisher
        self._on_withheld = on_withheld
        self._tree = DeviceTree.empty()
        # resource -> (the pool as last offered, its WantedPool, the memo of slice_devices for it)
        self._pools: dict[str, tuple[ResourcePool, WantedPool, Memo]] = {}
        self._seen_problems: set[str] = set()  # what slice_devices logged already: once in all
        self._on_server: frozenset[str] = frozenset()  # pool names with slices on the server
        self._told: frozenset[str] = frozenset()  # the pools with slices, as last told

    def offer(self, tree: DeviceTree) -> None:
        self._tree = tree
        wanted: dict[str, WantedPool] = {}
        kept: dict[str, tuple[ResourcePool, WantedPool, Memo]] = {}
        for resource, pool in tree.pools.items():
            if pool.road != DRA_ROAD:
                continue
            cached = self._pools.get(resource)
            if cached is not None and cached[0] is pool:
                pool_wanted, memo = cached[1], cached[2]
            else:
                # a reload may change what the describer says: a new pool config, a new memo
                memo = cached[2] if cached is not None and cached[0].pool_config is pool.pool_config else Memo()
                hooks = self._hooks.get(pool.handler)
                effect = unhealthy_taint_effect(pool)
                describer = hooks.describer if hooks is not None else None
                shares = pool_shares(self._hooks, pool)
                devices: list[JsonObject] = slice_devices(
                    pool, self._driver, describer, taint_effect=effect, shares=shares, seen=self._seen_problems,
                    memo=memo)
                # for a server that drops consumable capacity: the shares as devices of their own
                unshared = slice_devices(pool, self._driver, describer, taint_effect=effect,
                                         seen=self._seen_problems) if shares else None
                max_devices = MAX_DEVICES_PER_SLICE if effect is None and not shares else MAX_TAINTED_DEVICES_PER_SLICE
                if cached is not None and (cached[1].devices, cached[1].unshared, cached[1].max_devices) == (
                        devices, unshared, max_devices):
                    pool_wanted = cached[1]  # the same devices: the same wanted pool, written or not
                else:
                    pool_wanted = WantedPool(resource, devices, tree.arrival, max_devices, unshared)
            kept[resource] = (pool, pool_wanted, memo)
            wanted[pool_name(self._node, resource)] = pool_wanted
        self._pools = kept
        elsewhere = frozenset(pool_name(self._node, r) for r, p in tree.pools.items() if p.road != DRA_ROAD)
        self._publisher.update(wanted, elsewhere)
        self._update_withheld()

    def on_server(self, pools: frozenset[str]) -> None:
        """The publisher's word after each round: the pools (by name) that have slices now."""
        self._on_server = pools
        self._update_withheld()

    def _update_withheld(self) -> None:
        """Tell which of the tree's pools have slices on the server whenever that changes (the
        assembly withholds those the config serves through the device-plugin API; a pool that
        left the config, or moved, is told too), with a reason when the withheld ones changed."""
        tree = self._tree
        published = frozenset(r for r in tree.pools if pool_name(self._node, r) in self._on_server)
        if published == self._told:
            return
        device_plugin = frozenset(r for r, pool in tree.pools.items()
                                  if pool.pool_config.entry.allocation_api != DRA_API)
        before, now = self._told & device_plugin, published & device_plugin
        self._told = published
        reason = ""
        if now != before:
            if released := before - now:
                log.info("DRA: the slices of %s are deleted; the kubelet gets it now", ", ".join(sorted(released)),
                         extra={"EVENT": "dra"})
            reason = "slices withdrawn" if released else "slices to withdraw"
        self._on_withheld(published, reason)

"""The one builder of the daemon's trees for tests: a pool entry as the config parser makes it,
a ResourcePool of devices (plain ones from their IDs, or the records given), a DeviceTree of pools.

    pool("example.com/things", ["d1", "d2"], unhealthy=["d2"], road=DRA_ROAD)
    pool(configured, handler.build(facts, [configured])[configured.resource])  # a handler's own pool
    tree(pool(...), pool(...))  # the next version; tree(..., version=3) for a given one

Every pool has a real ``ConfiguredPool`` (the type says so, and the daemon reads it: the pool's
allocation API, its entry), never ``None``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from daemon.core import UNHEALTHY, ConfiguredPool, DeviceInfo, ResourcePool
from daemon.core._config import DEVICE_PLUGIN_API, DRA_API, parse_config
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, DeviceTree

TEST_HANDLER = "test"
TEST_DEVICE_TYPE = "test"

_versions = itertools.count(1)


def configured(resource: str, *, handler: str = TEST_HANDLER, api: str = DEVICE_PLUGIN_API,
               spec: object = None, unhealthy_taint: str | None = None) -> ConfiguredPool[Any]:
    """``resource`` (``<prefix>/<name>``) as the config parser makes its entry: no selectors,
    served through ``api`` (with ``unhealthyTaint`` when given), with ``handler``'s parsed spec
    ``spec``. A new object each call (the daemon tells a reloaded pool by its config's identity)."""
    prefix, name = resource.split("/", 1)
    entry: dict[str, Any] = {"resourceName": name, "deviceType": TEST_DEVICE_TYPE, "allocationApi": api,
                             "selectors": {}}
    if unhealthy_taint is not None:
        entry["unhealthyTaint"] = unhealthy_taint
    document = {"resourceList": [entry]}
    parsers = {TEST_DEVICE_TYPE: (handler, lambda entry: spec)}
    (only,) = parse_config(json.dumps(document), "test", prefix, parsers).pools
    return only


def pool(resource: str | ConfiguredPool[Any], devices: Mapping[str, DeviceInfo] | Iterable[str] = (), *,
         unhealthy: Collection[str] = (), road: str | None = None, api: str | None = None,
         handler: str = TEST_HANDLER, leased: Iterable[str] = (), vanished: Iterable[str] = (),
         claimed: Iterable[str] = (), kubelet_held: Iterable[str] = (), lost_book: str = "",
         unhealthy_taint: str | None = None) -> ResourcePool:
    """A pool as the tree holds it. ``resource`` is a name (its config is made, served through
    ``api``: DRA when ``road`` is DRA's, else the device-plugin API; ``unhealthy_taint`` its
    ``unhealthyTaint``) or a handler's own
    ``ConfiguredPool`` (its resource and handler are the pool's, its road DRA's when it says so).
    ``devices`` are records by ID, or IDs (plain healthy devices); ``unhealthy`` IDs among them
    are Unhealthy. The rest are the pool's holds, as in ResourcePool."""
    if isinstance(resource, ConfiguredPool):
        config = resource
        if road is None:
            road = DRA_ROAD if config.entry.allocation_api == DRA_API else DEVICE_PLUGIN_ROAD
    else:
        road = road or DEVICE_PLUGIN_ROAD
        config = configured(resource, handler=handler, api=api or (DRA_API if road == DRA_ROAD else DEVICE_PLUGIN_API),
                            unhealthy_taint=unhealthy_taint)
    records = dict(devices) if isinstance(devices, Mapping) else {device_id: DeviceInfo() for device_id in devices}
    for device_id in unhealthy:
        records[device_id] = replace(records[device_id], health=UNHEALTHY)
    return ResourcePool(config.resource, config.handler, config, MappingProxyType(records),
                        leased=frozenset(leased), vanished=frozenset(vanished), road=road, claimed=frozenset(claimed),
                        kubelet_held=frozenset(kubelet_held), lost_book=lost_book)


def tree(*pools: ResourcePool, version: int | None = None, arrival: float | None = None) -> DeviceTree:
    """A tree of ``pools`` at ``version`` (by default the next of a counter shared by every test,
    so trees built one after another are newer)."""
    return DeviceTree.build(next(_versions) if version is None else version, pools, arrival)


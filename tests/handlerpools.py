"""A handler's pools from config entries, parsed and built as the daemon does it: the shared part
of the per-handler test drivers (tests/pci.py, usbpools.py, auxpools.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from daemon.core import ConfiguredPool, ContainerAllocation, DeviceInfo, ResourcePool
from daemon.core._config import parse_config
from daemon.core._handler import Hooks, allocate_container
from tests import trees


def configure_pools(handler: Any, entries: Iterable[dict[str, Any]], prefix: str,
                    device_type: str | None = None) -> list[ConfiguredPool[Any]]:
    """``entries`` as the ``resourceList`` of a config file, parsed with ``handler``'s parser
    (``device_type``, when given, is put in every entry)."""
    listed = [{"deviceType": device_type, **entry} if device_type else entry for entry in entries]
    table = {kind: (handler.name, handler.parse_pool) for kind in handler.device_types}
    return list(parse_config(json.dumps({"resourceList": listed}), "t", prefix, table).pools)


def build_by_name(handler: Any, facts: Any, configured: list[ConfiguredPool[Any]]) -> dict[str, dict[str, DeviceInfo]]:
    """The devices of each pool built from ``facts``, by resource name without the prefix."""
    built = handler.build(facts, configured)
    return {pool.resource.split("/")[1]: dict(built[pool.resource]) for pool in configured}


def pool_of(handler: Any, configured: ConfiguredPool[Any], facts: Any = None) -> ResourcePool:
    """The one pool ``configured`` as the tree holds it, built from ``facts`` (a fresh scan by default)."""
    facts = handler.scan() if facts is None else facts
    devices: Mapping[str, DeviceInfo] = handler.build(facts, [configured])[configured.resource]
    return trees.pool(configured, devices)


def allocate_as_daemon(handler: Any, pool: ResourcePool, device_ids: list[str]) -> ContainerAllocation:
    """The Allocate answer the daemon would give (the handler's hooks, else the default answer)."""
    return allocate_container(Hooks.of(handler), pool, device_ids)

"""Pools of device nodes (``deviceType: devNode``), e.g. KubeVirt-style shared ``/dev/kvm``.

``{"resourceName": "kvm", "deviceType": "devNode", "selectors": {"paths": ["/dev/kvm"]},
"count": 110, "permissions": "rw"}``: ``paths`` are globs of absolute ``/dev`` paths (``*``, ``?``
and ``[...]`` within one path component) looked up under ``--dev-root``; each matching character
or block device node is offered ``count`` times. A selector may also (or instead) pick nodes by
what udev knows of them, ``"udev": {"subsystems": [...], "properties": {...},
"parentProperties": {...}}`` (see ``_selectors``); with udev's symlinks known,
``"containerPath": "by-id"`` (or ``"by-path"``) puts the node in the container at its first such
link, ``/dev/serial/by-id/usb-FTDI_...``, instead of its kernel name. Device IDs come from the
node's path (``net/tun`` -> ``net_tun``, with ``-0`` ... ``-<count-1>`` when ``count`` > 1), so
they are the same across restarts. A node claimed by an earlier pool is not offered by a later one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from daemon.core import (
    HEALTHY,
    AttributeValue,
    ConfigError,
    ConfiguredPool,
    DeviceInfo,
    DeviceMap,
    DeviceSpec,
    Event,
    Explanation,
    HandlerContext,
    Offered,
    PoolEntry,
    ResourcePool,
    Resync,
    UEvent,
)
from daemon.handlers._devnodes import parse_permissions, relative_devname
from daemon.handlers._functions import is_pcie_error_report
from daemon.handlers.devnode._explain import explain as explain_node
from daemon.handlers.devnode._explain import why_empty as why_pool_empty
from daemon.handlers.devnode._nodes import NodeRecord, read_record, scan_records
from daemon.handlers.devnode._selectors import NodeSelector, parse_selector, path_matches

if TYPE_CHECKING:
    from daemon.core import DeviceDescriber, DeviceSharer, Explainer, Handler

log = logging.getLogger("devplugd.devnode")

MAX_COUNT = 100_000
CONTAINER_PATHS = ("kernel", "by-id", "by-path")
# events that change what a node's ancestors say of themselves (a driver bound, a rule rerun)
ANCESTOR_ACTIONS = frozenset({"change", "bind", "unbind", "move"})


@dataclass(frozen=True)
class DevNodePoolSpec:
    selectors: tuple[NodeSelector, ...]
    count: int
    permissions: str
    container_path: str = "kernel"


def device_ids(record: NodeRecord, count: int) -> list[str]:
    base = record.relative_path.replace("/", "_")
    return [base] if count == 1 else [f"{base}-{index}" for index in range(count)]


class DevNodeHandler:
    name: ClassVar[str] = "devnode"
    device_types: ClassVar[frozenset[str]] = frozenset({"devNode"})
    # Any subsystem can have device nodes (misc, block, macvtap, mem, tty, vfio, ...): all uevents
    # are read; those without DEVNAME matter only to the nodes below them.
    subsystems: ClassVar[frozenset[str]] = frozenset()
    wants_links: ClassVar[bool] = False

    def __init__(self, context: HandlerContext) -> None:
        self._context = context

    def parse_pool(self, entry: PoolEntry) -> DevNodePoolSpec:
        selectors = tuple(parse_selector(selector) for selector in entry.selectors)
        count = entry.raw.get("count", int, 1)
        if not 1 <= count <= MAX_COUNT:
            raise ConfigError(entry.raw.path_of("count"), f"must be between 1 and {MAX_COUNT}, not {count}")
        container_path = entry.raw.get("containerPath", str, "kernel")
        if container_path not in CONTAINER_PATHS:
            raise ConfigError(entry.raw.path_of("containerPath"),
                              f"must be one of {', '.join(CONTAINER_PATHS)}, not {container_path!r}")
        spec = DevNodePoolSpec(selectors, count, parse_permissions(entry), container_path)
        self._say_what_is_unseen(entry, spec)
        return spec

    def _say_what_is_unseen(self, entry: PoolEntry, spec: DevNodePoolSpec) -> None:
        """Without udev, its keys and links are not there to match: say so once per pool."""
        if self._context.udev_data is not None:
            return
        unseen = sorted({key for selector in spec.selectors if selector.udev for key in selector.udev.udev_only_keys()})
        if unseen:
            log.warning("%s: the uevents come from the kernel, not udev: udev property %s never match, so "
                        "the selectors that use them select nothing", entry.json_path, ", ".join(unseen),
                        extra={"CONFIG_PATH": entry.json_path})
        if spec.container_path != "kernel":
            log.warning("%s: containerPath %r needs udev's symlinks, which are unknown without udev: nodes "
                        "keep their kernel names", entry.json_path, spec.container_path,
                        extra={"CONFIG_PATH": entry.json_path})

    def scan(self) -> Mapping[str, NodeRecord]:
        """Every character and block device node under the dev root, by relative path."""
        return MappingProxyType(scan_records(self._context))

    def fold(self, facts: Mapping[str, NodeRecord], event: Event) -> Mapping[str, NodeRecord]:
        """A uevent with ``DEVNAME`` adds, replaces or removes that one node (devtmpfs made or
        removed it before the kernel sent the event); a ``change``, ``bind`` or ``unbind`` of a
        device above nodes reads those nodes again (not a PCIe error report: see
        ``is_pcie_error_report``); ``Resync`` scans everything again."""
        if isinstance(event, Resync):
            return self.scan()
        if not isinstance(event, UEvent):
            return facts
        if not event.devname:
            return self._fold_ancestor(facts, event)
        relative = relative_devname(event.devname)
        if relative is None:
            log.warning("ignoring uevent %s %s: DEVNAME %r is outside /dev", event.action, event.devpath,
                        event.devname, extra={"EVENT": event.action})
            return facts
        record = None if event.action == "remove" else read_record(self._context, relative, event=event)
        if facts.get(relative) == record:
            return facts
        updated = dict(facts)
        if record is None:
            updated.pop(relative, None)
        else:
            updated[relative] = record
        return MappingProxyType(updated)

    def _fold_ancestor(self, facts: Mapping[str, NodeRecord], event: UEvent) -> Mapping[str, NodeRecord]:
        if event.action not in ANCESTOR_ACTIONS or is_pcie_error_report(event):
            return facts
        below = event.devpath.rstrip("/") + "/"
        stale = [relative for relative, record in facts.items() if record.devpath and record.devpath.startswith(below)]
        if not stale:
            return facts
        updated = dict(facts)
        cache: dict[str, Mapping[str, str]] = {}
        for relative in stale:
            record = read_record(self._context, relative, cache, earlier=facts[relative])
            if record is None:
                updated.pop(relative, None)
            else:
                updated[relative] = record
        return MappingProxyType(updated)

    def build(
        self, facts: Mapping[str, NodeRecord], pools: Sequence[ConfiguredPool[DevNodePoolSpec]]
    ) -> dict[str, DeviceMap]:
        taken: set[str] = set()
        result: dict[str, DeviceMap] = {}
        for pool in pools:
            spec: DevNodePoolSpec = pool.spec
            devices: dict[str, DeviceInfo] = {}
            for record in self._selected(facts, spec.selectors, taken):
                taken.add(record.relative_path)
                info = DeviceInfo(
                    health=HEALTHY,
                    numa_nodes=(record.numa_node,)
                    if record.numa_node is not None and not pool.entry.exclude_topology
                    else (),
                    specs=(DeviceSpec(self._container_path(record, spec), record.host_path, spec.permissions),),
                    details=record,
                )
                ids = device_ids(record, spec.count)
                if clash := [device_id for device_id in ids if device_id in devices]:
                    log.warning("%s: %s gives device ID %r already used by another node; skipped",
                                pool.resource, record.host_path, clash[0], extra={"RESOURCE": pool.resource})
                    continue
                devices.update(dict.fromkeys(ids, info))
            result[pool.resource] = devices
        return result

    @staticmethod
    def _selected(facts: Mapping[str, NodeRecord], selectors: Sequence[NodeSelector],
                  taken: set[str]) -> list[NodeRecord]:
        """The nodes the selectors pick, in selector order, then glob order, then path order."""
        picked: dict[str, NodeRecord] = {}
        for selector in selectors:
            for parts in selector.patterns or (None,):
                for relative, record in facts.items():
                    if relative in taken or relative in picked:
                        continue
                    if parts is not None and not path_matches(parts, relative):
                        continue
                    if selector.udev is None or selector.udev.matches(record.properties, record.ancestors):
                        picked[relative] = record
        return list(picked.values())

    @staticmethod
    def _container_path(record: NodeRecord, spec: DevNodePoolSpec) -> str:
        if spec.container_path == "kernel":
            return record.host_path
        return record.first_link(spec.container_path) or record.host_path

    # Explainer: why a node is or is not in a pool (devplugd explain).
    def explain(self, facts: Mapping[str, NodeRecord], pools: Sequence[ConfiguredPool[DevNodePoolSpec]],
                device: str, offered: Offered) -> Explanation | None:
        return explain_node(facts, pools, device, offered)

    def why_empty(self, facts: Mapping[str, NodeRecord], pools: Sequence[ConfiguredPool[DevNodePoolSpec]],
                  resource: str) -> str:
        return why_pool_empty(facts, pools, resource)

    # DeviceDescriber: a DRA device says which node it puts in the container.
    def shares(self, pool: ResourcePool) -> Mapping[str, Sequence[str]]:
        """With ``count`` > 1, each node's ``count`` device IDs are shares of the node (its base
        ID, ``net_tun`` for ``net_tun-0`` ...); through DRA the node is one device."""
        spec: DevNodePoolSpec = pool.pool_config.spec
        if spec.count == 1:
            return {}
        groups: dict[str, list[str]] = {}
        for device_id, info in pool.devices.items():
            record: NodeRecord = info.details
            groups.setdefault(device_ids(record, 1)[0], []).append(device_id)
        return {base: sorted(ids, key=lambda i: int(i.rpartition("-")[2])) for base, ids in groups.items()}

    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        """``path``: the device node's path inside the container (``/dev/net/tun``)."""
        specs = pool.devices[device_id].specs
        return {"path": specs[0].container_path} if specs else {}


if TYPE_CHECKING:
    # mypy checks here that DevNodeHandler keeps the handler contract and the hooks it opts into.
    _handler: type[Handler[Mapping[str, NodeRecord], DevNodePoolSpec]] = DevNodeHandler
    _describer: type[DeviceDescriber] = DevNodeHandler
    _sharer: type[DeviceSharer] = DevNodeHandler
    _explainer: type[Explainer] = DevNodeHandler

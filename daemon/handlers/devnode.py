"""Pools of device nodes (``deviceType: devNode``), e.g. KubeVirt-style shared ``/dev/kvm``.

``{"resourceName": "kvm", "deviceType": "devNode", "selectors": {"paths": ["/dev/kvm"]},
"count": 110, "permissions": "rw"}``: ``paths`` are globs of absolute ``/dev`` paths (``*``, ``?``
and ``[...]`` within one path component) looked up under ``--dev-root``; each matching character
or block device node is offered ``count`` times. Device IDs come from the node's path
(``net/tun`` -> ``net_tun``, with ``-0`` ... ``-<count-1>`` when ``count`` > 1), so they are the
same across restarts. A node claimed by an earlier pool is not offered by a later one.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
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
    HandlerContext,
    PoolEntry,
    ResourcePool,
    Resync,
    SysfsError,
    UEvent,
    read_int,
)

if TYPE_CHECKING:
    from daemon.core import DeviceDescriber, Handler

log = logging.getLogger("devplugd.devnode")

DEV_PREFIX = "/dev/"
MAX_COUNT = 100_000


@dataclass(frozen=True, slots=True)
class DeviceNode:
    relative_path: str
    kind: str  # "char" or "block"
    major: int
    minor: int
    numa_node: int | None

    @property
    def host_path(self) -> str:
        return DEV_PREFIX + self.relative_path


@dataclass(frozen=True)
class DevNodePoolSpec:
    patterns: tuple[tuple[str, ...], ...]  # each glob split into path components
    count: int
    permissions: str


def _parse_glob(pattern: str, json_path: str) -> tuple[str, ...]:
    if not pattern.startswith(DEV_PREFIX) or pattern.rstrip("/") == "/dev":
        raise ConfigError(json_path, f"{pattern!r} must be an absolute path under /dev/")
    parts = tuple(part for part in pattern[len(DEV_PREFIX):].split("/") if part)
    if any(part in (".", "..") for part in parts):
        raise ConfigError(json_path, f"{pattern!r} must not contain '.' or '..'")
    return parts


def _matches(parts: tuple[str, ...], relative_path: str) -> bool:
    path_parts = relative_path.split("/")
    return len(path_parts) == len(parts) and all(map(fnmatchcase, path_parts, parts))


def device_ids(node: DeviceNode, count: int) -> list[str]:
    base = node.relative_path.replace("/", "_")
    return [base] if count == 1 else [f"{base}-{index}" for index in range(count)]


class DevNodeHandler:
    name: ClassVar[str] = "devnode"
    device_types: ClassVar[frozenset[str]] = frozenset({"devNode"})
    # Any subsystem can have device nodes (misc, block, macvtap, mem, tty, vfio, ...): all uevents
    # are read and those without DEVNAME are ignored at once.
    subsystems: ClassVar[frozenset[str]] = frozenset()
    wants_links: ClassVar[bool] = False

    def __init__(self, context: HandlerContext) -> None:
        self._context = context

    def parse_pool(self, entry: PoolEntry) -> DevNodePoolSpec:
        patterns: list[tuple[str, ...]] = []
        for selector in entry.selectors:
            paths = selector.string_list("paths")
            if not paths:
                raise ConfigError(selector.path_of("paths"), "is required: a list of /dev globs")
            patterns.extend(
                _parse_glob(path, f"{selector.path_of('paths')}[{index}]") for index, path in enumerate(paths)
            )
        count = entry.raw.get("count", int, 1)
        if not 1 <= count <= MAX_COUNT:
            raise ConfigError(entry.raw.path_of("count"), f"must be between 1 and {MAX_COUNT}, not {count}")
        permissions = entry.raw.get("permissions", str, "rw")
        if not permissions or set(permissions) - set("rwm"):
            raise ConfigError(entry.raw.path_of("permissions"), f"{permissions!r} must be letters from 'rwm'")
        return DevNodePoolSpec(patterns=tuple(patterns), count=count, permissions=permissions)

    def scan(self) -> Mapping[str, DeviceNode]:
        """Every character and block device node under the dev root, by relative path."""
        nodes: dict[str, DeviceNode] = {}
        root = os.fspath(self._context.dev_root)
        for directory, subdirectories, files in os.walk(root):
            subdirectories.sort()
            for file_name in sorted(files):
                relative = os.path.relpath(os.path.join(directory, file_name), root)
                node = self._read_node(relative)
                if node is not None:
                    nodes[relative] = node
        return MappingProxyType(nodes)

    def _read_node(self, relative: str) -> DeviceNode | None:
        """The device node at ``relative`` under the dev root, or ``None`` if there is none."""
        try:
            status = os.stat(os.path.join(self._context.dev_root, relative), follow_symlinks=False)
        except (OSError, ValueError):
            return None  # gone (or never there): not a device
        if stat.S_ISCHR(status.st_mode):
            kind = "char"
        elif stat.S_ISBLK(status.st_mode):
            kind = "block"
        else:
            return None
        major, minor = os.major(status.st_rdev), os.minor(status.st_rdev)
        return DeviceNode(relative, kind, major, minor, self._numa_node(kind, major, minor))

    def _numa_node(self, kind: str, major: int, minor: int) -> int | None:
        path = self._context.sysfs_root / "dev" / kind / f"{major}:{minor}" / "device" / "numa_node"
        try:
            numa = read_int(path)
        except SysfsError as error:
            log.warning("ignoring NUMA node of %d:%d: %s", major, minor, error)
            return None
        return numa if numa is not None and numa >= 0 else None

    def fold(self, facts: Mapping[str, DeviceNode], event: Event) -> Mapping[str, DeviceNode]:
        """A uevent with ``DEVNAME`` adds, replaces or removes that one node (devtmpfs made or
        removed it before the kernel sent the event); ``Resync`` scans everything again."""
        if isinstance(event, Resync):
            return self.scan()
        if not isinstance(event, UEvent) or not event.devname:
            return facts
        relative = os.path.normpath(event.devname)
        if relative.startswith(("/", "..")):
            log.warning("ignoring uevent %s %s: DEVNAME %r is outside /dev", event.action, event.devpath,
                        event.devname, extra={"EVENT": event.action})
            return facts
        node = None if event.action == "remove" else self._read_node(relative)
        if facts.get(relative) == node:
            return facts
        updated = dict(facts)
        if node is None:
            updated.pop(relative, None)
        else:
            updated[relative] = node
        return MappingProxyType(updated)

    def build(
        self, facts: Mapping[str, DeviceNode], pools: Sequence[ConfiguredPool[DevNodePoolSpec]]
    ) -> dict[str, DeviceMap]:
        taken: set[str] = set()
        result: dict[str, DeviceMap] = {}
        for pool in pools:
            spec: DevNodePoolSpec = pool.spec
            devices: dict[str, DeviceInfo] = {}
            for parts in spec.patterns:
                for relative, node in facts.items():
                    if relative in taken or not _matches(parts, relative):
                        continue
                    taken.add(relative)
                    info = DeviceInfo(
                        health=HEALTHY,
                        numa_nodes=(node.numa_node,)
                        if node.numa_node is not None and not pool.entry.exclude_topology
                        else (),
                        specs=(DeviceSpec(node.host_path, node.host_path, spec.permissions),),
                        details=node,
                    )
                    ids = device_ids(node, spec.count)
                    if clash := [device_id for device_id in ids if device_id in devices]:
                        log.warning("%s: %s gives device ID %r already used by another node; skipped",
                                    pool.resource, node.host_path, clash[0], extra={"RESOURCE": pool.resource})
                        continue
                    devices.update(dict.fromkeys(ids, info))
            result[pool.resource] = devices
        return result

    # DeviceDescriber: a DRA device says which node it puts in the container.
    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        """``path``: the device node's path inside the container (``/dev/net/tun``)."""
        specs = pool.devices[device_id].specs
        return {"path": specs[0].container_path} if specs else {}


if TYPE_CHECKING:
    # mypy checks here that DevNodeHandler keeps the handler contract and the hooks it opts into.
    _handler: type[Handler[Mapping[str, DeviceNode], DevNodePoolSpec]] = DevNodeHandler
    _describer: type[DeviceDescriber] = DevNodeHandler

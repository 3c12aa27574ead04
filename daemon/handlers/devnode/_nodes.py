"""What the devNode handler knows of one node: the node, its device in sysfs, their properties.

A node's device is found through ``/sys/dev/{char,block}/<major>:<minor>``, a link to its
directory under ``/sys/devices``; its ancestors are the directories above that have a
``uevent`` file. Properties are read as ``daemon.core.device_properties`` reads them (the
kernel's, and udev's when ``udev_data`` is given); symlinks come from udev's entry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from daemon.core import HandlerContext, SysfsError, UEvent, device_properties, read_int, set_by_udev
from daemon.handlers._devnodes import DEV_PREFIX, DeviceNode, stat_node

log = logging.getLogger("devplugd.devnode")

_EMPTY: Mapping[str, str] = MappingProxyType({})
# an event's properties that say something of the event, not of the device
EVENT_ONLY_KEYS = frozenset({"ACTION", "SEQNUM", "SYNTH_UUID", "SYNTH_ARG"})
AncestorCache = dict[str, Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node: DeviceNode
    numa_node: int | None = None
    devpath: str | None = None  # its device below the sysfs root (``/devices/...``), when known
    properties: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    ancestors: tuple[Mapping[str, str], ...] = ()  # nearest first
    links: tuple[str, ...] = ()  # udev's symlinks, relative to /dev

    @property
    def relative_path(self) -> str:
        return self.node.relative_path

    @property
    def host_path(self) -> str:
        return self.node.host_path

    def first_link(self, kind: str) -> str | None:
        """The first (sorted) udev symlink of ``kind`` (``by-id``, ``by-path``), as a /dev path."""
        matching = sorted(link for link in self.links if f"/{kind}/" in f"/{link}")
        return DEV_PREFIX + matching[0] if matching else None


def _devpath_of(context: HandlerContext, node: DeviceNode) -> str | None:
    link = f"{context.sysfs_root}/dev/{node.kind}/{node.major}:{node.minor}"
    try:
        target = os.readlink(link)
    except OSError:
        return None
    devpath = os.path.normpath(os.path.join(f"/dev/{node.kind}", target))
    return devpath if devpath.startswith("/devices/") else None


def _numa_node(context: HandlerContext, node: DeviceNode) -> int | None:
    path = f"{context.sysfs_root}/dev/{node.kind}/{node.major}:{node.minor}/device/numa_node"
    try:
        numa = read_int(path)
    except SysfsError as error:
        log.warning("ignoring NUMA node of %d:%d: %s", node.major, node.minor, error)
        return None
    return numa if numa is not None and numa >= 0 else None


def _ancestors(context: HandlerContext, devpath: str, cache: AncestorCache) -> tuple[Mapping[str, str], ...]:
    found: list[Mapping[str, str]] = []
    parent = os.path.dirname(devpath)
    while parent.startswith("/devices/"):
        if parent not in cache:
            properties, _ = device_properties(context.sysfs_root, parent, context.udev_data)
            cache[parent] = MappingProxyType(properties)
        if cache[parent]:
            found.append(cache[parent])
        parent = os.path.dirname(parent)
    return tuple(found)


def read_record(context: HandlerContext, relative: str, cache: AncestorCache | None = None,
                event: UEvent | None = None, earlier: NodeRecord | None = None) -> NodeRecord | None:
    """The node at ``relative`` below the dev root with what sysfs and udev say of it, or ``None``
    when there is no node. ``event`` (one for this node) adds the properties that sysfs and the
    database did not have: without a readable database (``/run/udev`` not mounted in a container)
    they are the only udev properties there are. ``earlier`` (the node's record before an event
    of one of its ancestors) keeps the udev properties and links only its own event had."""
    node = stat_node(context.dev_root, relative)
    if node is None:
        return None
    devpath = _devpath_of(context, node)
    properties: dict[str, str] = {}
    links: tuple[str, ...] = ()
    ancestors: tuple[Mapping[str, str], ...] = ()
    if devpath is not None:
        properties, entry = device_properties(context.sysfs_root, devpath, context.udev_data)
        links = entry.links
        ancestors = _ancestors(context, devpath, {} if cache is None else cache)
    if event is not None:
        for key, value in event.properties.items():
            if key not in EVENT_ONLY_KEYS:
                properties.setdefault(key, value)  # sysfs and the database, read now, come first
        if not links and context.udev_data is not None and (devlinks := event.properties.get("DEVLINKS")):
            links = tuple(sorted(
                link.removeprefix(DEV_PREFIX) for link in devlinks.split() if link.startswith(DEV_PREFIX)))
    if earlier is not None and earlier.node == node:
        for key, value in earlier.properties.items():
            if set_by_udev(key):
                properties.setdefault(key, value)
        links = links or earlier.links
    return NodeRecord(node, _numa_node(context, node), devpath, MappingProxyType(properties), ancestors, links)


def scan_records(context: HandlerContext) -> dict[str, NodeRecord]:
    """Every character and block node under the dev root, by relative path."""
    records: dict[str, NodeRecord] = {}
    cache: AncestorCache = {}
    root = os.fspath(context.dev_root)
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for file_name in sorted(files):
            relative = os.path.relpath(os.path.join(directory, file_name), root)
            record = read_record(context, relative, cache)
            if record is not None:
                records[relative] = record
    return records

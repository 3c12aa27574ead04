"""DRAResourceHealth (v1alpha1) for the pools served through DRA: the health the kubelet shows in
the status of the pods that hold the devices.

``NodeWatchResources`` sends the health of every device of every DRA pool of the current tree as
one complete list, then a complete list again on each tree in which a DRA device's health, its
reason, or the set of DRA devices changed. A device the handler lost while it is held
(``pool.vanished``) is Unhealthy; a device left out of the ResourceSlices because something holds
it (a host lease, a claim, a device-plugin pod) still reports its health, since its holder is
what the report is for.

Messages are made as ListAndWatch's are (``daemon.wire``): each device's encoding is kept while
its health stays, and a message is the kept encodings joined and parsed in one C call, so one
changed device of 4096 costs one encoding. A pool that is the same object in the next tree gives
the same part of the report. ``last_updated_time`` is when the device's health (or its message)
was last seen to change in this daemon's run, which is what it says.

The kubelet stamps each device with the time a message *arrived* (not ``last_updated_time``) and
takes it as Unknown once that is older than ``health_check_timeout_seconds`` (30 s when 0, and
always 30 s for kubelets before 1.35, which do not read the field). So an unchanged list is sent
again every ``resend_interval`` (10 s: three chances within the timeout); the kubelet counts an
unchanged repeat as no change, so pods are not touched. The timeout we send is that same 30 s:
a daemon that stopped sending is Unknown after it on every kubelet alike, and a daemon that
stopped altogether ends the stream, which clears the driver's health in the kubelet at once.

Each stream is a subscriber of the notifier as the host API's Watch streams are, through a
``TreeStream``: ``offer(tree)`` returns at once, a slow stream is conflated to the newest tree
and never delays the event loop, and a tree in which a DRA device became Unhealthy is never
conflated away (a PCIe recovery of 0.3 ms is an Unhealthy report, then a Healthy one); it is
unsubscribed when the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from daemon._generated.drahealth.v1alpha1 import api_pb2 as health
from daemon.core import HEALTHY, DeviceInfo, ResourcePool
from daemon.core._notifier import MailboxClosed, Notifier, TreeStream, devices_scope
from daemon.core._tree import DRA_ROAD, DeviceTree
from daemon.metrics import DRA_HEALTH, Metrics
from daemon.wire import framed

from ._devices import SharesOf
from ._names import device_name, pool_name

log = logging.getLogger("devplugd.dra")

HEALTH_TIMEOUT_SECONDS = 30  # the kubelet's DefaultHealthTimeout, stated rather than implied
RESEND_INTERVAL = 10.0
VANISHED_MESSAGE = "the device is no longer on the host"

Entry = tuple["health.HealthStatus", str]  # (HealthStatus, message) of one device


@dataclass(frozen=True, eq=False)
class PoolHealth:
    """One DRA pool's part of a health message: each device's entry by device name, and the
    part's encoding (each device framed as a ``devices`` element, joined). Never changed after
    it is made: a stream may hold it while the next is made from it."""

    pool: ResourcePool
    names: Mapping[str, str]  # device ID -> device name
    entries: Mapping[str, Entry]
    encoded: Mapping[str, bytes]  # device name -> its framed DeviceHealth
    body: bytes

    def __eq__(self, other: object) -> bool:  # what a kubelet sees: the entries
        return isinstance(other, PoolHealth) and (self.entries is other.entries or self.entries == other.entries)

    __hash__ = None  # type: ignore[assignment]


# what one message says: per pool name, its part
HealthReport = Mapping[str, PoolHealth]


def _entry(device_id: str, info: DeviceInfo, vanished: frozenset[str]) -> Entry:
    if device_id in vanished:
        return health.UNHEALTHY, VANISHED_MESSAGE
    return (health.HEALTHY, "") if info.health == HEALTHY else (health.UNHEALTHY, "")


def _encoded(pool_id: str, device: str, entry: Entry, now: int) -> bytes:
    return framed(1, health.DeviceHealth(
        device=health.DeviceIdentifier(pool_name=pool_id, device_name=device), health=entry[0],
        last_updated_time=now, health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
        message=entry[1]).SerializeToString())


class HealthReports:
    """The health of every device of every DRA pool of a tree, and the messages saying it.
    Shared by the streams (it is pure): a pool that is the same object as last time gives the
    same part; a changed one is its last part with the devices whose record changed made again
    (a carrier flip in a pool of 4096 encodes one device). A shared device (``shares_of``) is
    one entry under the name its slice publishes, which its claims' results name: Unhealthy
    when a share is."""

    def __init__(self, node_name: str, shares_of: SharesOf = lambda pool: {}) -> None:
        self._node_name = node_name
        self._shares_of = shares_of
        self._pools: dict[str, PoolHealth] = {}

    def report(self, tree: DeviceTree) -> HealthReport:
        pools: dict[str, PoolHealth] = {}
        for resource, pool in tree.pools.items():
            if pool.road != DRA_ROAD:
                continue
            last = self._pools.get(resource)
            pools[resource] = last if last is not None and last.pool is pool else self._part(resource, pool, last)
        self._pools = pools
        return {pool_name(self._node_name, resource): part for resource, part in sorted(pools.items())}

    def _part(self, resource: str, pool: ResourcePool, last: PoolHealth | None) -> PoolHealth:
        pool_id = pool_name(self._node_name, resource)
        now = int(time.time())
        shares = self._shares_of(pool)
        # devices came or went, or shares are one device (a few): all of it
        if shares or last is None or last.pool.devices.keys() != pool.devices.keys():
            known = {share: device_name(shared) for shared, ids in shares.items() for share in ids}
            if last is not None:
                known = {**last.names, **known}
            names = {device_id: known.get(device_id) or device_name(device_id) for device_id in pool.devices}
            entries: dict[str, Entry] = {}
            for device_id, info in pool.devices.items():
                entry, name = _entry(device_id, info, pool.vanished), names[device_id]
                if name not in entries or (entries[name][0] == health.HEALTHY and entry[0] != health.HEALTHY):
                    entries[name] = entry
            old_entries, old_encoded = (last.entries, last.encoded) if last is not None else ({}, {})
            encoded = {name: old_encoded[name] if old_entries.get(name) == entry else
                       _encoded(pool_id, name, entry, now) for name, entry in entries.items()}
            return PoolHealth(pool, names, entries, encoded, b"".join(encoded.values()))
        before, vanished_changed = last.pool.devices, last.pool.vanished ^ pool.vanished
        changed = {i: info for i, info in pool.devices.items() if before[i] is not info or i in vanished_changed}
        news = {last.names[i]: entry for i, info in changed.items()
                if (entry := _entry(i, info, pool.vanished)) != last.entries[last.names[i]]}
        if not news:  # nothing a kubelet sees changed
            return PoolHealth(pool, last.names, last.entries, last.encoded, last.body)
        entries, encoded = dict(last.entries), dict(last.encoded)
        for name, entry in news.items():
            entries[name], encoded[name] = entry, _encoded(pool_id, name, entry, now)
        return PoolHealth(pool, last.names, entries, encoded, b"".join(encoded.values()))


def message_bytes(report: HealthReport) -> bytes:
    """The serialized ``NodeWatchResourcesResponse`` (v1alpha1 and v1 alike) of ``report``."""
    return b"".join(part.body for part in report.values())


def count_devices(report: HealthReport) -> tuple[int, int]:
    """(devices, unhealthy ones) of a report."""
    return (sum(len(part.entries) for part in report.values()),
            sum(1 for part in report.values() for status, _ in part.entries.values() if status != health.HEALTHY))


def _dra_pools_changed(old: DeviceTree, new: DeviceTree) -> bool:
    """Whether a pool that is (or was) served through DRA is not the same object in both trees:
    one identity check per resource, so the report is rebuilt only when it may differ."""
    return any(
        (diff.old is not None and diff.old.road == DRA_ROAD) or (diff.new is not None and diff.new.road == DRA_ROAD)
        for diff in new.diff(old).resources.values()
    )


# a health stream follows the devices of the DRA pools
HEALTH_SCOPE = devices_scope(_dra_pools_changed, lambda pool: pool.road == DRA_ROAD)


class HealthServicer:
    """``DRAResourceHealth`` (v1alpha1 and v1: the same messages) for the DRA pools of
    ``notifier``'s trees on ``node_name``. ``watch`` yields each message serialized: the sockets
    send the bytes as they are under either name (``_sockets.py``), with no message made in
    Python in between (for 4096 devices: 2 to 3 ms of every change saved)."""

    def __init__(self, notifier: Notifier, node_name: str, resend_interval: float = RESEND_INTERVAL,
                 metrics: Metrics | None = None, shares_of: SharesOf = lambda pool: {}) -> None:
        self._notifier = notifier
        self._node_name = node_name
        self._resend_interval = resend_interval
        self._metrics = metrics or Metrics()
        self._streams: set[TreeStream] = set()
        self._reports = HealthReports(node_name, shares_of)

    def close_streams(self) -> None:
        """End every open stream (before the server that carries them stops)."""
        for stream in tuple(self._streams):
            stream.close()

    async def watch(self) -> AsyncIterator[bytes]:
        first = self._notifier.tree
        loop = asyncio.get_running_loop()
        with self._notifier.stream(HEALTH_SCOPE, first) as stream, \
                self._metrics.tree_streams.labels(DRA_HEALTH).track_inprogress():
            self._streams.add(stream)
            try:
                reports = self._reports
                report = reports.report(first)
                log.info("kubelet watches DRA device health: %d devices", count_devices(report)[0])
                yield message_bytes(report)
                resend_at = loop.time() + self._resend_interval
                while True:
                    tree = await stream.next(resend_at - loop.time())
                    if tree is not None:
                        new_report = reports.report(tree)
                        if new_report == report:
                            continue
                        log.info("DRA device health changed (tree %d): %d devices, %d unhealthy",
                                 tree.version, *count_devices(new_report), extra={"EVENT": f"tree:{tree.version}"})
                        report = new_report
                    elif loop.time() < resend_at:
                        continue
                    yield message_bytes(report)
                    resend_at = loop.time() + self._resend_interval
            except MailboxClosed:
                return
            finally:
                self._streams.discard(stream)

"""The devices of each prepared claim in the claim's ``status.devices`` (KEP-4817, GA in 1.37).

For each device a claim is prepared with, one entry ``{driver, pool, device}`` (and the result's
``shareID`` when it has one) and, for a device with a network interface on the host (a VF on a
kernel net driver, an SF: the handler's ``netdev`` attribute, as its ResourceSlice publishes it),
``networkData`` with its ``interfaceName`` and ``hardwareAddress`` (sysfs
``class/net/<netdev>/address``); once written it stays while the claim is prepared, so a write
after the interface went into the pod's network namespace (at a restart) keeps it. At Unprepare
our entries go. Entries of other drivers are kept as they are.

Written in the background, never on Prepare's way: Prepare says what it wants (``prepared``,
``unprepared``) and returns. One task per claim, ``START_DELAY`` after the wish (so that its
calls, a worker thread building and parsing HTTP with the GIL held, start once the kubelet's
answer is out, not while the daemon is sending it; a claim unprepared meanwhile is one write),
reads the claim (GET), puts our entries in place
of those there and writes the status back (PUT, with the resourceVersion it read as the
precondition: a 409 is read again and retried at once, up to ``CONFLICT_RETRIES`` times in a
row). Nothing is written when the claim says so already. Any other failure is logged (the first
of a row at warning level, the next ones at debug) and retried with a backoff capped at
``RETRY_MAX``, with the newest wish for the claim; a claim gone from the API server (404), or
there with another UID (replaced), ends it: its status is nobody's to write any more. At start
every prepared claim is wished prepared again, so a write a restart cut short is made.

The calls run in worker threads of their own (``WRITER_THREADS``), so a slow API server never
holds the threads Prepare's allocations need.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from daemon.core import SysfsError, read_text
from daemon.core._handler import Hooks
from daemon.core._tree import DeviceTree
from daemon.metrics import Metrics
from daemon.supervise import Backoff

from ._kube import Conflict, Kube, KubeError, NotFound
from ._prepared import PreparedClaim, PreparedDevice

log = logging.getLogger("devplugd.dra")

START_DELAY = 0.005  # seconds from a claim's wish to its task's first write
RETRY_FIRST = 0.5  # seconds before the first retry of a failed write, doubled each time
RETRY_MAX = 30.0
CONFLICT_RETRIES = 5
WRITER_THREADS = 2

JsonObject = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class _Wish:
    """What a claim's status should say of our devices (``devices`` empty: nothing)."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]

    @property
    def label(self) -> str:
        return f"claim {self.namespace}/{self.name}"


class _Gone(Exception):
    """The claim is not there to write: deleted, or replaced by another of that name."""


class ClaimStatusWriter:
    """``prepared``/``unprepared``/``forget`` (on the trio thread, returning at once) and ``run``,
    the task that writes them (see the module docstring)."""

    def __init__(self, driver: str, kube: Callable[[], Awaitable[Kube]], tree: Callable[[], DeviceTree],
                 hooks: Mapping[str, Hooks], sysfs_root: Path, metrics: Metrics | None = None, *,
                 retry_first: float = RETRY_FIRST, retry_max: float = RETRY_MAX,
                 start_delay: float = START_DELAY) -> None:
        self._driver = driver
        self._kube = kube
        self._tree = tree
        self._hooks = hooks
        self._sysfs_root = sysfs_root
        self._metrics = metrics or Metrics()
        self._retry_first = retry_first
        self._retry_max = retry_max
        self._start_delay = start_delay
        self._wishes: dict[str, _Wish] = {}  # claim UID -> the newest wish not written yet
        self._working: set[str] = set()  # claim UIDs with a task
        self._nursery: trio.Nursery | None = None
        self._limiter = trio.CapacityLimiter(WRITER_THREADS)

    def prepared(self, claim: PreparedClaim) -> None:
        """``claim`` is prepared: its status should list its devices."""
        self._wish(_Wish(claim.namespace, claim.name, claim.uid, claim.devices))

    def unprepared(self, claim: PreparedClaim) -> None:
        """``claim`` is unprepared: its status should list none of ours."""
        self._wish(_Wish(claim.namespace, claim.name, claim.uid, ()))

    def forget(self, uid: str) -> None:
        """Write nothing more for claim ``uid`` (it is gone from the API server, or replaced)."""
        self._wishes.pop(uid, None)

    @property
    def pending(self) -> frozenset[str]:
        """The UIDs of the claims whose status is not written yet."""
        return frozenset(self._wishes)

    def _wish(self, wish: _Wish) -> None:
        self._wishes[wish.uid] = wish
        if self._nursery is not None and wish.uid not in self._working:
            self._working.add(wish.uid)
            self._nursery.start_soon(self._work, wish.uid)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write every wish, those made before too, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for uid in list(self._wishes):
                self._working.add(uid)
                nursery.start_soon(self._work, uid)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # -- one claim's task ------------------------------------------------------------------------
    async def _work(self, uid: str) -> None:
        backoff = Backoff(self._retry_first, self._retry_max)
        failures = 0
        try:
            await trio.sleep(self._start_delay)
            while (wish := self._wishes.get(uid)) is not None:
                try:
                    await self._write(wish)
                except _Gone as gone:
                    log.info("%s (UID %s): its status is not written: %s", wish.label, uid, gone,
                             extra={"EVENT": "claim-status"})
                    self._wishes.pop(uid, None)
                    return
                except Exception as error:
                    self._metrics.dra_claim_status_writes.labels("failed").inc()
                    failures += 1
                    delay = backoff.next_delay()
                    if failures == 1:
                        log.warning("%s (UID %s): cannot write its status.devices: %s; retrying (every %g s at "
                                    "most)", wish.label, uid, _describe(error), self._retry_max,
                                    exc_info=not isinstance(error, KubeError), extra={"EVENT": "claim-status"})
                    else:
                        log.debug("%s (UID %s): cannot write its status.devices: %s; retrying in %.1f s",
                                  wish.label, uid, _describe(error), delay)
                    await trio.sleep(delay)
                    continue
                if failures:
                    log.info("%s (UID %s): status.devices written after %d failed tries", wish.label, uid, failures,
                             extra={"EVENT": "claim-status"})
                failures = 0
                backoff.reset()
                if self._wishes.get(uid) is wish:
                    del self._wishes[uid]
        finally:
            self._working.discard(uid)

    async def _write(self, wish: _Wish) -> None:
        """Make the claim's status say ``wish``: read, replace our entries, write (409: again)."""
        kube = await self._kube()
        ours = await self._entries(wish.devices)
        for _ in range(CONFLICT_RETRIES):
            claim = await self._call(kube.get_claim, wish.namespace, wish.name)
            uid = claim.get("metadata", {}).get("uid")
            if uid != wish.uid:
                raise _Gone(f"the API server has UID {uid} under that name now")
            status = claim.get("status")
            status = dict(status) if isinstance(status, Mapping) else {}
            current = status.get("devices")
            current = list(current) if isinstance(current, list) else []
            theirs = [entry for entry in current if not _is_ours(entry, self._driver)]
            there = [entry for entry in current if _is_ours(entry, self._driver)]
            ours = _keeping_network_data(ours, there)
            if there == ours:
                return  # says so already
            if theirs or ours:
                status["devices"] = theirs + ours
            else:
                status.pop("devices", None)
            claim["status"] = status
            try:
                await self._call(kube.replace_claim_status, wish.namespace, wish.name, claim)
            except Conflict:
                continue  # written by someone since our read: read it again
            self._metrics.dra_claim_status_writes.labels("written").inc()
            return
        raise KubeError(f"UPDATE resourceclaim {wish.namespace}/{wish.name} status: {CONFLICT_RETRIES} conflicts "
                        "in a row")

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(method, *args, limiter=self._limiter, abandon_on_cancel=True)
        except NotFound as error:
            raise _Gone("it is gone from the API server") from error

    # -- our entries -----------------------------------------------------------------------------
    async def _entries(self, devices: Sequence[PreparedDevice]) -> list[JsonObject]:
        """The ``status.devices`` entries of ``devices``, in their order."""
        tree = self._tree()
        netdevs = {index: netdev for index, device in enumerate(devices)
                   if (netdev := self._netdev(tree, device)) is not None}
        addresses = await trio.to_thread.run_sync(self.read_addresses, sorted(set(netdevs.values())),
                                                  limiter=self._limiter) if netdevs else {}
        entries: list[JsonObject] = []
        listed: set[tuple[str, str, str | None]] = set()
        for index, device in enumerate(devices):
            if (key := (device.pool_name, device.device_name, device.share_id)) in listed:
                continue  # a result that consumed two shares of a device is one entry
            listed.add(key)
            entry: JsonObject = {"driver": self._driver, "pool": device.pool_name, "device": device.device_name}
            if device.share_id is not None:
                entry["shareID"] = device.share_id
            if (netdev := netdevs.get(index)) is not None:
                network = {"interfaceName": netdev}
                if (address := addresses.get(netdev)) is not None:
                    network["hardwareAddress"] = address
                entry["networkData"] = network
            entries.append(entry)
        return entries

    def _netdev(self, tree: DeviceTree, device: PreparedDevice) -> str | None:
        """The device's network interface on the host, as its handler describes the device (the
        ``netdev`` attribute of its ResourceSlice), or ``None``."""
        pool = tree.pools.get(device.resource)
        if pool is None or device.device_id not in pool.devices:
            return None
        hooks = self._hooks.get(pool.handler)
        if hooks is None or hooks.describer is None:
            return None
        try:
            netdev = hooks.describer.dra_attributes(pool, device.device_id).get("netdev")
        except Exception:
            log.exception("handler %s failed to describe %s of %s", pool.handler, device.device_id, pool.resource,
                          extra={"RESOURCE": pool.resource})
            return None
        return netdev if isinstance(netdev, str) and netdev else None

    def read_addresses(self, netdevs: Sequence[str]) -> dict[str, str]:
        """(worker thread) Each interface's hardware address, as sysfs has it (the claim's status
        and its device metadata say it in networkData)."""
        addresses = {}
        for netdev in netdevs:
            path = self._sysfs_root / "class" / "net" / netdev / "address"
            try:
                address = read_text(path)
            except SysfsError as error:
                log.warning("no hardware address for %s in a claim's status: %s", netdev, error)
                continue
            if address:
                addresses[netdev] = address
        return addresses


def _keeping_network_data(ours: list[JsonObject], there: Sequence[Any]) -> list[JsonObject]:
    """``ours``, each entry without ``networkData`` given the one the status has for the same
    device and share: an interface moved into the pod's network namespace (as CNI does with a
    VF) is gone from the host's sysfs, yet it is the device's interface while the claim holds it."""
    known = {(e.get("pool"), e.get("device"), e.get("shareID")): e["networkData"] for e in there
             if isinstance(e, Mapping) and isinstance(e.get("networkData"), Mapping)}
    return [entry if "networkData" in entry or (key := (entry["pool"], entry["device"], entry.get("shareID")))
            not in known else {**entry, "networkData": known[key]} for entry in ours]


def _is_ours(entry: Any, driver: str) -> bool:
    return isinstance(entry, Mapping) and entry.get("driver") == driver


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, KubeError) else f"{type(error).__name__}: {error}"

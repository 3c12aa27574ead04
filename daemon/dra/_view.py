"""Our ResourceSlices as the API server has them, as far as we know: what the publisher
reconciles against.

``follow`` lists our own slices (``spec.driver``, ``spec.nodeName``) and then watches them,
listing again after 410 Gone or a broken stream. That is how slices deleted by someone else (the
kubelet wipes a node's slices when it starts, and a driver's when it loses it) are noticed and
published again, and slices changed by someone else put right. Our own writes go into the same
view at once (``written``, ``deleting``, ``gone``), so a watch event that lags behind them never
makes us write twice: an event older than what the view holds is ignored, and a slice we
deleted stays deleted in the view until its DELETED event (or a newer version) comes.

``lock`` is held by a publisher's sync round and by a list with its taking over the view: a list
taken before our writes and answered after them would undo them in the view.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from daemon.supervise import Backoff

from ._kube import Expired, Kube, KubeError, StreamEnded

log = logging.getLogger("devplugd.dra")

WATCH_LASTED = 5.0  # seconds: a watch that ran this long was a good one

JsonObject = dict[str, Any]

_INDEX = re.compile(r"([0-9a-f]{5,})-")


def pool_of(slice_object: Mapping[str, Any]) -> str:
    return str(((slice_object.get("spec") or {}).get("pool") or {}).get("name", ""))


def slice_index(name: str) -> int | None:
    """A slice's place in its pool, from the hex index its name starts with (``generate_name``)."""
    match = _INDEX.match(name)
    return int(match.group(1), 16) if match else None


def version_of(obj: Mapping[str, Any]) -> int:
    """The object's resourceVersion as a number (-1 when it is not one: then it is taken as new)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", ""))
    except ValueError:
        return -1


class Written:
    """What a pool's slices on the server hold as far as we know: the devices we wrote (or found
    there as we would have written them), their generation, the resourceVersion of each slice as
    we left it (any other version means someone else wrote since), and each slice's devices as
    the entries we wrote, by slice name: while the versions are ours, a change is placed against
    these (an unchanged device is the same object, compared in no time) instead of the server's
    copies (4096 devices compared field by field: tens of milliseconds)."""

    __slots__ = ("_where", "devices", "generation", "slices", "versions")

    def __init__(self, devices: list[JsonObject], generation: int, versions: dict[str, str],
                 slices: dict[str, list[Mapping[str, Any]]], where: dict[str, str] | None = None) -> None:
        self.devices = devices
        self.generation = generation
        self.versions = versions
        self.slices = slices
        self._where = where

    def largest(self) -> int:
        """The most devices one of the slices holds."""
        return max((len(devices) for devices in self.slices.values()), default=0)

    def where(self) -> dict[str, str]:
        """Each device's slice, by device name (made once, then kept while the names stay)."""
        if self._where is None:
            self._where = {device["name"]: name for name, devices in self.slices.items() for device in devices}
        return self._where


def versions_of(slices: Sequence[JsonObject]) -> dict[str, str]:
    """Each slice's resourceVersion, by name."""
    return {s["metadata"]["name"]: str(s["metadata"].get("resourceVersion")) for s in slices}


class Complaints:
    """One error line per distinct reason (``KubeError.reason``: every call to a server that is
    down is one), whichever task meets it, and a line when things work again."""

    def __init__(self, retry_max: float) -> None:
        self._last: str | None = None
        self.retry_max = retry_max

    def failed(self, error: KubeError, retry_in: float) -> None:
        if error.reason != self._last:
            log.error("DRA: %s; retrying (every %g s at most)", error, self.retry_max, extra={"EVENT": "dra"})
            self._last = error.reason
        else:
            log.debug("DRA: %s; retrying in %.1f s", error, retry_in)

    def recovered(self, what: str) -> None:
        if self._last is not None:
            log.info("DRA: %s", what, extra={"EVENT": "dra"})
            self._last = None


class SliceView:
    """Our slices by name. ``on_change`` is told when someone else changed them (the publisher
    then looks again); ``ours(name)`` says whether a slice is one we wrote (for the log)."""

    def __init__(self, on_change: Callable[[], None], ours: Callable[[str], bool] = lambda name: False) -> None:
        self._on_change = on_change
        self._ours = ours
        self._server: dict[str, JsonObject] = {}
        # slice name -> the resourceVersion it is deleted at: by us (until its DELETED event), or as
        # a DELETED event said (so that our create's answer arriving after it is not taken as live)
        self._deleted: dict[str, int] = {}
        self.listed = trio.Event()
        self.lock = trio.Lock()
        self.deleted_by_someone = False  # since the publisher last looked: the Node may be new

    # -- reading ---------------------------------------------------------------------------------
    def slices_of(self, pool: str) -> list[JsonObject]:
        return sorted((s for s in self._server.values() if pool_of(s) == pool), key=lambda s: s["metadata"]["name"])

    def pools(self) -> frozenset[str]:
        return frozenset(pool_of(s) for s in self._server.values())

    # -- our own writes --------------------------------------------------------------------------
    def written(self, obj: JsonObject) -> bool:
        """Our create or update was answered with ``obj``; False when the slice was deleted (a
        wipe) before the answer reached us, and is not in the view."""
        name = obj["metadata"]["name"]
        if self._deleted.get(name, -1) >= version_of(obj):
            return False
        self._server[name] = obj
        return True

    def read_again(self, name: str, obj: JsonObject | None) -> None:
        """After a 409 or a 404: the slice as the server has it now (``None``: gone)."""
        if obj is None:
            self._server.pop(name, None)
        else:
            self._server[name] = obj

    def deleting(self, obj: JsonObject) -> None:
        """Before our delete call: its DELETED event may come before its answer."""
        self._deleted[obj["metadata"]["name"]] = version_of(obj)

    def gone(self, name: str) -> None:
        """Our delete was answered."""
        self._server.pop(name, None)

    # -- the server's word -----------------------------------------------------------------------
    def replace(self, items: Sequence[JsonObject]) -> None:
        self._server = {item["metadata"]["name"]: item for item in items}
        self._deleted.clear()
        self.listed.set()
        self._on_change()

    def apply_event(self, kind: str, obj: JsonObject) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        version = version_of(obj)
        known = self._server.get(name)
        if name in self._deleted:
            if kind == "DELETED":  # our own delete (its answer may still be on its way): all before it is in
                del self._deleted[name]
                self._server.pop(name, None)
                return
            if version <= self._deleted[name]:
                return  # an event from before our own delete
        if kind == "DELETED":
            # kept even for a slice not in the view yet: our create's answer may come after it
            self._deleted[name] = max(version, self._deleted.get(name, -1))
            if known is not None and version_of(known) <= version:
                del self._server[name]
                if self._ours(name):
                    log.info("DRA: ResourceSlice %s (pool %s) was deleted by someone else; publishing it again",
                             name, pool_of(known), extra={"EVENT": "dra"})
                self.deleted_by_someone = True
                self._on_change()
            return
        if known is not None and version_of(known) >= version >= 0:
            return  # our own write, already in the view
        self._server[name] = obj
        self._on_change()

    async def follow(self, kube: Kube, selector: str, complaints: Complaints) -> None:
        """List our slices, then watch them; list again after 410 Gone or a broken stream."""
        backoff = Backoff(first=0.2, maximum=complaints.retry_max)
        while True:
            try:
                async with self.lock:
                    items, version = await trio.to_thread.run_sync(kube.list_slices, selector,
                                                                   abandon_on_cancel=True)
                    self.replace(items)
                complaints.recovered("watching our ResourceSlices again")
                while True:
                    started = trio.current_time()
                    version = await trio.to_thread.run_sync(self._watch_until_it_ends, kube, selector, version,
                                                            trio.lowlevel.current_trio_token(),
                                                            abandon_on_cancel=True)
                    # the backoff starts again only after a watch that lasted: one the server
                    # ends at once, again and again, is not followed in a tight loop
                    if trio.current_time() - started >= WATCH_LASTED:
                        backoff.reset()
                    else:
                        await trio.sleep(backoff.next_delay())
            except Expired:
                log.debug("DRA: the watch of our ResourceSlices expired; listing them again")
            except StreamEnded as error:  # no failure yet (a proxy resets it too): the list says
                delay = backoff.next_delay()
                log.debug("DRA: %s; listing our ResourceSlices again in %.1f s", error, delay)
                await trio.sleep(delay)
            except KubeError as error:
                delay = backoff.next_delay()
                complaints.failed(error, delay)
                await trio.sleep(delay)

    def _watch_until_it_ends(self, kube: Kube, selector: str, version: str, token: trio.lowlevel.TrioToken) -> str:
        """(worker thread) Follow the watch, handing each event to the trio side; the version to
        watch from next."""
        for kind, obj in kube.watch_slices(selector, version):
            new_version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind != "BOOKMARK":
                trio.from_thread.run_sync(self.apply_event, kind, obj, trio_token=token)
            if new_version:
                version = str(new_version)
        return version

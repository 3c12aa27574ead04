"""The ResourceSlice publisher: a reconciler from the slices we want (``update``: per pool, its
devices) to the API server, in the shape of the Go helper's ``resourceslice.Controller``.

One sync task writes only the pools whose wanted devices differ from what the server has
(``_view.py``), coalesced (a burst of updates is one write of the newest). A pool's devices go out
in slices of at most 128 (64 for a pool that may carry taints or shared devices: the server's
cap). A change that fits the slices there are (``_slices.slice_updates``: a device's entry
replaced, added where a slice has room, removed) is written to the slices it touches alone, at
the generation they have, so the pool stays complete and allocatable throughout. Any other change
raises the generation: every slice of the new generation is written (PUT into the slice whose name
has its index, as the Go helper matches them; ``generateName`` for a new one), and the slices it
no longer needs are deleted only once it is complete (with uid and resourceVersion
preconditions). A 409 re-reads the slice and tries again (a delete too, with the new
preconditions); a 422 is logged with the object and the server's causes and not tried again until
the pool's devices change. Taints keep the ``timeAdded`` they have on the server (``_taints.py``);
a server that drops taints or consumable capacity gets the pool as it can keep it (``_gates.py``).
Slices that already publish what we want (after a restart: the slices of the last run) are
adopted as they are, without a write. Slices of pools we do not want (any more) are deleted;
``on_server`` is told which pools have slices after each round, so the driver knows when a pool
moved back to the device-plugin API may be served there.

With no API server, no credentials or no Node object, one error line is logged (again only when
the reason changes) and everything is retried with a backoff capped at 10 s; the rest of the
daemon does not wait for any of it. At SIGTERM the slices stay: a restart adopts them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from daemon.metrics import Metrics
from daemon.settings import Settings
from daemon.supervise import Backoff

from ._gates import Fallbacks, dropped_gates
from ._kube import ApiLink, Conflict, Invalid, Kube, KubeError, NotFound
from ._slices import MAX_DEVICES_PER_SLICE, placed, replacements, slice_bodies, slice_body, slice_updates
from ._taints import TaintCounts, TaintTimes
from ._view import Complaints, JsonObject, SliceView, Written, slice_index, versions_of

log = logging.getLogger("devplugd.dra")

RETRY_MAX = 10.0
CONFLICT_RETRIES = 5
PARALLEL_WRITES = 8  # slice writes of one pool in flight at once


@dataclass(frozen=True)
class WantedPool:
    """What one pool should publish: its resource, its devices (``devices[]`` entries), when
    the oldest event that changed them reached the event loop (``None``: none did), how many
    devices a slice of it holds (64 for a pool that may carry taints or shared devices: the
    server's cap for a slice with either, so a taint never needs a new slice), and, for a pool
    with shared devices, its devices with each share a device of its own (``unshared``: for a
    server that drops consumable capacity)."""

    resource: str
    devices: list[JsonObject]
    arrival: float | None = None
    max_devices: int = MAX_DEVICES_PER_SLICE
    unshared: list[JsonObject] | None = None


def _essentials(obj: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """What a slice says to its consumers and the garbage collector: its owner and its spec
    without empty fields (the server leaves out an empty ``devices``)."""
    spec = {key: value for key, value in (obj.get("spec") or {}).items() if value not in (None, [], {})}
    return (obj.get("metadata") or {}).get("ownerReferences"), spec


class SlicePublisher:
    def __init__(self, settings: Settings, link: ApiLink, metrics: Metrics | None = None,
                 on_server: Callable[[frozenset[str]], None] = lambda pools: None) -> None:
        self._driver = settings.dra_driver
        self._node = settings.node_name
        self._link = link
        self._metrics = metrics or Metrics()
        self._on_server = on_server
        self._selector = f"spec.driver={self._driver},spec.nodeName={self._node}"
        self._wanted: Mapping[str, WantedPool] = {}
        self._elsewhere: frozenset[str] = frozenset()
        self._wakeup = trio.Event()
        self._node_uid: str | None = None
        self._view = SliceView(self._view_changed, self._written_name)
        self._written: dict[str, Written] = {}  # pool name -> what we wrote
        self._rejected: dict[str, list[JsonObject]] = {}  # pool name -> devices the server refused (422)
        self._answered: dict[str, WantedPool] = {}  # pool name -> the wanted pool last written (reaction time)
        self._complaints = Complaints(RETRY_MAX)  # shared by the tasks: an outage is one error line
        self._writers = trio.CapacityLimiter(PARALLEL_WRITES)
        self._taint_times = TaintTimes()
        self._taint_counts = TaintCounts(self._metrics.dra_device_taints)
        self._fallbacks = Fallbacks()

    def update(self, wanted: Mapping[str, WantedPool], elsewhere: frozenset[str] = frozenset()) -> None:
        """What every pool (by pool name) should publish from now on; a pool left out has its
        slices deleted (``elsewhere``: the pools left out because they are served on another
        road, for the log)."""
        self._wanted = wanted
        self._elsewhere = elsewhere
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    def _view_changed(self) -> None:
        self._wake()
        self._on_server(self._view.pools())  # at once: slices left from the last run of a pool moved back

    def _written_name(self, name: str) -> bool:
        return any(name in written.versions for written in self._written.values())

    # -- the tasks --------------------------------------------------------------------------------
    async def run(self) -> None:
        complaints = self._complaints
        complaints.retry_max = RETRY_MAX
        backoff = Backoff(first=0.2, maximum=RETRY_MAX)
        while True:
            try:
                kube = await self._link.get()
                self._node_uid = await trio.to_thread.run_sync(kube.node_uid, self._node, abandon_on_cancel=True)
                break
            except KubeError as error:  # no slice can be written: counted as a failed write
                if isinstance(error, NotFound):
                    error = KubeError(f"node {self._node} is not on the API server ({error})")
                self._metrics.dra_slice_write_failures.labels("error").inc()
                delay = backoff.next_delay()
                complaints.failed(error, delay)
            await trio.sleep(delay)
        self._metrics.dra_api_connected.set(1)
        complaints.recovered(f"API server {kube.server} reachable; node {self._node} has uid {self._node_uid}")
        log.info("DRA: publishing ResourceSlices of driver %s for node %s on %s", self._driver, self._node,
                 kube.server, extra={"EVENT": "dra"})
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._view.follow, kube, self._selector, complaints)
                await self._sync_forever(kube)
        finally:
            self._metrics.dra_api_connected.set(0)

    async def _sync_forever(self, kube: Kube) -> None:
        await self._view.listed.wait()
        complaints = self._complaints
        backoff = Backoff(first=0.2, maximum=RETRY_MAX)
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            try:
                async with self._view.lock:
                    await self._sync(kube)
            except KubeError as error:
                self._metrics.dra_slice_write_failures.labels("error").inc()
                delay = backoff.next_delay()
                complaints.failed(error, delay)
                await trio.sleep(delay)
                self._wake()  # try again even if nothing else happens
                continue
            finally:  # what is left on the server, even when a write failed
                self._on_server(self._view.pools())
            backoff.reset()
            complaints.recovered("ResourceSlices written again")
            if not self._wakeup.is_set():
                self._metrics.dra_slice_syncs.inc()

    # -- one sync round --------------------------------------------------------------------------
    async def _sync(self, kube: Kube) -> None:
        if self._view.deleted_by_someone:
            await self._read_node_uid(kube)
        wanted = self._wanted
        for gone in self._rejected.keys() - wanted.keys():  # wanted again later, it is tried again
            del self._rejected[gone]
        for pool, pool_wanted in wanted.items():
            devices = self._fallbacks.devices(pool, pool_wanted.devices, pool_wanted.unshared)
            devices, causes = self._taint_times.stamp(pool, devices, functools.partial(self._server_devices, pool))
            if self._up_to_date(pool, devices, pool_wanted.max_devices) or self._rejected.get(pool) == devices:
                self._taint_counts.count(pool_wanted.resource, causes)
                continue
            self._rejected.pop(pool, None)
            if not await self._write_pool(kube, pool, devices, pool_wanted.max_devices):
                continue
            self._taint_counts.count(pool_wanted.resource, causes)
            if pool_wanted.arrival is not None and self._answered.get(pool) is not pool_wanted:
                self._answered[pool] = pool_wanted  # a rewrite of the same answers no event
                self._metrics.dra_reaction.labels(pool_wanted.resource).observe(
                    time.monotonic() - pool_wanted.arrival)
        self._metrics.dra_pools_refused.set(len(self._rejected))
        for pool in sorted(self._view.pools() - wanted.keys()):
            why = "no longer served through DRA" if pool in self._elsewhere else "no longer configured"
            log.info("DRA: deleting the ResourceSlices of pool %s (%s)", pool, why,
                     extra={"EVENT": "dra", "DRA_POOL": pool})
            await self._delete_slices(kube, self._view.slices_of(pool))
            self._written.pop(pool, None)
            self._answered.pop(pool, None)
            self._taint_times.forget(pool)
        self._taint_counts.keep({w.resource for w in wanted.values()})

    def _server_devices(self, pool: str) -> dict[str, JsonObject]:
        """The pool's devices on the server, by name."""
        return {device["name"]: device for item in self._view.slices_of(pool)
                for device in item["spec"].get("devices") or []}

    async def _read_node_uid(self, kube: Kube) -> None:
        """Read the Node's uid again: a node deleted and registered again has a new one, and the
        garbage collector deletes the slices owned by the old (which, written again as they
        were, it would delete again and again)."""
        uid = await trio.to_thread.run_sync(kube.node_uid, self._node, abandon_on_cancel=True)
        self._view.deleted_by_someone = False
        if uid != self._node_uid:
            log.info("DRA: node %s has a new uid %s (was %s); its ResourceSlices are owned by it from now on",
                     self._node, uid, self._node_uid, extra={"EVENT": "dra"})
            self._node_uid = uid

    def _up_to_date(self, pool: str, devices: list[JsonObject], max_devices: int) -> bool:
        """Whether the server's slices of ``pool`` publish ``devices``: they are as we left
        them, or (after a restart, or someone else's write) they are ours, complete at one
        generation, and hold exactly these device entries, in whichever slices: adopted as ours."""
        on_server = self._view.slices_of(pool)
        versions = versions_of(on_server)
        written = self._written.get(pool)
        if written is not None and written.versions == versions:
            # the same objects, where unchanged: fast; slices cut for another cap are cut again
            return written.devices == devices and written.largest() <= max_devices
        if not self._ours(pool, on_server) or slice_updates(on_server, devices, max_devices) != {}:
            return False
        self._written[pool] = Written(devices, on_server[0]["spec"]["pool"]["generation"], versions,
                                       {s["metadata"]["name"]: s["spec"].get("devices") or [] for s in on_server})
        return True

    def _ours(self, pool: str, slices: list[JsonObject]) -> bool:
        """Whether ``slices`` say what ours would, their devices aside: the owner (this node's
        uid now), the driver, the node and the pool's name."""
        expected = _essentials(self._bodies(pool, 0, [])[0])
        return all(_essentials(item)[0] == expected[0]
                   and {key: item["spec"].get(key) for key in ("driver", "nodeName")}
                   == {key: expected[1][key] for key in ("driver", "nodeName")}
                   and item["spec"]["pool"].get("name") == pool for item in slices)

    def _bodies(self, pool: str, generation: int, devices: Sequence[Mapping[str, Any]],
                max_devices: int = MAX_DEVICES_PER_SLICE) -> list[JsonObject]:
        return slice_bodies(driver=self._driver, node_name=self._node, node_uid=self._node_uid,
                            pool_name=pool, generation=generation, devices=devices, max_devices=max_devices)

    async def _write_pool(self, kube: Kube, pool: str, devices: list[JsonObject], max_devices: int,
                          refused: bool = False) -> bool:
        """Publish ``devices`` as the pool's slices; whether the server took them. In place when
        the change fits the slices there are (``slice_updates``: only the slices that change are
        written, at the generation they have, so the pool stays complete and allocatable
        throughout); else at the next generation, every slice written back to back and the
        slices the new generation does not need deleted only once it is complete. A generation
        the server refuses part of leaves the pool incomplete: the devices it took last are
        written again at the next one (``refused``: this is that write)."""
        existing = self._view.slices_of(pool)
        existing_versions = versions_of(existing)
        written = self._written.get(pool)
        held = written.slices if written is not None and written.versions == existing_versions else None
        ours = self._ours(pool, existing)
        # a taint or an attribute changed: found without looking at every device
        replaced = replacements(written.devices, devices, held, written.where()) if (
            ours and written is not None and held is not None and written.largest() <= max_devices) else None
        updates = replaced if replaced is not None else slice_updates(existing, devices, max_devices, held) if (
            ours) else None
        writes: list[tuple[JsonObject, JsonObject | None]]
        if updates is not None:
            generation = int(existing[0]["spec"]["pool"]["generation"])
            by_name = {item["metadata"]["name"]: item for item in existing}
            count = len(existing)
            writes = [(slice_body(driver=self._driver, node_name=self._node, node_uid=self._node_uid, pool_name=pool,
                                  generation=generation, index=slice_index(name) or 0, count=count, devices=kept),
                       by_name[name]) for name, kept in updates.items()]
            obsolete: list[JsonObject] = []
        else:
            generations = [int(s["spec"]["pool"].get("generation", 0)) for s in existing]
            generation = max([*generations, written.generation if written is not None else 0]) + 1
            bodies = self._bodies(pool, generation, devices, max_devices)
            count = len(bodies)
            writes, obsolete = placed(existing, bodies)
        try:
            names, dropped = await self._write_slices(kube, writes)
            await self._delete_slices(kube, obsolete)  # once the new generation is complete
        except Invalid as error:
            again = updates is None and written is not None and not refused  # the pool it was, complete again
            log.error("DRA: the API server refused pool %s (generation %d, %d devices in %d slices): %s; causes: %s; "
                      "not tried again until its devices change%s", pool, generation, len(devices), count, error,
                      "; ".join(error.causes) or "none given", "; the devices it took last are written again"
                      if again else "", extra={"EVENT": "dra", "DRA_POOL": pool})
            self._rejected.setdefault(pool, devices)  # the devices refused first, not those written again
            self._metrics.dra_slice_write_failures.labels("refused").inc()
            if again and written is not None:
                await self._write_pool(kube, pool, written.devices, max_devices, refused=True)
            return False
        slices = {name: held[name] if held is not None else item["spec"].get("devices") or []
                  for name, item in by_name.items()} if updates is not None else {}
        versions = existing_versions if updates is not None else {}
        for (body, _), (name, version) in zip(writes, names):
            slices[name], versions[name] = body["spec"]["devices"], version
        self._written[pool] = Written(devices, generation, versions, slices,
                                      written.where() if replaced is not None and written is not None else None)
        log.info("DRA: pool %s generation %d: %d devices in %d slices (%d written%s)", pool, generation,
                 len(devices), count, len(writes), ", in place" if updates is not None else "",
                 extra={"EVENT": "dra", "DRA_POOL": pool})
        if self._fallbacks.dropped(pool, dropped):
            self._wake()  # written again as this server keeps it
            return False
        return True

    async def _write_slices(self, kube: Kube, writes: list[tuple[JsonObject, JsonObject | None]],
                            ) -> tuple[list[tuple[str, str]], set[str]]:
        """Each body into its slice (``None``: a new one), all at once (each its own request: 8
        slices take one PUT's time); the name and resourceVersion of each slice written, in the
        order of ``writes``, and the feature gates whose fields the server dropped. Raises the
        first failure, a refusal (Invalid) before any other."""
        written: list[tuple[str, str] | None] = [None] * len(writes)
        failures: list[KubeError] = []
        dropped: set[str] = set()

        async def write(index: int, body: JsonObject, current: JsonObject | None) -> None:
            async with self._writers:
                try:
                    answer = await self._put_or_create(kube, body, current)
                except KubeError as error:
                    failures.append(error)
                    return
            written[index] = (answer["metadata"]["name"], str(answer["metadata"]["resourceVersion"]))
            dropped.update(dropped_gates(body["spec"]["devices"], answer["spec"].get("devices") or []))

        async with trio.open_nursery() as nursery:
            for index, (body, current) in enumerate(writes):
                nursery.start_soon(write, index, body, current)
        if failures:
            raise next((f for f in failures if isinstance(f, Invalid)), failures[0])
        return [entry for entry in written if entry is not None], dropped

    async def _put_or_create(self, kube: Kube, body: JsonObject, current: JsonObject | None) -> JsonObject:
        for _ in range(CONFLICT_RETRIES):
            if current is None:
                written = await trio.to_thread.run_sync(kube.create_slice, body, abandon_on_cancel=True)
                operation = "create"
                break
            name = current["metadata"]["name"]
            body["metadata"] = {**body["metadata"], "name": name,
                                "resourceVersion": current["metadata"]["resourceVersion"]}
            body["metadata"].pop("generateName", None)
            try:
                written = await trio.to_thread.run_sync(kube.replace_slice, name, body, abandon_on_cancel=True)
                operation = "update"
                break
            except Conflict:
                self._metrics.dra_slice_conflicts.inc()
                current = await self._read_again(kube, name)
            except NotFound:  # deleted meanwhile (a kubelet's wipe): made again under its name
                current = None
                body["metadata"].pop("resourceVersion", None)  # a create carries none
            self._view.read_again(name, current)
        else:
            raise KubeError(f"ResourceSlice {body['metadata'].get('name')}: still in conflict after "
                            f"{CONFLICT_RETRIES} tries")
        self._metrics.dra_slice_writes.labels(operation).inc()
        if not self._view.written(written):
            self._wake()  # deleted (a wipe) before its answer reached us: write the pool again
        return written

    @staticmethod
    async def _read_again(kube: Kube, name: str) -> JsonObject | None:
        """After a 409: the slice as the server has it now (``None``: gone)."""
        log.info("DRA: ResourceSlice %s changed on the server; reading it again", name, extra={"EVENT": "dra"})
        try:
            return await trio.to_thread.run_sync(kube.read_slice, name, abandon_on_cancel=True)
        except NotFound:
            return None

    async def _delete_slices(self, kube: Kube, slices: Sequence[JsonObject]) -> None:
        for item in slices:
            name = item["metadata"]["name"]
            current = item
            for _ in range(CONFLICT_RETRIES):
                metadata = current["metadata"]
                self._view.deleting(current)  # before the call: its DELETED event may come first
                try:
                    await trio.to_thread.run_sync(kube.delete_slice, name, metadata.get("uid", ""),
                                                  metadata.get("resourceVersion", ""), abandon_on_cancel=True)
                    self._metrics.dra_slice_writes.labels("delete").inc()
                    break
                except Conflict:  # changed since we saw it: obsolete all the same, at its new version
                    self._metrics.dra_slice_conflicts.inc()
                    if (read := await self._read_again(kube, name)) is None:
                        break
                    current = read
            else:
                raise KubeError(f"ResourceSlice {name}: still in conflict after {CONFLICT_RETRIES} tries")
            self._view.gone(name)


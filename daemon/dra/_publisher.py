"""ResourceSlices for the DRA pools: the tree, kept on the API server as the scheduler sees it.

``SlicePublisher`` is a subscriber of the notifier. Each tree it is offered wakes its one sync
task, which writes only the pools whose published devices changed (coalesced as ListAndWatch
is: a burst of trees is one write of the newest). A pool is ``<node>/<resource made valid>``;
its devices (healthy, held by nobody: see ``_slices.slice_devices``) go out in slices of at most
128, and every write raises the pool's generation and puts it on every slice of the pool, so a
consumer never mixes two versions. Existing slices are updated in place (PUT, matched by the
index their name starts with, as the Go helper matches them); extra ones are deleted first
(with uid and resourceVersion preconditions), missing ones created (``generateName``). A 409
re-reads the slice and tries again (a delete too, with the new preconditions); a 422 is logged
with the object and the server's causes and not tried again until the pool's devices change.

A second task lists and watches our own slices (``spec.driver``, ``spec.nodeName``), which is
how slices deleted by someone else (the kubelet wipes a node's slices when it starts, and a
driver's when it loses it) are noticed and published again, and slices changed by someone else
are put right; our own writes go into the same view at once, so a watch event that lags behind
them never makes us write twice. Slices that already publish what we would write (after a
restart: the slices of the last run) are adopted as they are, without a write. Slices of
pools that are not DRA pools (any more) are deleted; while a pool moved back to the
device-plugin API still has slices, it is ``withheld`` (the event loop serves it neither way)
and ``on_change`` tells the loop when that ends.

With no API server, no credentials or no Node object, one error line is logged (again only when
the reason changes) and everything is retried with a backoff capped at 10 s; the rest of the
daemon does not wait for any of it. At SIGTERM the slices stay: a restart adopts them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from daemon.core import DRA_API, DRA_ROAD, DeviceTree, Hooks, ResourcePool
from daemon.settings import Settings
from daemon.supervise import Backoff

from ._kube import ApiLink, Conflict, Expired, Invalid, Kube, KubeError, NotFound, StreamEnded
from ._names import pool_name
from ._slices import slice_bodies, slice_devices

log = logging.getLogger("devplugd.dra")

RETRY_MAX = 10.0
CONFLICT_RETRIES = 5
WATCH_LASTED = 5.0  # seconds: a watch that ran this long was a good one
PARALLEL_WRITES = 8  # slice writes of one pool in flight at once

JsonObject = dict[str, Any]


def _pool_of(slice_object: Mapping[str, Any]) -> str:
    return str(((slice_object.get("spec") or {}).get("pool") or {}).get("name", ""))


_INDEX = re.compile(r"([0-9a-f]{5,})-")


def _slice_index(name: str) -> int | None:
    """A slice's place in its pool, from the hex index its name starts with (``generate_name``)."""
    match = _INDEX.match(name)
    return int(match.group(1), 16) if match else None


def _version(obj: Mapping[str, Any]) -> int:
    """The object's resourceVersion as a number (-1 when it is not one: then it is taken as new)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", ""))
    except ValueError:
        return -1


class _Complaints:
    """One error line per distinct reason (``KubeError.reason``: every call to a server that is
    down is one), whichever of the tasks meets it, and a line when things work again."""

    def __init__(self) -> None:
        self._last: str | None = None

    def failed(self, error: KubeError, retry_in: float) -> None:
        if error.reason != self._last:
            log.error("DRA: %s; retrying (every %g s at most)", error, RETRY_MAX, extra={"EVENT": "dra"})
            self._last = error.reason
        else:
            log.debug("DRA: %s; retrying in %.1f s", error, retry_in)

    def recovered(self, what: str) -> None:
        if self._last is not None:
            log.info("DRA: %s", what, extra={"EVENT": "dra"})
            self._last = None


class _Written:
    """What a pool's slices on the server hold as far as we know: the devices we wrote (or found
    there as we would have written them), their generation, and the resourceVersion of each
    slice as we left it: any other version means someone else wrote since."""

    __slots__ = ("devices", "generation", "versions")

    def __init__(self, devices: list[JsonObject], generation: int, versions: dict[str, str]) -> None:
        self.devices = devices
        self.generation = generation
        self.versions = versions


def _essentials(obj: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """What a slice says to its consumers and the garbage collector: its owner and its spec
    without empty fields (the server leaves out an empty ``devices``)."""
    spec = {key: value for key, value in (obj.get("spec") or {}).items() if value not in (None, [], {})}
    return (obj.get("metadata") or {}).get("ownerReferences"), spec


class SlicePublisher:
    def __init__(self, settings: Settings, hooks: Mapping[str, Hooks], link: ApiLink,
                 on_change: Callable[[str], None] = lambda reason: None) -> None:
        self._settings = settings
        self._driver = settings.dra_driver
        self._node = settings.node_name
        self._hooks = hooks
        self._link = link
        self._on_change = on_change
        self._selector = f"spec.driver={self._driver},spec.nodeName={self._node}"
        self._tree = DeviceTree.empty()
        self._wakeup = trio.Event()
        self._node_uid: str | None = None
        self._recheck_node = False  # slices of ours deleted by someone else: the Node may be new
        self._server: dict[str, JsonObject] = {}  # our slices on the server by name, as last seen
        # slice name -> the resourceVersion it is deleted at: by us (until its DELETED event), or as
        # a DELETED event said (so that our create's answer arriving after it is not taken as live)
        self._deleted: dict[str, int] = {}
        self._listed = trio.Event()
        # Held by a sync round and by a list with its taking over the view: a list taken before
        # our writes and answered after them would undo them in the view (and make us write twice).
        self._view_lock = trio.Lock()
        # resource -> (the pool as last offered, its devices, the memo of slice_devices for it)
        self._devices: dict[str, tuple[ResourcePool, list[JsonObject], dict[str, Any]]] = {}
        self._seen_problems: set[str] = set()  # what slice_devices logged already: once in all
        self._written: dict[str, _Written] = {}  # pool name -> what we wrote
        self._rejected: dict[str, list[JsonObject]] = {}  # pool name -> devices the server refused (422)
        self._withheld: frozenset[str] = frozenset()  # resources with slices on the server
        self._complaints = _Complaints()  # shared by the tasks: an outage is one error line
        self._writers = trio.CapacityLimiter(PARALLEL_WRITES)
        self.writes = 0  # slices created, updated or deleted so far (for tests and benchmarks)
        self.synced = trio.Event()  # set after each sync round that left nothing to do
        self.connected = False

    # -- the subscriber and what the event loop asks ---------------------------------------------
    def offer(self, tree: DeviceTree) -> None:
        self._tree = tree
        self._wake()

    def withheld(self) -> frozenset[str]:
        """Resources that have slices on the API server (as far as we know): the event loop
        withholds such a pool from the kubelet when its config says ``devicePlugin``."""
        return self._withheld

    def _wake(self) -> None:
        self._wakeup.set()

    # -- the tasks --------------------------------------------------------------------------------
    async def run(self) -> None:
        complaints = self._complaints
        backoff = Backoff(first=0.2, maximum=RETRY_MAX)
        while True:
            try:
                kube = await self._link.get()
                self._node_uid = await trio.to_thread.run_sync(kube.node_uid, self._node, abandon_on_cancel=True)
                break
            except NotFound as error:
                delay = backoff.next_delay()
                complaints.failed(KubeError(f"node {self._node} is not on the API server ({error})"), delay)
            except KubeError as error:
                delay = backoff.next_delay()
                complaints.failed(error, delay)
            await trio.sleep(delay)
        self.connected = True
        complaints.recovered(f"API server {kube.server} reachable; node {self._node} has uid {self._node_uid}")
        log.info("DRA: publishing ResourceSlices of driver %s for node %s on %s", self._driver, self._node,
                 kube.server, extra={"EVENT": "dra"})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_server, kube)
            await self._sync_forever(kube)

    async def _sync_forever(self, kube: Kube) -> None:
        await self._listed.wait()
        complaints = self._complaints
        backoff = Backoff(first=0.2, maximum=RETRY_MAX)
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            try:
                async with self._view_lock:
                    await self._sync(kube)
            except KubeError as error:
                delay = backoff.next_delay()
                complaints.failed(error, delay)
                await trio.sleep(delay)
                self._wake()  # try again even if nothing else happens
                continue
            backoff.reset()
            complaints.recovered("ResourceSlices written again")
            if not self._wakeup.is_set():
                self.synced.set()
                self.synced = trio.Event()

    async def _follow_server(self, kube: Kube) -> None:
        """List our slices, then watch them; list again after 410 Gone or a broken stream."""
        complaints = self._complaints
        backoff = Backoff(first=0.2, maximum=RETRY_MAX)
        while True:
            try:
                async with self._view_lock:
                    items, version = await trio.to_thread.run_sync(kube.list_slices, self._selector,
                                                                   abandon_on_cancel=True)
                    self._replace_view(items)
                complaints.recovered("watching our ResourceSlices again")
                while True:
                    started = trio.current_time()
                    version = await trio.to_thread.run_sync(self._watch_until_it_ends, kube, version,
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

    def _watch_until_it_ends(self, kube: Kube, version: str, token: trio.lowlevel.TrioToken) -> str:
        """(worker thread) Follow the watch, handing each event to the trio side; the version to
        watch from next."""
        for kind, obj in kube.watch_slices(self._selector, version):
            new_version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind != "BOOKMARK":
                trio.from_thread.run_sync(self._apply_event, kind, obj, trio_token=token)
            if new_version:
                version = str(new_version)
        return version

    # -- the view of our slices on the server ----------------------------------------------------
    def _replace_view(self, items: Sequence[JsonObject]) -> None:
        self._server = {item["metadata"]["name"]: item for item in items}
        self._deleted.clear()
        self._listed.set()
        self._update_withheld(self._tree)  # at once: slices left from the last run of a pool moved back
        self._wake()

    def _apply_event(self, kind: str, obj: JsonObject) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        version = _version(obj)
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
            if known is not None and _version(known) <= version:
                del self._server[name]
                if self._written_name(name):
                    log.info("DRA: ResourceSlice %s (pool %s) was deleted by someone else; publishing it again",
                             name, _pool_of(known), extra={"EVENT": "dra"})
                self._recheck_node = True
                self._wake()
            return
        if known is not None and _version(known) >= version >= 0:
            return  # our own write, already in the view
        self._server[name] = obj
        self._wake()

    def _written_name(self, name: str) -> bool:
        return any(name in written.versions for written in self._written.values())

    def _slices_of(self, pool: str) -> list[JsonObject]:
        return sorted((s for s in self._server.values() if _pool_of(s) == pool), key=lambda s: s["metadata"]["name"])

    # -- one sync round --------------------------------------------------------------------------
    def _desired(self, tree: DeviceTree) -> dict[str, tuple[str, list[JsonObject]]]:
        """pool name -> (resource, devices) for every DRA pool of ``tree``; a pool's devices are
        worked out again only when its ResourcePool changed, and then only those whose record
        changed (the memo)."""
        desired: dict[str, tuple[str, list[JsonObject]]] = {}
        kept: dict[str, tuple[ResourcePool, list[JsonObject], dict[str, Any]]] = {}
        for resource, pool in tree.pools.items():
            if pool.road != DRA_ROAD:
                continue
            cached = self._devices.get(resource)
            if cached is not None and cached[0] is pool:
                devices, memo = cached[1], cached[2]
            else:
                # a reload may change what the describer says: a new pool config, a new memo
                memo = cached[2] if cached is not None and cached[0].pool_config is pool.pool_config else {}
                hooks = self._hooks.get(pool.handler)
                devices = slice_devices(pool, self._driver, hooks.describer if hooks is not None else None,
                                        seen=self._seen_problems, memo=memo)
            kept[resource] = (pool, devices, memo)
            desired[pool_name(self._node, resource)] = (resource, devices)
        self._devices = kept
        return desired

    async def _sync(self, kube: Kube) -> None:
        tree = self._tree
        try:
            await self._sync_tree(kube, tree)
        finally:  # what is left on the server, even when a write failed
            self._update_withheld(tree)

    async def _sync_tree(self, kube: Kube, tree: DeviceTree) -> None:
        if self._recheck_node:
            await self._read_node_uid(kube)
        desired = self._desired(tree)
        for gone in self._rejected.keys() - desired.keys():  # configured again later, it is tried again
            del self._rejected[gone]
        for pool, (_resource, devices) in desired.items():
            if self._up_to_date(pool, devices) or self._rejected.get(pool) == devices:
                continue
            self._rejected.pop(pool, None)
            await self._write_pool(kube, pool, devices)
        ours = {pool_name(self._node, resource) for resource in tree.pools}
        for pool in sorted({_pool_of(s) for s in self._server.values()} - desired.keys()):
            why = "no longer served through DRA" if pool in ours else "no longer configured"
            log.info("DRA: deleting the ResourceSlices of pool %s (%s)", pool, why,
                     extra={"EVENT": "dra", "DRA_POOL": pool})
            await self._delete_slices(kube, self._slices_of(pool))
            self._written.pop(pool, None)

    async def _read_node_uid(self, kube: Kube) -> None:
        """Read the Node's uid again: a node deleted and registered again has a new one, and the
        garbage collector deletes the slices owned by the old (which, written again as they
        were, it would delete again and again)."""
        uid = await trio.to_thread.run_sync(kube.node_uid, self._node, abandon_on_cancel=True)
        self._recheck_node = False
        if uid != self._node_uid:
            log.info("DRA: node %s has a new uid %s (was %s); its ResourceSlices are owned by it from now on",
                     self._node, uid, self._node_uid, extra={"EVENT": "dra"})
            self._node_uid = uid

    def _up_to_date(self, pool: str, devices: list[JsonObject]) -> bool:
        """Whether the server's slices of ``pool`` publish ``devices``: they are as we left
        them, or (after a restart, or someone else's write) they are what we would write at
        their generation, which is then adopted as ours."""
        on_server = self._slices_of(pool)
        versions = {s["metadata"]["name"]: str(s["metadata"].get("resourceVersion")) for s in on_server}
        written = self._written.get(pool)
        if written is not None and written.versions == versions and written.devices == devices:
            return True
        generations = {s["spec"]["pool"].get("generation") for s in on_server}
        if len(generations) != 1 or not isinstance(generation := generations.pop(), int):
            return False
        bodies = self._bodies(pool, generation, devices)
        if [_slice_index(name) for name in versions] != list(range(len(bodies))) or any(
                _essentials(item) != _essentials(body) for item, body in zip(on_server, bodies)):
            return False
        self._written[pool] = _Written(devices, generation, versions)
        return True

    def _bodies(self, pool: str, generation: int, devices: list[JsonObject]) -> list[JsonObject]:
        return slice_bodies(driver=self._driver, node_name=self._node, node_uid=self._node_uid,
                            pool_name=pool, generation=generation, devices=devices)

    async def _write_pool(self, kube: Kube, pool: str, devices: list[JsonObject]) -> None:
        existing = self._slices_of(pool)
        generations = [int(s["spec"]["pool"].get("generation", 0)) for s in existing]
        last = self._written.get(pool)
        generation = max([*generations, last.generation if last is not None else 0]) + 1
        bodies = self._bodies(pool, generation, devices)
        # Each body goes into the slice whose name has its index (so the names keep sorting in
        # slice order, which is the allocator's order); any other slice of the pool is obsolete.
        placed: dict[int, JsonObject] = {}
        obsolete: list[JsonObject] = []
        for item in existing:
            index = _slice_index(item["metadata"]["name"])
            if index is None or index >= len(bodies) or index in placed:
                obsolete.append(item)
            else:
                placed[index] = item
        versions: dict[str, str] = {}
        failures: list[KubeError] = []

        async def write(index: int, body: JsonObject) -> None:
            async with self._writers:
                try:
                    written = await self._put_or_create(kube, body, placed.get(index))
                except KubeError as error:
                    failures.append(error)
                    return
            versions[written["metadata"]["name"]] = str(written["metadata"]["resourceVersion"])

        try:
            await self._delete_slices(kube, obsolete)  # obsolete ones first
            # the slices of a pool at once (each its own request): 8 slices take one PUT's time
            async with trio.open_nursery() as nursery:
                for index, body in enumerate(bodies):
                    nursery.start_soon(write, index, body)
            if failures:
                raise next((f for f in failures if isinstance(f, Invalid)), failures[0])
        except Invalid as error:
            log.error("DRA: the API server refused pool %s (generation %d, %d devices in %d slices): %s; causes: %s; "
                      "not tried again until its devices change", pool, generation, len(devices), len(bodies),
                      error, "; ".join(error.causes) or "none given", extra={"EVENT": "dra", "DRA_POOL": pool})
            self._rejected[pool] = devices
            return
        self._written[pool] = _Written(devices, generation, versions)
        log.info("DRA: pool %s generation %d: %d devices in %d slices", pool, generation, len(devices), len(bodies),
                 extra={"EVENT": "dra", "DRA_POOL": pool})

    async def _put_or_create(self, kube: Kube, body: JsonObject, current: JsonObject | None) -> JsonObject:
        for _ in range(CONFLICT_RETRIES):
            if current is None:
                written = await trio.to_thread.run_sync(kube.create_slice, body, abandon_on_cancel=True)
                break
            name = current["metadata"]["name"]
            body["metadata"] = {**body["metadata"], "name": name,
                                "resourceVersion": current["metadata"]["resourceVersion"]}
            body["metadata"].pop("generateName", None)
            try:
                written = await trio.to_thread.run_sync(kube.replace_slice, name, body, abandon_on_cancel=True)
                break
            except Conflict:
                current = await self._read_again(kube, name)
            except NotFound:
                self._server.pop(name, None)
                current = None
            if current is not None:
                self._server[name] = current
        else:
            raise KubeError(f"ResourceSlice {body['metadata'].get('name')}: still in conflict after "
                            f"{CONFLICT_RETRIES} tries")
        self.writes += 1
        name = written["metadata"]["name"]
        if self._deleted.get(name, -1) >= _version(written):
            self._wake()  # deleted (a wipe) before its answer reached us: write the pool again
        else:
            self._server[name] = written
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
                self._deleted[name] = _version(current)  # before the call: its DELETED event may come first
                try:
                    await trio.to_thread.run_sync(kube.delete_slice, name, metadata.get("uid", ""),
                                                  metadata.get("resourceVersion", ""), abandon_on_cancel=True)
                    self.writes += 1
                    break
                except Conflict:  # changed since we saw it: obsolete all the same, at its new version
                    if (read := await self._read_again(kube, name)) is None:
                        break
                    current = read
            else:
                raise KubeError(f"ResourceSlice {name}: still in conflict after {CONFLICT_RETRIES} tries")
            self._server.pop(name, None)

    def _update_withheld(self, tree: DeviceTree) -> None:
        """Keep ``withheld()`` true, and tell the loop when it changed for a pool the config
        serves through the device-plugin API (it is served neither way until its slices go)."""
        on_server = {_pool_of(s) for s in self._server.values()}
        published = frozenset(resource for resource in tree.pools if pool_name(self._node, resource) in on_server)
        device_plugin = frozenset(resource for resource, pool in tree.pools.items()
                                  if pool.pool_config.entry.allocation_api != DRA_API)
        before, self._withheld = self._withheld & device_plugin, published
        now = published & device_plugin
        if now != before:
            if released := before - now:
                log.info("DRA: the slices of %s are deleted; the kubelet gets it now", ", ".join(sorted(released)),
                         extra={"EVENT": "dra"})
            self._on_change("slices withdrawn" if released else "slices to withdraw")

"""Preparing DRA ResourceClaims for the kubelet (NodePrepareResources / NodeUnprepareResources),
with no gRPC in it: ``daemon.dra._servicer`` is the gRPC face.

Prepare, for each claim of a call:

1. a claim the book already has (by UID) is answered from the book, its CDI spec written again
   if it went missing; the API server is not asked (the UID names one claim for ever, and an
   idempotent answer should not fail because the API server is slow);
2. the others are read from the API server, all of a call at once, each within
   ``CLAIM_GET_TIMEOUT``, before the one lock every Prepare and Unprepare of the daemon takes
   (as the Go helper does);
3. under the lock: the claim must have the UID the kubelet named and be allocated; of its
   ``status.allocation.devices``, the results of other drivers are ignored, an opaque config for
   ours is refused (devplugd takes no claim parameters yet), and every result of ours must name
   a DRA pool of this node and a device in it that is Healthy, not under a host lease, not held
   by a pod through the device-plugin API, and not prepared for another claim (unless one of
   the two allocations is admin access, which takes the device from no one);
4. for each request and pool, one ``allocate_container`` for the claim's devices of that request
   in that pool (so ``PCIDEVICE_*`` lists them all, as one Allocate for one container would;
   netDevice pools write their device-info files), in a worker thread. Per request, because a
   container gets the devices of its requests only: the claim the scheduler makes for a pod's
   ``resources.limits`` (KEP-5004) has one request per container, and each container must see
   its own VFs in ``PCIDEVICE_*``, never its neighbour's;
5. the claim's CDI spec, ``devplugd-claim-<claim UID>.json`` in the CDI directory: kind
   ``<driver>/claim``, one CDI device ``<claim UID>-<device name>`` per device holding its device
   nodes and its request's env and mounts (the same on every device of the request, so a
   container that takes any of them has them; a device node no single device accounts for goes
   with the request's first device);
6. the checkpoint (``ClaimBook.add``), then the answer. If 5 or 6 fails, what was done is undone
   (spec removed, side files released) and the claim's answer is the error.

Every claim gets an answer of its own: one claim's failure, whatever it is, never fails another.
Unprepare removes the spec, the side files (those no other prepared claim shares) and the book
entry; an unknown claim is already unprepared. The work under the lock is shielded from
cancellation (a kubelet that gives up mid-way), so a claim is never left half prepared.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from daemon.cdi import CLAIM_FILE_PREFIX, cdi_env_name, cdi_kind, cdi_version, claim_spec_file_name, container_edits
from daemon.core import (
    DRA_ROAD,
    HEALTHY,
    AllocationError,
    ContainerAllocation,
    DeviceSpec,
    DeviceTree,
    HandlerFailed,
    Hooks,
    ResourcePool,
    allocate_container,
)
from daemon.files import write_atomically

from ._claims import AllocationResult, ClaimBook, ClaimRef, ClaimRefused, PreparedClaim, PreparedDevice, driver_results
from ._names import device_name, pool_name

log = logging.getLogger("devplugd.dra")

CLAIM_GET_TIMEOUT = 10.0  # seconds for one claim's GET: the kubelet's whole call has 45
# A claim UID is a UUID; anything that is not a CDI device-name start and safe in a file name is refused.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


class ClaimNotFound(Exception):
    """The API server has no such claim (404)."""


@dataclass(frozen=True)
class PrepareResult:
    """One claim's answer: its devices, or why it cannot be prepared."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True)
class _Chosen:
    pool: ResourcePool
    device: PreparedDevice


class ClaimPreparer:
    def __init__(
        self,
        driver: str,
        node_name: str,
        cdi_dir: Path,
        claims: ClaimBook,
        tree: Callable[[], DeviceTree],
        hooks: Mapping[str, Hooks],
        get_claim: GetClaim,
        on_change: Callable[[str], None],
        *,
        get_timeout: float = CLAIM_GET_TIMEOUT,
        lease_holders: Callable[[], Mapping[tuple[str, str], object]] = dict,
    ) -> None:
        self._driver = driver
        self._node = node_name
        self._cdi_dir = cdi_dir
        self._claims = claims
        self._tree = tree
        self._hooks = hooks
        self._get_claim = get_claim
        self._on_change = on_change
        self._get_timeout = get_timeout
        # host leases as the lease book has them now: a lease granted a moment ago is not in the tree yet
        self._lease_holders = lease_holders
        self._kind = cdi_kind(f"{driver}/claim")
        self._lock = trio.Lock()
        # with a lost checkpoint: the claims whose specs say they were prepared before (None: not read yet)
        self._unaccounted: set[str] | None = None

    def spec_path(self, uid: str) -> Path:
        return self._cdi_dir / claim_spec_file_name(uid)

    # -- prepare ---------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        refs = list({ref.uid: ref for ref in claims}.values())
        wanted = [ref for ref in refs if _UID.fullmatch(ref.uid) and self._claims.prepared(ref.uid) is None]
        fetched: dict[str, Mapping[str, Any] | str] = {}
        async with trio.open_nursery() as nursery:
            for ref in wanted:
                nursery.start_soon(self._fetch, ref, fetched)
        answers: dict[str, PrepareResult] = {}
        async with self._lock:
            with trio.CancelScope(shield=True):
                for ref in refs:
                    answers[ref.uid] = await self._answer(ref, fetched.get(ref.uid))
        return answers

    async def _fetch(self, ref: ClaimRef, fetched: dict[str, Mapping[str, Any] | str]) -> None:
        """The claim as the API server has it, or the error string."""
        with trio.move_on_after(self._get_timeout):
            try:
                fetched[ref.uid] = await self._get_claim(ref.namespace, ref.name)
            except ClaimNotFound:
                fetched[ref.uid] = f"{ref.label} not found on the API server (deleted?)"
            except Exception as error:
                fetched[ref.uid] = f"{ref.label}: cannot read it from the API server: {type(error).__name__}: {error}"
            return
        fetched[ref.uid] = f"{ref.label}: reading it from the API server timed out after {self._get_timeout:g} s"

    async def _answer(self, ref: ClaimRef, fetched: Mapping[str, Any] | str | None) -> PrepareResult:
        try:
            return await self._prepare(ref, fetched)
        except ClaimRefused as refusal:
            log.warning("not preparing %s (UID %s): %s", ref.label, ref.uid, refusal, extra={"EVENT": "prepare"})
            return PrepareResult(error=str(refusal))
        except Exception as error:
            log.exception("preparing %s (UID %s) failed", ref.label, ref.uid, extra={"EVENT": "prepare"})
            return PrepareResult(error=f"{ref.label}: internal error: {type(error).__name__}: {error}")

    async def _prepare(self, ref: ClaimRef, fetched: Mapping[str, Any] | str | None) -> PrepareResult:
        if not _UID.fullmatch(ref.uid):
            raise ClaimRefused(f"{ref.label}: {ref.uid!r} is not a claim UID")
        known = self._claims.prepared(ref.uid)
        if known is not None:
            await self._rewrite_spec_if_missing(known)
            return PrepareResult(devices=known.devices)
        if fetched is None:  # in the book when the call came, unprepared by another call since
            raise ClaimRefused(f"{ref.label} was unprepared while this call waited; ask again")
        if isinstance(fetched, str):
            raise ClaimRefused(fetched)
        await self._check_accounted(ref)
        results = driver_results(fetched, ref, self._driver)
        chosen = self._choose(self._tree(), ref, results)
        if not chosen:
            return PrepareResult()
        try:
            allocations = await self._allocate(ref, chosen)
            claim = await self._record(ref, chosen, allocations)
        except Exception:
            await self._undo(ref.uid, chosen)
            raise
        if self._unaccounted:
            self._unaccounted.discard(ref.uid)
        log.info("prepared %s (UID %s): %s", ref.label, ref.uid,
                 ", ".join(f"{c.device.device_id} of {c.device.resource}" for c in chosen), extra={"EVENT": "prepare"})
        self._on_change(f"{ref.label} prepared")
        return PrepareResult(devices=claim.devices)

    async def _record(self, ref: ClaimRef, chosen: Sequence[_Chosen],
                      allocations: Sequence[tuple[list[_Chosen], ContainerAllocation]]) -> PreparedClaim:
        """Write the claim's CDI spec, then its checkpoint entry."""
        spec = self._claim_spec(ref.uid, chosen, allocations)
        claim = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(c.device for c in chosen), spec)
        try:
            await trio.to_thread.run_sync(self._write_spec, ref.uid, spec)
        except OSError as error:
            raise ClaimRefused(f"{ref.label}: cannot write its CDI spec {self.spec_path(ref.uid)}: {error}") from error
        try:
            await self._claims.add(claim)
        except OSError as error:
            raise ClaimRefused(f"{ref.label}: cannot write the checkpoint {self._claims.path}: {error}") from error
        return claim

    async def _check_accounted(self, ref: ClaimRef) -> None:
        """With a lost checkpoint, only the claims that were prepared before may be prepared (again)
        until they are all unprepared: nobody knows which devices they hold."""
        if self._claims.lost is None:
            return
        if self._unaccounted is None:
            self._unaccounted = await trio.to_thread.run_sync(self._claim_spec_uids) - set(self._claims.claims)
        if self._unaccounted and ref.uid not in self._unaccounted:
            shown = ", ".join(sorted(self._unaccounted)[:5]) + (", ..." if len(self._unaccounted) > 5 else "")
            raise ClaimRefused(f"{ref.label}: not prepared: {self._claims.lost}; the devices of the "
                               f"{len(self._unaccounted)} claims prepared before are unknown, so no other claim is "
                               f"prepared until they are unprepared ({shown})")

    def _claim_spec_uids(self) -> set[str]:
        """The UIDs of the claim specs in the CDI directory: every claim prepared and not yet
        unprepared has one (the spec is written before the checkpoint and removed before it)."""
        try:
            names = os.listdir(self._cdi_dir)
        except FileNotFoundError:
            return set()
        return {name[len(CLAIM_FILE_PREFIX):-len(".json")] for name in names
                if name.startswith(CLAIM_FILE_PREFIX) and name.endswith(".json")}

    def _choose(self, tree: DeviceTree, ref: ClaimRef, results: Sequence[AllocationResult]) -> list[_Chosen]:
        """Each device of the results (one per device: its requests merged), checked (see the
        module docstring); ClaimRefused names the first that cannot be had."""
        pools = {pool_name(self._node, resource): pool for resource, pool in tree.pools.items()}
        names: dict[str, dict[str, str]] = {}  # pool name -> device name -> device ID
        merged: dict[tuple[str, str], list[AllocationResult]] = {}
        for result in results:
            merged.setdefault((result.pool, result.device), []).append(result)
        exclusive = {(d.resource, d.device_id): claim for claim in self._claims.claims.values()
                     for d in claim.devices if not d.admin_access}
        leases = self._lease_holders()
        chosen: list[_Chosen] = []
        for (pool_label, name), device_results in merged.items():
            pool = pools.get(pool_label)
            if pool is None:
                raise ClaimRefused(f"{ref.label}: pool {pool_label!r} is not a pool of this node ({self._node})")
            if pool.road != DRA_ROAD:
                raise ClaimRefused(f"{ref.label}: pool {pool_label!r} ({pool.resource}) is not a DRA pool of this "
                                   f"node (it is served through {pool.road})")
            ids = names.get(pool_label)
            if ids is None:
                ids = names[pool_label] = {device_name(device_id): device_id for device_id in pool.devices}
            device_id = ids.get(name)
            if device_id is None:
                raise ClaimRefused(f"{ref.label}: device {name!r} is not in pool {pool_label!r}")
            admin_access = all(result.admin_access for result in device_results)
            what = f"{ref.label}: device {name!r} ({device_id} of {pool.resource})"
            if device_id in pool.vanished:
                raise ClaimRefused(f"{what} is gone from the host")
            if pool.devices[device_id].health != HEALTHY:
                raise ClaimRefused(f"{what} is {pool.devices[device_id].health}")
            if device_id in pool.leased or (pool.resource, device_id) in leases:
                raise ClaimRefused(f"{what} is held by a host lease")
            if device_id in pool.kubelet_held:
                raise ClaimRefused(f"{what} is held by a pod through the device-plugin API (the kubelet's checkpoint)")
            holder = exclusive.get((pool.resource, device_id))
            if holder is not None and not admin_access:
                raise ClaimRefused(f"{what} is prepared for {holder.label} (UID {holder.uid})")
            requests = tuple(dict.fromkeys(result.request.split("/", 1)[0] for result in device_results))
            device = PreparedDevice(pool.resource, device_id, pool_label, name, requests, admin_access,
                                    f"{self._kind}={ref.uid}-{name}")
            chosen.append(_Chosen(pool, device))
        return chosen

    async def _allocate(self, ref: ClaimRef,
                        chosen: Sequence[_Chosen]) -> list[tuple[list[_Chosen], ContainerAllocation]]:
        """One allocation per request and pool (with the devices it is for), in a worker thread;
        ClaimRefused says what failed."""
        by_request: dict[tuple[str, str], list[_Chosen]] = {}
        for item in chosen:
            request = item.device.request_names[0] if item.device.request_names else ""
            by_request.setdefault((item.pool.resource, request), []).append(item)
        allocations: list[tuple[list[_Chosen], ContainerAllocation]] = []
        for (resource, _request), items in by_request.items():
            pool = items[0].pool
            hooks = self._hooks.get(pool.handler)
            if hooks is None:
                raise ClaimRefused(f"{ref.label}: {resource} has no handler {pool.handler!r}")
            device_ids = [item.device.device_id for item in items]
            try:
                allocation = await trio.to_thread.run_sync(allocate_container, hooks, pool, device_ids)
            except (AllocationError, OSError, HandlerFailed) as error:
                raise ClaimRefused(f"{ref.label}: allocating {', '.join(device_ids)} of {resource} failed: "
                                   f"{error}") from error
            if allocation.annotations:
                log.warning("%s: the annotations %s of %s have no place in a CDI spec; left out", ref.label,
                            ", ".join(sorted(allocation.annotations)), resource, extra={"RESOURCE": resource})
            allocations.append((items, allocation))
        return allocations

    def _claim_spec(self, uid: str, chosen: Sequence[_Chosen],
                    allocations: Sequence[tuple[list[_Chosen], ContainerAllocation]]) -> dict[str, Any]:
        """The claim's CDI spec document (see the module docstring, step 5), its devices in the
        order of the claim's results."""
        needs_host_path = False
        edits_of: dict[str, dict[str, Any]] = {}  # device name -> its containerEdits
        for items, allocation in allocations:
            allocated = set(allocation.specs)
            attributed: set[DeviceSpec] = set()
            own_specs: dict[str, list[DeviceSpec]] = {}
            for item in items:
                own = [spec for spec in item.pool.devices[item.device.device_id].specs if spec in allocated]
                attributed.update(own)
                own_specs[item.device.device_name] = own
            loose = [spec for spec in allocation.specs if spec not in attributed]
            for position, item in enumerate(items):
                specs = own_specs[item.device.device_name] + (loose if position == 0 else [])
                # the device's own env too, so that its edits are never empty (CDI refuses those)
                env = {**allocation.envs, _device_env_name(item.device): item.device.device_id}
                edits, needs = container_edits(specs, allocation.mounts, env)
                needs_host_path |= needs
                edits_of[item.device.device_name] = edits
        devices = [{"name": f"{uid}-{item.device.device_name}", "containerEdits": edits_of[item.device.device_name]}
                   for item in chosen]
        return {"cdiVersion": cdi_version(needs_host_path), "kind": self._kind, "devices": devices}

    def _write_spec(self, uid: str, spec: Mapping[str, Any]) -> None:
        self._cdi_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.spec_path(uid), json.dumps(spec, separators=(",", ":")).encode(), mode=0o644,
                         durable=False)

    async def _rewrite_spec_if_missing(self, claim: PreparedClaim) -> None:
        if claim.cdi_spec is None or await trio.to_thread.run_sync(self.spec_path(claim.uid).exists):
            return
        log.warning("%s (UID %s): its CDI spec %s is missing; writing it again", claim.label, claim.uid,
                    self.spec_path(claim.uid), extra={"EVENT": "prepare"})
        try:
            await trio.to_thread.run_sync(self._write_spec, claim.uid, claim.cdi_spec)
        except OSError as error:
            raise ClaimRefused(f"{claim.label}: cannot write its CDI spec {self.spec_path(claim.uid)} again: "
                               f"{error}") from error

    async def _undo(self, uid: str, chosen: Sequence[_Chosen]) -> None:
        """Take back a prepare that failed half-way: its spec and its devices' side files."""
        try:
            await trio.to_thread.run_sync(self._remove_spec, uid)
        except OSError as error:
            log.error("cannot remove %s: %s", self.spec_path(uid), error, extra={"EVENT": "prepare"})
        await self._release(uid, [(item.pool, item.device) for item in chosen])

    def _remove_spec(self, uid: str) -> None:
        self.spec_path(uid).unlink(missing_ok=True)

    async def _release(self, uid: str, devices: Sequence[tuple[ResourcePool, PreparedDevice]]) -> None:
        """Release the side files of ``devices`` that no other prepared claim shares; a handler
        that fails is logged (a stale side file is rewritten by the next allocation)."""
        shared = {(d.resource, d.device_id) for claim in self._claims.claims.values() if claim.uid != uid
                  for d in claim.devices}
        by_pool: dict[str, tuple[ResourcePool, list[str]]] = {}
        for pool, device in devices:
            if (device.resource, device.device_id) not in shared:
                by_pool.setdefault(pool.resource, (pool, []))[1].append(device.device_id)
        for resource, (pool, device_ids) in by_pool.items():
            hooks = self._hooks.get(pool.handler)
            if hooks is None or hooks.releaser is None:
                continue
            try:
                await trio.to_thread.run_sync(hooks.releaser.release_side_files, pool, device_ids)
            except Exception:
                log.exception("handler %s failed to release the side files of %s of %s", pool.handler,
                              ", ".join(device_ids), resource, extra={"RESOURCE": resource})

    # -- unprepare -------------------------------------------------------------------------------
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        """Each claim's error, or ``None`` when it is unprepared (or never was)."""
        answers: dict[str, str | None] = {}
        async with self._lock:
            with trio.CancelScope(shield=True):
                for ref in {ref.uid: ref for ref in claims}.values():
                    try:
                        answers[ref.uid] = await self._unprepare(ref)
                    except Exception as error:
                        log.exception("unpreparing %s (UID %s) failed", ref.label, ref.uid,
                                      extra={"EVENT": "unprepare"})
                        answers[ref.uid] = f"{ref.label}: internal error: {type(error).__name__}: {error}"
        return answers

    async def _unprepare(self, ref: ClaimRef) -> str | None:
        if not _UID.fullmatch(ref.uid):
            return None  # never prepared: no spec, no entry has such a UID
        try:
            await trio.to_thread.run_sync(self._remove_spec, ref.uid)
        except OSError as error:
            return f"{ref.label}: cannot remove its CDI spec {self.spec_path(ref.uid)}: {error}"
        claim = self._claims.prepared(ref.uid)
        if claim is not None:
            tree = self._tree()
            await self._release(ref.uid, [(tree.pools[d.resource], d) for d in claim.devices
                                          if d.resource in tree.pools])
            try:
                await self._claims.remove(ref.uid)
            except OSError as error:
                return f"{ref.label}: cannot write the checkpoint {self._claims.path}: {error}"
            log.info("unprepared %s (UID %s)", claim.label, ref.uid, extra={"EVENT": "unprepare"})
            self._on_change(f"{claim.label} unprepared")
        if self._unaccounted and ref.uid in self._unaccounted:
            self._unaccounted.discard(ref.uid)
            log.info("%s (UID %s), prepared before the checkpoint was lost, is unprepared; %d such claims left",
                     ref.label, ref.uid, len(self._unaccounted), extra={"EVENT": "unprepare"})
        return None

    # -- start -----------------------------------------------------------------------------------
    async def restore(self) -> None:
        """At start: write again the specs of prepared claims that are missing (a reboot empties
        /var/run while the kubelet still counts the claims prepared) and remove claim specs of
        ours the checkpoint does not have (a prepare that crashed before its checkpoint; the
        kubelet, never answered, asks again). With a lost checkpoint nothing is removed: those
        specs are all that tells which claims were prepared."""
        async with self._lock:
            for claim in list(self._claims.claims.values()):
                try:
                    await self._rewrite_spec_if_missing(claim)
                except ClaimRefused as error:
                    log.error("%s", error, extra={"EVENT": "restore"})
            if self._claims.lost is not None:
                self._unaccounted = await trio.to_thread.run_sync(self._claim_spec_uids) - set(self._claims.claims)
                return
            stale = await trio.to_thread.run_sync(self._stale_specs)
            for uid in stale:
                log.warning("removing the CDI spec of claim UID %s: not in the checkpoint", uid,
                            extra={"EVENT": "restore"})
                await trio.to_thread.run_sync(self._remove_spec, uid)

    def _stale_specs(self) -> list[str]:
        stale = []
        for uid in sorted(self._claim_spec_uids() - set(self._claims.claims)):
            try:
                kind = json.loads(self.spec_path(uid).read_bytes()).get("kind")
            except (OSError, ValueError, AttributeError):
                continue
            if kind == self._kind:
                stale.append(uid)
        return stale


def _device_env_name(device: PreparedDevice) -> str:
    """``DEVPLUGD_<RESOURCE>_<DEVICE NAME>``: set to the device's ID by its own CDI device."""
    return f"{cdi_env_name(device.resource)}_{device.device_name.upper().replace('-', '_')}"

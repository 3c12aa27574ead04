"""Preparing DRA ResourceClaims for the kubelet (NodePrepareResources / NodeUnprepareResources),
with no gRPC in it: ``daemon.dra._servicer`` is the gRPC face.

Prepare, for each claim of a call:

1. a claim the book already has (by UID) is answered from the book, its CDI spec written again
   if it went missing; the API server is not asked (the UID names one claim for ever);
2. the others are read from the API server, all of a call at once, each within
   ``CLAIM_GET_TIMEOUT``, before the one lock every Prepare and Unprepare takes (as the Go
   helper does);
3. under the lock: the claim must have the UID the kubelet named and be allocated; of its
   results, those of other drivers are ignored, a config of ours must be a ``VfioConfig``
   (``_claims.driver_results``), and every result of ours must name a DRA pool of this node and
   a device the one availability rule (``daemon.holdings.refusal``) lets it have
   (``_choice.choose``);
4. the devices a ``VfioConfig`` asks for on vfio-pci are taken from their drivers
   (``_loans.py``: checked, checkpointed pending, rebound);
5. for each request and pool, one ``allocate_container`` for the claim's devices of that request
   in that pool (``_choice.allocate``: a container gets the devices of its own requests only;
   a prioritized list's subrequest ``nic/fast`` counts as ``nic``); the claim's CDI spec
   (``_claimspecs.py``) and each request's device metadata (``_metadata.py``, KEP-5304); the
   checkpoint (``ClaimBook.add_made``), then the answer. These run in one worker thread (one trip
   to a thread, not three). If one fails, what was done is undone and the claim's answer is the
   error.

Every claim gets an answer of its own: one claim's failure never fails another. Unprepare removes
the device metadata, the spec, the side files (those no other prepared claim shares), gives back
what went to vfio-pci, then drops the book entry, in one worker thread; an unknown claim is
already unprepared. A claim the kubelet will never unprepare (``_orphans.py``) is unprepared the
same way (``release_orphans``). ``status.devices`` is written in the background (``_status.py``).
The work under the lock is shielded from cancellation (a kubelet that gives up mid-way), so a
claim is never left half prepared. With a lost book, only the claims prepared before the loss
may be prepared (``_unaccounted.py``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from daemon.core import AllocationError, Lent, Loan, ResourcePool
from daemon.core._handler import Hooks
from daemon.core._tree import DeviceTree
from daemon.holdings import Holder, HolderLookup
from daemon.metrics import Metrics

from ._choice import allocate, choose, releaser
from ._claims import ClaimNotFound, ClaimRef, ClaimRefused, driver_results
from ._claimspecs import Chosen, ClaimSpecs
from ._devices import pool_shares
from ._loans import ClaimLoans, wanted_loans
from ._metadata import ClaimMetadata, DeviceMetadataFiles, MetadataStays
from ._prepared import ClaimBook, PreparedClaim, PreparedDevice
from ._status import ClaimStatusWriter
from ._unaccounted import UnaccountedClaims

log = logging.getLogger("devplugd.dra")

CLAIM_GET_TIMEOUT = 10.0  # seconds for one claim's GET: the kubelet's whole call has 45
# A claim UID is a UUID; anything that is not a CDI device-name start and safe in a file name is refused.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


@dataclass(frozen=True)
class PrepareResult:
    """One claim's answer: its devices, or why it cannot be prepared."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


class _SpecStays(Exception):
    """An unprepared claim's CDI spec could not be removed (the message: why): nothing else was done."""


GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any]]]


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
        holders: HolderLookup | None = None,
        metrics: Metrics | None = None,
        status: ClaimStatusWriter | None = None,
        metadata: DeviceMetadataFiles | None = None,
        post: Callable[[Lent], None] = lambda event: None,
    ) -> None:
        self._driver = driver
        self._node = node_name
        self._specs = ClaimSpecs(cdi_dir, driver)
        self._claims = claims
        self._tree = tree
        self._hooks = hooks
        self._get_claim = get_claim
        self._on_change = on_change
        self._get_timeout = get_timeout
        # who holds what now (a lease granted a moment ago is not in the tree yet)
        self._holders = holders
        self._metrics = metrics or Metrics()
        # told of each claim prepared and unprepared, for its status.devices (in the background)
        self._status = status
        # each request's device metadata file and its CDI spec (None: none written)
        self._metadata = metadata
        # devices a claim asks for on vfio-pci: taken from their drivers and given back; the
        # handlers are told what is lent through ``post`` (the event bus)
        self._loans = ClaimLoans(hooks, claims, post, self._metrics)
        self._lock = trio.Lock()
        # with a lost checkpoint: the claims whose specs say they were prepared before
        self._unaccounted = UnaccountedClaims(claims, self._specs)

    def spec_path(self, uid: str) -> Path:
        return self._specs.path(uid)

    # -- prepare ---------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        started = time.perf_counter()
        refs = list({ref.uid: ref for ref in claims}.values())
        wanted = [ref for ref in refs if _UID.fullmatch(ref.uid) and self._claims.prepared(ref.uid) is None]
        fetched: dict[str, Mapping[str, Any] | str] = {}
        if len(wanted) == 1:  # the usual call: no nursery to start and wait for
            await self._fetch(wanted[0], fetched)
        elif wanted:
            async with trio.open_nursery() as nursery:
                for ref in wanted:
                    nursery.start_soon(self._fetch, ref, fetched)
        answers: dict[str, PrepareResult] = {}
        async with self._lock:
            with trio.CancelScope(shield=True):
                for ref in refs:
                    answers[ref.uid] = await self._answer(ref, fetched.get(ref.uid))
        self._metrics.dra_prepare_duration.observe(time.perf_counter() - started)
        self._metrics.dra_claim_errors.labels("prepare").inc(sum(1 for a in answers.values() if a.error is not None))
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
        except ClaimRefused as refusal_:
            log.warning("not preparing %s (UID %s): %s", ref.label, ref.uid, refusal_, extra={"EVENT": "prepare"})
            return PrepareResult(error=str(refusal_))
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
        before_loss = await self._unaccounted.prepared_before(ref)
        results = driver_results(fetched, ref, self._driver)
        plan = self._metadata.plan(fetched, ref, results) if self._metadata is not None else None
        chosen = choose(self._tree(), self._node, self._specs.kind, ref, results, before_loss,
                        self._holders or self._book_holder, self._shares_of)
        if not chosen:
            return PrepareResult()
        wanted = wanted_loans(ref, chosen, results)
        # held from the choice on, with no await between: a host lease granted while the
        # allocation runs in its thread must not get these devices
        reserved = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(c.device for c in chosen))
        self._claims.reserve(reserved)
        loans: tuple[Loan, ...] = ()
        try:
            if wanted:
                planned = self._loans.plan(ref, wanted)
                moving = [(item, loan) for item, loan in zip(wanted, planned, strict=True) if loan.parts]
                if moving:  # a device on vfio-pci already is handed out as it is
                    wanted, planned = [item for item, _ in moving], tuple(loan for _, loan in moving)
                    await trio.to_thread.run_sync(self._loans.check, ref, wanted, planned)
                    loans = planned  # from here on, what failed gives them back
                    chosen = await self._loans.take(ref, reserved, chosen, wanted, loans)
            claim = await self._claims.add_made(ref.uid, lambda: self._made(ref, chosen, plan, loans))
        except Exception as error:
            self._claims.unreserve(ref.uid)
            await self._undo(ref, chosen)
            if loans:
                await self._loans.give_back_failed(ref, loans)
            if isinstance(error, OSError):  # the checkpoint's write (the spec's is a ClaimRefused)
                raise ClaimRefused(f"{ref.label}: cannot write the checkpoint {self._claims.path}: {error}") from error
            raise
        self._unaccounted.prepared(ref.uid)
        if self._status is not None:
            self._status.prepared(claim)
        log.info("prepared %s (UID %s): %s", ref.label, ref.uid,
                 ", ".join(f"{c.device.device_id} of {c.device.resource}" for c in chosen), extra={"EVENT": "prepare"})
        self._on_change(f"{ref.label} prepared")
        return PrepareResult(devices=claim.devices)

    def _made(self, ref: ClaimRef, chosen: Sequence[Chosen], plan: ClaimMetadata | None,
              loans: tuple[Loan, ...] = ()) -> PreparedClaim:
        """(worker thread, the checkpoint's: ``ClaimBook.add_made``) Allocate the devices, write
        the claim's CDI spec and (with ``plan``) its device metadata; the claim to checkpoint
        (with the ``loans`` its devices are on vfio-pci under)."""
        allocations = allocate(self._hooks, ref, chosen)
        spec = self._specs.document(ref.uid, chosen, allocations)
        try:
            self._specs.write(ref.uid, spec)
        except OSError as error:
            raise ClaimRefused(f"{ref.label}: cannot write its CDI spec {self.spec_path(ref.uid)}: {error}") from error
        claim = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(c.device for c in chosen), spec, loans=loans)
        return self._metadata.made(claim, chosen, plan) if self._metadata is not None and plan is not None else claim

    def _book_holder(self, pool: ResourcePool, device_id: str) -> Holder | None:
        """Without the daemon's holdings (alone, in a test): the claim book's word."""
        return self._claims.holders().get((pool.resource, device_id))

    def _shares_of(self, pool: ResourcePool) -> Mapping[str, Sequence[str]]:
        return pool_shares(self._hooks, pool)

    async def _rewrite_spec_if_missing(self, claim: PreparedClaim) -> None:
        """Write again the claim's CDI spec if it is missing, and its device metadata files and
        specs that are missing or say something else; ClaimRefused says which cannot be."""
        if claim.cdi_spec is not None and not await trio.to_thread.run_sync(self.spec_path(claim.uid).exists):
            log.warning("%s (UID %s): its CDI spec %s is missing; writing it again", claim.label, claim.uid,
                        self.spec_path(claim.uid), extra={"EVENT": "prepare"})
            try:
                await trio.to_thread.run_sync(self._specs.write, claim.uid, claim.cdi_spec)
            except OSError as error:
                raise ClaimRefused(f"{claim.label}: cannot write its CDI spec {self.spec_path(claim.uid)} again: "
                                   f"{error}") from error
        if self._metadata is not None and claim.device_metadata:
            rewritten = await trio.to_thread.run_sync(self._metadata.rewrite, claim)
            if rewritten:
                log.warning("%s (UID %s): its device metadata %s was missing or changed; written again", claim.label,
                            claim.uid, ", ".join(map(str, rewritten)), extra={"EVENT": "prepare"})

    async def _undo(self, ref: ClaimRef, chosen: Sequence[Chosen]) -> None:
        """Take back a prepare that failed half-way: its spec, its device metadata and its
        devices' side files (those no other prepared claim shares; a handler that fails is
        logged: a stale side file is rewritten by the next allocation)."""
        try:
            await trio.to_thread.run_sync(self._specs.remove, ref.uid)
        except OSError as error:
            log.error("cannot remove %s: %s", self.spec_path(ref.uid), error, extra={"EVENT": "prepare"})
        if self._metadata is not None:
            try:
                await trio.to_thread.run_sync(self._metadata.remove, ref.namespace, ref.name, ref.uid)
            except MetadataStays as error:
                log.error("%s (UID %s): %s", ref.label, ref.uid, error, extra={"EVENT": "prepare"})
        devices = [(item.pool, item.device) for item in chosen]
        await trio.to_thread.run_sync(releaser(self._hooks, self._claims.claims, ref.uid, devices))

    # -- unprepare -------------------------------------------------------------------------------
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        """Each claim's error, or ``None`` when it is unprepared (or never was)."""
        started = time.perf_counter()
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
        self._metrics.dra_unprepare_duration.observe(time.perf_counter() - started)
        self._metrics.dra_claim_errors.labels("unprepare").inc(sum(1 for a in answers.values() if a is not None))
        return answers

    async def release_orphans(self, orphans: Mapping[str, tuple[ClaimRef, str]]) -> None:
        """Unprepare claims the kubelet will never unprepare (UID -> the claim and why: its
        ResourceClaim is gone, or replaced; ``_orphans.py``), as Unprepare does, under its lock;
        one line each, naming the claim and why. Their status is not written: it is nobody's."""
        async with self._lock:
            with trio.CancelScope(shield=True):
                for uid, (ref, why) in orphans.items():
                    if self._claims.written(uid) is None:
                        continue  # the kubelet unprepared it meanwhile
                    try:
                        error = await self._unprepare(ref, orphaned=why)
                    except Exception as failure:
                        error = f"internal error: {type(failure).__name__}: {failure}"
                        log.exception("unpreparing %s (UID %s) failed", ref.label, uid, extra={"EVENT": "orphans"})
                    if error is not None:
                        log.error("%s (UID %s) stays prepared although %s: %s", ref.label, uid, why, error,
                                  extra={"EVENT": "orphans"})
                    else:
                        self._metrics.dra_orphaned_claims.inc()

    async def _unprepare(self, ref: ClaimRef, *, orphaned: str | None = None) -> str | None:
        """Unprepare ``ref``; ``orphaned``: why the kubelet never will (logged, no status written)."""
        if not _UID.fullmatch(ref.uid):
            return None  # never prepared: no spec, no entry has such a UID
        claim = self._claims.written(ref.uid)  # a pending one too: its functions go back now
        if claim is None:
            try:
                if self._metadata is not None:  # a prepare that crashed before its checkpoint may have left some
                    await trio.to_thread.run_sync(self._metadata.remove, ref.namespace, ref.name, ref.uid)
                await trio.to_thread.run_sync(self._specs.remove, ref.uid)
            except MetadataStays as stays:
                return f"{ref.label}: {stays}"
            except OSError as error:
                return f"{ref.label}: cannot remove its CDI spec {self.spec_path(ref.uid)}: {error}"
        else:
            tree = self._tree()
            release = releaser(self._hooks, self._claims.claims, ref.uid,
                               [(tree.pools[d.resource], d) for d in claim.devices if d.resource in tree.pools])

            def before() -> None:  # in the checkpoint's worker thread, before its write
                if self._metadata is not None:  # MetadataStays: nothing else is done; None: look (an older claim)
                    self._metadata.remove(claim.namespace, claim.name, claim.uid,
                                          None if claim.device_metadata is None else claim.device_metadata.keys())
                try:
                    self._specs.remove(ref.uid)
                except OSError as error:
                    raise _SpecStays(str(error)) from error
                release()
                self._loans.give_back(claim.label, claim.loans)  # AllocationError: it stays prepared

            try:
                await self._claims.remove(ref.uid, before=before)
            except _SpecStays as stays:
                return f"{ref.label}: cannot remove its CDI spec {self.spec_path(ref.uid)}: {stays}"
            except AllocationError as stays:
                return (f"{ref.label}: not every function it had on vfio-pci could go back to its driver: {stays}; "
                        "it stays prepared (ask again)")
            except MetadataStays as stays:
                return f"{ref.label}: {stays}"
            except OSError as error:
                return f"{ref.label}: cannot write the checkpoint {self._claims.path}: {error}"
            if orphaned is None:
                log.info("unprepared %s (UID %s)", claim.label, ref.uid, extra={"EVENT": "unprepare"})
                if self._status is not None:
                    self._status.unprepared(claim)
            else:
                log.warning("unprepared %s (UID %s), which the kubelet will never unprepare: %s", claim.label,
                            ref.uid, orphaned, extra={"EVENT": "orphans"})
                if self._status is not None:
                    self._status.forget(ref.uid)
            self._on_change(f"{claim.label} unprepared")
            if claim.loans:
                self._loans.announce(f"{claim.label} unprepared")
        self._unaccounted.unprepared(ref)
        return None

    # -- start -----------------------------------------------------------------------------------
    async def restore(self) -> None:
        """At start: what went to vfio-pci made right (``ClaimLoans.restore``); the specs of
        prepared claims written again where missing (a reboot empties /var/run) and claim specs
        the checkpoint does not have removed (a prepare that crashed before its checkpoint: the
        kubelet asks again), but not with a lost checkpoint (they are all that tells which claims
        were prepared); each prepared claim's status written (in the background)."""
        async with self._lock:
            await self._loans.restore()
            for claim in list(self._claims.claims.values()):
                if claim.pending:
                    continue  # its loans could not be given back: not prepared
                if self._status is not None:  # a write a restart cut short is made now
                    self._status.prepared(claim)
                try:
                    await self._rewrite_spec_if_missing(claim)
                except ClaimRefused as error:
                    log.error("%s", error, extra={"EVENT": "restore"})
            if self._claims.lost is not None:
                await self._unaccounted.read()
                return
            if self._metadata is not None:
                for path in await trio.to_thread.run_sync(self._metadata.remove_stale, dict(self._claims.claims)):
                    log.warning("removed %s: device metadata of a claim not in the checkpoint", path,
                                extra={"EVENT": "restore"})
            for uid in await trio.to_thread.run_sync(self._specs.stale, set(self._claims.claims)):
                log.warning("removing the CDI spec of claim UID %s: not in the checkpoint", uid,
                            extra={"EVENT": "restore"})
                await trio.to_thread.run_sync(self._specs.remove, uid)

"""Devices a claim asks for on vfio-pci (``VfioConfig``): which (``wanted_loans``), the checks,
the rebinding and the way back (``ClaimLoans``, through the handlers' ``daemon.core.Lender``
hooks), for ``ClaimPreparer``.

Crash safety is the claim checkpoint's: a claim whose devices are lent is written there with its
loans (each function and the driver it goes back to) and ``pending`` before the first function
leaves its driver, and as prepared once its CDI spec is written; Unprepare gives the loans back
before the entry leaves the file. So a daemon killed at any point finds at start what it may
have rebound: a pending entry (a Prepare cut short; the kubelet, never answered, asks again) is
given back and dropped, a prepared one is made whole again (a reboot puts every function back on
its own driver while the kubelet still counts the claim prepared). A device never stays on
vfio-pci without a claim, and never goes back while a claim holds it.

The handlers keep a lent function in its pool whatever driver the rebinding leaves it on (see
``daemon.core.Lent``): ``announce`` tells each Lender every part the checkpoint has lent, before a
loan starts and after one ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import trio

from daemon.core import AllocationError, Lender, Lent, Loan
from daemon.core._handler import Hooks
from daemon.metrics import Metrics

from ._claims import AllocationResult, ClaimRef, ClaimRefused
from ._claimspecs import Chosen
from ._prepared import ClaimBook, PreparedClaim, PreparedDevice, lent_parts
from ._vfioconfig import VfioConfig

log = logging.getLogger("devplugd.dra")

Wanted = list[tuple[Chosen, VfioConfig]]


def wanted_loans(ref: ClaimRef, chosen: Sequence[Chosen], results: Sequence[AllocationResult]) -> Wanted:
    """The chosen devices whose results carry a ``VfioConfig``, with it; ClaimRefused for a device
    asked for with two backends, or on vfio-pci for admin access (which takes it from nobody)."""
    configs: dict[tuple[str, str, str | None], set[VfioConfig]] = {}
    for result in results:
        if result.vfio is not None:
            configs.setdefault((result.pool, result.device, result.share_id), set()).add(result.vfio)
    wanted: Wanted = []
    for item in chosen:
        device = item.device
        asked = configs.get((device.pool_name, device.device_name, device.share_id))
        if not asked:
            continue
        if len(asked) > 1:
            backends = ", ".join(sorted(config.backend for config in asked))
            raise ClaimRefused(f"{ref.label}: {_named(device)} is asked for with the VfioConfig backends {backends}; "
                               "one device has one")
        if device.admin_access:
            raise ClaimRefused(f"{ref.label}: {_named(device)} is asked for with admin access and a VfioConfig: "
                               "admin access takes it from nobody, so it cannot be taken from its driver")
        wanted.append((item, next(iter(asked))))
    return wanted


class ClaimLoans:
    """The loans of the claims in ``book``: planned (on the event loop: a few sysfs links),
    checked, lent and given back (these block on the kernel: in worker threads) through the
    handlers' Lender hooks, and announced to the handlers (``post``, the event bus)."""

    def __init__(self, hooks: Mapping[str, Hooks], book: ClaimBook, post: Callable[[Lent], None],
                 metrics: Metrics | None = None) -> None:
        self._hooks = hooks
        self._book = book
        self._post = post
        self._metrics = metrics or Metrics()
        self._announced: set[str] = set()  # the handlers told of some lent part last time

    async def take(self, ref: ClaimRef, reserved: PreparedClaim, chosen: Sequence[Chosen], wanted: Wanted,
                   loans: tuple[Loan, ...]) -> list[Chosen]:
        """Take the devices of ``loans`` to vfio-pci: into the checkpoint first, as the claim
        ``reserved`` pending (OSError: nothing moved), the handlers told, then the rebinding
        (ClaimRefused: the caller gives everything back); ``chosen`` with each lent device as it
        is then."""
        await self._book.add(replace(reserved, loans=loans, pending=True))
        self.announce(f"{ref.label} is being prepared")
        started = time.perf_counter()
        try:
            lent = await trio.to_thread.run_sync(self.lend, ref, wanted, loans)
        except ClaimRefused:
            self._metrics.dra_vfio_rebinds.labels("to_vfio", "failed").inc()
            raise
        self._metrics.dra_vfio_rebinds.labels("to_vfio", "done").inc(len(loans))
        self._metrics.dra_vfio_rebind_duration.observe(time.perf_counter() - started)
        log.info("%s (UID %s): %s on vfio-pci in %.0f ms", ref.label, ref.uid,
                 ", ".join(f"{part} (from {driver or 'no driver'})" for loan in loans for part, driver in loan.parts),
                 (time.perf_counter() - started) * 1000, extra={"EVENT": "vfio"})
        return [lent.get((item.device.resource, item.device.device_id), item) for item in chosen]

    async def give_back_failed(self, ref: ClaimRef, loans: Sequence[Loan]) -> None:
        """A Prepare that failed after its loans were checkpointed: every function back to its
        driver, then the pending entry dropped; when a function cannot go back, the entry stays
        (the next start finds it) and the error is logged."""
        try:
            await trio.to_thread.run_sync(self.give_back, ref.label, loans)
        except AllocationError as error:
            log.error("%s (UID %s): giving back what its failed Prepare took to vfio-pci failed: %s; it stays in "
                      "the checkpoint, to be given back at the next start", ref.label, ref.uid, error,
                      extra={"EVENT": "vfio"})
            return
        try:
            await self._book.remove(ref.uid)
        except OSError as error:
            log.error("%s (UID %s): cannot drop its pending entry from %s: %s", ref.label, ref.uid, self._book.path,
                      error, extra={"EVENT": "vfio"})
        self.announce(f"{ref.label} was not prepared")

    async def restore(self) -> None:
        """At start, before anything else: the handlers told what the checkpoint has lent; a
        pending claim (a Prepare a crash cut short, perhaps between two functions' binds) given
        back and dropped (the kubelet, never answered, asks again); a prepared claim's devices
        whole on vfio-pci again (a reboot gave them back to their drivers)."""
        lent = lent_claims(self._book.claims)
        if not lent:
            return
        self.announce("the checkpoint at start")
        for claim in lent:
            try:
                if claim.pending:
                    await trio.to_thread.run_sync(self.give_back, claim.label, claim.loans)
                    await self._book.remove(claim.uid)
                    log.warning("%s (UID %s): its Prepare was cut short (the daemon stopped while its devices went "
                                "to vfio-pci); every function is back on its driver", claim.label, claim.uid,
                                extra={"EVENT": "restore"})
                else:
                    await trio.to_thread.run_sync(self.keep_lent, claim)
            except (AllocationError, OSError) as error:
                log.error("%s (UID %s): %s", claim.label, claim.uid, error, extra={"EVENT": "restore"})
        self.announce("the checkpoint at start, restored")

    def plan(self, ref: ClaimRef, wanted: Wanted) -> tuple[Loan, ...]:
        """The loan of each wanted device (what would move; a few sysfs links, read on the event
        loop); nothing changes on the host. ClaimRefused names the device and why it cannot be
        lent whole."""
        loans = []
        for item, _config in wanted:
            pool, device = item.pool, item.device
            hooks = self._hooks.get(pool.handler)
            if hooks is None or hooks.lender is None or not hooks.lender.lends(pool.pool_config):
                raise ClaimRefused(f"{ref.label}: device {device.device_name!r} asks for vfio-pci (VfioConfig), but "
                                   f"pool {pool.resource} does not take its devices to vfio-pci on demand "
                                   "(vfioOnDemand is not set)")
            try:
                loan = hooks.lender.plan_loan(pool, device.device_id)
            except (AllocationError, OSError) as error:
                raise ClaimRefused(f"{ref.label}: {_named(device)} cannot go to vfio-pci: {error}") from error
            loans.append(replace(loan, parts=self._with_earlier_loan(ref, loan)))
        return tuple(loans)

    def _with_earlier_loan(self, ref: ClaimRef, loan: Loan) -> tuple[tuple[str, str | None], ...]:
        """``loan``'s parts with their own drivers where the book lent them already, and the
        parts this claim's pending entry (a Prepare whose giving back failed; the reservation
        of this Prepare hides it from ``claims``) left on vfio-pci, which the plan of the host
        as it is now does not see: they are this loan's to give back too."""
        earlier = self._book.written(ref.uid)
        earlier_loans = [other for other in earlier.loans if other.handler == loan.handler] if earlier else []
        homes = lent_parts(self._book.claims).get(loan.handler, {})
        for other in earlier_loans:
            homes.update(other.parts)
        parts = {part: homes.get(part, driver) for part, driver in loan.parts}
        for other in earlier_loans:
            if (other.resource, other.device_id) == (loan.resource, loan.device_id):
                parts.update((part, home) for part, home in other.parts if part not in parts)
        return tuple(sorted(parts.items()))

    def check(self, ref: ClaimRef, wanted: Wanted, loans: Sequence[Loan]) -> None:
        """(worker thread) ClaimRefused naming the device, the function and why it may not leave
        its driver; nothing changes on the host."""
        for (item, _config), loan in zip(wanted, loans, strict=True):
            try:
                self._lender(loan).check_loan(loan)
            except (AllocationError, OSError) as error:
                raise ClaimRefused(f"{ref.label}: {_named(item.device)} cannot go to vfio-pci: {error}") from error

    def lend(self, ref: ClaimRef, wanted: Wanted, loans: Sequence[Loan]) -> dict[tuple[str, str], Chosen]:
        """(worker thread) Every loan's functions to vfio-pci; each lent device (by resource and
        ID) as it is then, in its pool, for the allocation. ClaimRefused names the device and the
        step that failed; what was rebound stays so (the caller gives every loan back)."""
        lent: dict[tuple[str, str], Chosen] = {}
        for (item, config), loan in zip(wanted, loans, strict=True):
            lender = self._lender(loan)
            try:
                info = lender.lend(item.pool, loan, config.backend)
            except (AllocationError, OSError) as error:
                raise ClaimRefused(f"{ref.label}: {_named(item.device)} could not go to vfio-pci: {error}") from error
            pool = replace(item.pool, devices={**item.pool.devices, loan.device_id: info})
            lent[loan.resource, loan.device_id] = Chosen(pool, item.device)
        return lent

    def give_back(self, label: str, loans: Sequence[Loan]) -> None:
        """(worker thread) Every loan back to its functions' drivers; AllocationError naming what
        stays on vfio-pci (after trying every loan)."""
        failures = []
        for loan in loans:
            try:
                self._lender(loan).give_back(loan)
            except (AllocationError, OSError) as error:
                failures.append(f"{loan.device_id} of {loan.resource}: {error}")
                self._metrics.dra_vfio_rebinds.labels("back", "failed").inc()
                continue
            self._metrics.dra_vfio_rebinds.labels("back", "done").inc()
            log.info("%s: %s of %s is back on %s", label, loan.device_id, loan.resource,
                     ", ".join(sorted({driver or "no driver" for _, driver in loan.parts})),
                     extra={"EVENT": "vfio", "RESOURCE": loan.resource})
        if failures:
            raise AllocationError("; ".join(failures))

    def keep_lent(self, claim: PreparedClaim) -> None:
        """(worker thread, at start) Every loan of a prepared claim whole on vfio-pci again;
        AllocationError naming what could not be."""
        failures = []
        for loan in claim.loans:
            try:
                self._lender(loan).keep_lent(loan)
            except (AllocationError, OSError) as error:
                failures.append(f"{loan.device_id} of {loan.resource}: {error}")
        if failures:
            raise AllocationError("; ".join(failures))

    def announce(self, reason: str) -> None:
        """Tell every Lender the parts the checkpoint (and the claims being added) has lent now:
        one ``Lent`` per handler with some, and to those that had some before, an empty one."""
        parts = lent_parts(self._book.claims)
        for handler in sorted(parts.keys() | self._announced):
            self._post(Lent(handler, tuple(sorted(parts.get(handler, {}).items())), reason))
        self._announced = set(parts)
        self._metrics.dra_vfio_lent_functions.set(sum(len(lent) for lent in parts.values()))

    def _lender(self, loan: Loan) -> Lender:
        hooks = self._hooks.get(loan.handler)
        if hooks is None or hooks.lender is None:
            raise AllocationError(f"no handler {loan.handler!r} to give {loan.device_id} of {loan.resource} back")
        return hooks.lender


def _named(device: PreparedDevice) -> str:
    """A claim's device in its refusals: its name in the slice, its ID and pool."""
    return f"device {device.device_name!r} ({device.device_id} of {device.resource})"


def lent_claims(claims: Mapping[str, PreparedClaim]) -> list[PreparedClaim]:
    """The claims with loans, pending ones first (a Prepare cut short: given back at start)."""
    return sorted((claim for claim in claims.values() if claim.loans), key=lambda claim: not claim.pending)

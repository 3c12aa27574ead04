"""Prepared claims the kubelet will never unprepare, unprepared by devplugd.

The kubelet unprepares a claim when the last pod using it is gone, from its own checkpoint. It
never does for a claim whose Prepare it stopped waiting for: a Prepare in flight across a kubelet
restart is not asked again for a pod deleted meanwhile (upstream's e2e "must not call
NodePrepareResources for deleted pod after Kubelet restart"), yet devplugd prepared it and holds
its devices. Such a claim is deleted from the API server soon after its pod (the resource claim
controller deletes a pod's generated claims; a claim in use cannot go while its pod is reserved
for it). So, as NVIDIA's driver does in ``cleanup.go``, each checkpointed claim is read from the
API server at start and every ``SWEEP_PERIOD`` seconds, and one that is gone (404) or that the
API server has under its name with another UID (the old one was deleted, a new one made) is
unprepared: its CDI spec, device-info files, checkpoint entry (``ClaimPreparer.release_orphans``,
the Unprepare path under the same lock), so its devices are free again. A UID names one claim for
ever: a claim gone is never coming back.

Only an answer counts: a GET that fails in any other way (the API server unreachable, a 403, a
500, a timeout, a body without a UID) says nothing, and the claim is kept until the next look.
A 403 is said once, as a warning: with the node's own identity (the kubelet's kubeconfig) the
Node authorizer lets devplugd read only the claims of the node's pods, so a claim whose pod is
gone is a 403 whether it is there or not, and this look can find nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from ._claims import ClaimNotFound, ClaimRef
from ._prepared import ClaimBook

log = logging.getLogger("devplugd.dra")

SWEEP_PERIOD = 45.0  # seconds from one look to the next: a claim gone is unprepared within 60 s
GET_TIMEOUT = 10.0  # seconds for one claim's GET

GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any]]]
# UID -> the claim and why the kubelet will never unprepare it
Orphans = Mapping[str, tuple[ClaimRef, str]]


class OrphanSweeper:
    """``run``: look at every prepared claim on the API server at once and every ``period``
    seconds, and hand those that are gone or replaced to ``release``."""

    def __init__(self, claims: ClaimBook, get_claim: GetClaim, release: Callable[[Orphans], Awaitable[None]], *,
                 period: float = SWEEP_PERIOD, get_timeout: float = GET_TIMEOUT) -> None:
        self._claims = claims
        self._get_claim = get_claim
        self._release = release
        self._period = period
        self._get_timeout = get_timeout
        self.sweeps = 0  # looks completed (for tests and the curious)
        self._forbidden_told = False  # a 403 warned of already

    async def run(self) -> None:
        while True:
            started = trio.current_time()
            await self.sweep()
            await trio.sleep_until(started + self._period)

    async def sweep(self) -> None:
        """One look at every claim prepared now."""
        orphans: dict[str, tuple[ClaimRef, str]] = {}
        for uid, claim in list(self._claims.claims.items()):
            if self._claims.written(uid) is None:
                continue  # a Prepare under way: its claim was read a moment ago
            ref = ClaimRef(claim.namespace, uid, claim.name)
            why = await self._why_orphaned(ref)
            if why is not None:
                orphans[uid] = (ref, why)
        if orphans:
            await self._release(orphans)
        self.sweeps += 1

    async def _why_orphaned(self, ref: ClaimRef) -> str | None:
        """Why the kubelet will never unprepare ``ref``, or ``None`` (its claim is there, or the
        API server did not answer)."""
        with trio.move_on_after(self._get_timeout):
            try:
                found = await self._get_claim(ref.namespace, ref.name)
            except ClaimNotFound:
                return "its ResourceClaim is gone from the API server"
            except Exception as error:
                if getattr(error, "status", None) == 403 and not self._forbidden_told:
                    self._forbidden_told = True
                    log.warning("%s (UID %s): the API server does not let devplugd read it (403: %s), so whether "
                                "it is gone cannot be told; with the node's own credentials that is every claim "
                                "whose pod is gone: give devplugd credentials that may get resourceclaims (the "
                                "RBAC of `devplugd dra device-classes --rbac`) for claims the kubelet will never "
                                "unprepare to be found", ref.label, ref.uid, error, extra={"EVENT": "orphans"})
                log.debug("%s (UID %s): cannot tell whether it is still on the API server: %s: %s", ref.label,
                          ref.uid, type(error).__name__, error, extra={"EVENT": "orphans"})
                return None
            metadata = found.get("metadata") if isinstance(found, Mapping) else None
            uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
            if not isinstance(uid, str) or not uid:
                log.debug("%s (UID %s): the API server's answer has no UID", ref.label, ref.uid,
                          extra={"EVENT": "orphans"})
                return None
            if uid != ref.uid:
                return f"the API server has another claim of that name now (UID {uid})"
            return None
        log.debug("%s (UID %s): reading it from the API server timed out after %g s", ref.label, ref.uid,
                  self._get_timeout, extra={"EVENT": "orphans"})
        return None

"""With a lost claim checkpoint (it could not be read): the claims whose CDI specs say they were
prepared before the loss. Nobody knows which devices they hold, so only they may be prepared
(again) until every one of them is accounted for, unprepared or prepared again (its devices in
the new checkpoint then); then the book is found again.
"""

from __future__ import annotations

import logging

import trio

from ._claims import ClaimRef, ClaimRefused
from ._claimspecs import ClaimSpecs
from ._prepared import ClaimBook

log = logging.getLogger("devplugd.dra")


class UnaccountedClaims:
    def __init__(self, claims: ClaimBook, specs: ClaimSpecs) -> None:
        self._claims = claims
        self._specs = specs
        self._uids: set[str] | None = None  # not read yet

    async def read(self) -> None:
        """The claims with a spec and no checkpoint entry: those prepared before the loss."""
        self._uids = await trio.to_thread.run_sync(self._specs.uids) - set(self._claims.claims)
        self._found_again_if_none_left()

    async def prepared_before(self, ref: ClaimRef) -> bool:
        """Whether ``ref`` is a claim prepared before the loss (``False`` with no loss);
        ClaimRefused for any other while the book is lost."""
        if self._claims.lost is None:
            return False
        if self._uids is None:
            await self.read()
            if self._claims.lost is None:
                return False
        assert self._uids is not None
        if ref.uid in self._uids:
            return True
        shown = ", ".join(sorted(self._uids)[:5]) + (", ..." if len(self._uids) > 5 else "")
        raise ClaimRefused(f"{ref.label}: not prepared: {self._claims.lost}; the devices of the "
                           f"{len(self._uids)} claims prepared before are unknown, so no other claim is "
                           f"prepared until each of them is unprepared or prepared again ({shown})")

    def prepared(self, uid: str) -> None:
        """Claim ``uid`` is in the checkpoint now: accounted for (the last: the book is found again)."""
        if self._uids and uid in self._uids:
            self._uids.discard(uid)
            self._found_again_if_none_left()

    def unprepared(self, ref: ClaimRef) -> None:
        """Claim ``ref`` is unprepared: one fewer unknown (the last: the book is found again)."""
        if self._uids and ref.uid in self._uids:
            self._uids.discard(ref.uid)
            log.info("%s (UID %s), prepared before the checkpoint was lost, is unprepared; %d such claims left",
                     ref.label, ref.uid, len(self._uids), extra={"EVENT": "unprepare"})
            self._found_again_if_none_left()

    def _found_again_if_none_left(self) -> None:
        if self._uids is not None and not self._uids and self._claims.lost is not None:
            self._claims.book.clear_lost("devplugd: every claim prepared before the loss is unprepared")

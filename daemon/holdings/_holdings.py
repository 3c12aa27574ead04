"""Who holds what now: the host leases, the prepared DRA claims, the kubelet's checkpoint, the
books that could not be read, and the pools withheld while their ResourceSlices go.

``Holdings`` is the live view every road asks (through the rule, ``holder``); ``snapshot`` is
what one tree is assembled from (``_assemble.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from daemon.checkpoint import Allocations, CheckpointReader, Reading
from daemon.core import ResourcePool
from daemon.core._tree import DRA_ROAD, WITHHELD_ROAD

from ._holder import KUBELET, DeviceKey, Holder, LostBook


class HoldingBook(Protocol):
    """A durable book of holders (the leases, the claims)."""

    def holders(self) -> Mapping[DeviceKey, Holder]:
        """(resource, device ID) -> its holder, for what the book holds now (in flight included)."""
        ...

    @property
    def lost_book(self) -> LostBook | None: ...


@dataclass(frozen=True)
class HeldSnapshot:
    """Who held what when a tree was assembled. ``kubelet`` is ``None`` when the checkpoint
    cannot be read (who holds what through the kubelet is unknown)."""

    leases: Mapping[DeviceKey, Holder] = field(default_factory=dict)
    claims: Mapping[DeviceKey, Holder] = field(default_factory=dict)
    kubelet: Allocations | None = field(default_factory=dict)
    withheld: frozenset[str] = frozenset()
    lost_leases: LostBook | None = None
    lost_claims: LostBook | None = None

    def lost_book(self, road: str) -> str:
        """Which lost book holds every device of a pool on ``road``: ``lease`` (any road),
        ``claim`` (the DRA road, and a pool withheld while its slices go: it was a DRA pool), or ``""``."""
        if self.lost_leases is not None:
            return "lease"
        if self.lost_claims is not None and road in (DRA_ROAD, WITHHELD_ROAD):
            return "claim"
        return ""


class Holdings:
    def __init__(self, leases: HoldingBook, claims: HoldingBook, checkpoint: CheckpointReader) -> None:
        self._leases = leases
        self._claims = claims
        self.checkpoint = checkpoint
        self._withheld: frozenset[str] = frozenset()

    @property
    def withheld(self) -> frozenset[str]:
        """Pools served through the device-plugin API by their config whose ResourceSlices (from
        a time they were DRA pools) are still on the API server: served neither way meanwhile."""
        return self._withheld

    def set_withheld(self, resources: frozenset[str]) -> bool:
        """Whether that changed."""
        changed, self._withheld = resources != self._withheld, resources
        return changed

    def lost_books(self) -> list[LostBook]:
        return [book for book in (self._leases.lost_book, self._claims.lost_book) if book is not None]

    def holder(self, pool: ResourcePool, device_id: str) -> Holder | None:
        """The device's holder now: a host lease, a claim, a pod (the checkpoint as last read),
        a lost book, the kubelet when its checkpoint cannot be read; ``None``: free. The named
        holders come before the unknown ones, so a refusal says the most the daemon knows."""
        key = (pool.resource, device_id)
        if (lease := self._leases.holders().get(key)) is not None:
            return lease
        if (claim := self._claims.holders().get(key)) is not None:
            return claim
        reading = self.checkpoint.reading
        if (pod := reading.holdings.get(key)) is not None:
            return Holder(KUBELET, f"pod {pod[0]}/{pod[1]}")
        if (lost := self._leases.lost_book) is not None:
            return lost.holder()
        if (lost := self._claims.lost_book) is not None and pool.road in (DRA_ROAD, WITHHELD_ROAD):
            return lost.holder()
        if reading.error is not None:  # who holds it through the kubelet is unknown: held
            return Holder(KUBELET, "", reading.error)
        return None

    def snapshot(self, checkpoint: Reading | None = None) -> HeldSnapshot:
        """What a tree is assembled from; ``checkpoint`` is the reading to use (``None``: not
        needed for this tree, taken as nothing held)."""
        return HeldSnapshot(
            leases=self._leases.holders(),
            claims=self._claims.holders(),
            kubelet=checkpoint.allocations if checkpoint is not None else {},
            withheld=self._withheld,
            lost_leases=self._leases.lost_book,
            lost_claims=self._claims.lost_book,
        )

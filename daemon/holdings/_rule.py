"""The one availability rule: may this device of this pool be handed to whoever asks?

Every road asks it: the kubelet's Allocate (``KUBELET_ASKS``), a host lease (``LEASE_ASKS``), a
DRA claim being prepared (``claim_asks``) and the ResourceSlices being published
(``SLICE_ASKS``). One list of reasons, in this order:

1. ``unknown``: the device is not in the pool;
2. ``wrong road`` / ``withheld``: the pool is not served on the asker's road (a host lease may
   come from any road's pool; the slices publish the pools the DRA driver chose);
3. ``vanished``: the handler lost it while something held it (kept listed, Unhealthy);
4. ``unhealthy`` (not for a claim whose pool publishes Unhealthy devices with a taint: the
   scheduler decided, by the claim's tolerations);
5. held: ``leased`` (a host lease), ``claimed`` (a prepared DRA claim), ``kubelet`` (a pod
   through the device-plugin API, per the kubelet's checkpoint), ``lost book`` (a book that
   could not be read holds every device it could have held).

A road does not count its own kind of holding where another authority decides it: the kubelet
decides which of its pods get which device (so its Allocate ignores its checkpoint), and a
claim's devices stay in the ResourceSlices (the scheduler counts them allocated through the
claim). Admin access takes a device from no one.

Holders come from the live books when the caller has them (``HolderLookup``: a lease granted a
moment ago is not in the tree yet) and from the tree's record of the pool otherwise; both count,
except the asker's own book, whose live word is final (a claim unprepared a moment ago is free
for the next claim even while the tree still says claimed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.core import HEALTHY, ResourcePool
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD

from ._holder import CLAIM, KUBELET, LEASE, LOST_CLAIMS, LOST_KINDS, LOST_LEASES, Holder

# the reasons, in the order the rule tries them
UNKNOWN = "unknown"
WRONG_ROAD = "wrong road"
WITHHELD = "withheld"
VANISHED = "vanished"
UNHEALTHY = "unhealthy"
LEASED = "leased"
CLAIMED = "claimed"
KUBELET_HELD = "kubelet"
LOST_BOOK = "lost book"

_HELD_REASONS = {LEASE: LEASED, CLAIM: CLAIMED, KUBELET: KUBELET_HELD, LOST_LEASES: LOST_BOOK, LOST_CLAIMS: LOST_BOOK}

HolderLookup = Callable[[ResourcePool, str], "Holder | None"]


@dataclass(frozen=True)
class Asker:
    """Who asks for a device: the road it serves, and for a claim which one."""

    road: str  # DEVICE_PLUGIN_ROAD, DRA_ROAD, or HOST (a lease: any road's pool)
    own_book: str = ""  # the holder kind whose live word is final for this asker
    ignored: frozenset[str] = frozenset()  # holder kinds this asker does not count
    claim_uid: str = ""
    prepared_before_loss: bool = False  # a claim the lost claim book may hold itself
    # an Unhealthy device is the asker's to take: it was published with a taint, so the
    # scheduler gave it to a claim that tolerates it (or took it before the fault)
    takes_unhealthy: bool = False

    def ignores(self, holder: Holder) -> bool:
        if holder.kind in self.ignored:
            return True
        if holder.kind == CLAIM and self.claim_uid and holder.detail == self.claim_uid:
            return True
        return holder.kind == LOST_CLAIMS and self.prepared_before_loss


HOST = "host"
SLICES = "slices"
KUBELET_ASKS = Asker(DEVICE_PLUGIN_ROAD, ignored=frozenset({KUBELET}))
LEASE_ASKS = Asker(HOST, own_book=LEASE)
# which pools publish slices is the DRA driver's choice (the pools on the DRA road); the rule
# says which of their devices
SLICE_ASKS = Asker(SLICES, ignored=frozenset({CLAIM}))


def claim_asks(uid: str, *, admin_access: bool = False, prepared_before_loss: bool = False,
               takes_unhealthy: bool = False) -> Asker:
    """A DRA claim being prepared; admin access counts no other claim's holding; with
    ``takes_unhealthy`` (its pool publishes Unhealthy devices with a taint) an Unhealthy device
    is not refused for its health."""
    return Asker(DRA_ROAD, own_book=CLAIM, ignored=frozenset({CLAIM}) if admin_access else frozenset(),
                 claim_uid=uid, prepared_before_loss=prepared_before_loss, takes_unhealthy=takes_unhealthy)


@dataclass(frozen=True)
class Refusal:
    """Why a device cannot be had: the reason, what to say after the device (``predicate``:
    ``is held by host lease lease-1a2b (owner ci@node1)``), and who holds it."""

    reason: str
    predicate: str
    holder: Holder | None = None


def road_refusal(pool: ResourcePool, asker: Asker) -> Refusal | None:
    """The road part of the rule, for the whole pool."""
    if asker.road == DEVICE_PLUGIN_ROAD and pool.road == WITHHELD_ROAD:
        return Refusal(WITHHELD, "is withheld from the kubelet until its pool's ResourceSlices are deleted")
    if asker.road in (DEVICE_PLUGIN_ROAD, DRA_ROAD) and pool.road != asker.road:
        return Refusal(WRONG_ROAD, f"is served through {pool.road}, not {asker.road}")
    return None


def refusal(pool: ResourcePool, device_id: str, asker: Asker, live: HolderLookup | None = None) -> Refusal | None:
    """Why ``device_id`` of ``pool`` cannot go to ``asker``, or ``None``: it can."""
    info = pool.devices.get(device_id)
    if info is None:
        return Refusal(UNKNOWN, f"is not in {pool.resource}")
    if (road := road_refusal(pool, asker)) is not None:
        return road
    if device_id in pool.vanished:
        return Refusal(VANISHED, "is gone from the host")
    if info.health != HEALTHY and not asker.takes_unhealthy:
        return Refusal(UNHEALTHY, f"is {info.health}")
    holder = holder_of(pool, device_id, asker, live)
    if holder is None:
        return None
    if holder.kind == CLAIM and asker.road == DRA_ROAD and holder.name:  # a claim's error, as the kubelet shows it
        uid = f" (UID {holder.detail})" if holder.detail else ""
        return Refusal(CLAIMED, f"is prepared for claim {holder.name}{uid}", holder)
    return Refusal(_HELD_REASONS[holder.kind], f"is held by {holder.describe()}", holder)


def rule_context(pool: ResourcePool, asker: Asker) -> tuple[object, ...]:
    """Everything ``refusal`` reads of ``pool`` for ``asker`` besides its devices' records
    (without live holders): while it is equal, a device whose record is the same object gets the
    same answer. A holding the asker does not count is left out (the slices do not count claims:
    a claim prepared or unprepared changes nothing they say)."""
    held = tuple(devices for kind, devices in ((LEASE, pool.leased), (CLAIM, pool.claimed),
                                               (KUBELET, pool.kubelet_held)) if kind not in asker.ignored)
    return (pool.resource, pool.road, pool.vanished, held, pool.lost_book)


def holder_of(pool: ResourcePool, device_id: str, asker: Asker, live: HolderLookup | None = None) -> Holder | None:
    """Who holds the device as far as ``asker`` is concerned (see the module docstring)."""
    if live is not None and (now := live(pool, device_id)) is not None and not asker.ignores(now):
        return now
    for kind, held in ((LEASE, pool.leased), (CLAIM, pool.claimed), (KUBELET, pool.kubelet_held)):
        if device_id in held and not (live is not None and kind == asker.own_book):
            recorded = Holder(kind)
            if not asker.ignores(recorded):
                return recorded
    if pool.lost_book:
        recorded = Holder(LOST_KINDS[pool.lost_book])
        if not asker.ignores(recorded):
            return recorded
    return None

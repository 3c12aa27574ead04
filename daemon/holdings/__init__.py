"""Who holds what: one home for the promise that a device goes to one holder at a time,
whichever road asks (the kubelet's device-plugin API, a DRA claim, a host lease).

* ``Holdings``: the live view of the holders (host leases, prepared claims, the kubelet's
  checkpoint, books that could not be read) and of the pools withheld while their slices go;
* ``refusal``: the one availability rule every road asks, with one list of reasons;
* ``Assembly``: the next DeviceTree from the previous one, the handlers' builds, the config and a
  ``HeldSnapshot`` of the holders, a pure function the event loop calls;
* ``DurableBook``: the one durable book (leases and claims), with one policy for a file that
  cannot be read;
* ``StateLock``, ``Handover``, ``WriteGate``: one instance writes the state directory at a time
  (the old and the new pod of a rolling update share it), and hands it over on request.
"""

from ._active import (
    Handover,
    StateLock,
    WriteGate,
    WritesClosed,
    become_active,
    instance_name,
    not_active_here,
    request_handover,
    serves,
)
from ._assemble import Assembly
from ._book import DurableBook
from ._holder import CLAIM, KUBELET, LEASE, Holder, LostBook
from ._holdings import HoldingBook, Holdings
from ._rule import (
    KUBELET_ASKS,
    KUBELET_HELD,
    LEASE_ASKS,
    LOST_BOOK,
    SLICE_ASKS,
    UNHEALTHY,
    UNKNOWN,
    VANISHED,
    HolderLookup,
    Refusal,
    claim_asks,
    holder_of,
    refusal,
    road_refusal,
)

__all__ = [
    "CLAIM",
    "KUBELET",
    "KUBELET_ASKS",
    "KUBELET_HELD",
    "LEASE",
    "LEASE_ASKS",
    "LOST_BOOK",
    "SLICE_ASKS",
    "UNHEALTHY",
    "UNKNOWN",
    "VANISHED",
    "Assembly",
    "DurableBook",
    "Handover",
    "Holder",
    "HolderLookup",
    "HoldingBook",
    "Holdings",
    "LostBook",
    "Refusal",
    "StateLock",
    "WriteGate",
    "WritesClosed",
    "become_active",
    "claim_asks",
    "holder_of",
    "instance_name",
    "not_active_here",
    "refusal",
    "request_handover",
    "road_refusal",
    "serves",
]

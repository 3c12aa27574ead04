"""DRA claims as this node prepared them, and their checkpoint (``ClaimBook``).

Each prepared claim is recorded with its devices (which pool, which device, the requests they
serve, whether the allocation is admin access), the CDI spec that was written for it, its device
metadata and the devices it took to vfio-pci (``loans``), so an Unprepare after a restart knows
what to undo and a spec that went missing (``/var/run`` is a tmpfs: a reboot empties it while the
kubelet still counts the claim prepared) is written again byte for byte, without asking the
handler anew.

The checkpoint (``<state-dir>/dra-claims.json`` and its second slot ``dra-claims.b.json``) is a
``DurableBook`` (``daemon.holdings``): written durably, never torn, before the kubelet hears of a
change, one write at a time; a claim being added
holds its devices from the moment ``add`` is called, and a claim being removed holds them until
the file no longer has it.

A checkpoint that cannot be read is not taken as empty: that could hand a device to a second
claim while the pod of the first still runs. It is moved aside, and the book is ``lost``: it
holds every device of the DRA pools, and the preparer refuses new claims, until every claim that
may have been prepared before is unprepared (see ``ClaimPreparer``) or an operator runs
``devplugd clear-lost claims``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.core import Loan
from daemon.holdings import CLAIM, DurableBook, Holder, LostBook

CLAIMS_FILE = "dra-claims.json"


# -- a claim as this node prepared it ------------------------------------------------------------


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim: where it comes from (``resource``, ``device_id``), what
    the kubelet was told (``pool_name``, ``device_name``, ``request_names``, ``cdi_id``,
    ``share_id``: the allocation's ``shareID`` of the device, or ``None``, and
    ``metadata_cdi_ids``: the device metadata CDI devices of the requests it is the first
    device of, ``_metadata.py``)."""

    resource: str
    device_id: str
    pool_name: str
    device_name: str
    request_names: tuple[str, ...]
    admin_access: bool
    cdi_id: str
    share_id: str | None = None
    metadata_cdi_ids: tuple[str, ...] = ()

    @property
    def cdi_ids(self) -> tuple[str, ...]:
        """The CDI devices the kubelet is told of for this device."""
        return (self.cdi_id, *self.metadata_cdi_ids)

    @property
    def cdi_name(self) -> str:
        """The device's name in its claim's CDI spec (``<claim UID>-<name>``)."""
        return self.cdi_id.partition("=")[2]

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "resource": self.resource,
            "device_id": self.device_id,
            "pool_name": self.pool_name,
            "device_name": self.device_name,
            "request_names": list(self.request_names),
            "admin_access": self.admin_access,
            "cdi_id": self.cdi_id,
        }
        if self.share_id is not None:  # left out otherwise: the checkpoints of earlier versions read the same
            document["share_id"] = self.share_id
        if self.metadata_cdi_ids:  # as share_id
            document["metadata_cdi_ids"] = list(self.metadata_cdi_ids)
        return document

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> PreparedDevice:
        share_id = item.get("share_id")
        if share_id is not None and not isinstance(share_id, str):
            raise ValueError(f"'share_id' must be a string, not {type(share_id).__name__}")
        return cls(
            resource=_string(item, "resource"),
            device_id=_string(item, "device_id"),
            pool_name=_string(item, "pool_name"),
            device_name=_string(item, "device_name"),
            request_names=tuple(_strings(item, "request_names")),
            admin_access=_boolean(item, "admin_access"),
            cdi_id=_string(item, "cdi_id"),
            share_id=share_id,
            metadata_cdi_ids=tuple(_strings(item, "metadata_cdi_ids")) if "metadata_cdi_ids" in item else (),
        )


@dataclass(frozen=True)
class PreparedClaim:
    """A claim as prepared: its identity, its devices, and the CDI spec written for it (the
    document, ``None`` for a claim with no devices of ours, which needs no spec); the pod's name
    for it (its annotation ``resource.kubernetes.io/pod-claim-name``, ``None`` when it has none)
    and the device metadata written for it (``_metadata.py``: each main request -> its
    documents, newest version first; ``None`` when none was, as by earlier versions)."""

    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    cdi_spec: Mapping[str, Any] | None = None
    pod_claim_name: str | None = None
    device_metadata: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
    # devices taken to vfio-pci for the claim (``_loans.py``): each function and its own driver
    loans: tuple[Loan, ...] = ()
    # written before the first function leaves its driver, until the claim is prepared: a
    # checkpoint that still says so at start is a Prepare a crash cut short
    pending: bool = False

    @property
    def label(self) -> str:
        return f"claim {self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [device.to_json() for device in self.devices],
            "cdi_spec": self.cdi_spec,
        }
        if self.pod_claim_name is not None:  # left out otherwise, as a device's share_id
            document["pod_claim_name"] = self.pod_claim_name
        if self.device_metadata is not None:
            document["device_metadata"] = {request: list(documents)
                                           for request, documents in self.device_metadata.items()}
        if self.loans:  # as pod_claim_name
            document["loans"] = [loan.to_json() for loan in self.loans]
        if self.pending:
            document["pending"] = True
        return document

    @classmethod
    def from_json(cls, item: object) -> PreparedClaim:
        if not isinstance(item, dict):
            raise ValueError(f"a claim entry is {type(item).__name__}, not an object")
        devices = item.get("devices")
        if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
            raise ValueError("'devices' must be a list of objects")
        spec = item.get("cdi_spec")
        if spec is not None and not isinstance(spec, dict):
            raise ValueError("'cdi_spec' must be an object or null")
        pod_claim_name = item.get("pod_claim_name")
        if pod_claim_name is not None and not isinstance(pod_claim_name, str):
            raise ValueError(f"'pod_claim_name' must be a string, not {type(pod_claim_name).__name__}")
        metadata = item.get("device_metadata")
        if metadata is not None and not (isinstance(metadata, dict) and all(
                isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
                for documents in metadata.values())):
            raise ValueError("'device_metadata' must be an object of lists of objects, or null")
        loans = item.get("loans", [])
        if not isinstance(loans, list) or not all(isinstance(loan, dict) for loan in loans):
            raise ValueError("'loans' must be a list of objects")
        pending = item.get("pending", False)
        if not isinstance(pending, bool):
            raise ValueError(f"'pending' must be true or false, not {type(pending).__name__}")
        return cls(
            uid=_string(item, "uid"),
            namespace=_string(item, "namespace"),
            name=_string(item, "name"),
            devices=tuple(PreparedDevice.from_json(d) for d in devices),
            cdi_spec=spec,
            pod_claim_name=pod_claim_name,
            device_metadata=metadata,
            loans=tuple(Loan.from_json(loan) for loan in loans),
            pending=pending,
        )


def _string(item: Mapping[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, not {type(value).__name__}")
    return value


def _strings(item: Mapping[str, Any], key: str) -> list[str]:
    value = item.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must be a list of strings")
    return value


def _boolean(item: Mapping[str, Any], key: str) -> bool:
    value = item.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"{key!r} must be true or false, not {type(value).__name__}")
    return value


class ClaimBook:
    """The prepared claims, and their file (a ``DurableBook``, see the module docstring).
    Changed only through ``add`` and ``remove``, trio coroutines that return once the file says so."""

    def __init__(self, state_dir: Path) -> None:
        # keys as written, not sorted: a claim's CDI spec comes back byte for byte
        self._book: DurableBook[PreparedClaim] = DurableBook(
            state_dir / CLAIMS_FILE, "claim", "claims", key=lambda claim: claim.uid, to_json=PreparedClaim.to_json,
            from_json=PreparedClaim.from_json, held_by=_held_by)

    @property
    def book(self) -> DurableBook[PreparedClaim]:
        return self._book

    @property
    def path(self) -> Path:
        return self._book.path

    @property
    def lost(self) -> str | None:
        """Why the claims prepared before this start are unknown (the checkpoint could not be
        read), or ``None``."""
        return self._book.lost

    @property
    def lost_book(self) -> LostBook | None:
        return self._book.lost_book

    @property
    def claims(self) -> Mapping[str, PreparedClaim]:
        """By UID: those on disk (removals in flight included) and those being added."""
        return self._book.records

    def prepared(self, uid: str) -> PreparedClaim | None:
        """The claim as written to the checkpoint, or ``None`` (also while it is ``pending``: its
        devices are being taken to vfio-pci, or a failed Prepare could not give them back)."""
        claim = self.written(uid)
        return None if claim is None or claim.pending else claim

    def written(self, uid: str) -> PreparedClaim | None:
        """The claim as written to the checkpoint, ``pending`` or not: what Unprepare undoes (a
        pending claim's functions go back to their drivers then)."""
        return self._book.on_disk.get(uid)

    def holders(self) -> Mapping[tuple[str, str], Holder]:
        """(resource, device ID) -> the claim it is prepared for (see ``_held_by``)."""
        return self._book.holders()

    def load(self) -> None:
        """Read the checkpoint (a missing one: no claims); one that cannot be read or parsed is
        moved aside, loudly, and the book is ``lost``."""
        self._book.load()

    def reserve(self, claim: PreparedClaim) -> None:
        """Hold ``claim``'s devices from now on, while it is prepared (call it in the same step
        that chose them: no other claim nor a host lease can get them meanwhile)."""
        self._book.reserve(claim)

    def unreserve(self, uid: str) -> None:
        self._book.unreserve(uid)

    async def add(self, claim: PreparedClaim) -> None:
        """Write ``claim`` to the file; it holds its devices from now on, or (when the write
        fails, OSError) nothing."""
        await self._book.add(claim)

    async def add_made(self, uid: str, make: Callable[[], PreparedClaim]) -> PreparedClaim:
        """Write the claim ``make`` returns (reserved before; ``make`` runs in the worker thread
        that writes the file, just before the write: ``DurableBook.add_made``). OSError: the
        checkpoint could not be written; what ``make`` raises, as it is. Either way it holds nothing."""
        return await self._book.add_made(uid, make)

    async def remove(self, uid: str, before: Callable[[], None] | None = None) -> PreparedClaim | None:
        """Take the claim out of the file (``None``: it was not in it); ``before`` runs first, in
        the worker thread that writes it (``DurableBook.remove``)."""
        return await self._book.remove(uid, before)


def _held_by(claim: PreparedClaim) -> Iterator[tuple[tuple[str, str], Holder]]:
    """The devices a prepared claim holds: its exclusive allocations only (an admin-access one
    takes the device from no one)."""
    for device in claim.devices:
        if not device.admin_access:
            yield (device.resource, device.device_id), Holder(CLAIM, f"{claim.namespace}/{claim.name}", claim.uid)


def lent_parts(claims: Mapping[str, PreparedClaim]) -> dict[str, dict[str, str | None]]:
    """What ``claims`` hold on vfio-pci, by handler: each function and the driver it goes back to."""
    parts: dict[str, dict[str, str | None]] = {}
    for claim in claims.values():
        for loan in claim.loans:
            parts.setdefault(loan.handler, {}).update(loan.parts)
    return parts

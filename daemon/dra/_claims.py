"""DRA claims: as the kubelet names them, as the API server allocated them (``driver_results``
reads and checks ``status.allocation``), and as this node prepared them (``ClaimBook``).

A result of a prioritized list (KEP-4816, ``firstAvailable``) names its request
``<main>/<subrequest>``; the pod spec and the kubelet know only ``<main>`` (``base_request``), and
a config applies to a result when it names no request, its main request or its subrequest
(``config_applies``: upstream's ``resourceclaim.BaseRequestRef`` and ``ConfigForResult``).

Each prepared claim is recorded with its devices (which pool, which device, the requests they
serve, whether the allocation is admin access) and the CDI spec that was written for it, so an
Unprepare after a restart knows what to undo and a spec that went missing (``/var/run`` is a
tmpfs: a reboot empties it while the kubelet still counts the claim prepared) is written again
byte for byte, without asking the handler anew.

The checkpoint (``<state-dir>/dra-claims.json``) is a ``DurableBook`` (``daemon.holdings``):
written atomically before the kubelet hears of a change, one write at a time; a claim being added
holds its devices from the moment ``add`` is called, and a claim being removed holds them until
the file no longer has it.

A checkpoint that cannot be read is not taken as empty: that could hand a device to a second
claim while the pod of the first still runs. It is moved aside, and the book is ``lost``: it
holds every device of the DRA pools, and the preparer refuses new claims, until every claim that
may have been prepared before is unprepared (see ``ClaimPreparer``) or an operator runs
``devplugd clear-lost claims``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from daemon.core import Loan
from daemon.holdings import CLAIM, DurableBook, Holder, LostBook

from ._devices import SHARES
from ._vfioconfig import VfioConfig, parse_vfio_config

CLAIMS_FILE = "dra-claims.json"


# -- a claim as the kubelet names it and as the API server allocated it --------------------------


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    @property
    def label(self) -> str:
        return f"claim {self.namespace}/{self.name}"


class ClaimNotFound(Exception):
    """The API server has no such claim (404)."""


class ClaimRefused(Exception):
    """A claim that cannot be prepared; the message (the claim's error) says which and why."""


@dataclass(frozen=True)
class AllocationResult:
    """One ``status.allocation.devices.results[]`` entry of our driver. ``request`` as the
    allocation names it (``<main>/<subrequest>`` for a prioritized list); ``share_id`` is the
    result's ``shareID`` (one share of a device allocated with consumable capacity), or ``None``."""

    request: str
    pool: str
    device: str
    admin_access: bool
    share_id: str | None = None
    shares: int = 1  # of a shared device: the shares it consumed (consumedCapacity's ``shares``)
    vfio: VfioConfig | None = None  # the VfioConfig that applies to it: the device goes to vfio-pci

    @property
    def main_request(self) -> str:
        return base_request(self.request)


# a result's request: a request's name, or a request's and one of its subrequests' (KEP-4816)
_REQUEST = re.compile(r"[^/]+(?:/[^/]+)?")


def base_request(request: str) -> str:
    """The request a pod's containers name (``nic`` of ``nic/fast``), as upstream's
    ``resourceclaim.BaseRequestRef``."""
    return request.split("/", 1)[0]


def config_applies(config_requests: Sequence[str], request: str) -> bool:
    """Whether a config naming ``config_requests`` applies to a result of ``request``: it names
    none (it is for every request), the result's request, or its main request (upstream's
    ``resourceclaim.ConfigForResult``)."""
    return not config_requests or request in config_requests or base_request(request) in config_requests


def driver_results(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[AllocationResult]:
    """The allocation results of ``driver`` in ``claim`` as the API server returns it, checked:
    the UID the kubelet named, allocated, well formed; an opaque config for ``driver`` that
    applies to one of them must be a ``VfioConfig`` (``_vfioconfig.py``), which that result
    carries (a config naming only a subrequest the allocation did not choose applies to
    nothing; of two that apply, the later: the class's come before the claim's); results of
    other drivers are left out. ClaimRefused says what is wrong."""
    label = ref.label

    def malformed(what: str) -> ClaimRefused:
        return ClaimRefused(f"{label}: malformed claim from the API server: {what}")

    metadata = _object(claim.get("metadata") if isinstance(claim, Mapping) else None, "metadata", malformed)
    uid = metadata.get("uid")
    if not isinstance(uid, str):
        raise malformed("metadata.uid is not a string")
    if uid != ref.uid:
        raise ClaimRefused(f"{label} got replaced: the API server has UID {uid}, the kubelet asked for {ref.uid}")
    status = claim.get("status")
    if status is not None and not isinstance(status, Mapping):
        raise malformed("status is not an object")
    allocation = status.get("allocation") if status is not None else None
    if allocation is None:
        raise ClaimRefused(f"{label} not allocated")
    allocation = _object(allocation, "status.allocation", malformed)
    devices = _object(allocation.get("devices") or {}, "status.allocation.devices", malformed)
    results = []
    for index, item in enumerate(_list(devices.get("results"), "status.allocation.devices.results", malformed)):
        where = f"status.allocation.devices.results[{index}]"
        item = _object(item, where, malformed)
        if not isinstance(item.get("driver"), str):
            raise malformed(f"{where}.driver is not a string")
        if item["driver"] != driver:
            continue
        for key in ("request", "pool", "device"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise malformed(f"{where}.{key} is missing or not a non-empty string")
        if not _REQUEST.fullmatch(item["request"]):
            raise malformed(f"{where}.request {item['request']!r} is neither <request> nor <request>/<subrequest>")
        admin_access = item.get("adminAccess")
        if admin_access is not None and not isinstance(admin_access, bool):
            raise malformed(f"{where}.adminAccess is not true or false")
        share_id = item.get("shareID")
        if share_id is not None and (not isinstance(share_id, str) or not share_id):
            raise malformed(f"{where}.shareID is not a non-empty string")
        results.append(AllocationResult(item["request"], item["pool"], item["device"], bool(admin_access),
                                        share_id, _consumed_shares(item, driver, where, malformed)))
    for index, entry in enumerate(_list(devices.get("config"), "status.allocation.devices.config", malformed)):
        where = f"status.allocation.devices.config[{index}]"
        entry = _object(entry, where, malformed)
        if entry.get("opaque") is None:
            continue
        opaque = _object(entry["opaque"], f"{where}.opaque", malformed)
        if not isinstance(opaque.get("driver"), str):
            raise malformed(f"{where}.opaque.driver is not a string")
        if opaque["driver"] != driver:
            continue
        requests = _list(entry.get("requests"), f"{where}.requests", malformed)
        if not all(isinstance(request, str) for request in requests):
            raise malformed(f"{where}.requests is not a list of strings")
        applies = [index for index, result in enumerate(results) if config_applies(requests, result.request)]
        if not applies:
            continue
        try:
            vfio = parse_vfio_config(opaque.get("parameters"), f"{where}.opaque.parameters")
        except ValueError as error:
            shown = ", ".join(f"{results[i].device} of pool {results[i].pool}" for i in applies)
            raise ClaimRefused(f"{label}: {error} (source {entry.get('source')}; for {shown})") from error
        for index in applies:  # a later config overrides an earlier one: the class's come first
            results[index] = replace(results[index], vfio=vfio)
    return results


def _consumed_shares(item: Mapping[str, Any], driver: str, where: str,
                     malformed: Callable[[str], ClaimRefused]) -> int:
    """The shares of a shared device a result consumed: its ``consumedCapacity`` of ``shares``
    (the capacity our slices publish; 1 when it says none)."""
    consumed = _object(item.get("consumedCapacity") or {}, f"{where}.consumedCapacity", malformed)
    value = consumed.get(SHARES, consumed.get(f"{driver}/{SHARES}", "1"))
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise malformed(f"{where}.consumedCapacity shares {value!r} is not a whole number of shares")
    return int(text)


def _object(value: Any, where: str, malformed: Callable[[str], ClaimRefused]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(f"{where} is not an object")
    return value


def _list(value: Any, where: str, malformed: Callable[[str], ClaimRefused]) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise malformed(f"{where} is not a list")
    return value


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
        claim = self._book.on_disk.get(uid)
        return None if claim is None or claim.pending else claim

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

"""DRA claims: as the kubelet names them, as the API server allocated them (``driver_results``
reads and checks ``status.allocation``), and as this node prepared them (``ClaimBook``).

Each prepared claim is recorded with its devices (which pool, which device, the requests they
serve, whether the allocation is admin access) and the CDI spec that was written for it, so an
Unprepare after a restart knows what to undo and a spec that went missing (``/var/run`` is a
tmpfs: a reboot empties it while the kubelet still counts the claim prepared) is written again
byte for byte, without asking the handler anew.

The checkpoint (``<state-dir>/dra-claims.json``) is written atomically before the kubelet hears
of a change: a temporary file, fsync, rename, fsync of the directory, in a worker thread, one
write at a time. What the book reports errs on the side of "held": a claim being added holds its
devices from the moment ``add`` is called, and a claim being removed holds them until the file no
longer has it.

A checkpoint that cannot be read is not taken as empty: that could hand a device to a second
claim while the pod of the first still runs. It is moved aside, and the book says it is
``lost``; the preparer then refuses new claims until every claim that may have been prepared
before is unprepared (see ``ClaimPreparer``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import trio

from daemon.files import write_atomically

log = logging.getLogger("devplugd.dra")

CLAIMS_FILE = "dra-claims.json"
FORMAT_VERSION = 1


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


class ClaimRefused(Exception):
    """A claim that cannot be prepared; the message (the claim's error) says which and why."""


@dataclass(frozen=True)
class AllocationResult:
    """One ``status.allocation.devices.results[]`` entry of our driver."""

    request: str
    pool: str
    device: str
    admin_access: bool


def driver_results(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[AllocationResult]:
    """The allocation results of ``driver`` in ``claim`` as the API server returns it, checked:
    the UID the kubelet named, allocated, well formed, no opaque config for ``driver`` (devplugd
    takes no claim parameters yet); results of other drivers are left out. ClaimRefused says
    what is wrong."""
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
    for index, entry in enumerate(_list(devices.get("config"), "status.allocation.devices.config", malformed)):
        where = f"status.allocation.devices.config[{index}]"
        entry = _object(entry, where, malformed)
        if entry.get("opaque") is None:
            continue
        opaque = _object(entry["opaque"], f"{where}.opaque", malformed)
        if not isinstance(opaque.get("driver"), str):
            raise malformed(f"{where}.opaque.driver is not a string")
        if opaque["driver"] == driver:
            requests = entry.get("requests") or []
            shown = ", ".join(map(str, requests)) if isinstance(requests, list) and requests else "all requests"
            raise ClaimRefused(f"{label}: devplugd takes no claim parameters yet, but {where} is an opaque config "
                               f"for {driver} (source {entry.get('source')}, {shown})")
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
        admin_access = item.get("adminAccess")
        if admin_access is not None and not isinstance(admin_access, bool):
            raise malformed(f"{where}.adminAccess is not true or false")
        results.append(AllocationResult(item["request"], item["pool"], item["device"], bool(admin_access)))
    return results


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
    the kubelet was told (``pool_name``, ``device_name``, ``request_names``, ``cdi_id``)."""

    resource: str
    device_id: str
    pool_name: str
    device_name: str
    request_names: tuple[str, ...]
    admin_access: bool
    cdi_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "device_id": self.device_id,
            "pool_name": self.pool_name,
            "device_name": self.device_name,
            "request_names": list(self.request_names),
            "admin_access": self.admin_access,
            "cdi_id": self.cdi_id,
        }

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> PreparedDevice:
        return cls(
            resource=_string(item, "resource"),
            device_id=_string(item, "device_id"),
            pool_name=_string(item, "pool_name"),
            device_name=_string(item, "device_name"),
            request_names=tuple(_strings(item, "request_names")),
            admin_access=_boolean(item, "admin_access"),
            cdi_id=_string(item, "cdi_id"),
        )


@dataclass(frozen=True)
class PreparedClaim:
    """A claim as prepared: its identity, its devices, and the CDI spec written for it (the
    document, ``None`` for a claim with no devices of ours, which needs no spec)."""

    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    cdi_spec: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"claim {self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [device.to_json() for device in self.devices],
            "cdi_spec": self.cdi_spec,
        }

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
        return cls(
            uid=_string(item, "uid"),
            namespace=_string(item, "namespace"),
            name=_string(item, "name"),
            devices=tuple(PreparedDevice.from_json(d) for d in devices),
            cdi_spec=spec,
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
    """The prepared claims, and their file. Changed only through ``add`` and ``remove``, trio
    coroutines that return once the file says so (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / CLAIMS_FILE
        self._on_disk: dict[str, PreparedClaim] = {}
        self._adding: dict[str, PreparedClaim] = {}
        self._write_lock = trio.Lock()
        self._version = 0
        self._lost: str | None = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def version(self) -> int:
        """Counts the changes written since the book was made (one per ``add`` and ``remove``)."""
        return self._version

    @property
    def lost(self) -> str | None:
        """Why the claims prepared before this start are unknown (the checkpoint could not be
        read), or ``None``."""
        return self._lost

    @property
    def claims(self) -> Mapping[str, PreparedClaim]:
        """By UID: those on disk (removals in flight included) and those being added."""
        return MappingProxyType({**self._on_disk, **self._adding})

    def prepared(self, uid: str) -> PreparedClaim | None:
        """The claim as written to the checkpoint, or ``None``."""
        return self._on_disk.get(uid)

    def holders(self) -> Mapping[tuple[str, str], str]:
        """(resource, device ID) -> ``claim <namespace>/<name>``, for exclusive allocations
        only: an admin-access allocation does not take the device from anyone."""
        return {
            (device.resource, device.device_id): claim.label
            for claim in self.claims.values()
            for device in claim.devices
            if not device.admin_access
        }

    def load(self) -> None:
        """Read the checkpoint (a missing one: no claims). One that cannot be read or parsed is
        moved aside, loudly, and the book is ``lost``."""
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as error:
            self._set_lost(f"cannot be read ({error})")
            return
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or not isinstance(document.get("claims"), list):
                raise ValueError("no 'claims' list")
            if document.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {document.get('version')!r}, expected {FORMAT_VERSION}")
            claims = [PreparedClaim.from_json(item) for item in document["claims"]]
        except ValueError as error:
            self._set_lost(f"is corrupt ({error})")
            return
        self._on_disk = {claim.uid: claim for claim in claims}
        log.info("loaded %d prepared DRA claims from %s", len(self._on_disk), self._path)

    def _set_lost(self, reason: str) -> None:
        aside = self._path.with_name(f"{CLAIMS_FILE}.corrupt-{int(time.time())}")
        try:
            os.replace(self._path, aside)
        except OSError as error:
            self._lost = f"the DRA claim checkpoint {self._path} {reason} and could not be moved aside ({error})"
        else:
            self._lost = f"the DRA claim checkpoint {self._path} {reason}; moved aside to {aside}"
        log.error("%s: the claims prepared before this start are unknown", self._lost)

    def _write(self, claims: Mapping[str, PreparedClaim]) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        document = {"version": FORMAT_VERSION, "claims": [claim.to_json() for claim in claims.values()]}
        # keys in the order written (not sorted): a claim's CDI spec comes back byte for byte
        write_atomically(self._path, json.dumps(document, indent=1).encode())

    async def _save(self, claims: dict[str, PreparedClaim]) -> None:
        if self._lost is not None and self._path.exists():
            # the unreadable file is still there: writing over it would lose what it holds
            raise OSError(f"not overwriting {self._path}: {self._lost}")
        await trio.to_thread.run_sync(self._write, claims)
        self._on_disk = claims
        self._version += 1

    async def add(self, claim: PreparedClaim) -> None:
        """Write ``claim`` to the file; it holds its devices from now on, or (when the write
        fails, OSError) nothing."""
        self._adding[claim.uid] = claim
        try:
            async with self._write_lock:
                await self._save({**self._on_disk, claim.uid: claim})
        finally:
            self._adding.pop(claim.uid, None)

    async def remove(self, uid: str) -> PreparedClaim | None:
        """Take the claim out of the file (``None``: it was not in it)."""
        async with self._write_lock:
            if uid not in self._on_disk:
                return None
            updated = dict(self._on_disk)
            removed = updated.pop(uid)
            await self._save(updated)
        return removed

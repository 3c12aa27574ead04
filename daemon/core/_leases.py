"""Host leases: devices handed to local workloads, persisted so that none is ever lost.

A lease records the allocation answer it gave (envs, device specs, mounts, CDI names) so it
stays valid for its whole life, like the kubelet's checkpointed Allocate answers. The lease file
(``<state-dir>/leases.json``) is written atomically before an answer is sent: a temporary file
in the same directory, fsync, rename over the old one, fsync of the directory. A ``kill -9`` at
any moment leaves the old or the new file, never a torn one. A file that cannot be read is moved
aside with a loud error and the daemon starts with no leases rather than not at all.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ._handler import ContainerAllocation
from ._tree import DeviceSpec, Mount

log = logging.getLogger("devplugd.leases")

LEASE_FILE = "leases.json"
FORMAT_VERSION = 1


class LeaseError(Exception):
    """A lease request that cannot be granted; the message names the input and the reason."""


@dataclass(frozen=True)
class Lease:
    lease: str
    resource: str
    owner: str
    devices: tuple[str, ...]
    created: float
    envs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    specs: tuple[DeviceSpec, ...] = ()
    mounts: tuple[Mount, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cdi_devices: tuple[str, ...] = ()

    @classmethod
    def grant(cls, resource: str, owner: str, devices: Sequence[str], allocation: ContainerAllocation) -> Lease:
        return cls(
            lease=f"lease-{secrets.token_hex(6)}",
            resource=resource,
            owner=owner,
            devices=tuple(devices),
            created=time.time(),
            envs=MappingProxyType(dict(allocation.envs)),
            specs=tuple(allocation.specs),
            mounts=tuple(allocation.mounts),
            annotations=MappingProxyType(dict(allocation.annotations)),
            cdi_devices=tuple(allocation.cdi_devices),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "lease": self.lease,
            "resource": self.resource,
            "owner": self.owner,
            "devices": list(self.devices),
            "created": self.created,
            "envs": dict(self.envs),
            "device_specs": [
                {"container_path": s.container_path, "host_path": s.host_path, "permissions": s.permissions}
                for s in self.specs
            ],
            "mounts": [
                {"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}
                for m in self.mounts
            ],
            "annotations": dict(self.annotations),
            "cdi_devices": list(self.cdi_devices),
        }

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> Lease:
        return cls(
            lease=str(item["lease"]),
            resource=str(item["resource"]),
            owner=str(item["owner"]),
            devices=tuple(str(d) for d in item["devices"]),
            created=float(item["created"]),
            envs=MappingProxyType({str(k): str(v) for k, v in item.get("envs", {}).items()}),
            specs=tuple(DeviceSpec(s["container_path"], s["host_path"], s["permissions"])
                        for s in item.get("device_specs", [])),
            mounts=tuple(Mount(m["container_path"], m["host_path"], bool(m["read_only"]))
                         for m in item.get("mounts", [])),
            annotations=MappingProxyType({str(k): str(v) for k, v in item.get("annotations", {}).items()}),
            cdi_devices=tuple(str(c) for c in item.get("cdi_devices", [])),
        )


def write_atomically(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers and crashes see the old or the new content.

    ``durable`` adds the fsyncs (file, then directory) that make the new content survive a power
    loss; files on a tmpfs (CDI specs in /var/run) need only the rename."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(descriptor, data)
        if durable:
            os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.rename(temporary, path)
    if not durable:
        return
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class LeaseBook:
    """The leases in force, and their file. Changed only through ``add`` and ``remove``, each of
    which has the file written before it returns."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / LEASE_FILE
        self._leases: dict[str, Lease] = {}

    @property
    def path(self) -> Path:
        return self._path

    @property
    def leases(self) -> Mapping[str, Lease]:
        return MappingProxyType(self._leases)

    def holders(self) -> dict[tuple[str, str], Lease]:
        """(resource, device ID) -> the lease holding it."""
        return {(lease.resource, device): lease for lease in self._leases.values() for device in lease.devices}

    def load(self) -> None:
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return
        except OSError as error:
            log.error("cannot read the lease file %s: %s; starting with no leases", self._path, error)
            return
        try:
            document = json.loads(text)
            leases = [Lease.from_json(item) for item in document["leases"]]
        except (ValueError, KeyError, TypeError) as error:
            aside = self._path.with_name(f"{LEASE_FILE}.corrupt-{int(time.time())}")
            os.replace(self._path, aside)
            log.error("the lease file %s is corrupt (%s): moved aside to %s; starting with no leases",
                      self._path, error, aside)
            return
        self._leases = {lease.lease: lease for lease in leases}
        log.info("loaded %d leases from %s", len(self._leases), self._path)

    def _save(self, leases: Mapping[str, Lease]) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        document = {"version": FORMAT_VERSION, "leases": [lease.to_json() for lease in leases.values()]}
        write_atomically(self._path, json.dumps(document, indent=1, sort_keys=True).encode())

    def add(self, lease: Lease) -> None:
        updated = {**self._leases, lease.lease: lease}
        self._save(updated)
        self._leases = updated

    def remove(self, lease_id: str) -> Lease:
        if lease_id not in self._leases:
            raise LeaseError(f"no lease {lease_id!r}")
        updated = dict(self._leases)
        removed = updated.pop(lease_id)
        self._save(updated)
        self._leases = updated
        return removed

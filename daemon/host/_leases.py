"""Host leases: devices handed to local workloads, persisted so that none is ever lost.

A lease records the allocation answer it gave (envs, device specs, mounts, CDI names) so it
stays valid for its whole life, like the kubelet's checkpointed Allocate answers. The lease file
(``<state-dir>/leases.json``) is written atomically before an answer is sent: a temporary file
in the same directory, fsync, rename over the old one, fsync of the directory, in a worker thread. A ``kill -9`` at
any moment leaves the old or the new file, never a torn one. A file that cannot be read is moved
aside with a loud error and the daemon starts with no leases rather than not at all.
"""

from __future__ import annotations

import asyncio
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

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon.core import ContainerAllocation, DeviceSpec, Mount
from daemon.files import write_atomically

log = logging.getLogger("devplugd.leases")

LEASE_FILE = "leases.json"
FORMAT_VERSION = 1


class LeaseError(Exception):
    """A lease request that cannot be granted; the message names the input and the reason."""


class NotEnoughFree(LeaseError):
    """Fewer free devices than asked for: the pool is exhausted for this request."""


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

    def to_json(self, missing_devices: Sequence[str] | None = None) -> dict[str, Any]:
        """The JSON shape of a lease, the same in the lease file and in the CLI's ``-o json``
        (which adds ``missing_devices``: the lease's devices no longer in their pool)."""
        document: dict[str, Any] = {
            "lease": self.lease,
            "resource": self.resource,
            "owner": self.owner,
            "devices": list(self.devices),
            "envs": dict(self.envs),
            "cdi_devices": list(self.cdi_devices),
            "device_specs": [
                {"container_path": s.container_path, "host_path": s.host_path, "permissions": s.permissions}
                for s in self.specs
            ],
            "mounts": [
                {"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}
                for m in self.mounts
            ],
            "annotations": dict(self.annotations),
            "created": self.created,
        }
        if missing_devices is not None:
            document["missing_devices"] = list(missing_devices)
        return document

    def to_message(self, missing_devices: Sequence[str] = ()) -> host.Lease:
        return host.Lease(
            lease=self.lease, resource=self.resource, owner=self.owner, devices=self.devices,
            envs=self.envs, annotations=self.annotations, cdi_devices=self.cdi_devices,
            created=self.created, missing_devices=missing_devices,
            device_specs=[host.DeviceSpec(container_path=s.container_path, host_path=s.host_path,
                                          permissions=s.permissions) for s in self.specs],
            mounts=[host.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                    for m in self.mounts],
        )

    @classmethod
    def from_message(cls, message: host.Lease) -> Lease:
        return cls(
            lease=message.lease, resource=message.resource, owner=message.owner, devices=tuple(message.devices),
            created=message.created, envs=MappingProxyType(dict(message.envs)),
            specs=tuple(DeviceSpec(s.container_path, s.host_path, s.permissions) for s in message.device_specs),
            mounts=tuple(Mount(m.container_path, m.host_path, m.read_only) for m in message.mounts),
            annotations=MappingProxyType(dict(message.annotations)), cdi_devices=tuple(message.cdi_devices),
        )

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


class LeaseBook:
    """The leases in force, and their file.

    Changed only through ``add`` and ``remove``, coroutines that return once the file says so.
    The write (two fsyncs) runs in a worker thread, so a slow disk never stalls the event loop;
    writes are one at a time, each of the leases on disk plus its own change. What the book
    reports in the meantime errs on the side of "held": a lease being granted holds its devices
    from the moment it is chosen (so no other client can get them), and a lease being released
    holds them until the file no longer has it (so a crash cannot leave a device with two holders).
    """

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / LEASE_FILE
        self._on_disk: dict[str, Lease] = {}
        self._granting: dict[str, Lease] = {}
        self._write_lock = asyncio.Lock()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def leases(self) -> Mapping[str, Lease]:
        """The leases in force: those on disk (releases in flight included) and those being granted."""
        return MappingProxyType({**self._on_disk, **self._granting})

    def holders(self) -> dict[tuple[str, str], Lease]:
        """(resource, device ID) -> the lease holding it."""
        return {(lease.resource, device): lease for lease in self.leases.values() for device in lease.devices}

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
        self._on_disk = {lease.lease: lease for lease in leases}
        log.info("loaded %d leases from %s", len(self._on_disk), self._path)

    def _write(self, leases: Mapping[str, Lease]) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        document = {"version": FORMAT_VERSION, "leases": [lease.to_json() for lease in leases.values()]}
        write_atomically(self._path, json.dumps(document, indent=1, sort_keys=True).encode())

    async def _save(self, leases: dict[str, Lease]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._write, leases)
        self._on_disk = leases

    def reserve(self, lease: Lease) -> None:
        """Hold ``lease``'s devices at once (call it in the same step that chose them)."""
        self._granting[lease.lease] = lease

    async def add(self, lease: Lease) -> None:
        """Write ``lease`` (reserved or not) to the file; on failure it holds nothing."""
        self._granting[lease.lease] = lease
        try:
            async with self._write_lock:
                await self._save({**self._on_disk, lease.lease: lease})
        finally:
            self._granting.pop(lease.lease, None)

    async def remove(self, lease_id: str) -> Lease:
        if lease_id not in self._on_disk:
            raise LeaseError(f"no lease {lease_id!r}")
        async with self._write_lock:
            updated = dict(self._on_disk)
            removed = updated.pop(lease_id, None)
            if removed is None:  # released by another call while this one waited
                raise LeaseError(f"no lease {lease_id!r}")
            await self._save(updated)
        return removed

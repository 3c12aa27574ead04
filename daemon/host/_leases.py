"""Host leases: devices handed to local workloads, persisted so that none is ever lost.

A lease records the allocation answer it gave (envs, device specs, mounts, CDI names) so it
stays valid for its whole life, like the kubelet's checkpointed Allocate answers. The lease file
(``<state-dir>/leases.json`` and its second slot ``leases.b.json``) is a ``DurableBook``
(``daemon.holdings``): written durably, never torn, before an answer is sent, and, when it cannot
be read, moved aside and *lost*: every device stays held by it until an operator runs
``devplugd clear-lost leases``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon.core import ContainerAllocation, DeviceSpec, Mount
from daemon.holdings import LEASE, DurableBook, Holder, LostBook

LEASE_FILE = "leases.json"


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
    """The leases in force, and their file (``DurableBook``: written before anyone hears of a
    change, one write at a time in a worker thread; a file that cannot be read is never taken as
    no leases). Changed only through ``reserve``, ``add`` and ``remove``."""

    def __init__(self, state_dir: Path) -> None:
        self._book: DurableBook[Lease] = DurableBook(
            state_dir / LEASE_FILE, "lease", "leases", key=lambda lease: lease.lease, to_json=Lease.to_json,
            from_json=Lease.from_json, held_by=_held_by, sort_keys=True)

    @property
    def book(self) -> DurableBook[Lease]:
        return self._book

    @property
    def path(self) -> Path:
        return self._book.path

    @property
    def leases(self) -> Mapping[str, Lease]:
        """The leases in force: those on disk (releases in flight included) and those being granted."""
        return self._book.records

    @property
    def lost_book(self) -> LostBook | None:
        return self._book.lost_book

    def holders(self) -> Mapping[tuple[str, str], Holder]:
        """(resource, device ID) -> the lease holding it."""
        return self._book.holders()

    def load(self) -> None:
        self._book.load()

    def reserve(self, lease: Lease) -> None:
        """Hold ``lease``'s devices at once (call it in the same step that chose them)."""
        self._book.reserve(lease)

    async def add(self, lease: Lease) -> None:
        """Write ``lease`` (reserved or not) to the file; on failure (OSError) it holds nothing."""
        await self._book.add(lease)

    async def remove(self, lease_id: str) -> Lease:
        """Release a lease: it holds its devices until the file no longer has it."""
        removed = await self._book.remove(lease_id)
        if removed is None:
            raise LeaseError(f"no lease {lease_id!r}")
        return removed


def _held_by(lease: Lease) -> Iterator[tuple[tuple[str, str], Holder]]:
    """The devices a lease holds, each as held by it."""
    for device in lease.devices:
        yield (lease.resource, device), Holder(LEASE, lease.lease, lease.owner)

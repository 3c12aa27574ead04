"""The CDI spec of each prepared claim: ``devplugd-claim-<claim UID>.json`` in the CDI directory.

Kind ``<driver>/claim``, one CDI device ``<claim UID>-<device name>`` per device (per share of
a shared device: named after the share), holding its
device nodes and its request's env and mounts (the same on every device of the request, so a
container that takes any of them has them; a device node no single device accounts for goes with
the request's first device). Specs live in ``/var/run`` (a tmpfs, no fsync needed) as long as
their claim is prepared, across restarts of the daemon: one that went missing (a reboot) is
written again from the book, byte for byte, and one the book does not have (a prepare that
crashed before its checkpoint) is removed at start. Every spec is written before the book's entry
and removed before it, so the specs on disk name every claim that may be prepared, which is what
a lost book is reconciled with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.cdi import CLAIM_FILE_PREFIX, cdi_env_name, cdi_kind, cdi_version, claim_spec_file_name, container_edits
from daemon.core import ContainerAllocation, DeviceSpec, ResourcePool
from daemon.core._jsonpath import parse_json
from daemon.files import write_atomically

from ._names import device_name
from ._prepared import PreparedDevice


@dataclass(frozen=True)
class Chosen:
    """A device of a claim being prepared, and the pool it comes from."""

    pool: ResourcePool
    device: PreparedDevice


class ClaimSpecs:
    def __init__(self, cdi_dir: Path, driver: str) -> None:
        self._cdi_dir = cdi_dir
        self.kind = cdi_kind(f"{driver}/claim")

    def path(self, uid: str) -> Path:
        return self._cdi_dir / claim_spec_file_name(uid)

    def document(self, uid: str, chosen: Sequence[Chosen],
                 allocations: Sequence[tuple[list[Chosen], ContainerAllocation]]) -> dict[str, Any]:
        """The claim's CDI spec document, its devices in the order of the claim's results."""
        needs_host_path = False
        edits_of: dict[str, dict[str, Any]] = {}  # device name -> its containerEdits
        for items, allocation in allocations:
            allocated = set(allocation.specs)
            attributed: set[DeviceSpec] = set()
            own_specs: dict[str, list[DeviceSpec]] = {}
            for item in items:
                own = [spec for spec in item.pool.devices[item.device.device_id].specs if spec in allocated]
                attributed.update(own)
                own_specs[item.device.cdi_name] = own
            loose = [spec for spec in allocation.specs if spec not in attributed]
            for position, item in enumerate(items):
                specs = own_specs[item.device.cdi_name] + (loose if position == 0 else [])
                # the device's own env too, so that its edits are never empty (CDI refuses those)
                env = {**allocation.envs, _device_env_name(item.device): item.device.device_id}
                edits, needs = container_edits(specs, allocation.mounts, env)
                needs_host_path |= needs
                edits_of[item.device.cdi_name] = edits
        devices = [{"name": item.device.cdi_name, "containerEdits": edits_of[item.device.cdi_name]} for item in chosen]
        return {"cdiVersion": cdi_version(needs_host_path), "kind": self.kind, "devices": devices}

    def write(self, uid: str, spec: Mapping[str, Any]) -> None:
        """(worker thread) Write the claim's spec; OSError when it cannot."""
        self._cdi_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path(uid), json.dumps(spec, separators=(",", ":")).encode(), mode=0o644,
                         durable=False)

    def remove(self, uid: str) -> None:
        """(worker thread) Remove the claim's spec (gone already is fine)."""
        self.path(uid).unlink(missing_ok=True)

    def uids(self) -> set[str]:
        """(worker thread) The UIDs of the claim specs in the CDI directory: every claim prepared
        and not yet unprepared has one."""
        try:
            names = os.listdir(self._cdi_dir)
        except FileNotFoundError:
            return set()
        return {name[len(CLAIM_FILE_PREFIX):-len(".json")] for name in names
                if name.startswith(CLAIM_FILE_PREFIX) and name.endswith(".json")}

    def stale(self, known: set[str]) -> list[str]:
        """(worker thread) The UIDs of our specs (kind ``<driver>/claim``) whose claims are not in
        ``known``."""
        stale = []
        for uid in sorted(self.uids() - known):
            try:
                kind = parse_json(self.path(uid).read_bytes()).get("kind")
            except (OSError, ValueError, AttributeError):
                continue
            if kind == self.kind:
                stale.append(uid)
        return stale


def _device_env_name(device: PreparedDevice) -> str:
    """``DEVPLUGD_<RESOURCE>_<DEVICE NAME>``: set to the device's ID by its own CDI device (a
    share's name is its own: ``kvm-1``, not the shared ``kvm``)."""
    return f"{cdi_env_name(device.resource)}_{device_name(device.device_id).upper().replace('-', '_')}"

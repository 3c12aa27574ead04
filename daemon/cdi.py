"""CDI specs for every pool, so podman or containerd can take devplugd's devices by name.

One file per pool in the CDI directory, ``devplugd-<vendor>-<class>.json``, holding one CDI
device per device ID with its device nodes, env and mounts. The kind is the resource name made
valid for CDI (``<vendor>/<class>``: the class may not contain dots), except for auxNetDevice
pools, whose kind is the SR-IOV plugin's for that type (``<prefix>/net-sf``: several such pools
of one prefix then share it, each in its own file, their device names, the auxiliary device
names, unique on the host). ``cdiVersion`` is the
lowest that carries what is used: 0.3.0, or 0.5.0 when a device node's host path differs from
its container path (``hostPath``). Files are written atomically and only when their content
changes; a pool that goes away takes its file with it. Only ``devplugd-*`` files are touched, and
not the per-claim specs of DRA (``devplugd-claim-<claim UID>.json``, see ``daemon.dra``): those
live as long as their claim is prepared, across restarts of the daemon.

A device kept listed after it vanished (``ResourcePool.vanished``: a pod held it) is left out:
there is nothing left to give, and a CDI name that does not resolve fails a container's creation
at once with the name in the error, where a device node that is gone would fail it later, less
clearly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from daemon.core import ContainerAllocation, DeviceInfo, DeviceSpec, Mount, ResourcePool
from daemon.core._tree import DeviceTree
from daemon.files import write_atomically
from daemon.follow import TreeFollower

log = logging.getLogger("devplugd.cdi")

FILE_PREFIX = "devplugd-"
CLAIM_FILE_PREFIX = FILE_PREFIX + "claim-"
SETTLE_SECONDS = 0.05  # specs follow a change this much later (timer armed only by a change)
_CLASS_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_NAME_INVALID = re.compile(r"[^A-Za-z0-9_.:-]")
# deviceType -> the class of the CDI kind the SR-IOV plugin's CDI mode gives its pools, where we
# keep upstream's (pkg/cdi: ``<prefix>/net-sf`` for auxNetDevice)
UPSTREAM_CLASSES: Mapping[str, str] = MappingProxyType({"auxNetDevice": "net-sf"})


def cdi_kind(resource: str) -> str:
    """``<vendor>/<class>`` valid for CDI: the vendor and the class start with a letter (an
    ``x`` is put in front otherwise) and the class has only letters, digits, ``_`` and ``-``."""
    vendor, _, name = resource.partition("/")
    if not vendor[:1].isalpha():
        vendor = f"x{vendor}"
    cdi_class = _CLASS_INVALID.sub("_", name)
    if not cdi_class[:1].isalpha():
        cdi_class = f"x{cdi_class}"
    return f"{vendor}/{cdi_class}"


def pool_kind(pool: ResourcePool) -> str:
    """The CDI kind of a pool's devices: its resource name's, or upstream's for its type."""
    entry = pool.pool_config.entry if pool.pool_config is not None else None
    upstream = UPSTREAM_CLASSES.get(entry.device_type) if entry is not None else None
    return cdi_kind(f"{entry.resource_prefix}/{upstream}" if entry is not None and upstream else pool.resource)


def cdi_device_name(device_id: str) -> str:
    return _NAME_INVALID.sub("_", device_id)


def cdi_names(pool: ResourcePool, device_ids: Sequence[str]) -> list[str]:
    kind = pool_kind(pool)
    return [f"{kind}={cdi_device_name(device_id)}" for device_id in device_ids]


def with_cdi_names(
    allocation: ContainerAllocation, pool: ResourcePool, device_ids: Sequence[str]
) -> ContainerAllocation:
    """``allocation`` with the CDI names of ``device_ids`` added, less those the handler had to
    read afresh (their spec may still say the old thing)."""
    allocation.cdi_devices.extend(cdi_names(pool, [d for d in device_ids if d not in allocation.reread]))
    return allocation


def cdi_env_name(resource: str) -> str:
    """``DEVPLUGD_<RESOURCE>``: each CDI device sets it to its own device ID."""
    return "DEVPLUGD_" + re.sub(r"[^A-Za-z0-9]", "_", resource).upper()


def spec_file_name(resource: str) -> str:
    return FILE_PREFIX + cdi_kind(resource).replace("/", "-") + ".json"


def claim_spec_file_name(claim_uid: str) -> str:
    """The spec file of one prepared DRA claim."""
    return f"{CLAIM_FILE_PREFIX}{claim_uid}.json"


def container_edits(
    specs: Iterable[DeviceSpec], mounts: Iterable[Mount], envs: Mapping[str, str]
) -> tuple[dict[str, Any], bool]:
    """CDI ``containerEdits`` for device nodes, env (sorted) and bind mounts (each key only when
    it has entries), and whether a node needs ``hostPath`` (cdiVersion 0.5.0)."""
    edits: dict[str, Any] = {}
    needs_host_path = False
    nodes = []
    for spec in specs:
        node = {"path": spec.container_path, "permissions": spec.permissions}
        if spec.host_path != spec.container_path:
            node["hostPath"] = spec.host_path
            needs_host_path = True
        nodes.append(node)
    if nodes:
        edits["deviceNodes"] = nodes
    if envs:
        edits["env"] = [f"{key}={value}" for key, value in sorted(envs.items())]
    mount_list = [
        {"hostPath": m.host_path, "containerPath": m.container_path, "options": ["bind", "ro" if m.read_only else "rw"]}
        for m in mounts
    ]
    if mount_list:
        edits["mounts"] = mount_list
    return edits, needs_host_path


def cdi_version(needs_host_path: bool) -> str:
    """The lowest cdiVersion that carries what a spec uses."""
    return "0.5.0" if needs_host_path else "0.3.0"


def _device_entry(device_id: str, info: DeviceInfo, env_name: str) -> tuple[dict[str, Any], bool]:
    """One CDI device, and whether it needs ``hostPath`` (cdiVersion 0.5.0)."""
    edits, needs_host_path = container_edits(info.specs, info.mounts, {**info.envs, env_name: device_id})
    return {"name": cdi_device_name(device_id), "containerEdits": edits}, needs_host_path


_Fragments = dict[str, tuple[DeviceInfo, bytes, bool]]


def spec_bytes(pool: ResourcePool, known: _Fragments) -> tuple[bytes, _Fragments]:
    """The CDI spec of ``pool`` as compact JSON, reusing the encoded devices of ``known`` whose
    DeviceInfo is the very same object (a tree keeps unchanged devices' objects): one changed
    device in a pool of hundreds costs one device's encoding."""
    env_name = cdi_env_name(pool.resource)
    fragments: _Fragments = {}
    for device_id, info in sorted(pool.devices.items()):
        if device_id in pool.vanished:
            continue
        cached = known.get(device_id)
        if cached is None or cached[0] is not info:
            entry, needs_host_path = _device_entry(device_id, info, env_name)
            cached = (info, json.dumps(entry, separators=(",", ":")).encode(), needs_host_path)
        fragments[device_id] = cached
    version = cdi_version(any(needs for _, _, needs in fragments.values()))
    head = json.dumps({"cdiVersion": version, "kind": pool_kind(pool)}, separators=(",", ":"))
    content = head[:-1].encode() + b',"devices":[' + b",".join(f for _, f, _ in fragments.values()) + b"]}"
    return content, fragments


class CdiWriter(TreeFollower):
    """Keeps the spec files in step with the newest tree: a subscriber of the notifier, writing
    SETTLE_SECONDS after a change in a worker thread (encoding a pool of thousands of devices
    takes milliseconds: not on the event loop)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(self.update, SETTLE_SECONDS)
        self._directory = directory
        # file name -> the digest of what it holds (the spec itself is not kept: with thousands of
        # devices it is a megabyte, and only a change has to be told from no change)
        self._written: dict[str, bytes] = {}
        self._built: dict[str, tuple[ResourcePool, bytes, _Fragments]] = {}  # resource -> its last spec's digest

    def remove_all(self) -> None:
        """Remove every devplugd CDI spec of a pool (at start and at stop); claims' specs stay."""
        try:
            names = os.listdir(self._directory)
        except OSError:
            return
        for name in names:
            if name.startswith(FILE_PREFIX) and name.endswith(".json") and not name.startswith(CLAIM_FILE_PREFIX):
                (self._directory / name).unlink(missing_ok=True)
        self._written.clear()
        self._built.clear()

    def update(self, tree: DeviceTree) -> None:
        to_write: dict[str, tuple[bytes, bytes]] = {}  # file name -> (spec, its digest)
        kept: set[str] = set()
        built: dict[str, tuple[ResourcePool, bytes, _Fragments]] = {}
        for pool in tree.pools.values():
            if len(pool.devices) <= len(pool.vanished):
                continue
            name = spec_file_name(pool.resource)
            kept.add(name)
            known = self._built.get(pool.resource)
            # pools that did not change are the same object; one whose file is not written yet is encoded again
            if known is None or known[0] is not pool or self._written.get(name) != known[1]:
                content, fragments = spec_bytes(pool, known[2] if known is not None else {})
                known = (pool, hashlib.sha256(content).digest(), fragments)
                if self._written.get(name) != known[1]:
                    to_write[name] = (content, known[1])
            built[pool.resource] = known
        self._built = built
        try:
            for name, (content, digest) in to_write.items():
                self._directory.mkdir(parents=True, exist_ok=True)
                write_atomically(self._directory / name, content, mode=0o644, durable=False)
                self._written[name] = digest
            for name in [n for n in self._written if n not in kept]:
                (self._directory / name).unlink(missing_ok=True)
                del self._written[name]
        except OSError as error:
            log.error("cannot write CDI specs in %s: %s", self._directory, error)

"""CDI specs for every pool, so podman or containerd can take devplugd's devices by name.

One file per pool in the CDI directory, ``devplugd-<vendor>-<class>.json``, holding one CDI
device per device ID with its device nodes, env and mounts. The kind is the resource name made
valid for CDI (``<vendor>/<class>``: the class may not contain dots). ``cdiVersion`` is the
lowest that carries what is used: 0.3.0, or 0.5.0 when a device node's host path differs from
its container path (``hostPath``). Files are written atomically and only when their content
changes; a pool that goes away takes its file with it. Only ``devplugd-*`` files are touched.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._leases import write_atomically
from ._tree import DeviceTree, ResourcePool

log = logging.getLogger("devplugd.cdi")

FILE_PREFIX = "devplugd-"
_CLASS_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_NAME_INVALID = re.compile(r"[^A-Za-z0-9_.:-]")


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


def cdi_device_name(device_id: str) -> str:
    return _NAME_INVALID.sub("_", device_id)


def cdi_names(resource: str, device_ids: Sequence[str]) -> list[str]:
    kind = cdi_kind(resource)
    return [f"{kind}={cdi_device_name(device_id)}" for device_id in device_ids]


def cdi_env_name(resource: str) -> str:
    """``DEVPLUGD_<RESOURCE>``: each CDI device sets it to its own device ID."""
    return "DEVPLUGD_" + re.sub(r"[^A-Za-z0-9]", "_", resource).upper()


def spec_file_name(resource: str) -> str:
    return FILE_PREFIX + cdi_kind(resource).replace("/", "-") + ".json"


def build_spec(pool: ResourcePool) -> dict[str, Any]:
    needs_host_path = False
    devices = []
    for device_id, info in sorted(pool.devices.items()):
        edits: dict[str, Any] = {}
        nodes = []
        for spec in info.specs:
            node = {"path": spec.container_path, "permissions": spec.permissions}
            if spec.host_path != spec.container_path:
                node["hostPath"] = spec.host_path
                needs_host_path = True
            nodes.append(node)
        if nodes:
            edits["deviceNodes"] = nodes
        envs = {**info.envs, cdi_env_name(pool.resource): device_id}
        edits["env"] = [f"{key}={value}" for key, value in sorted(envs.items())]
        if info.mounts:
            edits["mounts"] = [
                {"hostPath": m.host_path, "containerPath": m.container_path,
                 "options": ["bind", "ro" if m.read_only else "rw"]}
                for m in info.mounts
            ]
        devices.append({"name": cdi_device_name(device_id), "containerEdits": edits})
    return {"cdiVersion": "0.5.0" if needs_host_path else "0.3.0", "kind": cdi_kind(pool.resource),
            "devices": devices}


class CdiWriter:
    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._written: dict[str, bytes] = {}
        self._built: dict[str, tuple[ResourcePool, bytes]] = {}  # a pool object -> its spec, once

    def remove_all(self) -> None:
        """Remove every devplugd CDI spec (at start and at stop)."""
        try:
            names = os.listdir(self._directory)
        except OSError:
            return
        for name in names:
            if name.startswith(FILE_PREFIX) and name.endswith(".json"):
                (self._directory / name).unlink(missing_ok=True)
        self._written.clear()
        self._built.clear()

    def update(self, tree: DeviceTree) -> None:
        wanted: dict[str, bytes] = {}
        built: dict[str, tuple[ResourcePool, bytes]] = {}
        for pool in tree.pools.values():
            if pool.devices:
                known = self._built.get(pool.resource)
                if known is None or known[0] is not pool:  # pools that did not change are the same object
                    known = (pool, json.dumps(build_spec(pool), indent=1).encode())
                built[pool.resource] = known
                wanted[spec_file_name(pool.resource)] = known[1]
        self._built = built
        try:
            for name, content in wanted.items():
                if self._written.get(name) != content:
                    self._directory.mkdir(parents=True, exist_ok=True)
                    write_atomically(self._directory / name, content, mode=0o644)
                    self._written[name] = content
            for name in [n for n in self._written if n not in wanted]:
                (self._directory / name).unlink(missing_ok=True)
                del self._written[name]
        except OSError as error:
            log.error("cannot write CDI specs in %s: %s", self._directory, error)

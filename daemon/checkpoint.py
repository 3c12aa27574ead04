"""The kubelet's own record of which pod holds which device: its device manager checkpoint,
``kubelet_internal_checkpoint`` in the device-plugin directory. Read only, never written.

Two readers: the host API (who holds each device, for ``List`` and for refusing a lease) and
the event loop (a device that vanishes while the checkpoint names it stays listed, Unhealthy).
The kubelet writes the file to a temporary name and renames it into place, so a read sees the
old or the new file, never half of one; a file that cannot be read or parsed is logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("devplugd.checkpoint")

CHECKPOINT_NAME = "kubelet_internal_checkpoint"

Allocations = dict[tuple[str, str], str]
# (resource, device ID) -> (pod UID, container name)
Holdings = dict[tuple[str, str], tuple[str, str]]


class CheckpointError(Exception):
    """The checkpoint exists but cannot be read or parsed."""


def read_holdings(device_plugin_dir: Path) -> Holdings:
    """(resource, device ID) -> (pod UID, container) from the kubelet's checkpoint; ``{}`` when
    there is no checkpoint. Raises CheckpointError (not logged) when it cannot be read or parsed."""
    try:
        document = json.loads((device_plugin_dir / CHECKPOINT_NAME).read_text())
        entries = document["Data"]["PodDeviceEntries"] or []
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read the kubelet checkpoint in {device_plugin_dir}: {error}") from error
    held: Holdings = {}
    try:
        for entry in entries:
            try:
                owner = (str(entry["PodUID"]), str(entry["ContainerName"]))
                ids = entry["DeviceIDs"]
                flat = [i for group in ids.values() for i in group] if isinstance(ids, dict) else list(ids)
                for device_id in flat:
                    held[(entry["ResourceName"], device_id)] = owner
            except (KeyError, TypeError, AttributeError):
                continue
    except TypeError as error:  # PodDeviceEntries is not a list
        raise CheckpointError(f"cannot read the kubelet checkpoint in {device_plugin_dir}: {error}") from error
    return held


def read_allocations(device_plugin_dir: Path) -> Allocations | None:
    """(resource, device ID) -> ``pod <uid>/<container>`` from the kubelet's checkpoint; ``{}``
    when there is no checkpoint, ``None`` (logged) when it cannot be read or parsed."""
    try:
        held = read_holdings(device_plugin_dir)
    except CheckpointError as error:
        log.warning("%s", error)
        return None
    return {key: f"pod {pod_uid}/{container}" for key, (pod_uid, container) in held.items()}


def kubelet_allocations(device_plugin_dir: Path) -> Allocations:
    """(resource, device ID) -> ``pod <uid>/<container>`` from the kubelet's checkpoint; ``{}``
    when there is none or it cannot be read (logged)."""
    held = read_allocations(device_plugin_dir)
    return held if held is not None else {}

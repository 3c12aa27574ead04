"""The kubelet's own record of which pod holds which device: its device manager checkpoint,
``kubelet_internal_checkpoint`` in the device-plugin directory. Read only, never written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("devplugd.host")

CHECKPOINT_NAME = "kubelet_internal_checkpoint"


def kubelet_allocations(device_plugin_dir: Path) -> dict[tuple[str, str], str]:
    """(resource, device ID) -> ``pod <uid>/<container>`` from the kubelet's checkpoint."""
    try:
        document = json.loads((device_plugin_dir / CHECKPOINT_NAME).read_text())
        entries = document["Data"]["PodDeviceEntries"] or []
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("cannot read the kubelet checkpoint in %s: %s", device_plugin_dir, error)
        return {}
    held: dict[tuple[str, str], str] = {}
    for entry in entries:
        try:
            owner = f"pod {entry['PodUID']}/{entry['ContainerName']}"
            ids = entry["DeviceIDs"]
            flat = [i for group in ids.values() for i in group] if isinstance(ids, dict) else list(ids)
            for device_id in flat:
                held[(entry["ResourceName"], device_id)] = owner
        except (KeyError, TypeError, AttributeError):
            continue
    return held

"""The active Intel DDP profile of a device, read as the SR-IOV plugin reads it: from
``ddptool -l -a -j -s <pci address>`` (exit status 8 means no profile loaded).

This is the one fact a sysfs tree cannot give; it is looked up only when a pool has a
``ddpProfiles`` selector. A missing ``ddptool`` means no device has a profile.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess

log = logging.getLogger("devplugd.pci")

_NO_PROFILE_STATUS = 8


def read_ddp_profile(address: str) -> str | None:
    tool = shutil.which("ddptool")
    if tool is None:
        return None
    try:
        completed = subprocess.run(
            [tool, "-l", "-a", "-j", "-s", address], capture_output=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("ddptool for %s failed: %s", address, error, extra={"PCI_ADDR": address})
        return None
    if completed.returncode == _NO_PROFILE_STATUS:
        return None
    if completed.returncode != 0:
        log.warning("ddptool for %s exited %d", address, completed.returncode, extra={"PCI_ADDR": address})
        return None
    try:
        name = json.loads(completed.stdout)["DDPInventory"]["DDPpackage"]["name"]
    except (ValueError, KeyError, TypeError):
        log.warning("ddptool for %s printed no DDPInventory.DDPpackage.name", address, extra={"PCI_ADDR": address})
        return None
    return name if isinstance(name, str) and name else None

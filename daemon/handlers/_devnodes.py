"""Device nodes under the dev root, as the devNode and usbDevice handlers both hand them out."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.core import ConfigError, PoolEntry

DEV_PREFIX = "/dev/"
PERMISSION_LETTERS = frozenset("rwm")


@dataclass(frozen=True, slots=True)
class DeviceNode:
    relative_path: str  # below /dev: ``ttyUSB0``, ``bus/usb/001/003``
    kind: str  # "char" or "block"
    major: int
    minor: int

    @property
    def host_path(self) -> str:
        return DEV_PREFIX + self.relative_path


def stat_node(dev_root: Path, relative: str) -> DeviceNode | None:
    """The character or block node at ``relative`` under ``dev_root``; ``None`` when there is
    none (gone, never there, or another kind of file)."""
    try:
        status = os.stat(os.path.join(dev_root, relative), follow_symlinks=False)
    except (OSError, ValueError):
        return None
    if stat.S_ISCHR(status.st_mode):
        kind = "char"
    elif stat.S_ISBLK(status.st_mode):
        kind = "block"
    else:
        return None
    return DeviceNode(relative, kind, os.major(status.st_rdev), os.minor(status.st_rdev))


def relative_devname(devname: str) -> str | None:
    """A uevent's ``DEVNAME`` as a path below /dev, or ``None`` when it points outside."""
    relative = os.path.normpath(devname.removeprefix(DEV_PREFIX))
    return None if relative.startswith(("/", "..")) or relative == "." else relative


def parse_permissions(entry: PoolEntry) -> str:
    """The pool's ``permissions`` (cgroup letters ``r``, ``w``, ``m``; default ``rw``)."""
    permissions = entry.raw.get("permissions", str, "rw")
    if not permissions or set(permissions) - PERMISSION_LETTERS:
        raise ConfigError(entry.raw.path_of("permissions"), f"{permissions!r} must be letters from 'rwm'")
    return permissions

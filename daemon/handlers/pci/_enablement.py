"""Whether this host lets devplugd rebind the functions of ``vfioOnDemand`` pools, and what to
say when it does not.

The rebinding (``_rebind.py``) writes sysfs in two places: each function's ``driver_override``,
under ``<sysfs>/devices`` (where ``<sysfs>/bus/pci/devices/<address>`` leads), and the drivers'
``unbind`` and ``bind``, under ``<sysfs>/bus/pci``. The shipped unit (``ProtectKernelTunables=yes``)
and DaemonSet (``/sys`` mounted read-only) keep all of ``/sys`` read-only, as most hosts want; a
host that rebinds opts in as docs/passthrough.md ("Enabling it") says. Where it has not, the
handler says so once at start and at each reload (``read_only_problem``, naming the pools) and
refuses a claim before anything is written or checkpointed (``refuse_if_read_only``); a write
that fails all the same says why and what to do (``write_failure_hint``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from daemon.core import AllocationError

WRITTEN = ("bus/pci", "devices")  # where the rebinding writes, under the sysfs root
ENABLING = ('see "Enabling it" in docs/passthrough.md (/usr/share/doc/devplugd/docs/passthrough.md): the systemd '
            "drop-in vfio-on-demand.conf, or the DaemonSet's component deploy/vfio-on-demand")


def read_only_paths(sysfs_root: str) -> list[str]:
    """The directories the rebinding writes under that are on a read-only mount here."""
    return [path for part in WRITTEN if _read_only(path := f"{sysfs_root}/{part}")]


def read_only_problem(sysfs_root: str, resources: Sequence[str]) -> str | None:
    """One message for all the ``vfioOnDemand`` pools ``resources`` when this host keeps them
    from rebinding; ``None`` when it does not (or there are none)."""
    read_only = read_only_paths(sysfs_root) if resources else []
    if not read_only:
        return None
    pools = f"pool{'s' if len(resources) > 1 else ''} {', '.join(resources)}"
    return (f"vfioOnDemand {pools}: every claim with a VfioConfig will be refused, since {_are_read_only(read_only)} "
            f"for devplugd (the unit's ProtectKernelTunables=yes, or the DaemonSet's read-only /sys); {ENABLING}")


def refuse_if_read_only(sysfs_root: str, address: str) -> None:
    """AllocationError when the function ``address`` could not be rebound for a read-only sysfs."""
    read_only = read_only_paths(sysfs_root)
    if read_only:
        raise AllocationError(f"{address}: {_are_read_only(read_only)} for devplugd, and the rebinding writes there; "
                              f"{ENABLING}")


def write_failure_hint(error: OSError) -> str:
    """What to add to a sysfs write that failed with ``error``: the way to enable the writes when
    the mount is read-only or a container's AppArmor or SELinux refused them."""
    if error.errno == errno.EROFS:
        return f"; sysfs is read-only for devplugd: {ENABLING}"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"; in a container, AppArmor or SELinux may refuse writes to sysfs: {ENABLING}"
    return ""


def _are_read_only(paths: Sequence[str]) -> str:
    return f"{' and '.join(paths)} {'are' if len(paths) > 1 else 'is'} read-only"


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:  # missing: the rebinding's own reads and writes say what is wrong
        return False

"""One cgroup per test container, on whatever layout the host has.

The host's PID 1 is not systemd, so nobody hands us a delegated cgroup: each container's launcher
moves itself into ``/sys/fs/cgroup/<hierarchy>/<name>`` before it execs systemd-nspawn, which then
makes ``supervisor/`` and ``payload/`` (with the container's own tree) below it. Two containers
never share a cgroup, and removing the directories afterwards proves nothing is left running.

Layouts (``/proc/self/mountinfo``):

* ``hybrid``: v1 controllers, the named v1 ``systemd`` hierarchy at ``/sys/fs/cgroup/systemd`` and
  cgroup2 at ``/sys/fs/cgroup/unified`` (what the Debian 12 test VMs have);
* ``unified``: cgroup2 at ``/sys/fs/cgroup``;
* ``legacy``: v1 only, with the named ``systemd`` hierarchy.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tests.waiting import wait_until

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _mounts() -> dict[str, str]:
    """Mount point -> filesystem type, for the cgroup mounts."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            separator = fields.index("-")
            mount_point, fs_type = fields[4], fields[separator + 1]
            if mount_point.startswith(str(CGROUP_ROOT)):
                mounts[mount_point] = fs_type
    return mounts


def cgroup_layout() -> tuple[str, tuple[Path, ...]]:
    """(layout name, the hierarchies a container's launcher must join)."""
    mounts = _mounts()
    if mounts.get(str(CGROUP_ROOT)) == "cgroup2":
        return "unified", (CGROUP_ROOT,)
    named = CGROUP_ROOT / "systemd"
    unified = CGROUP_ROOT / "unified"
    if mounts.get(str(named)) != "cgroup":
        raise RuntimeError(f"no cgroup2 at {CGROUP_ROOT} and no named systemd hierarchy at {named}: {mounts}")
    if mounts.get(str(unified)) == "cgroup2":
        return "hybrid", (named, unified)
    return "legacy", (named,)


@dataclass
class ContainerCgroup:
    """``<hierarchy>/<name>`` in every hierarchy the container needs."""

    name: str

    def __post_init__(self) -> None:
        self.layout, hierarchies = cgroup_layout()
        self.directories = tuple(hierarchy / self.name for hierarchy in hierarchies)

    def create(self) -> None:
        for directory in self.directories:
            directory.mkdir()

    def launcher_prefix(self) -> list[str]:
        """argv prefix that joins every directory, then execs the rest of the argv."""
        joins = " && ".join(f'echo $$ > "${index + 1}"' for index in range(len(self.directories)))
        return ["sh", "-c", f'{joins} && shift {len(self.directories)} && exec "$@"', "sh",
                *(str(directory / "cgroup.procs") for directory in self.directories)]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for directory in self.directories:
            if not directory.exists():
                continue
            for procs in directory.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    found.update(int(pid) for pid in procs.read_text().split())
        return found

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, timeout: float = 10.0) -> None:
        """Kill whatever is left, then remove the directories, deepest first."""
        failures: list[OSError] = []

        def removed() -> bool:
            self.kill_all()
            try:
                for directory in self.directories:
                    if directory.exists():
                        for parent, _, _ in os.walk(directory, topdown=False):
                            os.rmdir(parent)  # cgroupfs: rmdir of a cgroup ignores its control files
            except OSError as error:  # busy until the killed processes are gone
                failures.append(error)
                return False
            return True

        try:
            wait_until(removed, timeout, interval=0.05)
        except AssertionError:
            raise failures[-1] from None

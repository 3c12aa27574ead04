"""Host-side plumbing for the e2e harness: tools, locks, work directories, chroots, safe removal."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

WORK_ROOT = Path("/var/tmp")  # not /tmp: units with PrivateTmp, and it may be a small tmpfs
WORK_PREFIX = "devplugd-e2e-"
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": CONTAINER_PATH, "LANG": "C.UTF-8"}

# tool -> Debian package (installed with apt-get when missing: a fresh machine has none of them)
HOST_TOOLS = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "zstd": "zstd",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "make": "make",  # `make deb` when dist/ has no package
}


def ensure_host_tools() -> list[str]:
    """Install the Debian packages the harness needs; returns the ones it installed."""
    missing = sorted({package for tool, package in HOST_TOOLS.items()
                      if shutil.which(tool, path=CONTAINER_PATH) is None})
    if missing:
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-qq"]
        environment = {**HOST_ENV, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([*apt, "update"], check=True, env=environment, capture_output=True)
        subprocess.run([*apt, "install", "-y", "--no-install-recommends", *missing], check=True, env=environment,
                       capture_output=True)
    return missing


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path``, waited for (two test runs building the same image)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


class WorkDir:
    """A fresh directory under /var/tmp, locked for as long as this process owns it, so that
    ``reap_stale`` can tell a leftover of a killed run from one in use by a run racing with us."""

    def __init__(self, kind: str, name: str | None = None) -> None:
        if name is None:
            self.path = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{kind}-", dir=WORK_ROOT))
        else:
            self.path = WORK_ROOT / name
            self.path.mkdir()
        self._lock = open(self.path / ".lock", "w")  # noqa: SIM115 (held until remove())
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    @property
    def name(self) -> str:
        return self.path.name

    def tree(self, tmpfs: bool) -> Path:
        """``<dir>/root``, on its own tmpfs when asked: this VM's virtual disk makes unpacking a
        240 MB tree take 2-17 s and every dpkg fsync count; tmpfs unpacks it in ~1.2 s."""
        root = self.path / "root"
        root.mkdir()
        if tmpfs:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "devplugd-e2e", str(root)], check=True,
                           capture_output=True)
        return root

    def remove(self) -> None:
        safe_rmtree(self.path)
        self._lock.close()


def tmpfs_wanted() -> bool:
    """Trees go on tmpfs unless DEVPLUGD_E2E_TMPFS=0 or memory is short (a tree is ~250-400 MB)."""
    if os.environ.get("DEVPLUGD_E2E_TMPFS", "1") == "0":
        return False
    with open("/proc/meminfo") as meminfo:
        available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    return available_kib > 4 * 1024 * 1024


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point == prefix or mount_point.startswith(prefix + "/"):
                found.append(mount_point)
    return found


def safe_rmtree(path: Path) -> None:
    """rm -rf that never walks into a mount (a bound /dev or /proc left by a crashed chroot)."""
    if not path.exists():
        return
    for mount_point in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], capture_output=True)
    if left := mounts_under(path):
        raise RuntimeError(f"refusing to remove {path}: still mounted: {left}")
    shutil.rmtree(path)


def reap_stale(remove_cgroup: object) -> list[str]:
    """Remove work directories (and their containers' cgroups) whose owning process is gone."""
    reaped = []
    for candidate in sorted(WORK_ROOT.glob(f"{WORK_PREFIX}*")):
        lock_path = candidate / ".lock"
        if not lock_path.exists():
            continue
        with open(lock_path, "a") as lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run owns it
            remove_cgroup(candidate.name)  # type: ignore[operator]
            safe_rmtree(candidate)
            reaped.append(candidate.name)
    return reaped


# In a private mount namespace (gone with the process, whatever happens): proc, a read-only
# sysfs, the host's /dev, an empty tmpfs /run (so nothing believes systemd is running and no
# runtime file lands on the image) and the host's resolv.conf for the downloads.
_CHROOT_SCRIPT = r"""
set -e
root=$1; shift
mount -t proc proc "$root/proc"
mount -t sysfs -o ro sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
if [ -f "$root/etc/resolv.conf" ] && [ ! -L "$root/etc/resolv.conf" ]; then
    mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
fi
exec chroot "$root" "$@"
"""


def chroot_run(root: Path, argv: Sequence[str], *, timeout: float = 600, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` chrooted into ``root`` (no systemd running there) with the host's network."""
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _CHROOT_SCRIPT, "sh", str(root),
               "env", "-i", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive", *argv]
    completed = subprocess.run(command, capture_output=True, timeout=timeout, env=HOST_ENV, input=input)
    result = subprocess.CompletedProcess(list(argv), completed.returncode,
                                         completed.stdout.decode(errors="replace"),
                                         completed.stderr.decode(errors="replace"))
    if check and result.returncode != 0:
        raise CommandFailed(f"chroot {root}", result)
    return result


class CommandFailed(AssertionError):
    def __init__(self, where: str, result: subprocess.CompletedProcess[str]) -> None:
        self.result = result
        super().__init__(f"{where}: {' '.join(map(str, result.args))} exited {result.returncode}\n"
                         f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")

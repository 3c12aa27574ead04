"""The .deb under test: ``dist/devplugd_<version>_<arch>.deb``, built with ``make deb`` when missing
or older than a file that goes into it (so a developer's edit is never tested against a stale one).
``<arch>`` is this machine's Debian architecture unless asked for another (``DebBuild("arm64")``
runs ``make deb ARCH=arm64``, built under qemu-user emulation).

``DEVPLUGD_E2E_DEB=/path/x.deb`` tests another file instead of this machine's architecture's
(developing the harness against a stand-in package). The build can run in the background while
the image is being made.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from .container import Container

REPO_ROOT = Path(__file__).resolve().parents[2]
DIST = REPO_ROOT / "dist"
DEB_GLOB = "devplugd_*_*.deb"
HOST_ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                           check=True).stdout.strip()
RELATION_FIELDS = ("Pre-Depends", "Depends", "Recommends")  # what `apt-get install ./x.deb` pulls in
PACKAGED = ("daemon", "config", "systemd", "packaging", "proto", "pyproject.toml")  # what the .deb is built from


def newest_packaged_change() -> float:
    """The latest mtime of the tracked files the package is built from."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", *PACKAGED], cwd=REPO_ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    return max((REPO_ROOT / name).stat().st_mtime for name in listed if name and (REPO_ROOT / name).exists())


def newest_deb(arch: str) -> Path | None:
    found = sorted(DIST.glob(f"devplugd_*_{arch}.deb"), key=lambda path: path.stat().st_mtime)
    return found[-1] if found else None


def existing_deb(arch: str = HOST_ARCH) -> Path | None:
    """The .deb of ``arch`` if it is up to date: its mtime (when its build started, see
    ``DebBuild.result``) is not older than any file it is built from."""
    if arch == HOST_ARCH and (override := os.environ.get("DEVPLUGD_E2E_DEB")):
        return Path(override)
    deb = newest_deb(arch)
    if deb is None or deb.stat().st_mtime < newest_packaged_change():
        return None
    return deb


class DebBuild:
    """``make deb`` started now, waited for with ``result()``; nothing to do if an up-to-date .deb exists.
    ``arch``: another Debian architecture (``make deb ARCH=arm64``)."""

    def __init__(self, arch: str = HOST_ARCH) -> None:
        self.arch = arch
        self.deb = existing_deb(arch)
        self.seconds = 0.0
        self.output = ""
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._process: subprocess.Popen[str] | None = None
        if self.deb is None:
            command = ["make", "deb"] if arch == HOST_ARCH else ["make", "deb", f"ARCH={arch}"]
            self._process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)

    def result(self, timeout: float = 900) -> Path:
        if self._process is not None:
            output, _ = self._process.communicate(timeout=timeout)
            self.output = output
            self.seconds = time.monotonic() - self._started
            if self._process.returncode != 0:
                raise AssertionError(f"`make deb` exited {self._process.returncode}:\n{output[-6000:]}")
            self.deb = newest_deb(self.arch)
            if self.deb is None or self.deb.stat().st_mtime < self._started_wall:
                raise AssertionError(f"`make deb` left no {DIST}/devplugd_*_{self.arch}.deb:\n{output[-3000:]}")
            # dated when its build started: a source edited while it ran (the arm64 build takes
            # minutes) is newer than the .deb, so the next run builds it again
            os.utime(self.deb, (self._started_wall, self._started_wall))
        assert self.deb is not None
        return self.deb

    def cancel(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait()


def deb_fields(deb: Path) -> dict[str, str]:
    fields = {}
    for name in ("Package", "Version", "Architecture", *RELATION_FIELDS):
        completed = subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True)
        fields[name] = " ".join(completed.stdout.split())
    return fields


def relations(fields: dict[str, str]) -> str:
    """One relation string for ``apt-get satisfy``: everything apt would install for the .deb."""
    return ", ".join(fields[name] for name in RELATION_FIELDS if fields.get(name))


def install_in_chroot(container: Container, deb: Path) -> str:
    """``apt-get install -y ./x.deb`` chrooted into the unbooted tree (no systemd running: the
    maintainer scripts' chroot path), with the host's network for anything not yet there."""
    staged = container.root / "tmp" / deb.name
    staged.write_bytes(deb.read_bytes())
    try:
        return container.chroot(["apt-get", "install", "-y", "-q", f"/tmp/{deb.name}"]).stdout
    finally:
        staged.unlink()


def venv_python(container: Container) -> str:
    """The interpreter of the package's private venv, found from what the package installed:
    the shebang of the script /usr/bin/devplugd points to, else a bin/python3 in its file list."""
    script = container.run(["readlink", "-f", "/usr/bin/devplugd"]).stdout.strip()
    first_line = container.run(["head", "-n", "1", script]).stdout
    candidates = [first_line[2:].split()[0]] if first_line.startswith("#!") else []
    files = container.run(["dpkg", "-L", "devplugd"]).stdout.split()
    candidates += [path for path in files if path.endswith(("/bin/python3", "/bin/python"))]
    for candidate in candidates:
        if container.run([candidate, "-c", "import grpc, daemon._generated"], check=False).returncode == 0:
            return candidate
    raise AssertionError(f"no python with grpc and daemon among {candidates} (from {script}, dpkg -L devplugd)")


# What the purge check does not compare: API and tmpfs mounts of the booted container, the
# journal, the package manager's own state, what systemd records about timers and users, the
# runtime directories of PrivateTmp= services, and the harness's staging directory. Directories
# only (not files in them): the kubelet's, which the unit creates when missing and keeps on
# purge because the kubelet shares them.
UNTRACKED_TREES = (
    "proc", "sys", "dev", "run", "tmp",
    "var/log/journal", "var/lib/apt", "var/cache/apt", "var/lib/dpkg", "var/cache/debconf",
    "var/lib/systemd/timers", "var/lib/systemd/linger", "var/lib/systemd/random-seed",
    "var/tmp/systemd-private-",
    "e2e",
)
SHARED_DIRECTORIES = ("d var/lib/kubelet", "d var/lib/kubelet/device-plugins")


def _tracked(entry: str) -> bool:
    path = entry.partition(" ")[2]
    if entry in SHARED_DIRECTORIES:
        return False
    return not any(path.startswith(tree) if tree.endswith("-") else path == tree or path.startswith(tree + "/")
                   for tree in UNTRACKED_TREES)


FIND_FORMAT = "%y %P\\n"  # type letter and path relative to the root: "f etc/devplugd/config.json"


def tree_file_list(root: Path) -> set[str]:
    """The file list of an unbooted tree, from the host."""
    output = subprocess.run(["find", str(root), "-xdev", "-mindepth", "1", "-printf", FIND_FORMAT],
                            check=True, capture_output=True, text=True).stdout
    return {entry for entry in output.splitlines() if _tracked(entry)}


def file_list(container: Container) -> set[str]:
    """The same list for the running container's root file system."""
    output = container.run(["find", "/", "-xdev", "-mindepth", "1", "-printf", FIND_FORMAT]).stdout
    return {entry for entry in output.splitlines() if _tracked(entry)}

"""A minimal Debian bookworm image and booted systemd containers made from it.

``BookwormImage`` builds, once per machine, ``debootstrap --variant=minbase`` with only what
systemd needs to boot and be driven (systemd, systemd-sysv, dbus) and keeps it as a tarball under
/var/cache/devplugd-e2e/ (built under a lock file, published by rename: two racing test runs build
it once). ``with_depends(relations)`` adds a second tarball with a package's Depends installed
(``apt-get satisfy``), keyed by those relations: reruns skip the download, and a .deb that forgets
a dependency still fails, because only what it declares is there.

``Container`` unpacks a tarball under /var/tmp, optionally runs chrooted commands in it (no
systemd running: the path image builders take), then boots it with ``systemd-nspawn --boot
--register=no --keep-unit --private-network`` from its own cgroup, and drives it with
``nsenter`` into the container's PID 1. The tree lives on its own tmpfs under /var/tmp when
memory allows (this VM's disk is slow, see ``WorkDir.tree``). Journal: ``--link-journal=no``
keeps the host's journal out of it; inside, bookworm's systemd ships /var/log/journal, so
journald (Storage=auto) is persistent in the container's own /var/log/journal, unless
``volatile_journal`` removes that directory (then it lives in /run/log/journal).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.waiting import wait_until

from ._cgroup import ContainerCgroup
from ._host import (
    CONTAINER_PATH,
    HOST_ENV,
    CommandFailed,
    WorkDir,
    chroot_run,
    ensure_host_tools,
    locked,
    reap_stale,
    tmpfs_wanted,
)

CACHE_DIR = Path(os.environ.get("DEVPLUGD_E2E_CACHE", "/var/cache/devplugd-e2e"))
SUITE = "bookworm"
BOOT_PACKAGES = ("systemd", "systemd-sysv", "dbus")
DEPENDS_IMAGES_KEPT = 3
RECIPE = 1  # bump when the way images are made changes: old cache entries are then ignored
TAR_OPTIONS = ["--numeric-owner"]  # no --xattrs: dpkg ships none, and it makes unpacking 5x slower
CONTAINER_ENV = ["SYSTEMD_COLORS=0", "SYSTEMD_PAGER=", "TERM=dumb", "LANG=C.UTF-8"]
_sequence = itertools.count(1)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


class BookwormImage:
    def __init__(self, cache_dir: Path = CACHE_DIR, suite: str = SUITE, include: Sequence[str] = BOOT_PACKAGES,
                 mirror: str | None = None, arch: str | None = None) -> None:
        self.cache_dir = cache_dir
        self.suite = suite
        self.include = tuple(include)
        self.mirror = mirror or os.environ.get("DEVPLUGD_E2E_MIRROR") or None  # None: debootstrap's default
        # Another Debian architecture (debootstrap --arch; its binaries run under qemu-user, which
        # packaging/foreign.sh enables); None: this machine's.
        self.arch = arch
        self.key = _digest(RECIPE, suite, self.include, self.mirror) if arch is None else \
            _digest(RECIPE, suite, self.include, self.mirror, arch)
        self.timings: dict[str, float] = {}  # what this process built, and how long it took

    def base(self) -> Path:
        return self._cached(f"{self.suite}-minbase-{self.key}.tar.zst", "debootstrap", self._build_base)

    def with_depends(self, relations: str) -> Path:
        """The base image plus whatever apt picks to satisfy ``relations`` (a Depends field)."""
        base = self.base()
        key = _digest(self.key, relations)
        path = self._cached(f"{self.suite}-deps-{key}.tar.zst", "depends",
                            lambda target: self._build_depends(base, relations, target))
        os.utime(path)  # most recently used: kept by _prune
        return path

    @staticmethod
    def metadata(tarball: Path) -> dict[str, object]:
        meta = tarball.with_name(tarball.name + ".json")
        return json.loads(meta.read_text()) if meta.exists() else {}

    def _cached(self, name: str, what: str, build: object) -> Path:
        path = self.cache_dir / name
        if path.exists():
            return path
        with locked(self.cache_dir / "lock"):
            if path.exists():  # a racing run built it while we waited
                return path
            ensure_host_tools()
            for stale in self.cache_dir.glob(".*.partial"):  # left by a killed build (we hold the lock)
                stale.unlink()
            partial = path.with_name(f".{name}.{os.getpid()}.partial")
            started = time.monotonic()
            try:
                unpacked = build(partial)  # type: ignore[operator]
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            seconds = time.monotonic() - started
            meta = {"built_seconds": round(seconds, 1), "tarball_bytes": partial.stat().st_size,
                    "unpacked_bytes": unpacked, "suite": self.suite, "include": self.include, "built_at": time.time(),
                    **({"arch": self.arch} if self.arch else {})}
            path.with_name(name + ".json").write_text(json.dumps(meta, indent=1))
            os.replace(partial, path)
            self.timings[what] = seconds
            self._prune(f"{self.suite}-deps-*.tar.zst", keep=DEPENDS_IMAGES_KEPT)
        return path

    def _prune(self, pattern: str, keep: int) -> None:
        """Each change of the package's Depends makes a new image: keep the most recently used."""
        images = sorted(self.cache_dir.glob(pattern), key=lambda image: image.stat().st_mtime, reverse=True)
        for image in images[keep:]:
            image.unlink()
            image.with_name(image.name + ".json").unlink(missing_ok=True)

    def _build_base(self, target: Path) -> int:
        work = WorkDir("debootstrap")
        try:
            root = work.tree(tmpfs_wanted())
            command = ["debootstrap", "--variant=minbase", *(["--arch", self.arch] if self.arch else []),
                       *([f"--include={','.join(self.include)}"] if self.include else []), self.suite, str(root)]
            if self.mirror:
                command.append(self.mirror)
            completed = subprocess.run(command, capture_output=True, text=True, env=HOST_ENV, timeout=900)
            if completed.returncode != 0:
                log = root / "debootstrap" / "debootstrap.log"
                detail = log.read_text(errors="replace")[-4000:] if log.exists() else completed.stderr[-4000:]
                raise RuntimeError(f"debootstrap failed ({completed.returncode}):\n"
                                   f"{completed.stdout[-2000:]}\n{detail}")
            return _pack(root, target)
        finally:
            work.remove()

    def _build_depends(self, base: Path, relations: str, target: Path) -> int:
        work = WorkDir("depends")
        try:
            root = work.tree(tmpfs_wanted())
            _unpack(base, root)
            chroot_run(root, ["apt-get", "-qq", "update"])
            chroot_run(root, ["apt-get", "-y", "-qq", "satisfy", relations])
            chroot_run(root, ["apt-get", "clean"])
            return _pack(root, target)
        finally:
            work.remove()


def _pack(root: Path, target: Path) -> int:
    subprocess.run(["tar", *TAR_OPTIONS, "-I", "zstd -T0 -3", "-C", str(root), "-cf", str(target), "."],
                   check=True, capture_output=True, env=HOST_ENV)
    completed = subprocess.run(["du", "-sb", str(root)], check=True, capture_output=True, text=True)
    return int(completed.stdout.split()[0])


def _unpack(tarball: Path, root: Path) -> None:
    subprocess.run(["tar", *TAR_OPTIONS, "-I", "zstd", "-C", str(root), "-xpf", str(tarball)],
                   check=True, capture_output=True, env=HOST_ENV)


class BootError(RuntimeError):
    pass


class Container:
    """A booted bookworm from ``tarball``. ``with Container(t) as c: c.run([...])``.

    With ``boot=False`` the context manager only unpacks: call ``chroot()`` as often as needed,
    then ``boot()``. Everything is torn down on exit, whatever happened: nspawn stopped (SIGTERM,
    then SIGKILL of the container's PID 1 and of nspawn), the cgroup emptied and removed, the
    directory removed. ``timings`` has unpack, boot, stop, cleanup and lifecycle seconds.
    """

    def __init__(self, tarball: Path, *, name: str | None = None, boot: bool = True,
                 binds: Sequence[str] = (), volatile_journal: bool = False, tmpfs: bool | None = None,
                 boot_timeout: float = 60.0, settle: float = 20.0) -> None:
        self.tarball = tarball
        self.name = name or f"devplugd-e2e-{os.getpid()}-{next(_sequence)}"
        self.binds = tuple(binds)
        self.volatile_journal = volatile_journal
        self.tmpfs = tmpfs_wanted() if tmpfs is None else tmpfs
        self.boot_timeout = boot_timeout
        self.settle = settle
        self._boot_on_enter = boot
        self.cgroup = ContainerCgroup(self.name)
        self.timings: dict[str, float] = {}
        self.system_state = ""
        self.leader: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._work: WorkDir | None = None
        self._created_at = 0.0

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Container:
        try:
            self.create()
            if self._boot_on_enter:
                self.boot()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.destroy()

    @property
    def workdir(self) -> Path:
        assert self._work is not None, "create() first"
        return self._work.path

    @property
    def root(self) -> Path:
        return self.workdir / "root"

    @property
    def log(self) -> str:
        path = self.workdir / "nspawn.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def create(self) -> None:
        ensure_host_tools()
        reap_stale(lambda name: ContainerCgroup(name).remove())
        self._created_at = time.monotonic()
        self._work = WorkDir("container", self.name)
        started = time.monotonic()
        _unpack(self.tarball, self._work.tree(self.tmpfs))
        if self.volatile_journal:  # journald's Storage=auto then keeps it in /run/log/journal
            subprocess.run(["rm", "-rf", str(self.root / "var/log/journal")], check=True)
        self.timings["unpack"] = time.monotonic() - started

    def chroot(self, argv: Sequence[str], **options: object) -> subprocess.CompletedProcess[str]:
        """Run a command chrooted into the (not yet booted) tree, with the host's network."""
        assert self.process is None, "chroot() is for before boot()"
        return chroot_run(self.root, argv, **options)  # type: ignore[arg-type]

    def boot(self) -> None:
        started = time.monotonic()
        self.cgroup.create()
        command = [
            "systemd-nspawn", "--boot", "--directory", str(self.root), "--machine", self.name,
            "--register=no", "--keep-unit", "--console=pipe", "--private-network", "--link-journal=no",
            *(f"--bind-ro={path}" for path in self.binds),
        ]
        with open(self.workdir / "nspawn.log", "wb") as log:
            self.process = subprocess.Popen([*self.cgroup.launcher_prefix(), *command], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, env=HOST_ENV,
                                            start_new_session=True)
        deadline = started + self.boot_timeout
        self.leader = self._find_leader(deadline)
        self.system_state = self._wait_for_systemd(deadline)
        self.timings["boot"] = time.monotonic() - started

    def _find_leader(self, deadline: float) -> int:
        """The container's PID 1: nspawn's child that is PID 1 in its own PID namespace and has
        exec'd systemd (before that it is still nspawn code setting up the namespaces)."""
        process = self.process
        assert process is not None

        def leader() -> int | None:
            if process.poll() is not None:
                raise BootError(f"systemd-nspawn exited {process.returncode}:\n{self.log}")
            for pid in _children(process.pid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    executable = os.readlink(f"/proc/{pid}/exe")
                except OSError:
                    continue
                nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
                if len(nspid) >= 2 and nspid[-1] == "1" and executable.endswith("/systemd"):
                    return pid
            return None

        try:
            found: int = wait_until(leader, deadline - time.monotonic(), interval=0.01)
        except AssertionError:
            raise BootError(f"no container PID 1 under nspawn {process.pid} in {self.boot_timeout}s:\n"
                            f"{self.log}") from None
        return found

    def _wait_for_systemd(self, deadline: float) -> str:
        """Until ``systemctl is-system-running --wait`` says the boot is over. systemd answers
        only once it is up, so it is retried until then. A start job that never ends (a
        Type=notify service that never sends READY=1) keeps the state at "starting" for its
        TimeoutStartSec: after ``settle`` seconds that is returned, for the tests to judge."""
        settle_deadline = min(deadline, time.monotonic() + self.settle)

        def up() -> str | None:
            remaining = max(settle_deadline - time.monotonic(), 0.001)
            try:
                completed = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError("still starting after the settle time") from None  # ends the wait
            state = completed.stdout.strip()
            return state if state in ("running", "degraded", "maintenance") else None

        with contextlib.suppress(AssertionError):
            found: str = wait_until(up, settle_deadline - time.monotonic(), interval=0.05)
            return found
        state = self.run(["systemctl", "is-system-running"], check=False).stdout.strip()
        if state in ("starting", "running", "degraded", "maintenance"):
            return state
        raise BootError(f"the container's systemd did not come up in {self.boot_timeout}s (state {state!r}):\n"
                        f"{self.log}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to nspawn (the container powers off cleanly), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.leader is not None:
                _kill(self.leader)  # PID 1 of the namespace: the kernel kills everything in it
            self.process.kill()
            self.process.wait()
        self.timings["stop"] = time.monotonic() - started

    def destroy(self) -> None:
        started = time.monotonic()
        try:
            self.stop()
        finally:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.cgroup.remove()
            Path(f"/run/systemd/nspawn/propagate/{self.name}").unlink(missing_ok=True)
            if self._work is not None:
                self._work.remove()
                self._work = None
            self.timings["cleanup"] = time.monotonic() - started
            if self._created_at:
                self.timings["lifecycle"] = time.monotonic() - self._created_at

    # -- inside the booted container ---------------------------------------------------------
    def run(self, command: Sequence[str] | str, *, check: bool = True, timeout: float = 60.0,
            input: str | bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (argv, or a string for ``sh -c``) in the container through nsenter,
        with a clean environment. Returns text output; raises CommandFailed if ``check``."""
        assert self.leader is not None, "boot() first"
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        full = ["nsenter", "-t", str(self.leader), "-a", "env", "-i", f"PATH={CONTAINER_PATH}", *CONTAINER_ENV, *argv]
        data = input.encode() if isinstance(input, str) else input
        completed = subprocess.run(full, capture_output=True, timeout=timeout, input=data, env=HOST_ENV,
                                   stdin=None if data is not None else subprocess.DEVNULL)
        result = subprocess.CompletedProcess(argv, completed.returncode, completed.stdout.decode(errors="replace"),
                                             completed.stderr.decode(errors="replace"))
        if check and result.returncode != 0:
            raise CommandFailed(f"container {self.name}", result)
        return result

    def copy_in(self, source: Path, destination: str, mode: int | None = None) -> None:
        """Copy a host file or directory to ``destination`` inside the running container (through
        the container's own view, so tmpfs mounts such as /tmp are honoured)."""
        if source.is_dir():
            archive = subprocess.run(["tar", "-C", str(source), "-cf", "-", "."], check=True,
                                     capture_output=True).stdout
            self.run(["sh", "-c", 'mkdir -p "$1" && tar -C "$1" --no-same-owner -xf -', "sh", destination],
                     input=archive)
        else:
            self.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", destination],
                     input=source.read_bytes())
        if mode is not None:
            self.run(["chmod", f"{mode:o}", destination])

    def write_text(self, destination: str, text: str, mode: int = 0o644) -> None:
        self.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"', "sh", destination,
                  f"{mode:o}"], input=text)

    def read_text(self, path: str) -> str:
        return self.run(["cat", path]).stdout


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in path.read_text().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

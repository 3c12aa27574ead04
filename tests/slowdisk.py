"""A directory whose fsync is slow for real: a FUSE filesystem that sleeps in fsync and fsyncdir.

``SlowDisk(workdir)`` mounts a passthrough FUSE filesystem at ``workdir/mnt`` over the plain
directory ``workdir/backing``. Every operation is passed through at once, except ``fsync`` of a
file and ``fsync`` of a directory: those sleep ``disk.delay`` seconds (0 at first; set it at any
time) and then fsync the backing file or directory. A program that writes there makes the real
system calls and is blocked in the kernel (in ``fsync(2)``, waiting for the FUSE server's answer)
exactly as on a slow disk; nothing in the program under test is patched.

Why FUSE and not a slow block device: device-mapper's ``delay`` target needs dm-delay, which a
kernel may lack (CONFIG_MD off on some VMs, no modules at all on others), and io-cgroup throttling
depends on the cgroup layout (v1 or v2, whether the io controller is delegated) and on which
thread the kernel charges writeback and journal commits to. FUSE needs ``/dev/fuse`` only, and
the delay is the same every time, on every fsync, whatever the machine.

Each fsync is logged to ``disk.events`` as it begins and ends, with ``time.monotonic()`` (one
clock for every process on the machine), so a test can tell whether a write was in flight when
something else happened.

The server runs as a separate process under Debian's ``/usr/bin/python3`` with ``python3-pyfuse3``
(apt; libfuse3 on trio); this file is that server when run as a script. A
missing package, ``/dev/fuse`` or mount fails loudly (``SlowDiskError``): a test that needs a slow
disk must fail, not skip, without one. ``close()`` (or leaving the ``with`` block) removes
everything, even after a failure: any sleeping fsync is cut short, the mount is unmounted (lazily
if it is busy), the server process is ended by its PID and the work directory is deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_PYTHON = "/usr/bin/python3"  # python3-pyfuse3 installs into Debian's python, not into a venv
PACKAGE = "python3-pyfuse3"


class SlowDiskError(Exception):
    """The slow disk cannot be set up; the message says what is missing."""


@dataclass(frozen=True)
class Fsync:
    """One fsync the filesystem served: of a file (``kind`` "file") or a directory ("dir")."""

    kind: str
    path: str  # inside the filesystem, "/" for its root
    began: float  # time.monotonic()
    ended: float | None  # None: still sleeping

    def covers(self, moment: float) -> bool:
        return self.began <= moment and (self.ended is None or moment <= self.ended)


class SlowDisk:
    def __init__(self, workdir: Path, timeout: float = 10.0) -> None:
        self.workdir = workdir
        self.backing = workdir / "backing"
        self.path = workdir / "mnt"  # the slow directory
        self._control = workdir / "delay"
        self._events = workdir / "events"
        self._stderr_path = workdir / "server.log"
        self._process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True)
        try:
            self._check_prerequisites()
            for directory in (self.backing, self.path):
                directory.mkdir()
            self.delay = 0.0
            self._events.touch()
            with open(self._stderr_path, "wb") as stderr:
                self._process = subprocess.Popen(
                    [SERVER_PYTHON, __file__, str(self.backing), str(self.path), str(self._control),
                     str(self._events)],
                    stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
            self._wait_mounted(timeout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_prerequisites() -> None:
        if not os.path.exists("/dev/fuse"):
            subprocess.run(["modprobe", "fuse"], capture_output=True)  # a kernel with FUSE as a module
        if not os.path.exists("/dev/fuse"):
            raise SlowDiskError("no /dev/fuse: the kernel has no FUSE (CONFIG_FUSE_FS), or /dev is not devtmpfs")
        probe = subprocess.run([SERVER_PYTHON, "-c", "import pyfuse3, trio"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise SlowDiskError(f"{SERVER_PYTHON} cannot import pyfuse3: apt-get install {PACKAGE} "
                                f"(.ci/run and scripts/bootstrap --tests install it)\n{probe.stderr}")

    def _wait_mounted(self, timeout: float) -> None:
        from tests.waiting import wait_until  # not at the top: the FUSE server runs this file on its own

        def mounted() -> bool:
            assert self._process is not None
            if not self.mounted and self._process.poll() is not None:
                raise SlowDiskError(f"the FUSE server exited {self._process.returncode} before mounting "
                                    f"{self.path}:\n{self.server_log}")
            return self.mounted

        try:
            wait_until(mounted, timeout)
        except AssertionError:
            raise SlowDiskError(f"{self.path} not mounted after {timeout}s:\n{self.server_log}") from None

    @property
    def mounted(self) -> bool:
        """From the mount table: ``os.path.ismount`` says False for a FUSE mount whose server died."""
        wanted = os.path.realpath(self.path)
        with open("/proc/self/mountinfo") as table:
            return any(line.split()[4] == wanted for line in table)

    @property
    def server_log(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def delay(self) -> float:
        return float(self._control.read_text())

    @delay.setter
    def delay(self, seconds: float) -> None:
        """Seconds each fsync from now on sleeps (one already sleeping keeps its own)."""
        temporary = self._control.with_name("delay.tmp")
        temporary.write_text(repr(float(seconds)))
        os.replace(temporary, self._control)

    def fsyncs(self) -> list[Fsync]:
        """Every fsync so far, in the order they began."""
        began: dict[str, tuple[str, str, float]] = {}
        ended: dict[str, float] = {}
        for line in self._events.read_text().splitlines():
            parts = line.split(" ", 4)
            if len(parts) != 5:
                continue  # a line being written
            event, number, kind, moment, path = parts
            if event == "begin":
                began[number] = (kind, path, float(moment))
            elif event == "end":
                ended[number] = float(moment)
        return [Fsync(kind, path, moment, ended.get(number))
                for number, (kind, path, moment) in sorted(began.items(), key=lambda item: item[1][2])]

    def wait_for_fsync(self, predicate=lambda fsync: fsync.ended is None, timeout: float = 10.0) -> Fsync:
        """The first fsync that satisfies ``predicate`` (default: one still sleeping), waiting for it."""
        from tests.waiting import wait_until  # not at the top: the FUSE server runs this file on its own

        found: Fsync = wait_until(lambda: next((fsync for fsync in self.fsyncs() if predicate(fsync)), None), timeout,
                                  lambda: f"a matching fsync on {self.path}; saw {self.fsyncs()}", interval=0.01)
        return found

    def close(self) -> None:
        if self._control.exists():
            self.delay = 0.0  # a sleeping fsync answers within its next poll of the delay file
        for command in (["umount"], ["umount", "-l"], ["fusermount3", "-u"], ["fusermount3", "-uz"]):
            if not self.mounted:
                break
            subprocess.run([*command, str(self.path)], capture_output=True)  # -l, -z: even while busy
        if self._process is not None:
            try:
                self._process.wait(5)  # libfuse's loop ends when the mount goes
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if not self.mounted:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SlowDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the FUSE server (run under /usr/bin/python3 with python3-pyfuse3) ------------------------------

def serve(backing: str, mountpoint: str, control: str, events: str) -> None:
    """Pass everything through to ``backing``; sleep the delay read from ``control`` in fsync and
    fsyncdir, and log their begin and end to ``events``. Inode numbers are our own (1 is the root),
    mapped to the backing paths by the backing inode number."""
    import errno
    import functools
    import itertools

    import pyfuse3  # python3-pyfuse3
    import trio

    log = open(events, "a", buffering=1)
    fsync_numbers = itertools.count(1)

    def passed_through(method):
        @functools.wraps(method)
        async def wrapper(*arguments):
            try:
                return await method(*arguments)
            except OSError as error:
                raise pyfuse3.FUSEError(error.errno or errno.EIO) from None
        return wrapper

    class SlowFS(pyfuse3.Operations):
        def __init__(self) -> None:
            super().__init__()
            self.paths = {pyfuse3.ROOT_INODE: backing}  # our inode -> backing path
            self.inodes = {os.lstat(backing).st_ino: pyfuse3.ROOT_INODE}  # backing st_ino -> ours
            self.numbers = itertools.count(pyfuse3.ROOT_INODE + 1)
            self.descriptors = {}  # file handle (the backing fd) -> our path inside the filesystem

        def path(self, inode: int) -> str:
            try:
                return self.paths[inode]
            except KeyError:
                raise pyfuse3.FUSEError(errno.ENOENT) from None

        def child(self, parent: int, name: bytes) -> str:
            return os.path.join(self.path(parent), os.fsdecode(name))

        def entry(self, path: str, stat: os.stat_result | None = None) -> pyfuse3.EntryAttributes:
            stat = stat or os.lstat(path)
            inode = self.inodes.get(stat.st_ino)
            if inode is None:
                inode = self.inodes[stat.st_ino] = next(self.numbers)
            self.paths[inode] = path
            attributes = pyfuse3.EntryAttributes()
            attributes.st_ino = inode
            attributes.entry_timeout = attributes.attr_timeout = 0  # always ask: renames stay visible
            for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize",
                         "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
                setattr(attributes, name, getattr(stat, name))
            return attributes

        def visible(self, path: str) -> str:
            relative = os.path.relpath(path, backing)
            return "/" if relative == "." else "/" + relative

        async def slow(self, kind: str, path: str, sync) -> None:
            number = next(fsync_numbers)
            log.write(f"begin {number} {kind} {time.monotonic():.6f} {self.visible(path)}\n")
            start = time.monotonic()
            while True:  # the delay is read again and again, so that close() can cut a sleep short
                try:
                    with open(control) as file:
                        delay = float(file.read())
                except (OSError, ValueError):
                    delay = 0.0
                remaining = start + delay - time.monotonic()
                if remaining <= 0:
                    break
                await trio.sleep(min(remaining, 0.05))
            sync()
            log.write(f"end {number} {kind} {time.monotonic():.6f} {self.visible(path)}\n")

        @passed_through
        async def lookup(self, parent_inode, name, ctx=None):
            if name == b".":
                return self.entry(self.path(parent_inode))
            if name == b"..":
                return self.entry(os.path.dirname(self.path(parent_inode)))
            return self.entry(self.child(parent_inode, name))

        @passed_through
        async def getattr(self, inode, ctx=None):
            return self.entry(self.path(inode))

        @passed_through
        async def setattr(self, inode, attr, fields, fh, ctx):
            path = self.path(inode)
            if fields.update_size:
                if fh is not None:
                    os.ftruncate(fh, attr.st_size)
                else:
                    os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, attr.st_mode & 0o7777)
            if fields.update_uid or fields.update_gid:
                os.chown(path, attr.st_uid if fields.update_uid else -1, attr.st_gid if fields.update_gid else -1)
            if fields.update_atime or fields.update_mtime:
                stat = os.lstat(path)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else stat.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else stat.st_mtime_ns))
            return self.entry(path)

        @passed_through
        async def opendir(self, inode, ctx):
            return os.open(self.path(inode), os.O_RDONLY | os.O_DIRECTORY)

        @passed_through
        async def readdir(self, fh, start_id, token):
            directory = self.paths.get(self.inodes.get(os.fstat(fh).st_ino))
            names = sorted(os.listdir(directory))
            for index, name in enumerate(names[start_id:], start_id + 1):
                path = os.path.join(directory, name)
                if not pyfuse3.readdir_reply(token, os.fsencode(name), self.entry(path), index):
                    break

        @passed_through
        async def fsyncdir(self, fh, datasync):
            path = self.paths.get(self.inodes.get(os.fstat(fh).st_ino), backing)
            await self.slow("dir", path, lambda: os.fsync(fh))

        @passed_through
        async def releasedir(self, fh):
            os.close(fh)

        @passed_through
        async def open(self, inode, flags, ctx):
            path = self.path(inode)
            descriptor = os.open(path, flags & ~os.O_CREAT)
            self.descriptors[descriptor] = path
            return pyfuse3.FileInfo(fh=descriptor)

        @passed_through
        async def create(self, parent_inode, name, mode, flags, ctx):
            path = self.child(parent_inode, name)
            descriptor = os.open(path, flags | os.O_CREAT, mode)
            self.descriptors[descriptor] = path
            return pyfuse3.FileInfo(fh=descriptor), self.entry(path, os.fstat(descriptor))

        @passed_through
        async def read(self, fh, off, size):
            return os.pread(fh, size, off)

        @passed_through
        async def write(self, fh, off, buf):
            return os.pwrite(fh, buf, off)

        @passed_through
        async def flush(self, fh):
            pass

        @passed_through
        async def release(self, fh):
            self.descriptors.pop(fh, None)
            os.close(fh)

        @passed_through
        async def fsync(self, fh, datasync):
            path = self.descriptors.get(fh, "?")
            await self.slow("file", path, lambda: (os.fdatasync if datasync else os.fsync)(fh))

        @passed_through
        async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
            if flags:
                raise pyfuse3.FUSEError(errno.EINVAL)  # no RENAME_NOREPLACE/EXCHANGE: nobody here needs them
            old, new = self.child(parent_inode_old, name_old), self.child(parent_inode_new, name_new)
            moved = os.lstat(old).st_ino
            os.rename(old, new)
            self.paths = {inode: path for inode, path in self.paths.items() if path != new}
            self.paths[self.inodes[moved]] = new
            for descriptor, path in self.descriptors.items():
                if path == old:
                    self.descriptors[descriptor] = new

        @passed_through
        async def unlink(self, parent_inode, name, ctx):
            os.unlink(self.child(parent_inode, name))

        @passed_through
        async def mkdir(self, parent_inode, name, mode, ctx):
            path = self.child(parent_inode, name)
            os.mkdir(path, mode)
            return self.entry(path)

        @passed_through
        async def rmdir(self, parent_inode, name, ctx):
            os.rmdir(self.child(parent_inode, name))

        @passed_through
        async def access(self, inode, mode, ctx):
            return os.access(self.path(inode), mode)

        @passed_through
        async def statfs(self, ctx):
            stat = os.statvfs(backing)
            data = pyfuse3.StatvfsData()
            for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                         "f_favail", "f_namemax"):
                setattr(data, name, getattr(stat, name))
            return data

    options = set(pyfuse3.default_options) | {"fsname=slowdisk", "subtype=slowdisk"}
    pyfuse3.init(SlowFS(), mountpoint, options)
    try:
        trio.run(pyfuse3.main)  # many worker tasks: an fsync that sleeps holds up only its caller
    finally:
        pyfuse3.close(unmount=False)  # the mount is close()'s to remove (or already gone)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: slowdisk.py BACKING MOUNTPOINT CONTROL EVENTS")
    serve(*sys.argv[1:])

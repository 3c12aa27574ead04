"""Uevent sources: kernel device events (add, remove, change, ...) as ``UEvent`` records on the bus.

``--uevent-source`` picks one of four ways to hear them:

``kernel``
    Our own ``NETLINK_KOBJECT_UEVENT`` socket on multicast group 1: the kernel's messages, kernel
    properties only, no udevd needed (these hosts usually have none).
``udev``
    libudev (through pyudev) on udevd's group: the same events after udevd's rules ran, with its
    ``ID_*`` properties. Without a running udevd this group is silent, hence ``auto``.
``auto``
    ``udev`` when udevd runs (``/run/udev/control`` exists), else ``kernel``.
``unix:PATH``
    A datagram unix socket the daemon binds at PATH (mode 0600); each datagram is one message in
    the kernel's format. It is the seam for tests and tools: it runs the same parser and the same
    filter as the netlink socket.
``none``
    No uevents.

Every source is event driven: its task sleeps in ``trio.lowlevel.wait_readable`` and wakes only
when a message is there; then it drains the socket until it would block. No threads, no timers.
A message that is not a valid uevent costs one warning line and is skipped.

When the kernel dropped messages because our receive buffer was full (``ENOBUFS``), the source
sends ``Resync(None, "uevent overflow")`` so every handler rebuilds its facts from a full scan. It
sends it only once the socket is drained, not when it reads the error: after an overrun the kernel
marks the socket congested and silently drops every further message until the queue is empty,
so a scan started before that could miss a change made meanwhile. Messages read between the
error and the end of the drain are still sent: the Resync that follows supersedes them.

``run`` takes trio's ``task_status``: ``await nursery.start(source.run, send)`` returns once the
socket is listening, so a scan started after it cannot miss an event.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from daemon.core import Event, Resync, UEvent
from daemon.sockets import SUN_PATH_MAX
from daemon.sources._netlink import raise_receive_buffer
from daemon.sources.uevent_wire import UEventError, parse_kernel_uevent

log = logging.getLogger("devplugd.uevents")

NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1
MAX_DATAGRAM_BYTES = 16 * 1024  # the kernel's uevent buffer is 2 KiB of properties plus the header
UDEV_CONTROL = Path("/run/udev/control")
SOCKET_MODE = 0o600
RECEIVE_BUFFER_BYTES = 16 * 1024 * 1024
DRAIN_BATCH = 256  # datagrams read between two trips through trio's scheduler
OVERFLOW_REASON = "uevent overflow"

SendChannel = trio.MemorySendChannel[Event]


class Overflow(Exception):
    """The kernel dropped messages for this socket (``ENOBUFS``)."""


async def pump(
    fd: object,
    receive: Callable[[], UEvent | None],
    name: str,
    subsystems: frozenset[str],
    send: SendChannel,
) -> None:
    """Forever: sleep until ``fd`` is readable, then send what ``receive`` returns until it is drained.

    ``receive`` returns the next event, ``None`` when nothing is queued, or raises ``Overflow``.
    Reading in batches keeps a storm of filtered-out messages from starving the other tasks.
    """
    overflowed = False
    while True:
        await trio.lowlevel.wait_readable(fd)  # type: ignore[arg-type]
        for _ in range(DRAIN_BATCH):
            try:
                event = receive()
            except Overflow:
                overflowed = True
                continue
            if event is None:
                if overflowed:
                    log_overflow(name)
                    await send.send(Resync(None, OVERFLOW_REASON))
                    overflowed = False
                break
            if wanted(event, subsystems):
                await send.send(event)


def wanted(event: UEvent, subsystems: frozenset[str]) -> bool:
    return not subsystems or event.subsystem in subsystems


def log_skipped(name: str, reason: str) -> None:
    log.warning("uevent source %s: skipped a malformed message: %s", name, reason, extra={"EVENT": "uevent-malformed"})


def log_overflow(name: str) -> None:
    log.warning(
        "uevent source %s: the kernel dropped uevents (receive buffer full); rescanning",
        name,
        extra={"EVENT": "uevent-overflow"},
    )


def subsystem_text(subsystems: frozenset[str]) -> str:
    return ", ".join(sorted(subsystems)) if subsystems else "all"





class UEventSource(Protocol):
    """What the daemon runs: one task sending ``UEvent`` (and ``Resync``) records."""

    def describe(self) -> str: ...

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


def make_uevent_source(spec: str, subsystems: frozenset[str], *, udev_control: Path = UDEV_CONTROL) -> UEventSource:
    """The source named by ``--uevent-source`` (``auto|udev|kernel|none|unix:PATH``).

    ``subsystems`` keeps only events of those subsystems (empty: all). Raises ``ValueError`` for
    a spec that names no source. Nothing is opened here: ``run`` opens and closes its socket.
    """
    spec = resolve_uevent_source(spec, udev_control=udev_control)
    if spec == "kernel":
        return KernelUEventSource(subsystems)
    if spec == "udev":
        from daemon.sources.udev_monitor import UdevUEventSource  # it builds on this module

        return UdevUEventSource(subsystems)
    if spec == "none":
        return NullUEventSource()
    if spec.startswith("unix:"):
        return UnixUEventSource(_unix_path(spec.removeprefix("unix:")), subsystems)
    raise ValueError(f"--uevent-source: {spec!r} is not one of auto, udev, kernel, none, unix:PATH")


def resolve_uevent_source(spec: str, *, udev_control: Path = UDEV_CONTROL) -> str:
    """``auto`` as the source it stands for now: ``udev`` when udevd runs (``/run/udev/control``
    exists), else ``kernel``; any other spec as it is."""
    if spec == "auto":
        return "udev" if udev_control.exists() else "kernel"
    return spec


def carries_udev_properties(spec: str, *, udev_control: Path = UDEV_CONTROL) -> bool:
    """Whether the source ``spec`` names delivers udev's properties: ``udev`` (``auto`` with a
    running udevd) does, and so does ``unix:PATH`` (tests feed it udev's messages as well as the
    kernel's); the handlers then also read udev's database at scan time."""
    resolved = resolve_uevent_source(spec, udev_control=udev_control)
    return resolved == "udev" or resolved.startswith("unix:")


def _unix_path(raw: str) -> Path:
    if not raw:
        raise ValueError("--uevent-source unix:PATH needs a path")
    if len(os.fsencode(raw)) > SUN_PATH_MAX:
        raise ValueError(f"--uevent-source unix:{raw}: a unix socket path has at most {SUN_PATH_MAX} bytes")
    return Path(raw)


class NullUEventSource:
    """``--uevent-source none``: never sends anything."""

    def describe(self) -> str:
        return "none (uevents disabled)"

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


class KernelUEventSource:
    """``--uevent-source kernel``: our own netlink socket on the kernel's uevent group."""

    def __init__(self, subsystems: frozenset[str], *, receive_buffer: int = RECEIVE_BUFFER_BYTES) -> None:
        self._subsystems = subsystems
        self._receive_buffer = receive_buffer

    def describe(self) -> str:
        return f"kernel (netlink uevent group {KERNEL_GROUP}; subsystems: {subsystem_text(self._subsystems)})"

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with _open_netlink(self._receive_buffer) as sock:
            task_status.started()
            await pump(sock, lambda: _receive_datagram(sock, "kernel", _from_kernel), "kernel", self._subsystems, send)


def _open_netlink(receive_buffer: int) -> socket.socket:
    sock = socket.socket(
        socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT
    )
    try:
        sock.bind((0, KERNEL_GROUP))  # port id 0: the kernel picks one
        raise_receive_buffer(sock, receive_buffer)
    except BaseException:
        sock.close()
        raise
    return sock


def _from_kernel(address: Any) -> bool:
    """Only the kernel (netlink port id 0) sends real uevents on group 1."""
    return isinstance(address, tuple) and address[0] == 0


class UnixUEventSource:
    """``--uevent-source unix:PATH``: kernel-format datagrams from a local sender (tests, tools)."""

    def __init__(self, path: Path, subsystems: frozenset[str]) -> None:
        self._path = path
        self._subsystems = subsystems

    @property
    def path(self) -> Path:
        return self._path

    def describe(self) -> str:
        return f"unix datagram socket {self._path} (kernel format; subsystems: {subsystem_text(self._subsystems)})"

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sock, identity = _bind_unix(self._path)
        try:
            task_status.started()
            name = f"unix:{self._path}"
            await pump(sock, lambda: _receive_datagram(sock, name, _anyone), name, self._subsystems, send)
        finally:
            sock.close()
            _remove_if_ours(self._path, identity)


def _bind_unix(path: Path) -> tuple[socket.socket, tuple[int, int]]:
    """Bind a datagram socket at ``path`` (mode 0600); returns it and the file's (dev, inode)."""
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        os.fchmod(sock.fileno(), SOCKET_MODE)  # Linux creates the file with this mode: no window at umask
        try:
            sock.bind(os.fspath(path))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot bind the uevent socket {path}: {exc.strerror}") from exc
        os.chmod(path, SOCKET_MODE)
        info = os.lstat(path)
    except BaseException:
        sock.close()
        raise
    return sock, (info.st_dev, info.st_ino)


def _remove_stale_socket(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket; refusing to remove it", os.fspath(path))
    if not _is_stale(path):
        raise OSError(errno.EADDRINUSE, "another process is bound to this socket; refusing to remove it", str(path))
    log.info("removing the stale uevent socket %s", path)
    path.unlink(missing_ok=True)


def _is_stale(path: Path) -> bool:
    """No process is bound to the socket file at ``path`` (connecting is refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # bound, but not as a datagram socket (EPROTOTYPE), or not ours to probe
        return False


def _remove_if_ours(path: Path, identity: tuple[int, int]) -> None:
    """Remove the socket file we bound, unless someone replaced it meanwhile."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)


def _receive_datagram(sock: socket.socket, name: str, sender_ok: Callable[[Any], bool]) -> UEvent | None:
    """The next uevent on ``sock``, or ``None`` when it is drained. Bad datagrams are logged and skipped."""
    while True:
        try:
            data, _ancillary, flags, address = sock.recvmsg(MAX_DATAGRAM_BYTES)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                raise Overflow from exc
            raise
        if flags & socket.MSG_TRUNC:
            log_skipped(name, f"datagram longer than {MAX_DATAGRAM_BYTES} bytes")
        elif not sender_ok(address):
            log_skipped(name, f"not sent by the kernel (sender {address!r})")
        else:
            try:
                return parse_kernel_uevent(data)
            except UEventError as exc:
                log_skipped(name, str(exc))


def _anyone(_address: Any) -> bool:
    """The unix seam's socket file is mode 0600: whoever can send may."""
    return True


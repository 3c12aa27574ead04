"""``--uevent-source udev``: libudev (through pyudev) on udevd's group: the kernel's events after
udevd's rules ran, with its ``ID_*`` properties."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

import trio

from daemon.core import UEvent
from daemon.sources._netlink import raise_receive_buffer
from daemon.sources.uevent_wire import KERNEL_ACTIONS, UEventError
from daemon.sources.uevents import RECEIVE_BUFFER_BYTES, Overflow, SendChannel, log_skipped, pump, subsystem_text


class _UdevDevice(Protocol):
    """The part of ``pyudev.Device`` we read."""

    @property
    def action(self) -> str | None: ...
    @property
    def device_path(self) -> str: ...
    @property
    def subsystem(self) -> str | None: ...
    @property
    def properties(self) -> Mapping[str, str]: ...


class UdevUEventSource:
    """``--uevent-source udev``: libudev's monitor on udevd's group (events after the rules ran).

    ``netlink_source="kernel"`` makes libudev listen on the kernel's group instead; tests use it
    to run this code path on hosts without udevd.
    """

    def __init__(
        self,
        subsystems: frozenset[str],
        *,
        netlink_source: str = "udev",
        receive_buffer: int = RECEIVE_BUFFER_BYTES,
    ) -> None:
        self._subsystems = subsystems
        self._netlink_source = netlink_source
        self._receive_buffer = receive_buffer

    def describe(self) -> str:
        return f"udev (libudev monitor, {self._netlink_source} group; subsystems: {subsystem_text(self._subsystems)})"

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        monitor = self._open_monitor()
        name = f"udev:{self._netlink_source}"
        # A second handle on libudev's socket, to read its pending error (see _receive_udev).
        with socket.socket(fileno=os.dup(monitor.fileno())) as alias:
            raise_receive_buffer(alias, self._receive_buffer)
            task_status.started()
            await pump(monitor.fileno(), lambda: _receive_udev(monitor, alias, name), name, self._subsystems, send)

    def _open_monitor(self) -> Any:
        import pyudev  # only this source needs libudev (and pyudev)

        monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self._netlink_source)
        for subsystem in sorted(self._subsystems):
            monitor.filter_by(subsystem)
        monitor.start()
        return monitor


def _receive_udev(monitor: Any, alias: socket.socket, name: str) -> UEvent | None:
    """The next event from the libudev monitor, or ``None`` when drained.

    After an overrun, pyudev's ``poll`` sees ``POLLERR`` and raises a bare ``OSError`` (no errno)
    before libudev can read the error; ``SO_ERROR`` tells (and clears) what it was.
    """
    while True:
        try:
            device = monitor.poll(timeout=0)
        except OSError as exc:
            if exc.errno == errno.ENOBUFS or _pending_error(alias) == errno.ENOBUFS:
                raise Overflow from exc
            raise
        if device is None:
            return None
        try:
            return udev_device_to_uevent(device)
        except UEventError as exc:
            log_skipped(name, str(exc))
        except UnicodeDecodeError as exc:  # pyudev decodes every name and value strictly
            log_skipped(name, f"not UTF-8 ({exc.reason} at byte {exc.start}): {getattr(device, 'sys_path', '?')}")


def _pending_error(sock: socket.socket) -> int:
    error: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    return error


def udev_device_to_uevent(device: _UdevDevice) -> UEvent:
    """A pyudev ``Device`` from a monitor as a ``UEvent``; ``devname`` made relative to /dev.

    ``properties`` are udev's, unchanged (its ``DEVNAME`` stays absolute).
    """
    action, subsystem = device.action, device.subsystem
    if action not in KERNEL_ACTIONS:
        raise UEventError(f"unknown action {action!r}", _udev_summary(device))
    if not subsystem:
        raise UEventError("no SUBSYSTEM property", _udev_summary(device))
    properties = dict(device.properties)
    devname = properties.get("DEVNAME")
    if devname is not None:
        devname = devname.removeprefix("/dev/")
    return UEvent(action, device.device_path, subsystem, devname, MappingProxyType(properties))


def _udev_summary(device: _UdevDevice) -> bytes:
    """What an error message shows of a libudev device (it has no raw bytes to show)."""
    return f"{device.action}@{device.device_path} SUBSYSTEM={device.subsystem}".encode(errors="replace")

"""A uevent listener for scripts that run inside the guest: kernel and/or udev netlink messages.

    with UeventListener(KERNEL | UDEV) as listener:
        inject_aer("rp0")
        events = listener.wait_for(lambda seen: len(recovery(seen, "SUCCESSFUL_RECOVERY")) == 3, 10)

One ``NETLINK_KOBJECT_UEVENT`` socket bound to group 1 (the kernel's messages), 2 (udevd's, after
its rules ran; libudev framing) or both, read by a thread into ``events`` with each message's
arrival time (``time.monotonic()``, comparable with ``tests.guest.monitor.Reply``). The receive
buffer is set with ``SO_RCVBUFFORCE`` (root): a plain ``SO_RCVBUF`` still overflowed during
``udevadm trigger`` (shared/docs/real-kernel-devices.md). An overflow is recorded in
``overflows``, never hidden.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from tests.waiting import wait_until

NETLINK_KOBJECT_UEVENT = 15
KERNEL = 1  # multicast group bits
UDEV = 2
SO_RCVBUFFORCE = 33
BUFFER_BYTES = 32 * 1024 * 1024
LIBUDEV_MAGIC = b"libudev\0"


@dataclass(frozen=True)
class Uevent:
    source: str  # "kernel" or "udev"
    received: float  # time.monotonic() when the listener read it
    properties: dict[str, str] = field(repr=False)

    @property
    def action(self) -> str:
        return self.properties.get("ACTION", "")

    @property
    def devpath(self) -> str:
        return self.properties.get("DEVPATH", "")

    @property
    def subsystem(self) -> str:
        return self.properties.get("SUBSYSTEM", "")

    @property
    def seqnum(self) -> int:
        return int(self.properties.get("SEQNUM", "0"))

    @property
    def name(self) -> str:
        """The last devpath component (a PCI function's address, ``vfio0``, ``3``...)."""
        return self.devpath.rsplit("/", 1)[-1]

    def summary(self) -> str:
        extra = " ".join(f"{key}={self.properties[key]}" for key in ("ERROR_EVENT", "DEVICE_ONLINE", "DRIVER")
                         if key in self.properties)
        return f"{self.source} {self.seqnum} {self.action}@{self.devpath} {extra}".rstrip()


def parse(data: bytes, received: float) -> Uevent | None:
    """A kernel (``action@devpath\\0KEY=VALUE\\0...``) or libudev-framed message; None if neither."""
    if data.startswith(LIBUDEV_MAGIC):
        offset, length = struct.unpack_from("=II", data, 16)
        payload, source = data[offset:offset + length], "udev"
    elif b"@" in data.split(b"\0", 1)[0]:
        payload, source = data.split(b"\0", 1)[1] if b"\0" in data else b"", "kernel"
    else:
        return None  # e.g. libudev's own filter messages
    properties = {}
    for item in payload.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            properties[key.decode(errors="replace")] = value.decode(errors="replace")
    return Uevent(source, received, properties)


class UeventListener:
    """Collects uevents on a thread while open (a context manager); see the module docstring."""

    def __init__(self, groups: int = KERNEL, *, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.groups = groups
        self.events: list[Uevent] = []
        self.overflows = 0
        self._lock = threading.Condition()
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT)
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, buffer_bytes)
        self._sock.bind((0, groups))
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._read, name="uevent-listener", daemon=True)
        self._thread.start()

    def __enter__(self) -> UeventListener:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        os.write(self._wake_write, b"x")
        self._thread.join(5)
        self._sock.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self._sock, self._wake_read], [], [])
            if self._wake_read in ready:
                return
            try:
                data = self._sock.recv(64 * 1024)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.overflows += 1
                    continue
                raise
            event = parse(data, time.monotonic())
            if event is not None:
                with self._lock:
                    self.events.append(event)
                    self._lock.notify_all()

    def snapshot(self) -> list[Uevent]:
        with self._lock:
            return list(self.events)

    def wait_for(self, condition: Callable[[list[Uevent]], bool], timeout: float) -> list[Uevent]:
        """Wait until ``condition(events so far)``; returns them. AssertionError lists what came."""
        with self._lock:
            wait_until(lambda: condition(self.events), timeout,
                       lambda: "uevents did not match; the last ones:\n" + "\n".join(
                           event.summary() for event in self.events[-40:]), condition=self._lock)
            return list(self.events)


def recovery(events: list[Uevent], error_event: str, *, source: str | None = None) -> list[Uevent]:
    """The AER recovery ``change`` uevents with ``ERROR_EVENT=error_event`` (BEGIN_RECOVERY,
    SUCCESSFUL_RECOVERY, FAILED_RECOVERY), optionally of one source only."""
    return [event for event in events
            if event.properties.get("ERROR_EVENT") == error_event and (source is None or event.source == source)]


def udev_delivery(events: list[Uevent]) -> dict[str, float | int]:
    """How udev passed on the kernel's events, from one listener on both groups: ``late`` (udev
    copies delivered after a copy with a higher SEQNUM: reordered across devices), ``matched``
    (kernel events udev passed on), and the kernel -> udev lag median and maximum in ms."""
    kernel = {event.seqnum: event.received for event in events if event.source == "kernel"}
    udev = [event for event in events if event.source == "udev" and event.seqnum in kernel]
    lags = sorted((event.received - kernel[event.seqnum]) * 1000 for event in udev)
    highest, late = 0, 0
    for event in udev:
        late += event.seqnum < highest
        highest = max(highest, event.seqnum)
    return {"matched": len(udev), "late": late, "lag_median_ms": round(lags[len(lags) // 2], 1) if lags else 0.0,
            "lag_max_ms": round(lags[-1], 1) if lags else 0.0}

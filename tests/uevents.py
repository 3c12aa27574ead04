"""Uevents for the source tests: the kernel's wire format, messages captured from a real kernel,
a source run in the test's trio run, and zram devices made and removed as root."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import trio

from daemon.core import Event, UEvent
from daemon.sources.uevents import UEventSource

ZRAM_CONTROL = Path("/sys/class/zram-control")
BLOCK = frozenset({"block"})

# Captured from this machine's kernel (zram hot_add, a change, hot_remove).
ZRAM_ADD = (
    b"add@/devices/virtual/block/zram1\0ACTION=add\0DEVPATH=/devices/virtual/block/zram1\0SUBSYSTEM=block\0"
    b"MAJOR=253\0MINOR=1\0DEVNAME=zram1\0DEVTYPE=disk\0DISKSEQ=11\0SEQNUM=861\0"
)
ZRAM_CHANGE = (
    b"change@/devices/virtual/block/zram1\0ACTION=change\0DEVPATH=/devices/virtual/block/zram1\0"
    b"SUBSYSTEM=block\0SYNTH_UUID=0\0MAJOR=253\0MINOR=1\0DEVNAME=zram1\0DEVTYPE=disk\0DISKSEQ=11\0SEQNUM=862\0"
)
BDI_ADD = b"add@/devices/virtual/bdi/253:1\0ACTION=add\0DEVPATH=/devices/virtual/bdi/253:1\0SUBSYSTEM=bdi\0SEQNUM=860\0"


def kernel_message(action: str, devpath: str, **properties: str) -> bytes:
    """A message in the kernel's format, ``ACTION`` and ``DEVPATH`` included like the kernel does."""
    fields = {"ACTION": action, "DEVPATH": devpath, **properties}
    return f"{action}@{devpath}\0".encode() + b"".join(f"{k}={v}\0".encode() for k, v in fields.items())


@asynccontextmanager
async def running(source: UEventSource) -> AsyncIterator[trio.MemoryReceiveChannel[Event]]:
    """Run ``source`` until the block ends; yields the channel it sends to."""
    send, receive = trio.open_memory_channel[Event](1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run, send)
        yield receive
        nursery.cancel_scope.cancel()


async def next_matching(
    receive: trio.MemoryReceiveChannel[Event], wanted: Callable[[Event], bool], timeout: float = 5.0
) -> Event:
    with trio.fail_after(timeout):
        while True:
            event = await receive.receive()
            if wanted(event):
                return event


def about(devpath: str, action: str | None = None) -> Callable[[Event], bool]:
    return lambda e: isinstance(e, UEvent) and e.devpath == devpath and (action is None or e.action == action)


class MadeDevices:
    """Devices a test made (by index); those it did not remove are removed at the end."""

    def __init__(self) -> None:
        self.created: list[int] = []

    def remove(self, index: int) -> None:
        self._remove(index)
        self.created.remove(index)

    def _remove(self, index: int) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        for index in list(self.created):
            with suppress(OSError):
                self.remove(index)


class ZramDevices(MadeDevices):
    """zram devices this test created (by the index ``hot_add`` returned); removed at the end."""

    def add(self) -> int:
        index = int((ZRAM_CONTROL / "hot_add").read_text())
        self.created.append(index)
        return index

    def _remove(self, index: int) -> None:
        (ZRAM_CONTROL / "hot_remove").write_text(str(index))

    @staticmethod
    def uevent(index: int, text: str = "change") -> None:
        Path(f"/sys/block/zram{index}/uevent").write_text(text)

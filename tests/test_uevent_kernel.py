"""The kernel uevent source on the kernel's netlink group, with real uevents: the tests create
and remove their own zram and loop devices (as root) and never touch the machine's devices."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from daemon.core import Event, Resync, UEvent
from daemon.sources._netlink import raise_receive_buffer
from daemon.sources.uevents import KernelUEventSource
from tests.uevents import BLOCK, MadeDevices, ZramDevices, about, next_matching, running

LOOP_CONTROL = Path("/dev/loop-control")
LOOP_CTL_ADD = 0x4C80
LOOP_CTL_REMOVE = 0x4C81


class LoopDevices(MadeDevices):
    """Empty loop devices this test created with LOOP_CTL_ADD (no file attached); removed at the end."""

    def add(self) -> int:
        index = 1 + max((int(p.name[4:]) for p in Path("/sys/block").glob("loop[0-9]*")), default=-1)
        while True:
            try:
                created: int = self._control(LOOP_CTL_ADD, index)
            except FileExistsError:
                index += 1
                continue
            self.created.append(created)
            return created

    def _remove(self, index: int) -> None:
        self._control(LOOP_CTL_REMOVE, index)

    @staticmethod
    def _control(request: int, index: int) -> int:
        fd = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
        try:
            return fcntl.ioctl(fd, request, index)
        finally:
            os.close(fd)


@pytest.fixture
def loop_devices() -> Iterator[LoopDevices]:
    devices = LoopDevices()
    yield devices
    devices.cleanup()


async def test_kernel_source_sees_real_zram_add_change_remove(zram: ZramDevices) -> None:
    async with running(KernelUEventSource(BLOCK)) as receive:
        index = zram.add()
        devpath = f"/devices/virtual/block/zram{index}"
        added = await next_matching(receive, about(devpath, "add"))
        zram.uevent(index)
        changed = await next_matching(receive, about(devpath, "change"))
        zram.remove(index)
        removed = await next_matching(receive, about(devpath, "remove"))
    for event in (added, changed, removed):
        assert isinstance(event, UEvent)
        assert event.subsystem == "block"
        assert event.devname == f"zram{index}"
        assert event.properties["DEVTYPE"] == "disk"
        assert event.properties["MINOR"] == str(index)
        assert event.properties["SEQNUM"].isdigit()
    assert isinstance(changed, UEvent) and changed.properties["SYNTH_UUID"] == "0"


async def test_kernel_source_filters_subsystems(zram: ZramDevices) -> None:
    async with running(KernelUEventSource(BLOCK)) as block_only, running(KernelUEventSource(frozenset())) as all_:
        index = zram.add()
        zram.remove(index)
        removed = about(f"/devices/virtual/block/zram{index}", "remove")
        seen_all = await collect_until(all_, removed)
        seen_block = await collect_until(block_only, removed)
    # zram's backing-dev-info device comes and goes with it, in subsystem "bdi".
    assert {"bdi", "block"} <= {e.subsystem for e in seen_all if isinstance(e, UEvent)}
    assert {e.subsystem for e in seen_block if isinstance(e, UEvent)} == {"block"}


async def collect_until(receive: trio.MemoryReceiveChannel[Event], wanted: Callable[[Event], bool]) -> list[Event]:
    """Every event up to and including the first one ``wanted``."""
    events: list[Event] = []

    def record(event: Event) -> bool:
        events.append(event)
        return wanted(event)

    await next_matching(receive, record)
    return events


async def test_kernel_source_sees_the_bdi_companion_without_filter(zram: ZramDevices) -> None:
    async with running(KernelUEventSource(frozenset())) as receive:
        index = zram.add()
        event = await next_matching(receive, lambda e: isinstance(e, UEvent) and e.subsystem == "bdi")
        await next_matching(receive, about(f"/devices/virtual/block/zram{index}", "add"))
    assert isinstance(event, UEvent) and event.action == "add" and event.devname is None


async def test_kernel_source_carries_synthetic_arguments(zram: ZramDevices) -> None:
    async with running(KernelUEventSource(BLOCK)) as receive:
        index = zram.add()
        marker = str(uuid.uuid4())
        zram.uevent(index, f"change {marker} DEVPLUGDTEST=yes")
        event = await next_matching(receive, about(f"/devices/virtual/block/zram{index}", "change"))
    assert isinstance(event, UEvent)
    assert event.properties["SYNTH_UUID"] == marker
    assert event.properties["SYNTH_ARG_DEVPLUGDTEST"] == "yes"


async def test_kernel_source_overflow_sends_resync_and_recovers(
    zram: ZramDevices, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="devplugd.uevents")
    source = KernelUEventSource(BLOCK, receive_buffer=4096)  # room for a handful of messages
    async with running(source) as receive:
        index = zram.add()
        for _ in range(300):  # no checkpoint here: the source cannot read while we write
            zram.uevent(index)
        resync = await next_matching(receive, lambda e: isinstance(e, Resync))
        marker = str(uuid.uuid4())
        zram.uevent(index, f"change {marker}")
        await next_matching(receive, lambda e: isinstance(e, UEvent) and e.properties.get("SYNTH_UUID") == marker)
    assert resync == Resync(None, "uevent overflow")
    overflow = [r for r in caplog.records if getattr(r, "EVENT", None) == "uevent-overflow"]
    assert overflow and overflow[0].levelno == logging.WARNING and "kernel" in overflow[0].getMessage()


async def test_kernel_source_sees_a_real_loop_device(loop_devices: LoopDevices) -> None:
    async with running(KernelUEventSource(BLOCK)) as receive:
        index = loop_devices.add()
        devpath = f"/devices/virtual/block/loop{index}"
        added = await next_matching(receive, about(devpath, "add"))
        loop_devices.remove(index)
        removed = await next_matching(receive, about(devpath, "remove"))
    for event in (added, removed):
        assert isinstance(event, UEvent) and event.devname == f"loop{index}" and event.subsystem == "block"


def test_receive_buffer_goes_past_rmem_max_as_root() -> None:
    rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15) as sock:
        assert raise_receive_buffer(sock, 2 * rmem_max) >= 2 * rmem_max  # the kernel doubles what it grants

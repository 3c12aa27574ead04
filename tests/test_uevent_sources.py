"""Uevent sources: the kernel-format parser, the unix seam, and real kernel uevents.

The real-kernel tests create and remove their own zram and loop devices (as root) and never
touch the machine's devices. udevd does not run on these machines: the libudev code path is
exercised on the kernel's group instead, and the udevd test runs only where udevd does.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import timeit
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.lowlevel

from daemon.core import Event, Resync, UEvent
from daemon.sources.uevent_wire import KERNEL_ACTIONS, UdevFormatError, UEventError, parse_kernel_uevent
from daemon.sources.uevents import (
    KernelUEventSource,
    NullUEventSource,
    UdevUEventSource,
    UEventSource,
    UnixUEventSource,
    make_uevent_source,
    raise_receive_buffer,
    udev_device_to_uevent,
)

ZRAM_CONTROL = Path("/sys/class/zram-control")
LOOP_CONTROL = Path("/dev/loop-control")
LOOP_CTL_ADD = 0x4C80
LOOP_CTL_REMOVE = 0x4C81
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


# --- the parser ---------------------------------------------------------------------------------


def test_parses_a_real_block_add_with_devname() -> None:
    event = parse_kernel_uevent(ZRAM_ADD)
    assert event == UEvent(
        action="add",
        devpath="/devices/virtual/block/zram1",
        subsystem="block",
        devname="zram1",
        properties=event.properties,
    )
    assert dict(event.properties) == {
        "ACTION": "add",
        "DEVPATH": "/devices/virtual/block/zram1",
        "SUBSYSTEM": "block",
        "MAJOR": "253",
        "MINOR": "1",
        "DEVNAME": "zram1",
        "DEVTYPE": "disk",
        "DISKSEQ": "11",
        "SEQNUM": "861",
    }


def test_parses_a_message_without_devname() -> None:
    event = parse_kernel_uevent(BDI_ADD)
    assert (event.action, event.devpath, event.subsystem, event.devname) == (
        "add", "/devices/virtual/bdi/253:1", "bdi", None,
    )


def test_properties_are_read_only() -> None:
    event = parse_kernel_uevent(ZRAM_CHANGE)
    assert event.properties["SYNTH_UUID"] == "0"
    with pytest.raises(TypeError):
        event.properties["DEVNAME"] = "sda"  # type: ignore[index]


@pytest.mark.parametrize("action", sorted(KERNEL_ACTIONS))
def test_every_kernel_action_parses(action: str) -> None:
    assert parse_kernel_uevent(kernel_message(action, "/devices/x", SUBSYSTEM="misc")).action == action


def test_value_may_contain_equals_and_last_nul_is_optional() -> None:
    event = parse_kernel_uevent(b"change@/devices/x\0SUBSYSTEM=misc\0SYNTH_ARG_A=b=c")
    assert event.properties["SYNTH_ARG_A"] == "b=c"
    # A sender that left ACTION/DEVPATH out of the properties gets them from the header.
    assert event.properties["ACTION"] == "change"
    assert event.properties["DEVPATH"] == "/devices/x"


def test_devname_may_have_subdirectories() -> None:
    event = parse_kernel_uevent(kernel_message("add", "/devices/x/card0", SUBSYSTEM="drm", DEVNAME="dri/card0"))
    assert event.devname == "dri/card0"


MALFORMED = [
    (b"", "no '@'"),
    (b"add/devices/x\0SUBSYSTEM=block\0", "no '@'"),
    (b"add@\0SUBSYSTEM=block\0", "empty devpath"),
    (b"add@devices/x\0SUBSYSTEM=block\0", "not an absolute path"),
    (b"add@/devices/../../etc\0SUBSYSTEM=block\0", "not an absolute path"),
    (b"add@/devices/x\0SUBSYSTEM=bl\xffock\0", "not UTF-8"),
    (b"add@/devices/x\0SUBSYSTEM=block\0NOEQUALS\0", "property without '='"),
    (b"add@/devices/x\0SUBSYSTEM=block\0\0MAJOR=1\0", "property without '='"),
    (b"add@/devices/x\0ACTION=add\0MAJOR=1\0", "no SUBSYSTEM"),
    (b"add@/devices/x", "no SUBSYSTEM"),
    (b"add@/devices/x\0SUBSYSTEM=\0", "no SUBSYSTEM"),
    (b"explode@/devices/x\0SUBSYSTEM=block\0", "unknown action 'explode'"),
    (b"ADD@/devices/x\0SUBSYSTEM=block\0", "unknown action 'ADD'"),
    (b"@/devices/x\0SUBSYSTEM=block\0", "unknown action ''"),
    (b"add@/devices/x\0ACTION=remove\0SUBSYSTEM=block\0", "ACTION property differs"),
    (b"add@/devices/x\0DEVPATH=/devices/y\0SUBSYSTEM=block\0", "DEVPATH property differs"),
    (b"add@/devices/x\0SUBSYSTEM=block\0SUBSYSTEM=net\0", "duplicate property"),
    (b"add@/devices/x\0SUBSYSTEM=block\0=value\0", "empty key"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=/dev/sda\0", "DEVNAME is not a path inside /dev"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=../etc/passwd\0", "DEVNAME is not a path inside /dev"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=\0", "DEVNAME is not a path inside /dev"),
]


@pytest.mark.parametrize(("data", "reason"), MALFORMED, ids=[reason for _, reason in MALFORMED])
def test_malformed_messages_raise_uevent_error(data: bytes, reason: str) -> None:
    with pytest.raises(UEventError) as caught:
        parse_kernel_uevent(data)
    assert isinstance(caught.value, ValueError)
    assert reason in caught.value.reason
    assert str(caught.value) == f"{caught.value.reason}: {data!r}"  # short messages are shown whole


def test_udevd_format_is_refused_with_a_clear_error() -> None:
    data = b"libudev\0\xfe\xed\xca\xfe" + bytes(32) + b"ACTION=add\0"
    with pytest.raises(UdevFormatError, match="udevd-format message"):
        parse_kernel_uevent(data)


def test_error_preview_is_short_and_escaped() -> None:
    data = b"add@/devices/x\0SUBSYSTEM=block\0EVIL=\x1b[2J\nforged log line\0" + b"X" * 100_000 + b"\0"
    with pytest.raises(UEventError) as caught:
        parse_kernel_uevent(data)
    message = str(caught.value)
    assert len(message) < 200
    assert "\n" not in message and "\x1b" not in message and "\0" not in message
    assert message.endswith(f"... ({len(data)} bytes)")


def test_parse_cost_is_a_few_microseconds() -> None:
    runs = 20_000
    seconds = min(timeit.repeat(lambda: parse_kernel_uevent(ZRAM_ADD), number=runs, repeat=5))
    per_message_us = seconds / runs * 1e6
    print(f"parse_kernel_uevent: {per_message_us:.2f} us per 9-property message")
    assert per_message_us < 50  # a few µs; generous for noisy machines


# --- choosing a source --------------------------------------------------------------------------


def test_spec_names_the_source(tmp_path: Path) -> None:
    assert isinstance(make_uevent_source("kernel", BLOCK), KernelUEventSource)
    assert isinstance(make_uevent_source("udev", BLOCK), UdevUEventSource)
    assert isinstance(make_uevent_source("none", BLOCK), NullUEventSource)
    unix = make_uevent_source(f"unix:{tmp_path}/ue.sock", BLOCK)
    assert isinstance(unix, UnixUEventSource) and unix.path == tmp_path / "ue.sock"
    for source in (make_uevent_source(spec, BLOCK) for spec in ("kernel", "udev", "none")):
        assert source.describe()
    assert "block" in make_uevent_source("kernel", BLOCK).describe()
    assert "all" in make_uevent_source("kernel", frozenset()).describe()


def test_auto_follows_udevd(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert isinstance(make_uevent_source("auto", BLOCK, udev_control=control), KernelUEventSource)
    control.touch()
    assert isinstance(make_uevent_source("auto", BLOCK, udev_control=control), UdevUEventSource)


@pytest.mark.parametrize("spec", ["", "netlink", "Kernel", "unix:", "unix:/" + "x" * 120])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--uevent-source"):
        make_uevent_source(spec, BLOCK)


# --- running sources ----------------------------------------------------------------------------


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


def nothing_queued(receive: trio.MemoryReceiveChannel[Event]) -> bool:
    return receive.statistics().current_buffer_used == 0


class StepCounter(trio.abc.Instrument):
    """Counts how often a uevent source's task runs."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("UEventSource.run"):
            self.steps += 1


async def test_none_source_sends_nothing() -> None:
    async with running(NullUEventSource()) as receive:
        await trio.sleep(0.05)
        assert nothing_queued(receive)


# --- the unix seam ------------------------------------------------------------------------------


def send_datagram(path: Path, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(data, os.fspath(path))


async def test_unix_seam_delivers_parsed_uevents(short_tmp: Path) -> None:
    path = short_tmp / "ue.sock"
    async with running(UnixUEventSource(path, BLOCK)) as receive:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        send_datagram(path, BDI_ADD)  # another subsystem: filtered out
        send_datagram(path, ZRAM_ADD)
        send_datagram(path, ZRAM_CHANGE)
        first = await next_matching(receive, lambda e: True)
        second = await next_matching(receive, lambda e: True)
    assert first == parse_kernel_uevent(ZRAM_ADD)
    assert second == parse_kernel_uevent(ZRAM_CHANGE)
    assert not path.exists()


async def test_unix_seam_without_filter_passes_every_subsystem(short_tmp: Path) -> None:
    path = short_tmp / "ue.sock"
    async with running(UnixUEventSource(path, frozenset())) as receive:
        send_datagram(path, BDI_ADD)
        event = await next_matching(receive, lambda e: True)
    assert isinstance(event, UEvent) and event.subsystem == "bdi"


async def test_unix_seam_logs_and_skips_garbage(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = short_tmp / "ue.sock"
    caplog.set_level(logging.WARNING, logger="devplugd.uevents")
    async with running(UnixUEventSource(path, BLOCK)) as receive:
        send_datagram(path, b"\xff\xfegarbage\nwith a newline")
        send_datagram(path, b"libudev\0\xfe\xed\xca\xfe")
        send_datagram(path, b"add@/devices/x\0SUBSYSTEM=block\0" + b"A" * 20_000)  # longer than any uevent
        send_datagram(path, ZRAM_ADD)
        event = await next_matching(receive, lambda e: True)
    assert event == parse_kernel_uevent(ZRAM_ADD)
    warnings = [r for r in caplog.records if r.name == "devplugd.uevents"]
    assert [r.levelno for r in warnings] == [logging.WARNING] * 3
    assert all(getattr(r, "EVENT", None) == "uevent-malformed" for r in warnings)
    messages = [r.getMessage() for r in warnings]
    assert all(f"unix:{path}" in m and "\n" not in m for m in messages)
    assert "not UTF-8" in messages[0]
    assert "udevd-format" in messages[1]
    assert "longer than" in messages[2]


async def test_unix_seam_replaces_a_stale_socket(short_tmp: Path) -> None:
    path = short_tmp / "ue.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as previous:
        previous.bind(os.fspath(path))  # a socket file left behind by a crashed daemon
    with pytest.raises(ConnectionRefusedError):
        send_datagram(path, ZRAM_ADD)  # nobody listens on it
    async with running(UnixUEventSource(path, BLOCK)) as receive:
        send_datagram(path, ZRAM_ADD)
        assert await next_matching(receive, lambda e: True) == parse_kernel_uevent(ZRAM_ADD)
    assert not path.exists()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
async def test_unix_seam_refuses_to_remove_what_is_not_a_socket(short_tmp: Path, kind: str) -> None:
    path = short_tmp / "ue.sock"
    if kind == "file":
        path.write_text("precious")
    elif kind == "directory":
        path.mkdir()
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
            other.bind(os.fspath(short_tmp / "real.sock"))
        path.symlink_to(short_tmp / "real.sock")
    send, _receive = trio.open_memory_channel[Event](1)
    with pytest.raises(FileExistsError, match="not a socket; refusing to remove it"):
        await UnixUEventSource(path, BLOCK).run(send)
    assert os.path.lexists(path)
    if kind == "file":
        assert path.read_text() == "precious"


@pytest.mark.parametrize("kind", [socket.SOCK_DGRAM, socket.SOCK_STREAM])
async def test_unix_seam_refuses_to_steal_a_live_socket(short_tmp: Path, kind: int) -> None:
    path = short_tmp / "ue.sock"
    send, _receive = trio.open_memory_channel[Event](1)
    with socket.socket(socket.AF_UNIX, kind) as other:
        other.bind(os.fspath(path))
        with pytest.raises(OSError, match="another process is bound") as caught:
            await UnixUEventSource(path, BLOCK).run(send)
        assert caught.value.errno == errno.EADDRINUSE
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


async def test_unix_seam_leaves_a_replaced_file_alone(short_tmp: Path) -> None:
    path = short_tmp / "ue.sock"
    async with running(UnixUEventSource(path, BLOCK)):
        path.unlink()
        path.write_text("someone else's")
    assert path.read_text() == "someone else's"


async def test_unix_seam_reports_a_missing_directory(short_tmp: Path) -> None:
    send, _receive = trio.open_memory_channel[Event](1)
    with pytest.raises(FileNotFoundError, match="cannot bind the uevent socket"):
        await UnixUEventSource(short_tmp / "missing" / "ue.sock", BLOCK).run(send)


async def test_unix_seam_does_not_wake_while_idle(short_tmp: Path) -> None:
    path = short_tmp / "ue.sock"
    counter = StepCounter()
    trio.lowlevel.add_instrument(counter)
    try:
        async with running(UnixUEventSource(path, BLOCK)) as receive:
            await trio.sleep(0.05)
            idle_from = counter.steps
            await trio.sleep(0.5)
            assert counter.steps == idle_from  # not one step in half a second
            send_datagram(path, ZRAM_ADD)
            await next_matching(receive, lambda e: True)
            assert counter.steps > idle_from
    finally:
        trio.lowlevel.remove_instrument(counter)


# --- real kernel uevents ------------------------------------------------------------------------


class ZramDevices:
    """zram devices this test created (by the index ``hot_add`` returned); removed at the end."""

    def __init__(self) -> None:
        self.created: list[int] = []

    def add(self) -> int:
        index = int((ZRAM_CONTROL / "hot_add").read_text())
        self.created.append(index)
        return index

    def remove(self, index: int) -> None:
        (ZRAM_CONTROL / "hot_remove").write_text(str(index))
        self.created.remove(index)

    @staticmethod
    def uevent(index: int, text: str = "change") -> None:
        Path(f"/sys/block/zram{index}/uevent").write_text(text)

    def cleanup(self) -> None:
        for index in list(self.created):
            with suppress(OSError):
                self.remove(index)


@pytest.fixture
def zram() -> Iterator[ZramDevices]:
    devices = ZramDevices()
    yield devices
    devices.cleanup()


class LoopDevices:
    """Empty loop devices this test created with LOOP_CTL_ADD (no file attached); removed at the end."""

    def __init__(self) -> None:
        self.created: list[int] = []

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

    def remove(self, index: int) -> None:
        self._control(LOOP_CTL_REMOVE, index)
        self.created.remove(index)

    @staticmethod
    def _control(request: int, index: int) -> int:
        fd = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
        try:
            return fcntl.ioctl(fd, request, index)
        finally:
            os.close(fd)

    def cleanup(self) -> None:
        for index in list(self.created):
            with suppress(OSError):
                self.remove(index)


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


def drain(receive: trio.MemoryReceiveChannel[Event]) -> list[Event]:
    events: list[Event] = []
    while True:
        try:
            events.append(receive.receive_nowait())
        except trio.WouldBlock:
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


# --- libudev (pyudev) -------------------------------------------------------------------------


def test_udev_device_becomes_a_uevent() -> None:
    device = SimpleNamespace(
        action="add",
        device_path="/devices/virtual/block/zram3",
        subsystem="block",
        properties={"ACTION": "add", "DEVNAME": "/dev/zram3", "ID_FS_TYPE": "swap", "SUBSYSTEM": "block"},
    )
    event = udev_device_to_uevent(device)
    assert (event.action, event.devpath, event.subsystem, event.devname) == (
        "add", "/devices/virtual/block/zram3", "block", "zram3",
    )
    assert event.properties["ID_FS_TYPE"] == "swap"
    with pytest.raises(TypeError):
        event.properties["X"] = "y"  # type: ignore[index]


@pytest.mark.parametrize(
    ("action", "subsystem", "reason"), [(None, "block", "unknown action"), ("add", None, "no SUBSYSTEM")]
)
def test_udev_device_without_action_or_subsystem_is_refused(action: Any, subsystem: Any, reason: str) -> None:
    device = SimpleNamespace(action=action, device_path="/devices/x", subsystem=subsystem, properties={})
    with pytest.raises(UEventError, match=reason):
        udev_device_to_uevent(device)


async def test_libudev_path_on_the_kernel_group(zram: ZramDevices) -> None:
    async with running(UdevUEventSource(BLOCK, netlink_source="kernel")) as receive:
        index = zram.add()
        devpath = f"/devices/virtual/block/zram{index}"
        added = await next_matching(receive, about(devpath, "add"))
        zram.uevent(index)
        await next_matching(receive, about(devpath, "change"))
        zram.remove(index)
        await next_matching(receive, about(devpath, "remove"))
        leftovers = drain(receive)
    assert isinstance(added, UEvent) and added.devname == f"zram{index}"
    assert added.properties["DEVNAME"] == f"/dev/zram{index}"  # libudev makes it absolute
    assert all(isinstance(e, UEvent) and e.subsystem == "block" for e in leftovers)


async def test_libudev_path_overflow_sends_resync(zram: ZramDevices) -> None:
    async with running(UdevUEventSource(BLOCK, netlink_source="kernel", receive_buffer=4096)) as receive:
        index = zram.add()
        for _ in range(300):
            zram.uevent(index)
        resync = await next_matching(receive, lambda e: isinstance(e, Resync))
    assert resync == Resync(None, "uevent overflow")


"""Running uevent sources that need no kernel: ``none``, and the unix seam (the kernel's wire
format on a unix datagram socket) with its socket file handled safely."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing

from daemon.core import Event, UEvent
from daemon.sources.uevent_wire import parse_kernel_uevent
from daemon.sources.uevents import NullUEventSource, UnixUEventSource
from tests.uevents import BDI_ADD, BLOCK, ZRAM_ADD, ZRAM_CHANGE, next_matching, running


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
        await trio.testing.wait_all_tasks_blocked()  # the source did all it does unprompted
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


async def test_unix_seam_does_not_wake_while_idle(short_tmp: Path, autojump_clock: trio.abc.Clock) -> None:
    path = short_tmp / "ue.sock"
    counter = StepCounter()
    trio.lowlevel.add_instrument(counter)
    try:
        async with running(UnixUEventSource(path, BLOCK)) as receive:
            await trio.testing.wait_all_tasks_blocked()  # the source is waiting for its socket
            idle_from = counter.steps
            # half a second of trio's clock, which jumps once every task waits: any timer the
            # source had set (a poll, a timeout) would have fired within it, in no time at all
            await trio.sleep(0.5)
            assert counter.steps == idle_from  # not one step in half a second
            send_datagram(path, ZRAM_ADD)
            await next_matching(receive, lambda e: True)
            assert counter.steps > idle_from
    finally:
        trio.lowlevel.remove_instrument(counter)

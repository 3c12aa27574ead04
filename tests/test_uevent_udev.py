"""The libudev (pyudev) uevent source. udevd does not run on these machines, so the libudev code
path runs on the kernel's netlink group, with zram devices the tests create and remove."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from daemon.core import Event, Resync, UEvent
from daemon.sources.udev_monitor import UdevUEventSource, _receive_udev, udev_device_to_uevent
from daemon.sources.uevent_wire import UEventError
from tests.uevents import BLOCK, ZramDevices, about, next_matching, running


def drain(receive: trio.MemoryReceiveChannel[Event]) -> list[Event]:
    events: list[Event] = []
    while True:
        try:
            events.append(receive.receive_nowait())
        except trio.WouldBlock:
            return events


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


class _UndecodableProperties:
    """What pyudev's Properties do with a value that is not UTF-8: raise on reading it."""

    def keys(self) -> list[str]:
        return ["NAME"]

    def __getitem__(self, key: str) -> str:
        raise UnicodeDecodeError("utf-8", b"caf\xe9", 3, 4, "invalid continuation byte")


def test_an_undecodable_udev_event_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    odd = SimpleNamespace(action="add", device_path="/devices/virtual/input/input9", subsystem="input",
                          sys_path="/sys/devices/virtual/input/input9", properties=_UndecodableProperties())
    good = SimpleNamespace(action="add", device_path="/devices/virtual/block/zram3", subsystem="block",
                           properties={"SUBSYSTEM": "block"})
    queue = [odd, good]
    monitor = SimpleNamespace(poll=lambda timeout: queue.pop(0) if queue else None)
    event = _receive_udev(monitor, None, "udev")  # type: ignore[arg-type]
    assert isinstance(event, UEvent) and event.devpath == "/devices/virtual/block/zram3"
    assert any("not UTF-8" in message and "input9" in message for message in caplog.messages), caplog.messages


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

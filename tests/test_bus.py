"""The daemon's own parts reach the bus through the Inbox: no task per event, what says the
same thing coalesced, and a flood bounded, whatever thread it comes from."""

from __future__ import annotations

import trio
import trio.testing

from daemon.bus import MAX_FILED, Inbox
from daemon.core import DeviceChanged, Event, Resync
from daemon.core._events import ClaimsChanged, LeasesChanged


async def test_a_flood_of_events_is_filed_by_key_without_a_task_per_event(autojump_clock: trio.abc.Clock):
    send, receive = trio.open_memory_channel[Event](4)  # a small bus, full at once
    inbox = Inbox(send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.run)
        await trio.testing.wait_all_tasks_blocked()
        tasks = trio.lowlevel.current_statistics().tasks_living
        for n in range(20000):
            inbox.post(LeasesChanged(f"lease {n}"))
            inbox.post(ClaimsChanged(f"claim {n}"))
            inbox.post(DeviceChanged("pci", "/devices/pci0000:00/0000:00:02.0/0000:3b:02.0", "pci", f"change {n}"))
        assert trio.lowlevel.current_statistics().tasks_living == tasks  # no task was started for them
        received: list[Event] = []
        # the loop reads the bus: everything that waits comes; the (virtual) half second ends
        # only once every task waits, the inbox's included: then it has handed over all it holds
        with trio.move_on_after(0.5):
            async for event in receive:
                received.append(event)
        nursery.cancel_scope.cancel()
    # 60000 posts, three things said: at most one event each waiting, the newest words
    assert sorted(type(event).__name__ for event in received) == ["ClaimsChanged", "DeviceChanged", "LeasesChanged"]


async def test_device_changes_past_the_bound_become_one_rescan_of_their_handler():
    send, receive = trio.open_memory_channel[Event](1)
    inbox = Inbox(send)
    for n in range(MAX_FILED * 3):  # the bus is not read: everything waits in the inbox
        inbox.post(DeviceChanged("usb", f"/devices/usb1/1-{n}", "usb", "nodes changed"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.run)
        received: list[Event] = []
        with trio.move_on_after(2):
            async for event in receive:
                received.append(event)
                if isinstance(event, Resync):
                    break
        nursery.cancel_scope.cancel()
    assert len(received) <= MAX_FILED + 1
    assert isinstance(received[-1], Resync) and received[-1].handler == "usb"


async def test_a_worker_thread_posts_through_the_trio_thread():
    send, receive = trio.open_memory_channel[Event](16)
    inbox = Inbox(send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.run)
        await trio.to_thread.run_sync(inbox.post, DeviceChanged("pci", "/devices/x", "pci", "IOMMU group changed"))
        with trio.fail_after(5):
            event = await receive.receive()
        nursery.cancel_scope.cancel()
    assert event == DeviceChanged("pci", "/devices/x", "pci", "IOMMU group changed")

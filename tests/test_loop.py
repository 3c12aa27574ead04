"""The event loop with real parts: events over the bus, handlers, tree, notifier, endpoints."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import trio
import trio.testing
import trio_asyncio

from daemon.core import (
    ConfigChanged,
    ConfiguredPool,
    DaemonConfig,
    DeviceInfo,
    Event,
    Notifier,
    PoolEntry,
    Resync,
    parse_config,
)
from daemon.deviceplugin import Endpoints
from daemon.loop import EventLoop
from daemon.settings import Settings


class CountingHandler:
    """A handler whose facts are a number of devices; it can be told to fail."""

    name: ClassVar[str] = "counting"
    device_types: ClassVar[frozenset[str]] = frozenset({"counted"})
    subsystems: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.devices = 2
        self.scans = 0
        self.fail_build = False
        self.fail_scan = False

    def parse_pool(self, entry: PoolEntry) -> None:
        return None

    def scan(self) -> int:
        self.scans += 1
        if self.fail_scan:
            raise OSError("sysfs went away")
        return self.devices

    def fold(self, facts: int, event: Event) -> int:
        return self.scan() if isinstance(event, Resync) else facts

    def build(self, facts: int, pools: Sequence[ConfiguredPool]) -> dict[str, Any]:
        if self.fail_build:
            raise ValueError("bad fact")
        return {pool.resource: {f"d{n}": DeviceInfo() for n in range(facts)} for pool in pools}


def counted_config(handler: CountingHandler, *names: str) -> DaemonConfig:
    pools = [{"resourceName": name, "deviceType": "counted", "selectors": {}} for name in names]
    return parse_config(json.dumps({"resourceList": pools}), "test", "example.com",
                        {"counted": ("counting", handler.parse_pool)})


def make_loop(
    tmp: Path, nursery: trio.Nursery, next_config: list[str] | None = None
) -> tuple[EventLoop, Notifier, CountingHandler]:
    """An event loop serving pool ``things``; a reload reads ``next_config`` (JSON text)."""
    handler = CountingHandler()
    config = counted_config(handler, "things")

    def load_config() -> DaemonConfig:
        text = next_config[0] if next_config else "{}"
        return parse_config(text, "test", "example.com", {"counted": ("counting", handler.parse_pool)})

    settings = Settings(device_plugin_dir=tmp / "dp", registration="none")
    notifier = Notifier()
    notifier.subscribe(Endpoints(settings, notifier, {"counting": handler}, nursery))
    return EventLoop({"counting": handler}, config, notifier, load_config), notifier, handler


async def test_initial_scan_arrives_as_an_event_and_is_served(short_tmp):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        loop, notifier, _ = make_loop(short_tmp, nursery)
        send, receive = trio.open_memory_channel[Event](16)
        nursery.start_soon(loop.run, receive)
        assert notifier.tree.version == 0
        await send.send(Resync(None, "start"))
        await loop.first_tree_published.wait()
        assert set(notifier.tree.pools["example.com/things"].devices) == {"d0", "d1"}
        with trio.fail_after(5):
            while not list((short_tmp / "dp").glob("devplugd-example.com_things-*.sock")):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_a_burst_of_events_becomes_one_new_tree_and_one_scan(short_tmp):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        loop, notifier, handler = make_loop(short_tmp, nursery)
        send, receive = trio.open_memory_channel[Event](300)
        for _ in range(256):
            send.send_nowait(Resync("counting", "burst"))
        nursery.start_soon(loop.run, receive)
        await loop.first_tree_published.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert notifier.tree.version == 1
        assert handler.scans == 1  # 256 Resyncs of one handler in one batch: one scan
        nursery.cancel_scope.cancel()


async def wait_for_scans(handler: CountingHandler, count: int) -> None:
    """Until the handler was scanned ``count`` times and the kernel loop is idle again."""
    with trio.fail_after(5):
        while handler.scans < count:
            await trio.sleep(0.005)
        await trio.sleep(0.05)


async def test_a_failing_handler_keeps_its_last_devices(short_tmp):
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        loop, notifier, handler = make_loop(short_tmp, nursery)
        send, receive = trio.open_memory_channel[Event](16)
        nursery.start_soon(loop.run, receive)
        await send.send(Resync(None, "start"))
        await loop.first_tree_published.wait()
        handler.devices, handler.fail_build = 5, True
        await send.send(Resync("counting", "again"))
        await wait_for_scans(handler, 2)
        assert len(notifier.tree.pools["example.com/things"].devices) == 2
        handler.fail_build, handler.fail_scan = False, True
        await send.send(Resync("counting", "again"))
        await wait_for_scans(handler, 3)
        assert len(notifier.tree.pools["example.com/things"].devices) == 2
        handler.fail_scan = False
        await send.send(Resync("counting", "recovered"))
        await wait_for_scans(handler, 4)
        assert len(notifier.tree.pools["example.com/things"].devices) == 5
        nursery.cancel_scope.cancel()


async def test_reload_adds_and_withdraws_pools_and_a_bad_file_changes_nothing(short_tmp):
    next_config = ["{}"]
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        loop, notifier, _handler = make_loop(short_tmp, nursery, next_config)
        send, receive = trio.open_memory_channel[Event](16)
        nursery.start_soon(loop.run, receive)
        await send.send(Resync(None, "start"))
        await loop.first_tree_published.wait()
        first_tree = notifier.tree
        next_config[0] = "{broken"
        await send.send(ConfigChanged("test"))
        await trio.sleep(0.05)
        assert notifier.tree is first_tree and loop.reloads == 0
        next_config[0] = json.dumps({"resourceList": [{"resourceName": "others", "deviceType": "counted",
                                                       "selectors": {}}]})
        await send.send(ConfigChanged("test"))
        with trio.fail_after(5):
            while not list((short_tmp / "dp").glob("devplugd-example.com_others-*.sock")):
                await trio.sleep(0.01)
            while list((short_tmp / "dp").glob("devplugd-example.com_things-*.sock")):
                await trio.sleep(0.01)
        assert set(notifier.tree.pools) == {"example.com/others"}
        nursery.cancel_scope.cancel()

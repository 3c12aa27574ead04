"""The event loop with real parts: events over the bus, handlers, tree, notifier, endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_asyncio

import daemon.checkpoint
from daemon.checkpoint import CHECKPOINT_NAME, read_holdings
from daemon.core import HEALTHY, UNHEALTHY, Event, Resync, UEvent
from daemon.core._config import DaemonConfig, parse_config
from daemon.core._events import CheckpointChanged, ConfigChanged
from daemon.core._notifier import Notifier
from daemon.deviceplugin import Endpoints
from daemon.loop import EventLoop
from daemon.metrics import Metrics
from daemon.settings import Settings
from tests.counting import (
    CountingHandler,
    batches,
    holdings_for,
    reloads,
    wait_for_batches,
    wait_for_socket,
    write_checkpoint,
)


def counted_config(handler: CountingHandler, *names: str) -> DaemonConfig:
    pools = [{"resourceName": name, "deviceType": "counted", "selectors": {}} for name in names]
    return parse_config(json.dumps({"resourceList": pools}), "test", "example.com",
                        {"counted": ("counting", handler.parse_pool)})


@dataclass
class Running:
    loop: EventLoop
    notifier: Notifier
    handler: CountingHandler
    send: trio.MemorySendChannel[Event]
    metrics: Metrics

    async def handle(self, event: Event) -> None:
        """Send ``event`` alone and wait until the loop has handled it."""
        handled = batches(self.metrics)
        await self.send.send(event)
        await wait_for_batches(self.metrics, handled + 1)

    def devices(self, name: str = "things") -> set[str]:
        return set(self.notifier.tree.pools[f"example.com/{name}"].devices)


@asynccontextmanager
async def running_loop(tmp: Path, next_config: list[str] | None = None, *, capacity: int = 16,
                       before_start: Sequence[Event] = ()) -> AsyncIterator[Running]:
    """An event loop serving pool ``things`` to real endpoints; a reload reads ``next_config``
    (JSON text). ``before_start`` events wait on the bus before the loop runs (one batch)."""
    handler = CountingHandler()
    config = counted_config(handler, "things")

    def load_config() -> DaemonConfig:
        text = next_config[0] if next_config else "{}"
        return parse_config(text, "test", "example.com", {"counted": ("counting", handler.parse_pool)})

    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        settings = Settings(device_plugin_dir=tmp / "dp", registration="none")
        notifier = Notifier()
        notifier.subscribe(Endpoints(settings, notifier, {"counting": handler}, nursery))
        metrics = Metrics()
        loop = EventLoop({"counting": handler}, config, notifier, load_config, holdings_for(tmp / "dp"),
                         metrics=metrics, capacity=capacity)
        send, receive = trio.open_memory_channel[Event](capacity)
        for event in before_start:
            send.send_nowait(event)
        nursery.start_soon(loop.run, receive)
        yield Running(loop, notifier, handler, send, metrics)
        nursery.cancel_scope.cancel()


async def test_initial_scan_arrives_as_an_event_and_is_served(short_tmp):
    async with running_loop(short_tmp) as running:
        assert running.notifier.tree.version == 0
        await running.handle(Resync(None, "start"))
        assert running.devices() == {"d0", "d1"}
        await wait_for_socket(short_tmp / "dp", "example.com_things")


async def test_a_burst_of_events_becomes_one_new_tree_and_one_scan(short_tmp):
    burst = [Resync("counting", "burst")] * 256
    async with running_loop(short_tmp, capacity=300, before_start=burst) as running:
        await wait_for_batches(running.metrics, 1)
        assert running.notifier.tree.version == 1
        assert running.handler.scans == 1  # 256 Resyncs of one handler in one batch: one scan


async def test_a_failing_handler_keeps_its_last_devices(short_tmp):
    async with running_loop(short_tmp) as running:
        handler = running.handler
        await running.handle(Resync(None, "start"))
        handler.devices, handler.fail_build = 5, True
        await running.handle(Resync("counting", "again"))
        assert handler.scans == 2 and running.devices() == {"d0", "d1"}
        handler.fail_build, handler.fail_scan = False, True
        await running.handle(Resync("counting", "again"))
        assert handler.scans == 3 and running.devices() == {"d0", "d1"}
        handler.fail_scan = False
        await running.handle(Resync("counting", "recovered"))
        assert handler.scans == 4 and len(running.devices()) == 5


async def test_reload_adds_and_withdraws_pools_and_a_bad_file_changes_nothing(short_tmp):
    next_config = ["{}"]
    async with running_loop(short_tmp, next_config) as running:
        await running.handle(Resync(None, "start"))
        first_tree = running.notifier.tree
        next_config[0] = "{broken"
        await running.handle(ConfigChanged("test"))
        assert running.notifier.tree is first_tree and reloads(running.metrics) == 0
        next_config[0] = json.dumps({"resourceList": [{"resourceName": "others", "deviceType": "counted",
                                                       "selectors": {}}]})
        await running.handle(ConfigChanged("test"))
        await wait_for_socket(short_tmp / "dp", "example.com_others")
        await wait_for_socket(short_tmp / "dp", "example.com_things", present=False)
        assert set(running.notifier.tree.pools) == {"example.com/others"}


async def test_a_handler_failing_to_parse_a_reloaded_pool_refuses_the_reload_and_keeps_serving(short_tmp, caplog):
    others = json.dumps({"resourceList": [{"resourceName": "others", "deviceType": "counted", "selectors": {}}]})
    async with running_loop(short_tmp, [others]) as running:
        handler = running.handler
        await running.handle(Resync(None, "start"))
        first_tree, parsed_at_start = running.notifier.tree, handler.parsed
        handler.fail_parse = True
        await running.handle(ConfigChanged("test"))
        assert handler.parsed > parsed_at_start  # the running handler validated the reload
        assert running.notifier.tree is first_tree and reloads(running.metrics) == 0
        assert "handler counting failed to parse this pool: KeyError" in caplog.text
        handler.fail_parse = False
        await running.handle(ConfigChanged("test"))
        assert reloads(running.metrics) == 1
        assert [pool.resource for pool in running.loop.config.pools] == ["example.com/others"]


async def remove_d2(running: Running, tmp: Path, *, held_by_a_pod: str) -> None:
    """Three devices served, the checkpoint saying a pod holds ``held_by_a_pod``, then d2 gone."""
    running.handler.devices = 3
    await running.handle(Resync(None, "start"))
    write_checkpoint(tmp / "dp", held_by_a_pod)
    running.handler.devices = 2
    await running.handle(Resync("counting", "d2 removed"))


def health(running: Running, name: str = "things") -> dict[str, str]:
    return {d: info.health for d, info in running.notifier.tree.pools[f"example.com/{name}"].devices.items()}


async def test_a_device_that_vanishes_while_allocated_stays_unhealthy_until_the_checkpoint_lets_it_go(short_tmp):
    async with running_loop(short_tmp) as running:
        await remove_d2(running, short_tmp, held_by_a_pod="d2")
        assert health(running) == {"d0": HEALTHY, "d1": HEALTHY, "d2": UNHEALTHY}
        pool = running.notifier.tree.pools["example.com/things"]
        assert pool.vanished == {"d2"} and ("d2", UNHEALTHY, ()) in pool.listing
        write_checkpoint(short_tmp / "dp", "d1")  # the pod went; another holds d1
        await running.handle(CheckpointChanged("test"))
        assert health(running) == {"d0": HEALTHY, "d1": HEALTHY}
        assert not running.notifier.tree.pools["example.com/things"].vanished


async def test_a_device_that_vanishes_unallocated_leaves_at_once(short_tmp):
    async with running_loop(short_tmp) as running:
        await remove_d2(running, short_tmp, held_by_a_pod="d0")
        assert health(running) == {"d0": HEALTHY, "d1": HEALTHY}


async def test_a_vanished_device_that_comes_back_is_the_handlers_fresh_record(short_tmp):
    async with running_loop(short_tmp) as running:
        await remove_d2(running, short_tmp, held_by_a_pod="d2")
        running.handler.devices = 3
        await running.handle(Resync("counting", "d2 back"))
        assert health(running) == {"d0": HEALTHY, "d1": HEALTHY, "d2": HEALTHY}
        assert not running.notifier.tree.pools["example.com/things"].vanished


async def test_a_checkpoint_that_cannot_be_read_keeps_vanished_devices_listed(short_tmp, caplog):
    async with running_loop(short_tmp) as running:
        await remove_d2(running, short_tmp, held_by_a_pod="d2")
        (short_tmp / "dp" / CHECKPOINT_NAME).write_text("{torn")
        await running.handle(CheckpointChanged("test"))
        assert "cannot read the kubelet checkpoint" in caplog.text
        assert health(running)["d2"] == UNHEALTHY  # kept as it was
        running.handler.devices = 1
        await running.handle(Resync("counting", "d1 removed"))  # who held d1 is unknown: kept, Unhealthy
        assert health(running) == {"d0": HEALTHY, "d1": UNHEALTHY, "d2": UNHEALTHY}
        write_checkpoint(short_tmp / "dp")
        await running.handle(CheckpointChanged("test"))
        assert health(running) == {"d0": HEALTHY}


async def test_the_checkpoint_is_read_only_when_a_device_vanished_or_it_changed(short_tmp, monkeypatch):
    reads: list[Path] = []

    def counting_read(directory: Path):
        reads.append(directory)
        return read_holdings(directory)

    monkeypatch.setattr(daemon.checkpoint, "read_holdings", counting_read)
    async with running_loop(short_tmp) as running:
        running.handler.devices = 3
        await running.handle(Resync(None, "start"))
        await running.handle(Resync("counting", "nothing gone"))
        tree = running.notifier.tree
        await running.handle(CheckpointChanged("test"))  # nothing kept: no new tree, no read
        assert reads == [] and running.notifier.tree is tree
        write_checkpoint(short_tmp / "dp", "d1", "d2")
        running.handler.devices = 2
        await running.handle(Resync("counting", "d2 removed"))
        running.handler.devices = 1
        await running.handle(Resync("counting", "d1 removed"))
        assert len(reads) == 1  # the checkpoint did not change in between
        assert health(running) == {"d0": HEALTHY, "d1": UNHEALTHY, "d2": UNHEALTHY}
        write_checkpoint(short_tmp / "dp", "d1")
        await running.handle(CheckpointChanged("test"))
        assert len(reads) == 2 and health(running) == {"d0": HEALTHY, "d1": UNHEALTHY}


async def test_a_pool_removed_by_a_reload_takes_its_vanished_devices_with_it(short_tmp):
    others = json.dumps({"resourceList": [{"resourceName": "others", "deviceType": "counted", "selectors": {}}]})
    async with running_loop(short_tmp, [others]) as running:
        await remove_d2(running, short_tmp, held_by_a_pod="d2")
        await running.handle(ConfigChanged("test"))
        assert set(running.notifier.tree.pools) == {"example.com/others"}
        assert health(running, "others") == {"d0": HEALTHY, "d1": HEALTHY}


class OtherHandler(CountingHandler):
    name = "other"
    device_types = frozenset({"other"})


async def test_a_handler_without_pools_neither_scans_nor_folds_until_a_reload_gives_it_one(short_tmp):
    """Its facts would serve nobody, and reading the host for them costs every event (a devNode
    handler reading nodes below a PCI device under a fatal reset blocked the loop for seconds)."""
    counting, other = CountingHandler(), OtherHandler()
    parsers = {"counted": ("counting", counting.parse_pool), "other": ("other", other.parse_pool)}
    both = json.dumps({"resourceList": [{"resourceName": "things", "deviceType": "counted", "selectors": {}},
                                        {"resourceName": "more", "deviceType": "other", "selectors": {}}]})
    config = parse_config(json.dumps({"resourceList": [
        {"resourceName": "things", "deviceType": "counted", "selectors": {}}]}), "test", "example.com", parsers)
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        notifier, metrics = Notifier(), Metrics()
        loop = EventLoop({"counting": counting, "other": other}, config, notifier,
                         lambda: parse_config(both, "test", "example.com", parsers), holdings_for(short_tmp / "dp"),
                         metrics=metrics)
        send, receive = trio.open_memory_channel[Event](16)
        nursery.start_soon(loop.run, receive)
        for event in (Resync(None, "start"), Resync("other", "asked"), UEvent("add", "/devices/x", "pci")):
            handled = batches(metrics)
            await send.send(event)
            await wait_for_batches(metrics, handled + 1)
        assert (counting.scans, other.scans) == (1, 0)
        handled = batches(metrics)
        await send.send(ConfigChanged("test"))
        await wait_for_batches(metrics, handled + 1)
        assert other.scans == 1 and set(notifier.tree.pools) == {"example.com/things", "example.com/more"}
        nursery.cancel_scope.cancel()

"""One road per pool: the event loop decides, for each pool, whether the kubelet's device-plugin
API or DRA serves it (or neither, while its slices are being withdrawn), and what each road
must leave out; real endpoints show what the kubelet would see."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio_asyncio

from daemon.core import Event, ResourcePool, Resync
from daemon.core._config import DaemonConfig, parse_config
from daemon.core._events import CheckpointChanged, ClaimsChanged, ConfigChanged
from daemon.core._notifier import Notifier
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD
from daemon.deviceplugin import Endpoints
from daemon.holdings import Holdings
from daemon.loop import EventLoop
from daemon.metrics import Metrics
from daemon.settings import Settings
from tests.counting import (
    ClaimsByDevice,
    CountingHandler,
    batches,
    holdings_for,
    wait_for_batches,
    wait_for_socket,
    write_checkpoint,
)
from tests.waiting import wait_until_async


def config_text(api: str) -> str:
    return json.dumps({"resourceList": [
        {"resourceName": "things", "deviceType": "counted", "selectors": {}, "allocationApi": api},
        {"resourceName": "others", "deviceType": "counted", "selectors": {}},
    ]})


@dataclass
class Roads:
    loop: EventLoop
    notifier: Notifier
    endpoints: Endpoints
    directory: Path  # the device-plugin directory
    send: trio.MemorySendChannel[Event]
    metrics: Metrics
    holdings: Holdings
    claims: dict[tuple[str, str], str] = field(default_factory=dict)
    next_config: list[str] = field(default_factory=list)

    async def handle(self, event: Event) -> None:
        handled = batches(self.metrics)
        await self.send.send(event)
        await wait_for_batches(self.metrics, handled + 1)

    def withhold(self, *resources: str) -> None:
        """What the DRA driver says while a pool's slices are still on the API server."""
        self.holdings.set_withheld(frozenset(resources))

    def pool(self, name: str = "things") -> ResourcePool:
        return self.notifier.tree.pools[f"example.com/{name}"]

    async def served(self) -> list[str]:
        """The resources with a socket in the device-plugin directory, once every endpoint the
        tree asks for is serving (a socket that would come has come)."""
        await wait_until_async(lambda: self.endpoints.settled(registered=False), what="every endpoint serving")
        return sorted(path.name.split("-")[1] for path in self.directory.glob("devplugd-*.sock"))


@asynccontextmanager
async def roads(tmp: Path, api: str) -> AsyncIterator[Roads]:
    handler = CountingHandler()
    parsers = {"counted": ("counting", handler.parse_pool)}
    state: Roads | None = None

    def load_config() -> DaemonConfig:
        assert state is not None
        return parse_config(state.next_config[0], "test", "example.com", parsers)

    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        settings = Settings(device_plugin_dir=tmp / "dp", registration="none")
        notifier = Notifier()
        endpoints = Endpoints(settings, notifier, {"counting": handler}, nursery)
        notifier.subscribe(endpoints)
        send, receive = trio.open_memory_channel[Event](16)
        claims = ClaimsByDevice()
        holdings = holdings_for(tmp / "dp", claims=claims)
        metrics = Metrics()
        loop = EventLoop({"counting": handler}, parse_config(config_text(api), "test", "example.com", parsers),
                         notifier, load_config, holdings, metrics=metrics)
        nursery.start_soon(loop.run, receive)
        state = Roads(loop, notifier, endpoints, settings.device_plugin_dir, send, metrics, holdings, claims.claims)
        await state.handle(Resync(None, "start"))
        yield state
        nursery.cancel_scope.cancel()


async def test_a_dra_pool_is_not_served_to_the_kubelet_and_a_device_plugin_pool_is(short_tmp):
    async with roads(short_tmp, "dra") as running:
        assert running.pool().road == DRA_ROAD
        assert running.pool("others").road == DEVICE_PLUGIN_ROAD
        await wait_for_socket(short_tmp / "dp", "example.com_others")
        assert await running.served() == ["example.com_others"]


async def test_moving_a_pool_to_dra_ends_its_kubelet_endpoint(short_tmp):
    async with roads(short_tmp, "devicePlugin") as running:
        await wait_for_socket(short_tmp / "dp", "example.com_things")
        running.next_config.append(config_text("dra"))
        await running.handle(ConfigChanged("test"))
        assert running.pool().road == DRA_ROAD
        await wait_for_socket(short_tmp / "dp", "example.com_things", present=False)
        await wait_for_socket(short_tmp / "dp", "example.com_others")


async def test_a_pool_moved_back_is_withheld_until_its_slices_are_gone(short_tmp):
    async with roads(short_tmp, "dra") as running:
        running.withhold("example.com/things")  # its slices are still on the API server
        running.next_config.append(config_text("devicePlugin"))
        await running.handle(ConfigChanged("test"))
        assert running.pool().road == WITHHELD_ROAD
        assert await running.served() == ["example.com_others"]
        running.withhold()
        await running.handle(ClaimsChanged("slices withdrawn"))
        assert running.pool().road == DEVICE_PLUGIN_ROAD
        await wait_for_socket(short_tmp / "dp", "example.com_things")


async def test_devices_prepared_for_claims_leave_the_kubelets_list_until_unprepared(short_tmp):
    async with roads(short_tmp, "devicePlugin") as running:
        running.claims[("example.com/things", "d1")] = "default/claim-a"
        await running.handle(ClaimsChanged("prepared"))
        assert running.pool().claimed == {"d1"}
        assert [device_id for device_id, *_ in running.pool().listing] == ["d0"]
        running.claims.clear()
        await running.handle(ClaimsChanged("unprepared"))
        assert [device_id for device_id, *_ in running.pool().listing] == ["d0", "d1"]


async def test_a_dra_pool_keeps_out_what_pods_still_hold_through_the_device_plugin_api(short_tmp):
    write_checkpoint(short_tmp / "dp", "d0")  # a pod got d0 while the pool was a device-plugin pool
    async with roads(short_tmp, "dra") as running:
        assert running.pool().kubelet_held == {"d0"}
        assert running.pool("others").kubelet_held == frozenset()  # not a DRA pool: not its business
        write_checkpoint(short_tmp / "dp")  # the pod went
        await running.handle(CheckpointChanged("test"))
        assert running.pool().kubelet_held == frozenset()


async def test_an_unreadable_checkpoint_holds_every_device_of_a_dra_pool(short_tmp):
    (short_tmp / "dp").mkdir()
    (short_tmp / "dp" / "kubelet_internal_checkpoint").write_text("{not json")
    async with roads(short_tmp, "dra") as running:
        assert running.pool().kubelet_held == {"d0", "d1"}

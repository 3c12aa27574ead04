"""The device-plugin endpoints as the notifier's subscriber: real servers on real sockets,
registered with the kubelet stand-in, fed trees by the notifier as the event loop feeds them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import ClassVar

import grpc
import pytest
import trio
import trio_asyncio

from daemon.core import ContainerAllocation, DeviceInfo, DeviceSpec, ResourcePool
from daemon.core._notifier import Notifier
from daemon.deviceplugin import Endpoints
from daemon.settings import Settings
from tests.kubelet import FakeKubelet
from tests.trees import pool, tree
from tests.waiting import wait_until_async


class NamedHandler:
    """The endpoints need a handler only for its options; this one offers nothing optional."""

    name: ClassVar[str] = "test"


@asynccontextmanager
async def endpoints_for(directory: Path, handler: object) -> AsyncIterator[tuple[Notifier, FakeKubelet]]:
    """A notifier whose trees reach real endpoints registered with a kubelet stand-in."""
    kubelet = FakeKubelet(directory)
    kubelet.start()
    try:
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            settings = Settings(device_plugin_dir=directory, registration="kubelet")
            notifier = Notifier()
            notifier.subscribe(Endpoints(settings, notifier, {"test": handler}, nursery))  # type: ignore[dict-item]
            yield notifier, kubelet
            nursery.cancel_scope.cancel()
    finally:
        kubelet.close()


def device_ids(kubelet: FakeKubelet, resource: str) -> list[set[str]]:
    state = kubelet.resources.get(resource)
    return [set(message) for message in state.messages] if state is not None else []


async def test_only_resources_whose_list_changed_get_a_listandwatch_message(short_tmp):
    async with endpoints_for(short_tmp / "dp", NamedHandler()) as (notifier, kubelet):
        x, y = "example.com/x", "example.com/y"
        first = tree(pool(x, ["d1"]), pool(y, ["d1"]))
        notifier.publish(first)
        await wait_until_async(lambda: device_ids(kubelet, x) == [{"d1"}] and device_ids(kubelet, y) == [{"d1"}],
                               what="both resources registered with their first list")
        second = tree(pool(x, ["d1", "d2"]), first.pools[y])
        notifier.publish(second)
        # y's device changes in a way the kubelet cannot see (its specs): no message for y
        invisible = pool(y, {"d1": DeviceInfo(specs=(DeviceSpec("/dev/y", "/dev/y"),))})
        notifier.publish(tree(second.pools[x], invisible))
        notifier.publish(tree(second.pools[x], pool(y, ["d1", "d2"])))
        await wait_until_async(lambda: len(device_ids(kubelet, y)) >= 2, what="y's second list")
        assert device_ids(kubelet, y) == [{"d1"}, {"d1", "d2"}]
        assert device_ids(kubelet, x) == [{"d1"}, {"d1", "d2"}]


class BrokenPostAllocator:
    """A handler whose PostAllocator has a bug the first time it runs."""

    name: ClassVar[str] = "test"

    def __init__(self) -> None:
        self.calls = 0

    def post_allocate(self, pool: ResourcePool, device_ids: Sequence[str],
                      allocation: ContainerAllocation) -> ContainerAllocation:
        self.calls += 1
        if self.calls == 1:
            raise TypeError("a bug in the handler")
        allocation.envs["CALL"] = str(self.calls)
        return allocation


async def test_an_allocation_hook_that_raises_refuses_that_request_and_the_resource_stays_served(short_tmp, caplog):
    async with endpoints_for(short_tmp / "dp", BrokenPostAllocator()) as (notifier, kubelet):
        x = "example.com/x"
        notifier.publish(tree(pool(x, ["d1"])))
        await wait_until_async(lambda: device_ids(kubelet, x) == [{"d1"}], what="x registered")
        with pytest.raises(grpc.RpcError) as refused:
            await trio.to_thread.run_sync(kubelet.allocate, x, ["d1"])
        assert refused.value.code() == grpc.StatusCode.INTERNAL
        assert "handler test failed in post_allocate for example.com/x: TypeError: a bug in the handler" \
            in refused.value.details()
        assert "a bug in the handler" in caplog.text
        answer = await trio.to_thread.run_sync(kubelet.allocate, x, ["d1"])
        assert answer.container_responses[0].envs["CALL"] == "2"

"""The ResourceSlice publisher, in-process, against the API server stand-in over real HTTP.

The real ``SlicePublisher`` runs in the test's trio run and is offered DeviceTrees built from
``daemon.core`` types; it reaches the stand-in through the official client and a real
kubeconfig. Every test asserts what a cluster user would see on the API server: the slices of
each pool, their generation and count, the requests that were made, the lines in the log.
"""

from __future__ import annotations

import calendar
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.core import UNHEALTHY, DeviceInfo, Fault, ResourcePool
from daemon.core._handler import Hooks
from daemon.core._tree import CARRIER_LOST, DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD, DeviceTree
from daemon.dra import _publisher
from daemon.dra._kube import ApiLink, Kube
from daemon.dra._pools import DraPools
from daemon.dra._publisher import SlicePublisher
from daemon.metrics import Metrics
from daemon.settings import Settings
from tests import trees
from tests.apiserver import SLICES_PATH, ApiServer, Request
from tests.trees import tree
from tests.waiting import wait_until_async

DRIVER = "devplugd.io"
NODE = "node1"
NODE_UID = "3c0f8a41-6f0e-4d0b-9d6b-0a7f2c1e5b11"
TOKEN = "node1-token"
PREFIX = "example.com"
SLICE_PATH = SLICES_PATH + "/"  # a path regex for one slice: PUT, DELETE, GET of a name


# -- trees ---------------------------------------------------------------------------------------
def ids(count: int, start: int = 0) -> list[str]:
    """Device IDs that are their own device names and sort as they count: d00000, d00001, ..."""
    return [f"d{index:05d}" for index in range(start, start + count)]


def pool(name: str, device_ids: Sequence[str], *, road: str = DRA_ROAD, unhealthy_taint: str = "omit",
         **options: Any) -> ResourcePool:
    """``example.com/<name>``, served on ``road``; its devices plain (no handler describes them:
    only the core attributes are published). Unless ``unhealthy_taint`` says otherwise its
    Unhealthy devices are left out, so its slices hold 128 devices (a pool that may carry taints
    holds 64: see the taint tests)."""
    return trees.pool(f"{PREFIX}/{name}", device_ids, road=road, unhealthy_taint=unhealthy_taint, **options)


def pool_name(name: str, node: str = NODE) -> str:
    return f"{node}/{PREFIX}/{name}"


# -- what the API server holds ---------------------------------------------------------------------
def slices_of(api: ApiServer, name: str, node: str = NODE) -> list[dict[str, Any]]:
    """The slices of pool ``example.com/<name>`` on the server, by name."""
    return [s for s in api.slices(driver=DRIVER, node=node) if s["spec"]["pool"]["name"] == pool_name(name, node)]


def state(api: ApiServer, name: str, node: str = NODE) -> tuple[int, list[str]] | None:
    """(generation, device names in slice order) of a pool whose slices are complete and of one
    generation, as a consumer would use it; None while it is not."""
    slices = slices_of(api, name, node)
    if not slices:
        return None
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
    if len(generations) != 1 or counts != {len(slices)}:
        return None
    return generations.pop(), [d["name"] for s in slices for d in s["spec"]["devices"]]


async def wait_published(api: ApiServer, name: str, device_ids: Sequence[str], *, node: str = NODE,
                         timeout: float = 5.0) -> int:
    """Wait until pool ``name`` shows exactly ``device_ids``, each once, in whichever slice (a
    device added in place goes to the first slice with room, wherever its name sorts); its
    generation."""
    def ready() -> tuple[int, list[str]] | None:
        current = state(api, name, node)
        return current if current is not None and sorted(current[1]) == sorted(device_ids) else None

    generation, _ = await api.wait_until_async(ready, timeout, lambda: f"pool {name}: {state(api, name, node)}")
    return generation


def writes(api: ApiServer) -> list[Request]:
    return [r for r in api.requests if r.method in ("POST", "PUT", "PATCH", "DELETE")]


def dra_log(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "devplugd.dra" and r.levelno >= level]


def logged(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.INFO) -> list[str]:
    """The lines of the DRA log (at ``level`` or above) that contain ``text``."""
    return [line for line in dra_log(caplog, level) if text in line]


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return dra_log(caplog, logging.ERROR)


async def wait_for_log(caplog: pytest.LogCaptureFixture, pattern: str, timeout: float = 5.0,
                       level: int = logging.DEBUG, count: int = 1) -> str:
    """The ``count``-th line of the DRA log (at ``level`` or above) like ``pattern``, once it is there."""
    def found() -> str | None:
        lines = [message for message in dra_log(caplog, level) if re.search(pattern, message)]
        return lines[count - 1] if len(lines) >= count else None

    return await wait_until_async(found, timeout, lambda: f"log line {count} like {pattern!r}: {dra_log(caplog, level)}")


# -- the publisher -------------------------------------------------------------------------------
@dataclass
class Running:
    pools: DraPools
    metrics: Metrics
    changes: list[str] = field(default_factory=list)
    told: list[frozenset[str]] = field(default_factory=list)  # the pools with slices, as told each time

    def withheld(self) -> frozenset[str]:
        """The pools with slices on the server, as last told (those served through the
        device-plugin API are withheld from it meanwhile)."""
        return self.told[-1] if self.told else frozenset()

    def syncs(self) -> float:
        """Sync rounds of the publisher that left nothing to do, as its metric counts them."""
        return self.metrics.registry.get_sample_value("devplugd_dra_slice_syncs_total") or 0.0

    async def settle(self, offered: DeviceTree, timeout: float = 5.0) -> None:
        """Offer ``offered`` and wait for the sync round after it that left nothing to do."""
        synced = self.syncs()
        self.pools.offer(offered)
        await wait_until_async(lambda: self.syncs() > synced, timeout, "a sync round after the tree", interval=0.002)


@asynccontextmanager
async def publishing(kubeconfig: Path, *, node: str = NODE, connect: Callable[[Settings], Kube] | None = None,
                     hooks: Mapping[str, Hooks] | None = None) -> AsyncIterator[Running]:
    """A SlicePublisher for ``node`` running until the block ends (then cancelled, as at SIGTERM)."""
    settings = Settings(kubeconfig=kubeconfig, node_name=node, dra_driver=DRIVER)
    link = ApiLink(settings, connect)
    changes: list[str] = []
    told: list[frozenset[str]] = []
    metrics = Metrics()
    pools: list[DraPools] = []

    def withheld(resources: frozenset[str], why: str) -> None:
        if why:
            changes.append(why)
        told.append(resources)

    publisher = SlicePublisher(settings, link, metrics, on_server=lambda on_server: pools[0].on_server(on_server))
    pools.append(DraPools(DRIVER, node, hooks or {}, publisher, withheld))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            yield Running(pools[0], metrics, changes, told)
            nursery.cancel_scope.cancel()
    finally:
        link.close()


class SlowAnswers(Kube):
    """The real client, but the answers of the calls named in ``slow`` reach the publisher
    ``lag`` seconds late: after the watch has brought the events they caused."""

    slow: set[str]
    touched: set[str]
    lag = 0.3

    def _late(self, call: str) -> None:
        if call in self.slow:
            time.sleep(self.lag)

    def delete_slice(self, name: str, uid: str, resource_version: str) -> None:
        super().delete_slice(name, uid, resource_version)
        self._late("delete_slice")

    def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        answer = super().list_slices(field_selector)
        self._late("list_slices")
        return answer


class ChangedBeforeDelete(SlowAnswers):
    """Someone else changes each slice (a label) just before our first delete of it reaches
    the server, so that delete's preconditions no longer hold."""

    touched: set[str]

    def delete_slice(self, name: str, uid: str, resource_version: str) -> None:
        if name not in self.touched:
            self.touched.add(name)
            current = self.read_slice(name)
            current["metadata"].setdefault("labels", {})["touched-by"] = "someone-else"
            self.replace_slice(name, current)
        super().delete_slice(name, uid, resource_version)


class Clients:
    """``connect`` for ApiLink: makes the publisher's client, a ``kind`` (SlowAnswers) slow in
    ``slow``, and keeps it (``kube``) for the test to slow down later."""

    def __init__(self, *slow: str, kind: type[SlowAnswers] = SlowAnswers) -> None:
        self._slow = set(slow)
        self._kind = kind
        self.kube: SlowAnswers | None = None

    def __call__(self, settings: Settings) -> Kube:
        kube = self._kind.connect(settings.kubeconfig)
        assert isinstance(kube, SlowAnswers)
        kube.slow = self._slow
        kube.touched = set()
        self.kube = kube
        return kube

    def slow(self, *calls: str) -> None:
        self._slow.update(calls)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(token=TOKEN) as server:
        server.add_node(NODE, uid=NODE_UID)
        yield server
    assert server.internal_errors == []


@pytest.fixture
def kubeconfig(api: ApiServer, tmp_path: Path) -> Path:
    return api.kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture(autouse=True)
def dra_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "devplugd.dra")


# -- publishing ------------------------------------------------------------------------------------
async def test_a_pool_is_published_at_generation_1_owned_by_the_node(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(3))))
        assert await wait_published(api, "things", ids(3)) == 1
    (published,) = slices_of(api, "things")
    assert published["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}]
    assert published["spec"]["driver"] == DRIVER and published["spec"]["nodeName"] == NODE
    assert published["spec"]["pool"] == {"name": pool_name("things"), "generation": 1, "resourceSliceCount": 1}
    assert published["spec"]["devices"][0] == {"name": "d00000", "attributes": {
        "id": {"string": "d00000"}, "resourceName": {"string": f"{PREFIX}/things"}}}


async def test_an_empty_pool_publishes_one_empty_slice(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", [])))
        assert await wait_published(api, "things", []) == 1
    (published,) = slices_of(api, "things")
    assert published["spec"]["pool"]["resourceSliceCount"] == 1 and published["spec"].get("devices", []) == []


async def test_4096_devices_are_32_slices_of_128_that_shrink_in_place_and_grow_at_a_new_generation(
    api: ApiServer, kubeconfig: Path
) -> None:
    every = ids(4096)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", every)))
        assert await wait_published(api, "things", every) == 1
        first = slices_of(api, "things")
        assert len(first) == 32 and all(len(s["spec"]["devices"]) == 128 for s in first)
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in first} == {32}

        # one device goes Unhealthy (carrier lost): its slice alone is written, at the same
        # generation, so the pool stays complete and allocatable
        before = len(writes(api))
        await running.settle(tree(pool("things", every, unhealthy=["d02000"])))
        assert await wait_published(api, "things", [i for i in every if i != "d02000"]) == 1
        (made,) = writes(api)[before:]
        assert made.method == "PUT" and made.path == f"{SLICES_PATH}/{first[2000 // 128]['metadata']['name']}"

        before = len(writes(api))
        gone = set(every[7::20][:200])  # 200 devices from all over the pool: every slice changes
        fewer = [i for i in every if i not in gone]
        assert len(fewer) == 3896
        await running.settle(tree(pool("things", fewer)))
        assert await wait_published(api, "things", fewer) == 1  # each slice in place: no new generation
        shrunk = slices_of(api, "things")
        assert [s["metadata"]["name"] for s in shrunk] == [s["metadata"]["name"] for s in first]
        assert [r.method for r in writes(api)[before:]] == ["PUT"] * 32

        # 300 more than the 200 free places: a 33rd slice, so a new generation, every slice
        # written before anything is deleted
        before = len(writes(api))
        more = ids(4196)
        await running.settle(tree(pool("things", more)))
        assert await wait_published(api, "things", more) == 2
        grown = slices_of(api, "things")
        assert len(grown) == 33 and {s["spec"]["pool"]["resourceSliceCount"] for s in grown} == {33}
        assert {s["metadata"]["name"] for s in shrunk} < {s["metadata"]["name"] for s in grown}
        assert sorted(r.method for r in writes(api)[before:]) == ["POST"] + ["PUT"] * 32


async def test_fewer_slices_take_a_new_generation_and_the_obsolete_slices_go_once_it_is_complete(
    api: ApiServer, kubeconfig: Path
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        assert await wait_published(api, "things", ids(300)) == 1
        last = slices_of(api, "things")[-1]["metadata"]["name"]
        before = len(writes(api))
        await running.settle(tree(pool("things", ids(200))))  # slice 2 would be empty: two slices now
        assert await wait_published(api, "things", ids(200)) == 2
        made = writes(api)[before:]
        assert [r.method for r in made] == ["PUT", "PUT", "DELETE"]  # the old slice goes last
        assert made[-1].path == f"{SLICES_PATH}/{last}"


async def test_a_change_in_one_slice_writes_that_slice_alone_and_an_unchanged_tree_writes_nothing(
    api: ApiServer, kubeconfig: Path
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        assert await wait_published(api, "things", ids(300)) == 1
        first = slices_of(api, "things")
        # one device in the last slice turns unhealthy: that slice alone, at generation 1
        before = len(writes(api))
        await running.settle(tree(pool("things", ids(300), unhealthy=["d00299"])))
        assert await wait_published(api, "things", ids(299)) == 1
        after = slices_of(api, "things")
        assert [r.path for r in writes(api)[before:]] == [f"{SLICES_PATH}/{first[2]['metadata']['name']}"]
        assert [s["metadata"]["resourceVersion"] for s in after[:2]] == [s["metadata"]["resourceVersion"]
                                                                          for s in first[:2]]
        # back to healthy: it returns to the slice it left
        await running.settle(tree(pool("things", ids(300))))
        assert await wait_published(api, "things", ids(300)) == 1
        before = len(api.requests)
        await running.settle(tree(pool("things", ids(300))))  # a new tree, the same devices
        await running.settle(tree(pool("things", ids(300))))
        assert api.requests[before:] == []


async def test_a_new_device_goes_to_the_first_slice_with_room_wherever_its_name_sorts(
    api: ApiServer, kubeconfig: Path
) -> None:
    every = ids(300)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", every)))
        await wait_published(api, "things", every)
        without = [i for i in every if i != "d00010"]
        await running.settle(tree(pool("things", without)))  # room in slice 0
        before = len(writes(api))
        await running.settle(tree(pool("things", [*without, "e-new"])))
        await api.wait_until_async(lambda: "e-new" in [d["name"] for d in slices_of(api, "things")[0]["spec"]["devices"]],
                                   5, "the new device in slice 0")
        assert len(writes(api)[before:]) == 1  # one slice, though "e-new" sorts after every other
        assert {s["spec"]["pool"]["generation"] for s in slices_of(api, "things")} == {1}


async def test_two_pools_are_independent(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("apples", ids(2)), pool("pears", ids(200))))
        await wait_published(api, "apples", ids(2))
        await wait_published(api, "pears", ids(200))
        pears = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, "pears")}
        before = len(writes(api))
        await running.settle(tree(pool("apples", ids(3)), pool("pears", ids(200))))
        assert await wait_published(api, "apples", ids(3)) == 1
        assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, "pears")} == pears
        (write,) = writes(api)[before:]
        assert write.path == f"{SLICES_PATH}/{slices_of(api, 'apples')[0]['metadata']['name']}"


# -- conflicts and changes behind our back ---------------------------------------------------------
async def test_a_conflict_is_read_again_and_retried(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(2))))
        await wait_published(api, "things", ids(2))
        (name,) = [s["metadata"]["name"] for s in slices_of(api, "things")]
        api.fail_next("PUT", SLICE_PATH, 409)
        await running.settle(tree(pool("things", ids(3))))
        assert await wait_published(api, "things", ids(3)) == 1
    assert logged(caplog, f"ResourceSlice {name} changed on the server; reading it again")
    assert [(r.method, r.status) for r in api.requests if r.path.endswith(name)] == [
        ("PUT", 409), ("GET", 200), ("PUT", 200)]
    assert errors(caplog) == []


async def test_a_slice_changed_by_someone_else_is_put_right(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(3))))
        await wait_published(api, "things", ids(3))
        (published,) = slices_of(api, "things")
        tampered = json.loads(json.dumps(published))
        del tampered["spec"]["devices"][1]  # the same generation, one device less
        kube = Kube.connect(kubeconfig)
        try:
            await trio.to_thread.run_sync(kube.replace_slice, published["metadata"]["name"], tampered)
        finally:
            kube.close()
        assert await wait_published(api, "things", ids(3)) == 1  # put right in place

async def test_a_slice_deleted_by_someone_else_is_published_again_in_its_place(
    api: ApiServer, kubeconfig: Path
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        await wait_published(api, "things", ids(300))
        api.delete_slice(slices_of(api, "things")[1]["metadata"]["name"])
        assert await wait_published(api, "things", ids(300)) == 2
    # slice k (its name starts with k in hex, so the names sort in slice order) has the k-th 128
    republished = slices_of(api, "things")
    assert [s["metadata"]["name"][:5] for s in republished] == ["00000", "00001", "00002"]
    assert [s["spec"]["devices"][0]["name"] for s in republished] == ["d00000", "d00128", "d00256"]


async def test_a_slice_changed_just_before_we_delete_it_is_read_again_and_deleted(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing(kubeconfig, connect=Clients(kind=ChangedBeforeDelete)) as running:
        await running.settle(tree(pool("things", ids(300))))
        obsolete = [s["metadata"]["name"] for s in slices_of(api, "things")][1:]
        await running.settle(tree(pool("things", ids(100))))
        assert await wait_published(api, "things", ids(100)) == 2
    assert len(slices_of(api, "things")) == 1
    assert [(r.method, r.status) for r in api.requests if r.method == "DELETE"] == [
        ("DELETE", 409), ("DELETE", 200), ("DELETE", 409), ("DELETE", 200)]
    for name in obsolete:
        assert logged(caplog, f"ResourceSlice {name} changed on the server; reading it again")
    assert errors(caplog) == []


# -- refused pools -----------------------------------------------------------------------------------
async def test_a_pool_the_server_refuses_is_logged_once_with_the_causes_and_not_retried(
    api: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a node name the API server takes (a DNS subdomain of 242 characters) that makes every
    # pool name longer than the 253 bytes a ResourceSlice pool name may have
    long_node = ".".join(["n" * 63, "o" * 63, "p" * 63, "q" * 50])
    api.add_node(long_node)
    async with publishing(api.kubeconfig(tmp_path / "kubeconfig"), node=long_node) as running:
        running.pools.offer(tree(pool("things", ids(2))))
        line = await wait_for_log(caplog, "refused pool", level=logging.ERROR)
        assert "spec.pool.name: Too long: may not be more than 253 bytes" in line
        assert "not tried again until its devices change" in line
        assert len(writes(api)) == 1
        await running.settle(tree(pool("things", ids(2))))  # a round after it, for the same devices
        assert len(writes(api)) == 1  # not tried again
        assert errors(caplog) == [line]
        running.pools.offer(tree(pool("things", ids(3))))  # a change of its devices: tried again
        await api.wait_until_async(lambda: len(writes(api)) == 2, 5, "a second POST")
        await wait_for_log(caplog, "generation 1, 3 devices", level=logging.ERROR)


async def test_a_refused_pool_is_tried_again_when_its_devices_change(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_next("POST", SLICES_PATH + "$", 422, message="ResourceSlice.resource.k8s.io is invalid: injected")
    async with publishing(kubeconfig) as running:
        running.pools.offer(tree(pool("things", ids(2)), pool("other", ids(1))))
        await wait_published(api, "other", ids(1))
        (line,) = errors(caplog)
        assert f"refused pool {pool_name('things')}" in line and "injected" in line
        assert slices_of(api, "things") == []
        await running.settle(tree(pool("things", ids(2)), pool("other", ids(2))))  # another pool changes
        assert slices_of(api, "things") == []
        await running.settle(tree(pool("things", ids(3)), pool("other", ids(2))))
        await wait_published(api, "things", ids(3))


async def test_a_refused_pool_removed_and_configured_again_is_tried_again(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.fail_next("POST", SLICES_PATH + "$", 422, message="ResourceSlice.resource.k8s.io is invalid: injected")
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(2)), pool("other", ids(1))))
        assert slices_of(api, "things") == [] and errors(caplog)
        await running.settle(tree(pool("other", ids(1))))  # a reload without it
        await running.settle(tree(pool("things", ids(2)), pool("other", ids(1))))  # and one with it, as it was
        await wait_published(api, "things", ids(2))


# -- the server's side: wipes, expired watches, outages, no node --------------------------------------
async def test_slices_wiped_by_the_kubelet_are_published_again(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        await wait_published(api, "things", ids(300))
        assert api.wipe(NODE) == 3
        await wait_published(api, "things", ids(300))


async def test_a_slice_wiped_between_our_view_and_our_update_is_made_again_at_once(
        api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's wipe lands between the publisher's view and its PUT: the 404 is followed by a
    create of the slice (no resourceVersion: the server refuses one on a create), not an error."""
    wiped: list[str] = []

    class WipedUnderUs(Kube):
        def replace_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
            if not wiped:
                wiped.append(name)
                api.delete_slice(name)
            return super().replace_slice(name, body)

    async with publishing(kubeconfig, connect=lambda settings: WipedUnderUs.connect(settings.kubeconfig)) as running:
        await running.settle(tree(pool("things", ids(2))))
        await wait_published(api, "things", ids(2))
        running.pools.offer(tree(pool("things", ids(3))))
        await wait_published(api, "things", ids(3))
    assert wiped and [r.status for r in api.requests if r.method == "POST"] == [201, 201]
    assert errors(caplog) == []


async def test_a_new_generation_the_server_refuses_part_of_leaves_the_pool_as_it_was_complete(
        api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture) -> None:
    """200 devices grow to 300: the first slices of the new generation are written, the third is
    refused (422). The pool would be incomplete, its 200 devices unallocatable too: the devices the
    server took last are written again at the next generation, and the 300 not tried again."""
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(200))))
        assert await wait_published(api, "things", ids(200)) == 1
        api.fail_next("POST", SLICES_PATH + "$", 422, message="ResourceSlice.resource.k8s.io is invalid: injected")
        await running.settle(tree(pool("things", ids(300))))
        assert await wait_published(api, "things", ids(200)) == 3  # 2 refused in part, 3 as it was
        requests = len(api.requests)
        await running.settle(tree(pool("things", ids(300))))
        assert [r for r in api.requests[requests:] if r.method != "GET"] == []
    assert [m for m in errors(caplog) if "the devices it took last are written again" in m]


def lists(api: ApiServer) -> int:
    return sum(1 for r in api.requests if r.path == SLICES_PATH and r.method == "GET" and "watch" not in r.query)


def watches(api: ApiServer) -> int:
    return sum(1 for r in api.requests if r.path == SLICES_PATH and "watch" in r.query)


def expire_the_watch(api: ApiServer) -> None:
    """End the watch with its resourceVersion compacted away: the next one is 410 Gone."""
    api.add_node(f"node-{api.resource_version}")  # a change our watch does not see: it falls behind
    api.compact()
    api.close_watches()


async def test_slices_deleted_with_a_node_that_registered_again_come_back_owned_by_the_new_node(
    api: ApiServer, kubeconfig: Path
) -> None:
    def owner() -> str | None:
        published = slices_of(api, "things")
        return published[0]["metadata"]["ownerReferences"][0]["uid"] if published else None

    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(2))))
        await wait_published(api, "things", ids(2))
        api.delete_node(NODE)
        uid = api.add_node(NODE)  # the node registered again: a new uid
        api.wipe(NODE)  # as the garbage collector deletes what the old node owned
        await api.wait_until_async(lambda: owner() == uid, 5, lambda: f"slices owned by {owner()}, not {uid}")
        await wait_published(api, "things", ids(2))


async def test_an_expired_watch_is_listed_again_and_a_wipe_after_it_is_noticed(
    api: ApiServer, kubeconfig: Path
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(3))))
        await wait_published(api, "things", ids(3))
        assert lists(api) == 1
        expire_the_watch(api)
        await api.wait_until_async(lambda: lists(api) == 2 and api.watch_count == 1, 5, "a new list and watch")
        api.wipe(NODE)
        await wait_published(api, "things", ids(3))


async def test_a_list_that_answers_late_never_undoes_our_writes(api: ApiServer, kubeconfig: Path) -> None:
    clients = Clients()
    async with publishing(kubeconfig, connect=clients) as running:
        await running.settle(tree(pool("things", ids(100))))
        await wait_published(api, "things", ids(100))
        clients.slow("list_slices")
        listed, watched = lists(api), watches(api)
        expire_the_watch(api)
        await api.wait_until_async(lambda: lists(api) == listed + 1, 5, "the list again")  # its answer is late
        before = len(writes(api))
        running.pools.offer(tree(pool("things", ids(200))))  # a second slice
        assert await wait_published(api, "things", ids(200)) == 2
        await api.wait_until_async(lambda: watches(api) > watched + 1, 5, "the list's answer in, a new watch")
        await running.settle(tree(pool("things", ids(200))))
        assert sorted(r.method for r in writes(api)[before:]) == ["POST", "PUT"]  # the two slices at once
        assert len(slices_of(api, "things")) == 2


async def test_an_outage_is_one_error_line_retried_with_a_capped_backoff_and_ends_with_the_latest_state(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_publisher, "RETRY_MAX", 0.5)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(3))))
        await wait_published(api, "things", ids(3))
        api.down()
        running.pools.offer(tree(pool("things", ids(4))))
        await wait_for_log(caplog, "unreachable", level=logging.ERROR)
        retry = r"UPDATE resourceslice .*; retrying in ([0-9.]+) s"
        await wait_for_log(caplog, retry, count=4)  # 0.2 + 0.4 + 0.5 + 0.5: several tries
        tried = sum(1 for line in dra_log(caplog, logging.DEBUG) if re.search(retry, line))
        running.pools.offer(tree(pool("things", ids(5))))  # the latest, while still down
        await wait_for_log(caplog, retry, count=tried + 2)  # a round that began after it failed too
        api.up()
        assert await wait_published(api, "things", ids(5)) == 1  # never the intermediate one
        await wait_for_log(caplog, "(watching our ResourceSlices|ResourceSlices written) again", level=logging.INFO)
    (line,) = errors(caplog)  # one line for the outage, whichever task met it first
    assert "unreachable" in line
    delays = [float(d) for d in re.findall(retry, "\n".join(dra_log(caplog, logging.DEBUG)))]
    assert len(delays) >= 3 and max(delays) == 0.5, delays


async def test_a_node_missing_from_the_api_server_is_one_error_line_and_publishing_starts_when_it_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_publisher, "RETRY_MAX", 0.5)
    with ApiServer(token=TOKEN) as api:
        async with publishing(api.kubeconfig(tmp_path / "kubeconfig")) as running:
            running.pools.offer(tree(pool("things", ids(2))))
            line = await wait_for_log(caplog, "not on the API server", level=logging.ERROR)
            assert f"node {NODE} is not on the API server" in line
            await api.wait_until_async(
                lambda: sum(1 for r in api.requests if r.path == f"/api/v1/nodes/{NODE}") >= 3, 5, "GET node again")
            assert errors(caplog) == [line]
            # each try counts as a failed write (three GETs sent: two answered), so the alert on
            # failing writes sees a wrong node name
            assert (running.metrics.registry.get_sample_value("devplugd_dra_slice_write_failures_total",
                                                              {"reason": "error"}) or 0) >= 2
            uid = api.add_node(NODE)
            await wait_published(api, "things", ids(2))
            (published,) = slices_of(api, "things")
            assert published["metadata"]["ownerReferences"][0]["uid"] == uid
    assert api.internal_errors == []


# -- pools that leave DRA ------------------------------------------------------------------------------
async def test_a_pool_moved_back_to_the_device_plugin_api_is_withheld_until_its_slices_are_deleted(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resource = f"{PREFIX}/things"
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300)), pool("other", ids(1))))
        await wait_published(api, "things", ids(300))
        assert running.changes == []
        last = slices_of(api, "things")[-1]["metadata"]["name"]
        api.fail_next("DELETE", f"{last}$", None, delay=1.0)  # the last delete takes a while
        running.pools.offer(tree(pool("things", ids(300), api="devicePlugin", road=WITHHELD_ROAD),
                                     pool("other", ids(1))))
        await api.wait_until_async(lambda: len(slices_of(api, "things")) == 1, 5, "two slices deleted")
        assert resource in running.withheld()
        await api.wait_until_async(lambda: not slices_of(api, "things"), 5, "every slice deleted")
        await wait_until_async(lambda: running.changes == ["slices withdrawn"], 5, lambda: f"{running.changes}")
        assert resource not in running.withheld()
        assert slices_of(api, "other")
    assert logged(caplog, f"deleting the ResourceSlices of pool {pool_name('things')} (no longer served through DRA)")
    assert not logged(caplog, "deleted by someone else")


async def test_after_a_restart_a_device_plugin_pool_with_slices_left_is_withheld_until_they_are_deleted(
    api: ApiServer, kubeconfig: Path
) -> None:
    resource = f"{PREFIX}/things"
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300)), pool("other", ids(1))))
    last = slices_of(api, "things")[-1]["metadata"]["name"]
    api.fail_next("DELETE", f"{last}$", None, delay=1.0)
    # the daemon comes back with the pool moved to the device-plugin API while it was down: the
    # loop, told of no slices yet, serves it that way until the publisher says otherwise
    async with publishing(kubeconfig) as running:
        running.pools.offer(tree(pool("things", ids(300), api="devicePlugin", road=DEVICE_PLUGIN_ROAD),
                                     pool("other", ids(1))))
        await api.wait_until_async(lambda: len(slices_of(api, "things")) == 1, 5, "two slices deleted")
        assert resource in running.withheld()
        assert running.changes == ["slices to withdraw"]
        await api.wait_until_async(lambda: not slices_of(api, "things"), 5, "every slice deleted")
        await wait_until_async(lambda: running.changes == ["slices to withdraw", "slices withdrawn"], 5,
                               lambda: f"{running.changes}")
        assert resource not in running.withheld()


async def test_a_pool_removed_from_the_config_has_its_slices_deleted(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300)), pool("other", ids(1))))
        await wait_published(api, "things", ids(300))
        await running.settle(tree(pool("other", ids(1))))
        assert slices_of(api, "things") == []
        assert slices_of(api, "other")
        assert running.changes == []
    assert logged(caplog, f"deleting the ResourceSlices of pool {pool_name('things')} (no longer configured)")
    assert not logged(caplog, "deleted by someone else")


async def test_our_own_deletes_are_not_taken_for_someone_elses_even_when_their_answers_come_late(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing(kubeconfig, connect=Clients("delete_slice")) as running:
        await running.settle(tree(pool("things", ids(300)), pool("other", ids(1))))
        await running.settle(tree(pool("things", ids(100)), pool("other", ids(1))))  # two slices obsolete
        assert await wait_published(api, "things", ids(100)) == 2
        await running.settle(tree(pool("other", ids(1))))  # and then the whole pool
        assert slices_of(api, "things") == []
        before = len(writes(api))
        await running.settle(tree(pool("other", ids(1))))
        assert writes(api)[before:] == []
    assert not logged(caplog, "deleted by someone else")
    assert not logged(caplog, "publishing it again")


async def test_slices_of_other_drivers_and_nodes_are_never_touched(api: ApiServer, kubeconfig: Path) -> None:
    def foreign(driver: str, node: str, pool_path: str) -> dict[str, Any]:
        return api.create_slice({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"00000-{driver}-{node}-"},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": pool_path, "generation": 7,
                                                                  "resourceSliceCount": 1},
                     "devices": [{"name": "d00000"}]}})

    others = [foreign("gpu.example.com", NODE, pool_name("things")), foreign(DRIVER, "node2", pool_name("things",
                                                                                                        "node2"))]
    versions = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in others}
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(2))))
        await wait_published(api, "things", ids(2))
        await running.settle(tree(pool("things", ids(3))))
        api.wipe(NODE, DRIVER)
        await wait_published(api, "things", ids(3))
        await running.settle(tree())
        assert slices_of(api, "things") == []
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in api.slices()} == versions
    assert not [r for r in api.requests if any(r.path.endswith(name) for name in versions)]


# -- a restart ----------------------------------------------------------------------------------------
async def test_a_restart_with_changed_devices_continues_the_generation(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        await running.settle(tree(pool("things", ids(384))))  # three full slices, in place
        assert await wait_published(api, "things", ids(384)) == 1
    names = {s["metadata"]["name"] for s in slices_of(api, "things")}
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(385))))  # a fourth slice: the next generation
        assert await wait_published(api, "things", ids(385)) == 2
    assert names < {s["metadata"]["name"] for s in slices_of(api, "things")}


async def test_a_restart_adopts_the_slices_it_finds(api: ApiServer, kubeconfig: Path) -> None:
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", ids(300))))
        await wait_published(api, "things", ids(300))
    names = [s["metadata"]["name"] for s in slices_of(api, "things")]
    before = len(writes(api))
    async with publishing(kubeconfig) as running:  # the same devices: nothing to write
        await running.settle(tree(pool("things", ids(300))))
        assert writes(api)[before:] == []
        await running.settle(tree(pool("things", ids(299))))
        assert await wait_published(api, "things", ids(299)) == 1
    assert [s["metadata"]["name"] for s in slices_of(api, "things")] == names
    assert [r.method for r in writes(api)[before:]] == ["PUT"]  # the last slice alone


async def test_a_restart_adopts_slices_whose_devices_are_not_in_name_order(api: ApiServer, kubeconfig: Path) -> None:
    every = ids(300)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", every)))
        await running.settle(tree(pool("things", [*every[:10], *every[11:]])))  # room in slice 0
        await running.settle(tree(pool("things", [*every[:10], *every[11:], "e-new"])))
        await api.wait_until_async(lambda: "e-new" in [d["name"] for d in slices_of(api, "things")[0]["spec"]["devices"]],
                                   5, "the new device in slice 0")
    before = len(writes(api))
    async with publishing(kubeconfig) as running:  # the same devices, arranged as they were placed
        await running.settle(tree(pool("things", [*every[:10], *every[11:], "e-new"])))
        assert writes(api)[before:] == []


# -- health as device taints ---------------------------------------------------------------------
TAINTS = "DRADeviceTaints"


@pytest.fixture
def api_taints() -> Iterator[ApiServer]:
    """A server that keeps device taints, as 1.36 and 1.37 do by default."""
    with ApiServer(token=TOKEN, feature_gates={TAINTS}) as server:
        server.add_node(NODE, uid=NODE_UID)
        yield server
    assert server.internal_errors == []


def sick(device_ids: Sequence[str], faults: dict[str, Fault]) -> dict[str, DeviceInfo]:
    """Plain records of ``device_ids``; those in ``faults`` Unhealthy with that fault."""
    return {i: DeviceInfo(health=UNHEALTHY, fault=faults[i]) if i in faults else DeviceInfo() for i in device_ids}


def taints_of(api: ApiServer, name: str) -> dict[str, list[dict[str, str]]]:
    """The taints of pool ``name``'s devices on the server, by device (untainted ones left out)."""
    return {d["name"]: d["taints"] for s in slices_of(api, name) for d in s["spec"]["devices"] if d.get("taints")}


def taint_gauge(running: Running, cause: str, name: str = "things") -> float | None:
    return running.metrics.registry.get_sample_value("devplugd_dra_device_taints",
                                                     {"resource": f"{PREFIX}/{name}", "cause": cause})


LOST = Fault(CARRIER_LOST, "ens1f0v3", "link ens1f0v3 is up without carrier")


async def test_an_unhealthy_device_stays_in_its_slice_with_a_taint_naming_its_cause_until_healthy_again(
    api_taints: ApiServer, tmp_path: Path
) -> None:
    api = api_taints
    every = ids(300)
    async with publishing(api.kubeconfig(tmp_path / "kubeconfig")) as running:
        await running.settle(tree(pool("things", every, unhealthy_taint="NoSchedule")))
        assert await wait_published(api, "things", every) == 1
        first = slices_of(api, "things")
        # a pool that may carry taints is cut in slices of 64: a taint never needs a new slice
        assert [len(s["spec"]["devices"]) for s in first] == [64, 64, 64, 64, 44]
        before = len(writes(api))
        started = int(time.time())
        await running.settle(tree(pool("things", sick(every, {"d00100": LOST}), unhealthy_taint="NoSchedule")))
        (taint,) = taints_of(api, "things")["d00100"]
        assert {k: v for k, v in taint.items() if k != "timeAdded"} == {
            "key": f"{DRIVER}/carrier-lost", "value": "ens1f0v3", "effect": "NoSchedule"}
        # when it came, in whole seconds (the API keeps no more)
        assert started <= calendar.timegm(time.strptime(taint["timeAdded"], "%Y-%m-%dT%H:%M:%SZ")) <= time.time()
        # the device's own slice alone, in place: the pool stays at its generation, complete
        assert await wait_published(api, "things", every) == 1
        assert [r.path for r in writes(api)[before:]] == [f"{SLICES_PATH}/{first[100 // 64]['metadata']['name']}"]
        assert taint_gauge(running, "carrier-lost") == 1
        # healthy again: the taint goes at once, in the same slice
        before = len(writes(api))
        await running.settle(tree(pool("things", every, unhealthy_taint="NoSchedule")))
        assert taints_of(api, "things") == {} and await wait_published(api, "things", every) == 1
        assert [r.path for r in writes(api)[before:]] == [f"{SLICES_PATH}/{first[1]['metadata']['name']}"]
        assert taint_gauge(running, "carrier-lost") is None


async def test_a_taint_keeps_its_time_added_while_it_stays_and_across_a_restart(
    api_taints: ApiServer, tmp_path: Path
) -> None:
    api, kubeconfig = api_taints, api_taints.kubeconfig(tmp_path / "kubeconfig")
    every = ids(10)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", sick(every, {"d00001": LOST}), unhealthy_taint="NoExecute")))
        (taint,) = taints_of(api, "things")["d00001"]
        assert taint["effect"] == "NoExecute"
        second = int(time.time())
        await wait_until_async(lambda: int(time.time()) > second, 2, "the next second")
        # the same device changes otherwise (a second NUMA node) while the same taint stays on it
        records = sick(every, {"d00001": LOST})
        records["d00001"] = replace(records["d00001"], numa_nodes=(1,))
        await running.settle(tree(pool("things", records, unhealthy_taint="NoExecute")))
        (device,) = [d for s in slices_of(api, "things") for d in s["spec"]["devices"] if d["name"] == "d00001"]
        assert device["attributes"]["numaNode"] == {"int": 1} and device["taints"] == [taint]
    versions = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, "things")}
    before = len(writes(api))
    async with publishing(kubeconfig) as running:  # a restart finds the same taint: adopted, time and all
        await running.settle(tree(pool("things", records, unhealthy_taint="NoExecute")))
        assert writes(api)[before:] == []
        assert taint_gauge(running, "carrier-lost") == 1
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(api, "things")} == versions


async def test_the_taint_names_vanished_and_unnamed_causes_and_held_devices_stay_out(
    api_taints: ApiServer, tmp_path: Path
) -> None:
    api = api_taints
    records = sick(ids(6), {"d00002": LOST})
    records["d00000"] = DeviceInfo(health=UNHEALTHY)  # a handler that does not say why
    async with publishing(api.kubeconfig(tmp_path / "kubeconfig")) as running:
        offered = pool("things", records, unhealthy_taint="None", vanished=["d00002"],  # vanished while claimed
                       claimed=["d00002", "d00003"], leased=["d00004"], unhealthy=["d00004", "d00005"])
        await running.settle(tree(offered))
        taints = taints_of(api, "things")
        assert {name: [(t["key"], t.get("value"), t["effect"]) for t in found] for name, found in taints.items()} == {
            "d00000": [(f"{DRIVER}/unhealthy", None, "None")],
            "d00002": [(f"{DRIVER}/vanished", None, "None")],
            "d00005": [(f"{DRIVER}/unhealthy", None, "None")],
        }
        # the leased device stays out, Unhealthy or not; the claimed one is published as before
        assert sorted(d["name"] for s in slices_of(api, "things") for d in s["spec"]["devices"]) == [
            "d00000", "d00001", "d00002", "d00003", "d00005"]
        assert (taint_gauge(running, "unhealthy"), taint_gauge(running, "vanished")) == (2, 1)


async def test_a_pool_that_may_carry_taints_from_now_on_is_cut_again_in_slices_of_64_before_any_taint(
    api_taints: ApiServer, tmp_path: Path
) -> None:
    api = api_taints
    every = ids(130)
    async with publishing(api.kubeconfig(tmp_path / "kubeconfig")) as running:
        await running.settle(tree(pool("things", every, unhealthy_taint="omit")))
        assert [len(s["spec"]["devices"]) for s in slices_of(api, "things")] == [128, 2]
        # a reload says NoSchedule: no device is Unhealthy, no entry changes, but a taint must
        # never land in a slice of 128 (the server refuses it): a new generation of 64s now
        await running.settle(tree(pool("things", every, unhealthy_taint="NoSchedule")))
        assert await wait_published(api, "things", every) == 2
        assert [len(s["spec"]["devices"]) for s in slices_of(api, "things")] == [64, 64, 2]
        await running.settle(tree(pool("things", sick(every, {"d00100": LOST}), unhealthy_taint="NoSchedule")))
        assert list(taints_of(api, "things")) == ["d00100"]
    assert [r for r in api.requests if r.status == 422] == []


async def test_omit_leaves_an_unhealthy_device_out_in_slices_of_128(api_taints: ApiServer, tmp_path: Path) -> None:
    api = api_taints
    async with publishing(api.kubeconfig(tmp_path / "kubeconfig")) as running:
        await running.settle(tree(pool("things", sick(ids(200), {"d00007": LOST}), unhealthy_taint="omit")))
        assert await wait_published(api, "things", [i for i in ids(200) if i != "d00007"]) == 1
        assert [len(s["spec"]["devices"]) for s in slices_of(api, "things")] == [128, 71]
        assert taints_of(api, "things") == {}


async def test_a_server_that_drops_taints_gets_the_unhealthy_device_left_out_and_one_error_line(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    every = ids(100)
    async with publishing(kubeconfig) as running:
        await running.settle(tree(pool("things", every, unhealthy_taint="NoSchedule")))
        await running.settle(tree(pool("things", sick(every, {"d00042": LOST}), unhealthy_taint="NoSchedule")))
        # the taint would be lost and the device schedulable: it leaves the slices instead
        assert await wait_published(api, "things", [i for i in every if i != "d00042"]) == 1
        await running.settle(tree(pool("things", sick(every, {"d00042": LOST, "d00043": LOST}),
                                      unhealthy_taint="NoSchedule")))
        assert await wait_published(api, "things", [i for i in every if i not in ("d00042", "d00043")]) == 1
        await running.settle(tree(pool("things", every, unhealthy_taint="NoSchedule")))
        assert await wait_published(api, "things", every) == 1
    (line,) = logged(caplog, "dropped fields", logging.ERROR)
    assert pool_name("things") in line and "DRADeviceTaints" in line and "unhealthy devices are left out" in line


# -- shared devices (consumable capacity) ----------------------------------------------------------
SHARING = "DRAConsumableCapacity"


class Shares:
    """A handler whose pool ``things`` is one device, ``kvm``, offered three times (``kvm-0`` ...)."""

    name = "test"

    def shares(self, pool: ResourcePool) -> Mapping[str, Sequence[str]]:
        return {"kvm": sorted(pool.devices)}


def shared_hooks() -> dict[str, Hooks]:
    return {trees.TEST_HANDLER: Hooks(handler=Shares(), sharer=Shares())}  # type: ignore[arg-type]


async def test_the_shares_of_a_device_are_one_device_many_claims_may_hold(tmp_path: Path) -> None:
    with ApiServer(token=TOKEN, feature_gates={SHARING, TAINTS}) as api:
        api.add_node(NODE, uid=NODE_UID)
        async with publishing(api.kubeconfig(tmp_path / "kubeconfig"), hooks=shared_hooks()) as running:
            await running.settle(tree(pool("things", ["kvm-0", "kvm-1", "kvm-2"], unhealthy_taint="NoSchedule")))
            (device,) = [d for s in slices_of(api, "things") for d in s["spec"]["devices"]]
            assert device["name"] == "kvm" and device["attributes"]["id"] == {"string": "kvm"}
            assert device["allowMultipleAllocations"] is True
            assert device["capacity"] == {"shares": {"value": "3", "requestPolicy": {
                "default": "1", "validRange": {"min": "1", "step": "1"}}}}
            # a share under a host lease is not the scheduler's to give: two left
            await running.settle(tree(pool("things", ["kvm-0", "kvm-1", "kvm-2"], leased=["kvm-1"],
                                           unhealthy_taint="NoSchedule")))
            (device,) = [d for s in slices_of(api, "things") for d in s["spec"]["devices"]]
            assert device["capacity"]["shares"]["value"] == "2"
            # one left: no step (the server refuses a range whose min + step is over the capacity)
            await running.settle(tree(pool("things", ["kvm-0", "kvm-1", "kvm-2"], leased=["kvm-1", "kvm-2"],
                                           unhealthy_taint="NoSchedule")))
            (device,) = [d for s in slices_of(api, "things") for d in s["spec"]["devices"]]
            assert device["capacity"] == {"shares": {"value": "1", "requestPolicy": {
                "default": "1", "validRange": {"min": "1"}}}}
            # the node's health is every share's: the one device is tainted
            await running.settle(tree(pool("things", sick(["kvm-0", "kvm-1", "kvm-2"], dict.fromkeys(
                ["kvm-0", "kvm-1", "kvm-2"], LOST)), unhealthy_taint="NoSchedule")))
            (device,) = [d for s in slices_of(api, "things") for d in s["spec"]["devices"]]
            assert [t["key"] for t in device["taints"]] == [f"{DRIVER}/carrier-lost"]
            assert device["capacity"]["shares"]["value"] == "3"
        assert [r for r in api.requests if r.status >= 400] == []
        assert api.internal_errors == []


async def test_a_server_that_drops_consumable_capacity_gets_the_shares_as_devices_and_one_error_line(
    api: ApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with publishing(kubeconfig, hooks=shared_hooks()) as running:
        await running.settle(tree(pool("things", ["kvm-0", "kvm-1", "kvm-2"])))
        # the fields are gone on the server: one device with a capacity and no sharing would be
        # one claim's; three devices are three claims', as before consumable capacity
        assert await wait_published(api, "things", ["kvm-0", "kvm-1", "kvm-2"]) == 1
        assert not any("capacity" in d for s in slices_of(api, "things") for d in s["spec"]["devices"])
        await running.settle(tree(pool("things", ["kvm-0", "kvm-1"])))
        assert await wait_published(api, "things", ["kvm-0", "kvm-1"]) == 1
    (line,) = logged(caplog, "dropped fields", logging.ERROR)
    assert pool_name("things") in line and SHARING in line and "device of its own" in line

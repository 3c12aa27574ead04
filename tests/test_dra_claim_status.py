"""Each prepared claim's ``status.devices`` (KEP-4817): the preparer of ``test_dra_prepare`` (real
PCI pools on a fake host, real CDI specs and checkpoints) with the API server stand-in behind it
over real HTTP through the official client, for the claim reads and the status writes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from daemon.dra._claims import ClaimNotFound, ClaimRef
from daemon.dra._kube import Invalid, Kube, NotFound
from daemon.dra._prepare import ClaimPreparer
from daemon.dra._status import ClaimStatusWriter
from daemon.metrics import Metrics
from tests.apiserver import ApiError, ApiServer
from tests.fakesysfs import FakeHost
from tests.pci import Pci
from tests.test_dra_prepare import DPDK, DRIVER, NET, NET_VFS, NODE, OTHER_DRIVER, VFIO_VFS, Node, result

MAC = "3c:fd:fe:a0:0b:01"
NET_DEVICE = "0000-3b-02-0"  # NET_VFS[0], netdev ens1f0v0
VFIO_DEVICE = "0000-3b-02-2"  # VFIO_VFS[0], no netdev
NET_POOL = f"{NODE}/intel.com/sriov-net"
DPDK_POOL = f"{NODE}/intel.com/dpdk"


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server
    assert server.internal_errors == []


class Claims:
    """A node's preparer whose claims are on the API server stand-in, and its status writer."""

    def __init__(self, node: Node, host: FakeHost, api: ApiServer, kube: Kube) -> None:
        self.node = node
        self.host = host
        self.api = api
        self.kube = kube
        self.metrics = Metrics()
        self.restart()

    def restart(self) -> None:
        """A new book, preparer and writer on the same directories, as after a daemon restart."""
        self.node.restart()
        self.status = ClaimStatusWriter(DRIVER, self._kube, self.node.tree, self.node.hooks, self.host.sys,
                                        self.metrics, retry_first=0.05, retry_max=0.2)
        self.preparer = ClaimPreparer(DRIVER, NODE, self.node.cdi_dir, self.node.book, self.node.tree,
                                      self.node.hooks, self.get_claim, self.node.changes.append,
                                      metrics=self.metrics, status=self.status)

    async def _kube(self) -> Kube:
        return self.kube

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return await trio.to_thread.run_sync(self.kube.get_claim, namespace, name)
        except NotFound as error:
            raise ClaimNotFound(str(error)) from error

    def put(self, name: str, results: list[dict[str, Any]], **options: Any) -> ClaimRef:
        return ClaimRef("default", self.api.put_claim("default", name, results=results, **options), name)

    async def prepare(self, ref: ClaimRef) -> None:
        answer = (await self.preparer.prepare([ref]))[ref.uid]
        assert answer.error is None and answer.devices

    def devices(self, name: str) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.api.claim("default", name)["status"].get("devices", [])
        return entries

    async def wait_devices(self, name: str, expected: list[dict[str, Any]]) -> None:
        """Until the claim's status.devices are ``expected`` and the writer has nothing left to do."""
        await self.api.wait_until_async(lambda: self.devices(name) == expected and not self.status.pending, 10,
                                        lambda: f"status.devices of {name}: {self.devices(name)}, not {expected}")

    def writes(self, outcome: str) -> int:
        return int(self.metrics.registry.get_sample_value("devplugd_dra_claim_status_writes_total",
                                                          {"outcome": outcome}) or 0)


@pytest.fixture
async def claims(short_tmp: Path, host: FakeHost, pci: Pci, api: ApiServer) -> AsyncIterator[Claims]:
    node = Node(short_tmp, host, pci)
    (host.sys / "class" / "net" / "ens1f0v0" / "address").write_text(f"{MAC}\n")
    kube = await trio.to_thread.run_sync(Kube.connect, api.kubeconfig(short_tmp / "kubeconfig"))
    yield Claims(node, host, api, kube)
    kube.close()


def entry(pool: str, device: str, **more: Any) -> dict[str, Any]:
    return {"driver": DRIVER, "pool": pool, "device": device, **more}


NET_ENTRY = entry(NET_POOL, NET_DEVICE, networkData={"interfaceName": "ens1f0v0", "hardwareAddress": MAC})
VFIO_ENTRY = entry(DPDK_POOL, VFIO_DEVICE)
OTHER_ENTRY = {"driver": OTHER_DRIVER, "pool": "gpus", "device": "gpu-0", "conditions": [],
               "data": {"temperature": 40}}


async def test_a_prepared_claim_lists_its_devices_a_vf_with_a_netdev_with_its_network_data(claims: Claims) -> None:
    ref = claims.put("vfs", [result(NET, NET_VFS[0], "nic/fast"), result(DPDK, VFIO_VFS[0], "dpdk")])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.wait_devices("vfs", [NET_ENTRY, VFIO_ENTRY])
        assert await claims.preparer.unprepare([ref]) == {ref.uid: None}
        await claims.wait_devices("vfs", [])
        assert "devices" not in claims.api.claim("default", "vfs")["status"]
        nursery.cancel_scope.cancel()
    assert (claims.writes("written"), claims.writes("failed")) == (2, 0)


async def test_a_shared_device_lists_its_share(claims: Claims) -> None:
    share = "7b6f3f0e-4c1a-4c1e-9d3b-0c6f0a5e2b11"
    ref = claims.put("share", [{**result(DPDK, VFIO_VFS[0]), "shareID": share}])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.wait_devices("share", [entry(DPDK_POOL, VFIO_DEVICE, shareID=share)])
        nursery.cancel_scope.cancel()


async def test_the_entries_of_other_drivers_are_kept_untouched(claims: Claims) -> None:
    other = {"request": "gpu", "driver": OTHER_DRIVER, "pool": "gpus", "device": "gpu-0"}
    ref = claims.put("mixed", [other, result(DPDK, VFIO_VFS[0])])
    claims.api.write_claim_status("default", "mixed", [OTHER_ENTRY])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.wait_devices("mixed", [OTHER_ENTRY, VFIO_ENTRY])
        await claims.preparer.unprepare([ref])
        await claims.wait_devices("mixed", [OTHER_ENTRY])
        nursery.cancel_scope.cancel()


async def test_a_write_held_up_never_delays_prepare(claims: Claims) -> None:
    ref = claims.put("slow", [result(DPDK, VFIO_VFS[0])])
    claims.api.fail_next("PUT", "/resourceclaims/slow/status$", None, delay=3.0)  # then served
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        assert claims.devices("slow") == []  # answered while the write is still on its way
        await claims.wait_devices("slow", [VFIO_ENTRY])
        nursery.cancel_scope.cancel()


async def test_a_failed_write_is_logged_and_retried_and_prepare_succeeds(
    claims: Claims, caplog: pytest.LogCaptureFixture
) -> None:
    ref = claims.put("flaky", [result(DPDK, VFIO_VFS[0])])
    claims.api.fail_next("PUT", "/resourceclaims/flaky/status$", 503, count=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        with caplog.at_level(logging.INFO, logger="devplugd.dra"):
            await claims.prepare(ref)
            await claims.wait_devices("flaky", [VFIO_ENTRY])
        nursery.cancel_scope.cancel()
    assert (claims.writes("written"), claims.writes("failed")) == (1, 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "claim default/flaky" in warnings[0] and "HTTP 503" in warnings[0]
    assert any("status.devices written after 3 failed tries" in r.getMessage() for r in caplog.records)


async def test_a_conflict_is_read_again_and_written(claims: Claims) -> None:
    other = {"request": "gpu", "driver": OTHER_DRIVER, "pool": "gpus", "device": "gpu-0"}
    ref = claims.put("raced", [other, result(DPDK, VFIO_VFS[0])])
    # another driver writes between our read and our write: ours is a 409, read again, and theirs is kept
    claims.api.fail_next("PUT", "/resourceclaims/raced/status$", None, delay=1.0)

    def reads() -> int:
        return sum(1 for r in claims.api.requests if r.method == "GET" and r.path.endswith("/resourceclaims/raced"))

    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.api.wait_until_async(lambda: reads() == 2, 10, "the writer's read")  # Prepare's, the writer's
        await trio.to_thread.run_sync(claims.api.write_claim_status, "default", "raced", [OTHER_ENTRY])
        await claims.wait_devices("raced", [OTHER_ENTRY, VFIO_ENTRY])
        nursery.cancel_scope.cancel()
    assert (claims.writes("written"), claims.writes("failed")) == (1, 0)
    puts = [r.status for r in claims.api.requests if r.method == "PUT" and r.path.endswith("/raced/status")]
    assert puts == [409, 200] and reads() == 3


async def test_a_claim_deleted_ends_the_retries(claims: Claims, caplog: pytest.LogCaptureFixture) -> None:
    ref = claims.put("going", [result(DPDK, VFIO_VFS[0])])
    claims.api.fail_next("PUT", "/resourceclaims/going/status$", 500, count=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        with caplog.at_level(logging.INFO, logger="devplugd.dra"):
            await claims.prepare(ref)
            await claims.api.wait_until_async(lambda: claims.writes("failed") >= 2, 10, "two failed writes")
            claims.api.delete_claim("default", "going")
            await claims.api.wait_until_async(lambda: not claims.status.pending, 10, "the writer giving up")
        nursery.cancel_scope.cancel()
    assert any("claim default/going" in r.getMessage() and "gone from the API server" in r.getMessage()
               for r in caplog.records)


async def test_a_claim_replaced_by_another_uid_is_never_written(claims: Claims) -> None:
    ref = claims.put("reused", [result(DPDK, VFIO_VFS[0])])
    claims.api.fail_next("PUT", "/resourceclaims/reused/status$", 500, count=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        claims.put("reused", [result(DPDK, VFIO_VFS[0])])  # a new claim of that name, a new UID
        await claims.api.wait_until_async(lambda: not claims.status.pending, 10, "the writer giving up")
        nursery.cancel_scope.cancel()
    assert claims.devices("reused") == [] and claims.writes("written") == 0


async def test_a_write_a_restart_cut_short_is_made_at_start(claims: Claims) -> None:
    ref = claims.put("kept", [result(NET, NET_VFS[0])])
    await claims.prepare(ref)  # and the daemon stops before its writer got to it
    assert claims.status.pending == {ref.uid}
    claims.restart()
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.preparer.restore()
        await claims.wait_devices("kept", [NET_ENTRY])
        nursery.cancel_scope.cancel()


async def test_network_data_stays_after_the_interface_went_into_the_pod(claims: Claims) -> None:
    """CNI moves the VF's interface into the pod's network namespace: the host's sysfs no longer
    shows it, and a write at a restart keeps what the status said of it."""
    ref = claims.put("moved", [result(NET, NET_VFS[0])])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.wait_devices("moved", [NET_ENTRY])
        nursery.cancel_scope.cancel()
    pool = claims.node.pools[NET]
    info = pool.devices[NET_VFS[0]]
    gone = dataclasses.replace(info.details, device=dataclasses.replace(info.details.device, netdevs=()))
    claims.node.change_pool(NET, devices={**pool.devices, NET_VFS[0]: dataclasses.replace(info, details=gone)})
    claims.restart()
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.preparer.restore()
        await claims.api.wait_until_async(lambda: not claims.status.pending, 10, "the writer done")
        nursery.cancel_scope.cancel()
    assert claims.devices("moved") == [NET_ENTRY]


async def test_a_write_that_changes_nothing_is_not_made(claims: Claims) -> None:
    ref = claims.put("same", [result(DPDK, VFIO_VFS[0])])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.wait_devices("same", [VFIO_ENTRY])
        claims.status.prepared(claims.node.book.claims[ref.uid])  # as at a restart
        await claims.api.wait_until_async(lambda: not claims.status.pending, 10, "the writer done")
        nursery.cancel_scope.cancel()
    assert claims.writes("written") == 1


# -- the stand-in validates status.devices as the API server does -----------------------------


@pytest.mark.parametrize(
    ("network", "cause"),
    [
        ({"interfaceName": "x" * 257}, "status.devices[0].networkData.interfaceName: Too long: may not be more than 256 bytes"),
        ({"hardwareAddress": "a" * 129}, "status.devices[0].networkData.hardwareAddress: Too long: may not be more than 128 bytes"),
        ({"ips": ["10.0.0.1"]}, 'status.devices[0].networkData.ips[0]: Invalid value: "10.0.0.1": must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)'),
        ({"ips": ["10.0.0.1/24", "10.0.0.1/24"]}, 'status.devices[0].networkData.ips[1]: Duplicate value: "10.0.0.1/24"'),
        ({"ips": [f"10.0.0.{n}/24" for n in range(17)]}, "status.devices[0].networkData.ips: Too many: 17: must have at most 16 items"),
    ],
)
async def test_network_data_is_validated_as_the_api_server_does(
    claims: Claims, network: dict[str, Any], cause: str
) -> None:
    claims.put("checked", [result(NET, NET_VFS[0])])
    claim = await trio.to_thread.run_sync(claims.kube.get_claim, "default", "checked")
    claim["status"]["devices"] = [entry(NET_POOL, NET_DEVICE, networkData=network)]
    with pytest.raises(Invalid) as refused:
        await trio.to_thread.run_sync(claims.kube.replace_claim_status, "default", "checked", claim)
    assert refused.value.causes == (cause,)
    good = {"interfaceName": "x" * 256, "hardwareAddress": "a" * 128, "ips": ["10.0.0.1/24", "fd00::1/64"]}
    claim["status"]["devices"] = [entry(NET_POOL, NET_DEVICE, networkData=good)]
    await trio.to_thread.run_sync(claims.kube.replace_claim_status, "default", "checked", claim)


def test_status_entries_must_be_allocated_devices_once_each(api: ApiServer) -> None:
    api.put_claim("default", "c", results=[result(NET, NET_VFS[0])])
    with pytest.raises(ApiError) as unallocated:
        api.write_claim_status("default", "c", [entry(NET_POOL, "0000-3b-02-7")])
    assert unallocated.value.code == 422 and "must be an allocated device in the claim" in str(unallocated.value)
    with pytest.raises(ApiError) as twice:
        api.write_claim_status("default", "c", [entry(NET_POOL, NET_DEVICE)] * 2)
    assert "status.devices[1].deviceID: Duplicate value" in str(twice.value)
    with pytest.raises(ApiError) as unshared:  # a share is allocated by its share ID
        api.write_claim_status("default", "c", [entry(NET_POOL, NET_DEVICE, shareID="x")])
    assert "must be an allocated device in the claim" in str(unshared.value)


def test_a_status_write_that_changes_nothing_keeps_the_resource_version(api: ApiServer) -> None:
    api.put_claim("default", "c", results=[result(NET, NET_VFS[0])])
    first = api.write_claim_status("default", "c", [entry(NET_POOL, NET_DEVICE)])
    again = api.write_claim_status("default", "c", [entry(NET_POOL, NET_DEVICE)])
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]

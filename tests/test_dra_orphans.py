"""Prepared claims the kubelet will never unprepare (their ResourceClaim gone from the API server,
or replaced by one with another UID), unprepared by devplugd's look at the API server: the
preparer of ``test_dra_claim_status`` (real pools, CDI specs, device-info files, checkpoint) with
the API server stand-in over real HTTP, the look every 0.05 s instead of 45."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from daemon.dra._claims import ClaimRef
from daemon.dra._orphans import OrphanSweeper
from tests.apiserver import ApiServer
from tests.fakesysfs import FakeHost
from tests.pci import Pci
from tests.test_dra_claim_status import Claims
from tests.test_dra_prepare import DPDK, NET, NET_VFS, VFIO_VFS, Node, result
from tests.waiting import wait_until_async

PERIOD = 0.05


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server
    assert server.internal_errors == []


@pytest.fixture
async def claims(short_tmp: Path, host: FakeHost, pci: Pci, api: ApiServer) -> AsyncIterator[Claims]:
    from daemon.dra._kube import Kube

    kube = await trio.to_thread.run_sync(Kube.connect, api.kubeconfig(short_tmp / "kubeconfig"))
    yield Claims(Node(short_tmp, host, pci), host, api, kube)
    kube.close()


def sweeper(claims: Claims, period: float = PERIOD) -> OrphanSweeper:
    return OrphanSweeper(claims.node.book, claims.get_claim, claims.preparer.release_orphans, period=period)


def orphaned(claims: Claims) -> int:
    return int(claims.metrics.registry.get_sample_value("devplugd_dra_orphaned_claims_total") or 0)


def prepared(claims: Claims, ref: ClaimRef) -> bool:
    return claims.node.book.prepared(ref.uid) is not None


async def sweeps_past(looks: OrphanSweeper, count: int) -> None:
    """Until ``count`` more looks than now have been completed."""
    target = looks.sweeps + count
    await wait_until_async(lambda: looks.sweeps >= target, 10, f"{count} looks at the API server")


async def test_a_claim_gone_from_the_api_server_is_unprepared_and_its_devices_are_free(
    claims: Claims, caplog: pytest.LogCaptureFixture
) -> None:
    ref = claims.put("gone", [result(NET, NET_VFS[0]), result(DPDK, VFIO_VFS[0])])
    await claims.prepare(ref)
    assert claims.node.devinfo_files() and claims.node.spec_path(ref.uid).exists()
    looks = sweeper(claims)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(looks.run)
        await sweeps_past(looks, 2)
        assert prepared(claims, ref)  # there: kept
        with caplog.at_level(logging.INFO, logger="devplugd.dra"):
            claims.api.delete_claim("default", "gone")
            await wait_until_async(lambda: not prepared(claims, ref), 10, "the claim unprepared")
        nursery.cancel_scope.cancel()
    assert not claims.node.spec_path(ref.uid).exists() and claims.node.devinfo_files() == []
    assert ref.uid not in {entry["uid"] for entry in claims.node.checkpoint()["claims"]}
    assert orphaned(claims) == 1 and claims.node.changes[-1] == "claim default/gone unprepared"
    (line,) = [r.getMessage() for r in caplog.records if "unprepared" in r.getMessage()]
    assert line == (f"unprepared claim default/gone (UID {ref.uid}), which the kubelet will never unprepare: its "
                    "ResourceClaim is gone from the API server")
    # the devices are free: another claim gets them
    other = claims.put("next", [result(NET, NET_VFS[0]), result(DPDK, VFIO_VFS[0])])
    await claims.prepare(other)


async def test_a_claim_replaced_by_one_with_another_uid_is_unprepared_and_the_new_ones_status_untouched(
    claims: Claims, caplog: pytest.LogCaptureFixture
) -> None:
    ref = claims.put("reused", [result(DPDK, VFIO_VFS[0])])
    async with trio.open_nursery() as nursery:
        await nursery.start(claims.status.run)
        await claims.prepare(ref)
        await claims.api.wait_until_async(lambda: not claims.status.pending, 10, "the status written")
        new_uid = claims.api.put_claim("default", "reused", results=[result(DPDK, VFIO_VFS[0])])
        looks = sweeper(claims)
        with caplog.at_level(logging.INFO, logger="devplugd.dra"):
            await looks.sweep()
        assert not claims.status.pending
        nursery.cancel_scope.cancel()
    assert not prepared(claims, ref) and orphaned(claims) == 1
    assert "devices" not in claims.api.claim("default", "reused")["status"]
    assert any(r.getMessage().endswith(f"the API server has another claim of that name now (UID {new_uid})")
               for r in caplog.records)


@pytest.mark.parametrize("failure", ["unreachable", 403, 500])
async def test_nothing_is_unprepared_while_the_api_server_does_not_answer(claims: Claims, failure: str | int) -> None:
    ref = claims.put("kept", [result(DPDK, VFIO_VFS[0])])
    await claims.prepare(ref)
    claims.api.delete_claim("default", "kept")
    if failure == "unreachable":
        claims.api.down()
    else:
        claims.api.fail_next("GET", "/resourceclaims/kept$", int(failure), count=1000)
    looks = sweeper(claims)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(looks.run)
        await sweeps_past(looks, 3)
        assert prepared(claims, ref) and claims.node.spec_path(ref.uid).exists() and orphaned(claims) == 0
        nursery.cancel_scope.cancel()
    if failure == "unreachable":
        claims.api.up()
        await looks.sweep()
        assert not prepared(claims, ref)


async def test_a_forbidden_read_is_warned_of_once_naming_the_credentials(
        claims: Claims, caplog: pytest.LogCaptureFixture) -> None:
    """The node's own identity may read only the claims of its pods: a 403 for every claim whose
    pod is gone, which the sweep cannot tell from a claim that is there."""
    refs = [claims.put(name, [result(DPDK, device)]) for name, device in (("a", VFIO_VFS[0]), ("b", VFIO_VFS[1]))]
    for ref in refs:
        await claims.prepare(ref)
    claims.api.fail_next("GET", "/resourceclaims/[ab]$", 403, count=1000)
    looks = sweeper(claims)
    await looks.sweep()
    await looks.sweep()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "403" in r.getMessage()]
    assert len(warned) == 1 and "credentials that may get resourceclaims" in warned[0]
    assert all(prepared(claims, ref) for ref in refs)


async def test_a_claim_with_its_uid_on_the_api_server_stays_prepared(claims: Claims) -> None:
    ref = claims.put("in-use", [result(DPDK, VFIO_VFS[0])])
    await claims.prepare(ref)
    looks = sweeper(claims)
    await looks.sweep()
    await looks.sweep()
    assert prepared(claims, ref) and claims.node.spec_path(ref.uid).exists() and orphaned(claims) == 0
    assert [r.path for r in claims.api.requests if r.method == "GET"].count("/apis/resource.k8s.io/v1/namespaces/"
                                                                            "default/resourceclaims/in-use") == 3


async def test_a_claim_the_kubelet_unprepared_meanwhile_is_left_alone(claims: Claims) -> None:
    ref = claims.put("both", [result(DPDK, VFIO_VFS[0])])
    await claims.prepare(ref)
    assert await claims.preparer.unprepare([ref]) == {ref.uid: None}
    await claims.preparer.release_orphans({ref.uid: (ref, "its ResourceClaim is gone from the API server")})
    assert orphaned(claims) == 0 and claims.node.changes.count("claim default/both unprepared") == 1

"""GetPreferredAllocation for PCI pools: the packed and spread policies (unit tests), called the
way the kubelet calls it (Case A and Case B of section 3.7), plus the kubelet stand-in's call.

The host: PFs A and B on NUMA node 0, C and D on node 1, eight VFs each (VF i of a PF on
function 0 is ``<bus>:02.i``, on function 1 ``<bus>:0a.i``).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon.handlers.pci._facts import PciDevice
from daemon.handlers.pci._preferred import PACKED, POLICIES, SPREAD, preferred_devices
from tests.kubelet import FakeKubelet

PF_A, PF_B = "0000:3b:00.0", "0000:3b:00.1"  # NUMA 0
PF_C, PF_D = "0000:af:00.0", "0000:af:00.1"  # NUMA 1
PF_E = "0000:3b:00.2"  # a third PF on NUMA 0, only where a test says so
PF_X = "0000:d8:00.0"  # a PF whose NUMA node is unknown, only where a test says so


def vf_id(pf: str, index: int) -> str:
    return f"{pf[:8]}{2 + 8 * int(pf[-1]):02x}.{index}"


def pci(address: str, numa: int | None, pf: str | None = None, index: int = -1) -> PciDevice:
    """An iavf-bound E810 VF of ``pf`` (VF ``index``), or a NIC that is not a VF when ``pf`` is None."""
    return PciDevice(
        address=address, vendor="8086", device="1889" if pf else "1593", class_code="020000",
        driver="iavf" if pf else "ice", numa_node=numa, acpi_index=None, is_pf=False, num_vfs=0,
        pf_address=pf, vf_index=index, pf_netdev=None, netdevs=(), link_type="ether", iommu_group=None,
        noiommu=False, uio_devices=(), rdma_devices=(), has_default_route=False,
    )


def vfs(pf: str, numa: int | None, count: int = 8) -> dict[str, PciDevice]:
    return {vf_id(pf, i): pci(vf_id(pf, i), numa, pf, i) for i in range(count)}


def ids(pf: str, *indices: int) -> list[str]:
    """VF IDs of ``pf``; all eight when no index is given."""
    return [vf_id(pf, i) for i in (indices or range(8))]


POOL: dict[str, PciDevice] = {**vfs(PF_A, 0), **vfs(PF_B, 0), **vfs(PF_C, 1), **vfs(PF_D, 1)}
A, B, C, D = ids(PF_A), ids(PF_B), ids(PF_C), ids(PF_D)
# Free: A all 8, B 2 (VFs 6-7), C 5 (VFs 3-7), D all 8.
MIXED = A + ids(PF_B, 6, 7) + ids(PF_C, 3, 4, 5, 6, 7) + D


def prefer(policy: str, available: list[str], must: list[str], size: int,
           devices: Mapping[str, PciDevice] = POOL) -> list[str]:
    return preferred_devices(policy, devices, available, must, size)


def test_an_unknown_policy_is_rejected_by_name() -> None:
    assert POLICIES == (PACKED, SPREAD) == ("packed", "spread")
    with pytest.raises(ValueError, match="'balanced'"):
        prefer("balanced", A, [], 1)


# -- the kubelet's two call patterns -------------------------------------------------------------


def test_case_a_packed_fills_the_pf_of_the_reused_device() -> None:
    # VF A5 is reused from an init container; the aligned devices are NUMA 0's free ones. B has
    # fewer free devices, but A already holds the container's device.
    available = A + ids(PF_B, 3, 4, 5, 6, 7)
    assert prefer(PACKED, available, [vf_id(PF_A, 5)], 3) == ids(PF_A, 5, 0, 1)


def test_case_a_spread_counts_the_reused_device_against_its_pf() -> None:
    available = A + ids(PF_B, 3, 4, 5, 6, 7)
    assert prefer(SPREAD, available, [vf_id(PF_A, 5)], 3) == [vf_id(PF_A, 5), vf_id(PF_B, 3), vf_id(PF_A, 0)]


def test_case_b_packed_completes_the_aligned_devices_from_the_best_fitting_pf() -> None:
    # NUMA 0 had only A6 and A7 free: the kubelet took both, then offers every free device.
    aligned = ids(PF_A, 6, 7)
    available = aligned + C + ids(PF_D, 5, 6, 7)
    assert prefer(PACKED, available, aligned, 4) == aligned + ids(PF_D, 5, 6)


def test_case_b_spread_balances_the_rest_over_the_other_pfs() -> None:
    aligned = ids(PF_A, 6, 7)
    available = aligned + C + ids(PF_D, 5, 6, 7)
    assert prefer(SPREAD, available, aligned, 5) == aligned + [vf_id(PF_C, 0), vf_id(PF_D, 5), vf_id(PF_C, 1)]


def test_nothing_more_is_chosen_when_the_must_include_devices_reach_the_size() -> None:
    # The kubelet needs every must-include device back, even more than the size.
    must = ids(PF_A, 3, 1, 2)
    assert prefer(PACKED, A, must, 3) == must
    assert prefer(SPREAD, A + B, must, 2) == must


# -- packed ---------------------------------------------------------------------------------------


def test_packed_takes_a_single_device_from_the_pf_with_the_fewest_free() -> None:
    assert prefer(PACKED, MIXED, [], 1) == [vf_id(PF_B, 6)]


def test_packed_takes_the_fewest_free_pf_that_still_suffices() -> None:
    # B (2 free) cannot give 3; C (5 free) can, which keeps A and D whole.
    assert prefer(PACKED, MIXED, [], 3) == ids(PF_C, 3, 4, 5)


def test_packed_overflows_to_another_pf_on_the_same_numa_node_first() -> None:
    # A holds the must-include device but has one more free; C (3 free, NUMA 1) would fit
    # better, yet B shares A's NUMA node.
    available = ids(PF_A, 6, 7) + B + ids(PF_C, 5, 6, 7)
    assert prefer(PACKED, available, [vf_id(PF_A, 6)], 4) == ids(PF_A, 6, 7) + ids(PF_B, 0, 1)


def test_packed_spans_pfs_on_the_numa_node_with_the_fewest_free_that_suffices() -> None:
    # No PF has 10 free; node 0 has 16, node 1 has 11: node 1, fullest PF first, then best fit.
    available = A + B + ids(PF_C, 5, 6, 7) + D
    assert prefer(PACKED, available, [], 10) == D + ids(PF_C, 5, 6)


def test_packed_starts_on_the_largest_node_when_no_node_suffices() -> None:
    available = A + B + ids(PF_C, 5, 6, 7) + D
    assert prefer(PACKED, available, [], 20) == A + B + ids(PF_D, 0, 1, 2, 3)


def test_packed_overflow_within_a_node_keeps_a_whole_pf_free() -> None:
    # Node 0 with A (8 free), B (8 free), E (3 free): 10 = all of A + 2 of E; B stays whole.
    devices = {**POOL, **vfs(PF_E, 0)}
    available = A + B + ids(PF_E, 5, 6, 7)
    assert prefer(PACKED, available, [], 10, devices) == A + ids(PF_E, 5, 6)


# -- spread ---------------------------------------------------------------------------------------


def test_spread_takes_one_device_per_pf_in_turn_most_free_first() -> None:
    assert prefer(SPREAD, MIXED, [], 6) == [vf_id(PF_A, 0), vf_id(PF_D, 0), vf_id(PF_C, 3), vf_id(PF_B, 6),
                                           vf_id(PF_A, 1), vf_id(PF_D, 1)]


def test_spread_counts_must_include_devices_and_prefers_their_numa_node() -> None:
    must = ids(PF_A, 0, 1)
    assert prefer(SPREAD, A + B + C + D, must, 6) == must + [vf_id(PF_B, 0), vf_id(PF_C, 0), vf_id(PF_D, 0),
                                                            vf_id(PF_B, 1)]


def test_spread_keeps_going_on_the_pfs_that_still_have_devices() -> None:
    available = A + [vf_id(PF_B, 7)]
    assert prefer(SPREAD, available, [], 4) == [vf_id(PF_A, 0), vf_id(PF_B, 7), vf_id(PF_A, 1), vf_id(PF_A, 2)]


# -- grouping, unknown NUMA nodes, unknown IDs ---------------------------------------------------


NICS = ["0000:5e:00.0", "0000:5e:00.1", "0000:5e:00.2"]


@pytest.mark.parametrize(
    ("policy", "size", "expected"),
    [
        (PACKED, 1, NICS[:1]),  # each is a one-device group: a perfect fit
        (PACKED, 2, ids(PF_A, 0, 1)),  # not two NICs: they are not one PF
        (SPREAD, 4, [vf_id(PF_A, 0), *NICS]),
    ],
)
def test_a_device_that_is_not_a_vf_is_a_group_of_its_own(policy: str, size: int, expected: list[str]) -> None:
    devices = {**POOL, **{address: pci(address, 0) for address in NICS}}
    assert prefer(policy, NICS + A, [], size, devices) == expected


@pytest.mark.parametrize(("policy", "expected"), [(PACKED, vf_id(PF_B, 6)), (SPREAD, vf_id(PF_B, 6))])
def test_pfs_with_an_unknown_numa_node_come_after_known_ones(policy: str, expected: str) -> None:
    # X (unknown node) has 1 free for packed to prefer, 8 for spread to prefer; neither does.
    devices = {**POOL, **vfs(PF_X, None)}
    available = ids(PF_B, 6, 7) + (ids(PF_X, 0) if policy == PACKED else ids(PF_X))
    assert prefer(policy, available, [], 1, devices) == [expected]


@pytest.mark.parametrize("policy", POLICIES)
def test_ids_unknown_to_the_pool_are_offered_only_after_every_known_device(policy: str) -> None:
    strangers = ["0000:99:00.1", "0000:03:00.0"]
    available = strangers + ids(PF_A, 0, 1)
    assert prefer(policy, available, [], 3) == ids(PF_A, 0, 1) + ["0000:03:00.0"]
    assert prefer(policy, available, [], 9) == ids(PF_A, 0, 1) + ["0000:03:00.0", "0000:99:00.1"]
    # A must-include ID is honoured even when the pool no longer knows it.
    assert prefer(policy, available, ["0000:99:00.1"], 2) == ["0000:99:00.1", vf_id(PF_A, 0)]


@pytest.mark.parametrize("policy", POLICIES)
def test_must_include_ids_come_first_once_and_only_when_offered(policy: str) -> None:
    must = [vf_id(PF_C, 4), vf_id(PF_A, 2), vf_id(PF_C, 4), vf_id(PF_D, 0)]  # D0 is not offered
    answer = prefer(policy, A + C, must, 4)
    assert answer[:2] == [vf_id(PF_C, 4), vf_id(PF_A, 2)]
    assert len(answer) == len(set(answer)) == 4 and set(answer) <= set(A + C)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_larger_than_the_offer_gets_everything_offered(policy: str) -> None:
    assert sorted(prefer(policy, ids(PF_B, 1, 2, 1), [], 5)) == ids(PF_B, 1, 2)


# -- invariants -----------------------------------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    numas = st.sampled_from([0, 1, None])
    devices: dict[str, PciDevice] = {}
    for bus in range(draw(st.integers(0, 4))):
        devices.update(vfs(f"0000:{0x3b + bus:02x}:00.0", draw(numas), draw(st.integers(1, 8))))
    for function in range(draw(st.integers(0, 3))):
        address = f"0000:5e:00.{function}"
        devices[address] = pci(address, draw(numas))
    universe = sorted(devices) + [f"0000:99:00.{n}" for n in range(draw(st.integers(0, 2)))]
    offered = st.lists(st.sampled_from(universe), max_size=45) if universe else st.just([])
    available = draw(offered)
    must = draw(st.lists(st.sampled_from([*universe, "0000:77:00.0"]), max_size=6))
    return {"policy": draw(st.sampled_from(POLICIES)), "devices": devices, "available": available,
            "must": must, "size": draw(st.integers(0, 50)), "seed": draw(st.integers(0, 2**32))}


def group_of(devices: Mapping[str, PciDevice], device_id: str) -> str:
    return devices[device_id].pf_address or device_id


@settings(max_examples=400, deadline=None)
@given(requests())
def test_every_answer_is_valid_and_depends_only_on_the_offered_set(request: dict[str, Any]) -> None:
    policy, devices, available, must, size = (request[k] for k in ("policy", "devices", "available", "must", "size"))
    answer = preferred_devices(policy, devices, available, must, size)

    offered = set(available)
    kept = list(dict.fromkeys(i for i in must if i in offered))
    assert answer[: len(kept)] == kept
    assert len(answer) == len(set(answer))
    assert set(answer) <= offered
    assert len(answer) == max(len(kept), min(size, len(offered)))
    chosen = answer[len(kept):]
    if any(i not in devices for i in chosen):
        assert {i for i in offered if i in devices} <= set(answer)

    shuffler = random.Random(request["seed"])
    shuffled = shuffler.sample(available, len(available))
    reordered = dict(shuffler.sample(list(devices.items()), len(devices)))
    assert preferred_devices(policy, reordered, shuffled, must, size) == answer

    if policy == SPREAD:
        # Every PF that still has an unchosen device got at most one fewer than any PF that was
        # given one more device.
        given_count = Counter(group_of(devices, i) for i in answer if i in devices)
        left = {group_of(devices, i) for i in offered - set(answer) if i in devices}
        for device_id in chosen:
            if device_id in devices:
                assert all(given_count[g] >= given_count[group_of(devices, device_id)] - 1 for g in left)


# -- the kubelet stand-in calls it as the kubelet does -------------------------------------------


class _Plugin(dp_grpc.DevicePluginServicer):
    """A minimal device plugin that answers GetPreferredAllocation with the packed policy."""

    def __init__(self) -> None:
        self.requests: list[dp.PreferredAllocationRequest] = []
        self.stopped = threading.Event()

    def GetDevicePluginOptions(self, request: dp.Empty, context: grpc.ServicerContext) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: dp.Empty, context: grpc.ServicerContext) -> Iterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(devices=[dp.Device(ID=i, health="Healthy") for i in sorted(POOL)])
        self.stopped.wait()

    def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        self.requests.append(request)
        return dp.PreferredAllocationResponse(container_responses=[
            dp.ContainerPreferredAllocationResponse(deviceIDs=preferred_devices(
                PACKED, POOL, r.available_deviceIDs, r.must_include_deviceIDs, r.allocation_size))
            for r in request.container_requests
        ])


def test_the_kubelet_stand_in_sends_one_container_request_and_reads_the_first_answer(kubelet: FakeKubelet) -> None:
    from concurrent.futures import ThreadPoolExecutor

    resource = "example.com/vf"
    plugin = _Plugin()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    dp_grpc.add_DevicePluginServicer_to_server(plugin, server)
    socket: Path = kubelet.device_plugin_dir / "pref.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{kubelet.socket_path}") as channel:
            dp_grpc.RegistrationStub(channel).Register(dp.RegisterRequest(
                version="v1beta1", endpoint=socket.name, resource_name=resource,
                options=dp.DevicePluginOptions(get_preferred_allocation_available=True)), timeout=10)
        kubelet.wait_for_devices(resource, len(POOL))
        assert kubelet.offers_preferred_allocation(resource)

        available = A + ids(PF_B, 3, 4, 5, 6, 7)
        answer = kubelet.preferred_allocation(resource, available, [vf_id(PF_A, 5)], 3)

        assert answer == ids(PF_A, 5, 0, 1)
        [sent] = plugin.requests
        [container] = sent.container_requests
        assert (list(container.available_deviceIDs), list(container.must_include_deviceIDs),
                container.allocation_size) == (available, [vf_id(PF_A, 5)], 3)
        assert not kubelet.offers_preferred_allocation("example.com/other")
        with pytest.raises(AssertionError, match="does not offer GetPreferredAllocation"):
            kubelet.preferred_allocation("example.com/other", A, [], 1)
    finally:
        plugin.stopped.set()
        server.stop(0)

"""A DRA pool as ResourceSlices: which devices a slice carries, their attributes as the API
server accepts them, and how a pool is cut into slices of one generation."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from kubernetes.client import ApiClient

from daemon.core import UNHEALTHY, AttributeValue, DeviceInfo, Fault, ResourcePool
from daemon.core._names import dns_subdomain_problem
from daemon.core._tree import CARRIER_LOST, DRA_ROAD
from daemon.dra import device_name, pool_name, qualified_name_problem, slice_bodies, slice_devices, string_problem
from daemon.dra._devices import Memo
from daemon.dra._slices import generate_name, slice_updates
from tests import trees
from tests.fakesysfs import FakeHost
from tests.pci import Pci

DRIVER = "devplugd.io"
NODE = "node1"
NODE_UID = "6f1d7a62-3c39-4b8e-9f54-2d0a1e7b9c10"
PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]
VF_NAMES = [device_name(vf) for vf in VFS]
THINGS = "example.com/things"


class Describer:
    """A describer that says what it is told to, or fails."""

    def __init__(self, attributes: Mapping[str, Any] | None = None, error: Exception | None = None) -> None:
        self.attributes = dict(attributes or {})
        self.error = error

    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        if self.error is not None:
            raise self.error
        return self.attributes


def names(devices: list[dict[str, Any]]) -> list[str]:
    return [device["name"] for device in devices]


def dra_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "devplugd.dra"]


@pytest.fixture
def vf_pool(pci: Pci, host: FakeHost) -> ResourcePool:
    """Four iavf VFs of PF ens1f0, from the PCI handler's scan and build, served through DRA."""
    host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592")
    host.add_vfs(PF, VFS, driver="iavf", device="1889", iommu_groups=[40, 41, 42, 43],
                 netdev_names=[f"ens1f0v{i}" for i in range(4)])
    pool = pci.pool({"resourceName": "sriov_vfs", "allocationApi": "dra", "selectors": {"drivers": ["iavf"]}})
    return replace(pool, road="dra")


# -- which devices ----------------------------------------------------------------------------


def test_every_healthy_free_device_is_published_in_listing_order(vf_pool: ResourcePool, pci: Pci) -> None:
    devices = slice_devices(vf_pool, DRIVER, pci.handler)
    assert names(devices) == VF_NAMES
    assert [device["attributes"]["id"] for device in devices] == [{"string": vf} for vf in VFS]


@pytest.mark.parametrize("hold", ["leased", "kubelet_held", "vanished"])
def test_held_and_vanished_devices_are_left_out(vf_pool: ResourcePool, pci: Pci, hold: str) -> None:
    pool = replace(vf_pool, **{hold: frozenset({VFS[1]})})
    assert names(slice_devices(pool, DRIVER, pci.handler)) == [VF_NAMES[0], VF_NAMES[2], VF_NAMES[3]]


def test_devices_prepared_for_claims_stay_in_the_slice(vf_pool: ResourcePool, pci: Pci) -> None:
    # the scheduler allocated them from this slice; their claims are what counts them taken
    pool = replace(vf_pool, claimed=frozenset({VFS[1]}))
    assert names(slice_devices(pool, DRIVER, pci.handler)) == VF_NAMES


def test_unhealthy_devices_are_left_out(vf_pool: ResourcePool, pci: Pci) -> None:
    devices = dict(vf_pool.devices)
    devices[VFS[2]] = replace(devices[VFS[2]], health=UNHEALTHY)
    pool = replace(vf_pool, devices=devices)
    assert names(slice_devices(pool, DRIVER, pci.handler)) == [VF_NAMES[0], VF_NAMES[1], VF_NAMES[3]]


def test_a_pool_with_nothing_to_offer_publishes_no_devices(vf_pool: ResourcePool, pci: Pci) -> None:
    pool = replace(vf_pool, leased=frozenset(VFS[:2]), kubelet_held=frozenset(VFS[2:]))
    assert slice_devices(pool, DRIVER, pci.handler) == []


def test_device_order_is_the_device_ids_order_not_the_pools(pci: Pci) -> None:
    pool = trees.pool(THINGS, ["kvm-2", "kvm-10", "kvm-1"])
    assert names(slice_devices(pool, DRIVER, None)) == ["kvm-1", "kvm-10", "kvm-2"]


def test_two_ids_with_one_device_name_keep_the_first_and_log_the_second(caplog: pytest.LogCaptureFixture) -> None:
    hashed = device_name("A")  # "A" is no DNS label: its name is "a-<hash>", itself a DNS label
    pool = trees.pool(THINGS, ["A", hashed])
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        devices = slice_devices(pool, DRIVER, None)
    assert [device["attributes"]["id"]["string"] for device in devices] == ["A"]
    (message,) = dra_messages(caplog)
    assert f"device {hashed} left out" in message and "is the name of device A" in message


# -- core attributes --------------------------------------------------------------------------


def test_core_attributes_are_the_id_the_resource_and_a_single_numa_node_also_by_its_standard_name() -> None:
    pool = trees.pool(THINGS, {
        "one": DeviceInfo(numa_nodes=(1,)), "two": DeviceInfo(numa_nodes=(0, 1)), "none": DeviceInfo()})
    attributes = {device["name"]: device["attributes"] for device in slice_devices(pool, DRIVER, None)}
    assert attributes["one"] == {"id": {"string": "one"}, "resourceName": {"string": "example.com/things"},
                                 "numaNode": {"int": 1}, "resource.kubernetes.io/numaNode": {"int": 1}}
    for unknown in ("two", "none"):  # several nodes, or none known (sysfs -1): no NUMA attribute at all
        assert set(attributes[unknown]) == {"id", "resourceName"}


def test_bools_are_bools_and_ints_are_ints() -> None:
    describer = Describer({"sriov": True, "count": 1, "zero": 0, "off": False})
    (device,) = slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer)
    assert {name: device["attributes"][name] for name in ("sriov", "count", "zero", "off")} == {
        "sriov": {"bool": True}, "count": {"int": 1}, "zero": {"int": 0}, "off": {"bool": False}}
    assert json.dumps(device["attributes"]["sriov"]) == '{"bool": true}'


def test_prefixed_attributes_keep_their_domain_and_our_own_domain_is_dropped() -> None:
    describer = Describer({"resource.kubernetes.io/pciBusID": "0000:3b:02.0", f"{DRIVER}/model": "x710"})
    (device,) = slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer)
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:3b:02.0"}
    assert device["attributes"]["model"] == {"string": "x710"}
    assert f"{DRIVER}/model" not in device["attributes"]


# -- bad attributes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("long", "x" * 65, "longer than 64 bytes"),
        ("accented", "é" * 33, "longer than 64 bytes"),  # 33 characters, 66 bytes
        ("bad name", "v", "not a C identifier"),
        ("1st", "v", "not a C identifier"),
        ("x" * 33, "v", "longer than 32 characters"),
        ("a/b/c", "v", "more than one '/'"),
        ("Example.COM/x", "v", "domain 'Example.COM'"),
        ("/x", "v", "domain ''"),
        ("ratio", 0.5, "a float is not an int, bool or string"),
        ("missing", None, "a NoneType is not"),
        ("huge", 2**63, "does not fit in int64"),
        ("id", "other", "'id' is set already"),
        (f"{DRIVER}/resourceName", "other", "'resourceName' is set already"),
    ],
)
def test_an_attribute_the_server_would_refuse_is_left_out_with_its_reason(
    caplog: pytest.LogCaptureFixture, name: str, value: Any, reason: str
) -> None:
    describer = Describer({name: value, "fine": "yes"})
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        (device,) = slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer)
    assert device["attributes"]["fine"] == {"string": "yes"}
    assert device["attributes"]["id"] == {"string": "a"}
    assert device["attributes"]["resourceName"] == {"string": "example.com/things"}
    if name != "id":
        assert name not in device["attributes"]
    (message,) = dra_messages(caplog)
    assert f"device a: attribute {name!r} left out" in message and reason in message


def test_a_describer_that_fails_contributes_nothing_and_the_device_is_still_published(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        devices = slice_devices(trees.pool(THINGS, ["a", "b"]), DRIVER, Describer(error=KeyError("gone")))
    assert [set(device["attributes"]) for device in devices] == [{"id", "resourceName"}] * 2
    assert dra_messages(caplog) == [
        f"example.com/things: device {i}: its handler's attributes left out of its ResourceSlice: "
        "the handler failed: KeyError: 'gone'" for i in ("a", "b")]


def test_attributes_beyond_32_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    describer = Describer({f"a{index:02}": index for index in range(40)})
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        (device,) = slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer)
    assert len(device["attributes"]) == 32
    assert "a29" in device["attributes"] and "a30" not in device["attributes"]  # id, resourceName, a00..a29
    assert len(dra_messages(caplog)) == 10
    assert all("at most 32 attributes" in message for message in dra_messages(caplog))


def test_a_long_device_id_loses_its_id_attribute_not_its_place(caplog: pytest.LogCaptureFixture) -> None:
    device_id = "d" * 70
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        (device,) = slice_devices(trees.pool(THINGS, [device_id]), DRIVER, None)
    assert device["name"] == device_name(device_id) and "id" not in device["attributes"]
    assert len(dra_messages(caplog)) == 1


def test_a_resource_name_too_long_for_its_attribute_publishes_no_devices(caplog: pytest.LogCaptureFixture) -> None:
    resource = "devices." + "a" * 50 + ".example.com/things"
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        assert slice_devices(trees.pool(resource, ["a"]), DRIVER, None) == []
    (message,) = dra_messages(caplog)
    assert message.startswith(f"{resource}: no devices published") and "longer than 64 bytes" in message


def test_a_problem_is_logged_once_across_publications_given_the_same_seen_set(caplog: pytest.LogCaptureFixture) -> None:
    describer = Describer({"bad name": 1})
    seen: set[str] = set()
    with caplog.at_level(logging.WARNING, "devplugd.dra"):
        for _ in range(3):
            slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer, seen=seen)
        slice_devices(trees.pool(THINGS, ["a"]), DRIVER, describer)  # no set: logged again
    assert len(dra_messages(caplog)) == 2


@pytest.mark.parametrize(
    ("name", "valid"),
    [("id", True), ("_x9", True), ("a" * 32, True), ("resource.kubernetes.io/pciBusID", True),
     ("gpu.nvidia.com/uuid", True), ("a" * 33, False), ("9x", False), ("x-y", False), ("", False),
     ("a.b/", False), ("UPPER.io/x", False), ("a/b/c", False), (("d" * 64) + ".io/x", False)],
)
def test_qualified_names(name: str, valid: bool) -> None:
    assert (qualified_name_problem(name) is None) == valid


def test_string_length_is_counted_in_bytes() -> None:
    assert string_problem("x" * 64) is None
    assert string_problem("é" * 32) is None
    assert string_problem("é" * 33) is not None


# -- slices -------------------------------------------------------------------------------------


def bodies(devices: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    arguments: dict[str, Any] = {"driver": DRIVER, "node_name": NODE, "node_uid": NODE_UID,
                                 "pool_name": pool_name(NODE, "example.com/things"), "generation": 7,
                                 "devices": devices, **fields}
    return slice_bodies(**arguments)


def test_300_devices_are_three_slices_of_one_generation_in_order() -> None:
    devices = slice_devices(trees.pool(THINGS, [f"dev-{index:03}" for index in range(300)]), DRIVER, None)
    slices = bodies(devices)
    assert [len(body["spec"]["devices"]) for body in slices] == [128, 128, 44]
    assert [body["spec"]["pool"] for body in slices] == [
        {"name": "node1/example.com/things", "generation": 7, "resourceSliceCount": 3}] * 3
    assert [device for body in slices for device in body["spec"]["devices"]] == devices
    assert [body["metadata"]["generateName"] for body in slices] == [
        "00000-devplugd.io-node1-", "00001-devplugd.io-node1-", "00002-devplugd.io-node1-"]


def test_a_slice_is_owned_by_its_node_and_says_who_made_it() -> None:
    (body,) = bodies(slice_devices(trees.pool(THINGS, ["a"]), DRIVER, None))
    assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "ResourceSlice"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}]
    assert body["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "devplugd"}
    assert body["spec"]["driver"] == DRIVER and body["spec"]["nodeName"] == NODE


def test_without_the_node_uid_there_is_no_owner() -> None:
    (body,) = bodies([], node_uid=None)
    assert "ownerReferences" not in body["metadata"]


def test_an_empty_pool_is_one_empty_slice() -> None:
    (body,) = bodies([])
    assert body["spec"]["devices"] == []
    assert body["spec"]["pool"]["resourceSliceCount"] == 1


def test_a_smaller_slice_size_is_honoured_and_a_bad_one_refused() -> None:
    devices = slice_devices(trees.pool(THINGS, [f"d{index}" for index in range(5)]), DRIVER, None)
    assert [len(body["spec"]["devices"]) for body in bodies(devices, max_devices=2)] == [2, 2, 1]
    for bad in (0, 129):
        with pytest.raises(ValueError, match="max_devices"):
            bodies(devices, max_devices=bad)
    with pytest.raises(ValueError, match="generation"):
        bodies(devices, generation=-1)


def test_generate_name_index_grows_past_five_hex_digits_and_the_name_is_cut_to_58() -> None:
    assert generate_name(0, 1, DRIVER, NODE) == "00000-devplugd.io-node1-"
    assert generate_name(3, 0x100001, DRIVER, NODE) == "000003-devplugd.io-node1-"
    long = generate_name(1, 2, "a" * 63, "n" * 253)
    assert len(long) == 58 and long.startswith("00001-" + "a" * 52)


def test_slices_are_what_the_kubernetes_client_models_read(vf_pool: ResourcePool, pci: Pci) -> None:
    """Every key is one the v1 models know, with the shape they expect: a round trip through
    V1ResourceSlice gives the same object back."""
    client = ApiClient()
    for body in bodies(slice_devices(vf_pool, DRIVER, pci.handler)) + bodies([]):
        model = client.deserialize(SimpleNamespace(data=json.dumps(body)), "V1ResourceSlice")
        assert client.sanitize_for_serialization(model) == body


class CountingDescriber:
    """A describer that counts the devices it is asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def dra_attributes(self, pool: ResourcePool, device_id: str) -> dict[str, object]:
        self.asked.append(device_id)
        return {"serial": f"s-{device_id}"}


def test_a_memo_describes_again_only_the_devices_whose_record_changed() -> None:
    pool = trees.pool(THINGS, ["kvm-0", "kvm-1", "kvm-2"])
    describer = CountingDescriber()
    memo = Memo()
    first = slice_devices(pool, DRIVER, describer, memo=memo)  # type: ignore[arg-type]
    devices = dict(pool.devices)
    devices["kvm-1"] = DeviceInfo(numa_nodes=(1,))  # a new record for one device
    del devices["kvm-2"]
    describer.asked.clear()
    second = slice_devices(replace(pool, devices=devices), DRIVER, describer, memo=memo)  # type: ignore[arg-type]
    assert describer.asked == ["kvm-1"]
    assert second[0] is first[0] and second[1]["attributes"]["numaNode"] == {"int": 1}
    assert set(memo.entries) == {"kvm-0", "kvm-1"}  # what left the pool leaves the memo
    assert second == slice_devices(replace(pool, devices=devices), DRIVER, describer)  # type: ignore[arg-type]


def test_a_memo_asks_the_rule_again_when_the_pool_holds_devices_otherwise() -> None:
    """The same records, but a device leased (or vanished, or held by the kubelet): the rule's
    answer changes though no record did, and the memo must not answer for it."""
    pool = trees.pool(THINGS, ["kvm-0", "kvm-1"], road=DRA_ROAD)
    memo = Memo()
    assert [d["name"] for d in slice_devices(pool, DRIVER, None, memo=memo)] == ["kvm-0", "kvm-1"]
    leased = replace(pool, leased=frozenset({"kvm-1"}))
    assert [d["name"] for d in slice_devices(leased, DRIVER, None, memo=memo)] == ["kvm-0"]
    assert [d["name"] for d in slice_devices(pool, DRIVER, None, memo=memo)] == ["kvm-0", "kvm-1"]
    sick = trees.pool(THINGS, ["kvm-0", "kvm-1"], road=DRA_ROAD, unhealthy=["kvm-0"])
    records = dict(sick.devices)
    pool = replace(pool, devices=MappingProxyType({"kvm-0": records["kvm-0"], "kvm-1": pool.devices["kvm-1"]}))
    assert [d["name"] for d in slice_devices(pool, DRIVER, None, memo=memo)] == ["kvm-1"]
    tainted = slice_devices(pool, DRIVER, None, taint_effect="NoSchedule", memo=memo)
    assert [(d["name"], [t["key"] for t in d.get("taints", [])]) for d in tainted] == [
        ("kvm-0", [f"{DRIVER}/unhealthy"]), ("kvm-1", [])]


def test_a_long_node_name_cut_on_a_dot_still_gives_a_valid_generate_name() -> None:
    from daemon.dra._slices import generate_name

    node = "worker-0123456789-abcdefghijklmnopqrstu.eu-west-1.compute.internal"
    name = generate_name(0, 1, "devplugd.io", node)
    assert len(name) <= 58 and not name.endswith(".")
    assert dns_subdomain_problem(name.rstrip("-") + "abcde") is None


# -- changes in place ----------------------------------------------------------------------------


def _on_server(*slices: list[str], generation: int = 1, count: int | None = None) -> list[dict[str, Any]]:
    return [{"metadata": {"name": f"{index:05x}-s"},
             "spec": {"pool": {"generation": generation, "resourceSliceCount": count or len(slices)},
                      "devices": [{"name": name} for name in names]}}
            for index, names in enumerate(slices)]


def _names(updates: dict[str, list[Any]] | None) -> dict[str, list[str]] | None:
    return None if updates is None else {slice_name: [d["name"] for d in kept] for slice_name, kept in updates.items()}


def test_a_change_in_place_keeps_each_device_in_its_slice_and_fills_the_first_with_room() -> None:
    server = _on_server(["a", "b"], ["c", "d"])
    wanted = [{"name": n} for n in ("a", "c", "d", "z")]
    assert _names(slice_updates(server, wanted, max_devices=2)) == {"00000-s": ["a", "z"]}
    assert _names(slice_updates(server, [{"name": n} for n in "abcd"], max_devices=2)) == {}
    changed = {"name": "c", "attributes": {"x": {"int": 1}}}  # an attribute (or a taint) of one device
    assert slice_updates(server, [{"name": "a"}, {"name": "b"}, changed, {"name": "d"}], max_devices=2) == {
        "00001-s": [changed, {"name": "d"}]}


def test_what_needs_a_new_generation_is_not_done_in_place() -> None:
    server = _on_server(["a", "b"], ["c", "d"])
    abcde = [{"name": n} for n in "abcde"]
    assert slice_updates(server, abcde, max_devices=2) is None  # no room
    assert slice_updates(server, [{"name": "a"}, {"name": "b"}], max_devices=2) is None  # a slice left empty
    assert slice_updates(server, [{"name": n} for n in "abcd"], max_devices=1) is None  # the cap went down
    assert slice_updates(_on_server(["a"], ["a"]), [{"name": "a"}]) is None  # a name in two slices
    assert slice_updates(server, [{"name": "a"}, {"name": "a"}]) is None  # a name twice
    assert slice_updates(_on_server(["a"], ["b"], count=3), [{"name": "a"}, {"name": "b"}]) is None  # incomplete
    mixed = [*_on_server(["a"]), *_on_server(["b"], generation=2)]
    assert slice_updates(mixed, [{"name": "a"}, {"name": "b"}]) is None
    assert slice_updates([], [{"name": "a"}]) is None
    assert _names(slice_updates(_on_server([]), [])) == {}  # an empty pool stays one empty slice


def test_replacements_find_what_slice_updates_finds_for_changed_entries_and_nothing_else() -> None:
    from daemon.dra._slices import replacements

    devices = [{"name": f"d{i:04d}", "attributes": {}} for i in range(200)]
    bodies = slice_bodies(driver=DRIVER, node_name="n", node_uid=None, pool_name="p", generation=1,
                          devices=devices, max_devices=64)
    for index, body in enumerate(bodies):
        body["metadata"]["name"] = f"{index:05x}-s"
    held = {body["metadata"]["name"]: body["spec"]["devices"] for body in bodies}
    where = {device["name"]: name for name, listed in held.items() for device in listed}
    changed = list(devices)
    for index in (3, 70, 71, 199):  # a taint on four devices, in three slices
        changed[index] = {**devices[index], "taints": [{"key": f"{DRIVER}/carrier-lost", "effect": "NoSchedule"}]}
    fast = replacements(devices, changed, held, where)
    assert fast == slice_updates(bodies, changed, 64, held)
    assert fast is not None and sorted(fast) == ["00000-s", "00001-s", "00003-s"]
    assert replacements(devices, devices, held, where) == {}
    # a device gone, added or renamed is not a replacement: slice_updates decides
    assert replacements(devices, changed[1:], held, where) is None
    assert replacements(devices, [*changed[:-1], {"name": "e-new", "attributes": {}}], held, where) is None


def test_a_memo_patched_for_a_few_changed_records_says_what_a_fresh_walk_says() -> None:
    """Records changing one at a time (a taint coming and going, a NUMA node, a device turning
    Unhealthy in a pool that leaves it out, a lease): the list made from the last one is the
    list made from nothing, every step."""
    base = {f"d{i:03d}": DeviceInfo(numa_nodes=(0,)) for i in range(40)}
    lost = Fault(CARRIER_LOST, "ens1", "link ens1 is up without carrier")
    steps = [
        (dict(base), "NoSchedule", ()),
        ({**base, "d007": DeviceInfo(health=UNHEALTHY, fault=lost)}, "NoSchedule", ()),
        ({**base, "d007": DeviceInfo(health=UNHEALTHY, fault=lost), "d008": DeviceInfo(numa_nodes=(1,))},
         "NoSchedule", ()),
        ({**base, "d008": DeviceInfo(numa_nodes=(1,))}, "NoSchedule", ()),
        ({**base, "d009": DeviceInfo(health=UNHEALTHY)}, None, ()),  # left out: the list is walked again
        ({**base, "d009": DeviceInfo(health=UNHEALTHY)}, None, ("d010",)),  # a lease: another context
        (dict(base), None, ("d010",)),
    ]
    memo = Memo()
    for records, effect, leased in steps:
        offered = replace(trees.pool(THINGS, records, road=DRA_ROAD), leased=frozenset(leased))
        made = slice_devices(offered, DRIVER, None, taint_effect=effect, memo=memo)
        assert made == slice_devices(offered, DRIVER, None, taint_effect=effect)


def test_a_claim_prepared_or_unprepared_changes_nothing_the_slices_say_and_the_memo_keeps_its_list() -> None:
    """The slices do not count claims (a prepared device stays published): a pool that differs
    only in what is claimed gives the same list, the very object, with no device asked again."""
    pool = trees.pool(THINGS, ["kvm-0", "kvm-1"], road=DRA_ROAD)
    describer = CountingDescriber()
    memo = Memo()
    first = slice_devices(pool, DRIVER, describer, memo=memo)  # type: ignore[arg-type]
    describer.asked.clear()
    claimed = slice_devices(replace(pool, claimed=frozenset({"kvm-1"})), DRIVER, describer,  # type: ignore[arg-type]
                            memo=memo)
    assert claimed is first and describer.asked == []

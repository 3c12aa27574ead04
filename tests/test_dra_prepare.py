"""Preparing DRA claims (ClaimPreparer) on a fake host: real PCI pools (a PF with VFs on iavf and
on vfio-pci) and a devNode pool, real CDI specs, device-info files and checkpoints in temporary
directories, and a stand-in for the API server's ResourceClaim GET."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio_asyncio
from trio_asyncio import aio_as_trio

from daemon._generated.dra.v1 import api_pb2 as dra
from daemon._generated.dra.v1 import api_pb2_grpc as dra_grpc
from daemon.cdi import CdiWriter
from daemon.core import UNHEALTHY, ResourcePool
from daemon.core._handler import Hooks, allocate_container
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, DeviceTree
from daemon.dra import device_name, pool_name
from daemon.dra._claims import ClaimNotFound, ClaimRef
from daemon.dra._prepare import ClaimPreparer, PrepareResult
from daemon.dra._prepared import CLAIMS_FILE, ClaimBook
from daemon.dra._servicer import DraPluginServicer, add_to_server
from daemon.sockets import start_unix_server
from tests import trees
from tests.books import book_document, plant_book
from tests.devnodes import DevNodes, mknod
from tests.fakesysfs import FakeHost
from tests.pci import Pci

DRIVER = "devplugd.io"
NODE = "node1"
PF = "0000:3b:00.0"
NET_VFS = ["0000:3b:02.0", "0000:3b:02.1"]  # iavf, with netdevs: intel.com/sriov_net
VFIO_VFS = ["0000:3b:02.2", "0000:3b:02.3"]  # vfio-pci, IOMMU groups 42 and 43: intel.com/dpdk
NET = "intel.com/sriov_net"
VFIO_CONFIG = {"apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig"}
DPDK = "intel.com/dpdk"
KVM = "devices.kubevirt.io/kvm"
OTHER_DRIVER = "gpu.example.com"


def uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def result(resource: str, device_id: str, request: str = "req", *, driver: str = DRIVER,
           admin: bool | None = None) -> dict[str, Any]:
    """One ``status.allocation.devices.results[]`` entry as the API server writes it."""
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": pool_name(NODE, resource),
                             "device": device_name(device_id)}
    if admin is not None:
        entry["adminAccess"] = admin
    return entry


def claim_json(n: int, name: str, results: list[dict[str, Any]], *, namespace: str = "default",
               config: list[dict[str, Any]] | None = None, allocated: bool = True) -> dict[str, Any]:
    """A ResourceClaim as ``GET .../resourceclaims/<name>`` returns it (dra-api.md §5.1)."""
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid(n), "resourceVersion": "7"},
        "spec": {"devices": {"requests": [{"name": "req", "exactly": {"deviceClassName": "vf", "count": 1}}]}},
        "status": {"reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": uid(900 + n)}]},
    }
    if allocated:
        claim["status"]["allocation"] = {
            "devices": {"results": results, "config": config or []},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
            "allocationTimestamp": "2026-01-01T00:00:00Z",
        }
    return claim


class FakeApi:
    """The API server's ResourceClaim GET: claims by (namespace, name); ``errors`` makes a GET
    raise, ``hang`` makes it never answer."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.errors: dict[tuple[str, str], Exception] = {}
        self.hang: set[tuple[str, str]] = set()
        self.calls: list[tuple[str, str]] = []

    def add(self, claim: dict[str, Any]) -> ClaimRef:
        metadata = claim["metadata"]
        self.claims[(metadata["namespace"], metadata["name"])] = claim
        return ClaimRef(metadata["namespace"], metadata["uid"], metadata["name"])

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append((namespace, name))
        await trio.sleep(0)
        if (namespace, name) in self.hang:
            await trio.sleep_forever()
        if (namespace, name) in self.errors:
            raise self.errors[(namespace, name)]
        if (namespace, name) not in self.claims:
            raise ClaimNotFound(f'resourceclaims.resource.k8s.io "{name}" not found')
        return copy.deepcopy(self.claims[(namespace, name)])


class Node:
    """One node's pools, API stand-in, claim book and preparer, all on real files."""

    def __init__(self, root: Path, host: FakeHost, pci: Pci) -> None:
        self.root = root
        self.pci = pci
        self.cdi_dir = root / "cdi"
        self.state_dir = root / "state"
        self.devinfo_dir = pci.devinfo_dir
        host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592")
        host.add_vfs(PF, NET_VFS + VFIO_VFS, driver="iavf", device="1889", iommu_groups=[40, 41, 42, 43],
                     netdev_names=["ens1f0v0", "ens1f0v1", "", ""])
        for vf in VFIO_VFS:
            host.bind(vf, "vfio-pci")
        self.devnodes = DevNodes(host)
        mknod(host.dev, "kvm", 10, 232)
        pools = pci.pools(
            {"resourceName": "sriov_net", "allocationApi": "dra", "selectors": {"drivers": ["iavf"]}},
            {"resourceName": "dpdk", "allocationApi": "dra", "selectors": {"drivers": ["vfio-pci"]}},
        )
        (kvm_config,) = self.devnodes.configure({"resourceName": "kvm", "allocationApi": "dra", "count": 3,
                                                 "selectors": {"paths": ["/dev/kvm"]}})
        kvm_devices = self.devnodes.handler.build(self.devnodes.handler.scan(), [kvm_config])[KVM]
        pools[KVM] = trees.pool(kvm_config, kvm_devices)
        self.pools = {resource: dataclasses.replace(pool, road=DRA_ROAD) for resource, pool in pools.items()}
        self.version = 1
        self.hooks = {"pci": Hooks.of(pci.handler), "devnode": Hooks.of(self.devnodes.handler)}
        self.api = FakeApi()
        self.changes: list[str] = []
        self.restart()

    def restart(self, **options: Any) -> None:
        """A new book and preparer on the same directories, as after a daemon restart."""
        self.book = ClaimBook(self.state_dir)
        self.book.load()
        self.preparer = ClaimPreparer(DRIVER, NODE, self.cdi_dir, self.book, self.tree, self.hooks,
                                      self.api.get_claim, self.changes.append, **options)

    def tree(self) -> DeviceTree:
        return trees.tree(*self.pools.values(), version=self.version)

    def change_pool(self, resource: str, **changes: Any) -> None:
        self.pools[resource] = dataclasses.replace(self.pools[resource], **changes)
        self.version += 1

    async def prepare(self, *refs: ClaimRef) -> dict[str, PrepareResult]:
        return await self.preparer.prepare(list(refs))

    async def prepare_one(self, ref: ClaimRef) -> PrepareResult:
        return (await self.prepare(ref))[ref.uid]

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"devplugd-claim-{claim_uid}.json"

    def spec(self, claim_uid: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.spec_path(claim_uid).read_text())
        return document

    def checkpoint(self) -> dict[str, Any]:
        document: dict[str, Any] = book_document(self.state_dir / CLAIMS_FILE)
        return document

    def devinfo_files(self) -> list[str]:
        return sorted(p.name for p in self.devinfo_dir.iterdir()) if self.devinfo_dir.exists() else []

    def device_plugin_envs(self, resource: str, device_ids: list[str]) -> dict[str, str]:
        """What a device-plugin Allocate of these devices puts in the container's env."""
        pool = self.pools[resource]
        return allocate_container(self.hooks[pool.handler], pool, device_ids).envs


def claim_labels(node: Node) -> dict[tuple[str, str], str]:
    """(resource, device ID) -> ``claim <namespace>/<name>`` of what the claim book holds."""
    return {key: f"claim {holder.name}" for key, holder in node.book.holders().items()}


@pytest.fixture
def node(short_tmp: Path, host: FakeHost, pci: Pci) -> Node:
    return Node(short_tmp, host, pci)


def env_of(edits: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in edits.get("env", []))


def nodes_of(edits: dict[str, Any]) -> list[str]:
    return [node["path"] for node in edits.get("deviceNodes", [])]


# -- what a prepared claim gets ---------------------------------------------------------------


async def test_prepare_answers_the_devices_with_their_claim_cdi_ids(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk"), result(NET, NET_VFS[1], "net")]))
    answer = await node.prepare_one(ref)
    assert answer.error is None
    assert [(d.pool_name, d.device_name, d.request_names, d.cdi_id) for d in answer.devices] == [
        ("node1/intel.com/dpdk", "0000-3b-02-2", ("dpdk",), f"devplugd.io/claim={uid(1)}-0000-3b-02-2"),
        ("node1/intel.com/sriov-net", "0000-3b-02-1", ("net",), f"devplugd.io/claim={uid(1)}-0000-3b-02-1"),
    ]
    assert node.changes == ["claim default/vfs prepared"]


async def test_claim_spec_has_one_cdi_device_per_device_with_its_device_nodes(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0]), result(DPDK, VFIO_VFS[1]),
                                             result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    spec = node.spec(uid(1))
    assert (spec["cdiVersion"], spec["kind"]) == ("0.3.0", "devplugd.io/claim")
    devices = {device["name"]: device["containerEdits"] for device in spec["devices"]}
    assert list(devices) == [f"{uid(1)}-0000-3b-02-2", f"{uid(1)}-0000-3b-02-3", f"{uid(1)}-0000-3b-02-0"]
    assert nodes_of(devices[f"{uid(1)}-0000-3b-02-2"]) == ["/dev/vfio/vfio", "/dev/vfio/42"]
    assert nodes_of(devices[f"{uid(1)}-0000-3b-02-3"]) == ["/dev/vfio/vfio", "/dev/vfio/43"]
    assert nodes_of(devices[f"{uid(1)}-0000-3b-02-0"]) == []
    # every CDI device has edits of its own (CDI refuses a device without): its ID under its name
    assert env_of(devices[f"{uid(1)}-0000-3b-02-0"])["DEVPLUGD_INTEL_COM_SRIOV_NET_0000_3B_02_0"] == NET_VFS[0]
    assert "containerEdits" not in spec  # what a container gets comes with the devices it is given


def allocation_env(edits: dict[str, Any]) -> dict[str, str]:
    """A CDI device's env less its own ``DEVPLUGD_<RESOURCE>_<DEVICE>`` line."""
    return {key: value for key, value in env_of(edits).items() if not key.startswith("DEVPLUGD_")}


async def test_claim_spec_env_is_what_a_device_plugin_allocate_of_the_same_devices_gives(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[1]), result(DPDK, VFIO_VFS[0]),
                                             result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    devices = {device["name"]: device["containerEdits"] for device in node.spec(uid(1))["devices"]}
    dpdk = node.device_plugin_envs(DPDK, [VFIO_VFS[1], VFIO_VFS[0]])
    net = node.device_plugin_envs(NET, [NET_VFS[0]])
    # each device of a request carries that request's whole answer, so a container given any of them has it
    assert allocation_env(devices[f"{uid(1)}-0000-3b-02-3"]) == allocation_env(devices[f"{uid(1)}-0000-3b-02-2"]) == dpdk
    assert allocation_env(devices[f"{uid(1)}-0000-3b-02-0"]) == net
    assert dpdk["PCIDEVICE_INTEL_COM_DPDK"] == "0000:3b:02.3,0000:3b:02.2"
    assert set(dpdk) == {"PCIDEVICE_INTEL_COM_DPDK", "PCIDEVICE_INTEL_COM_DPDK_INFO", "PCI_RESOURCE_INTEL_COM_DPDK"}


async def test_each_request_of_a_claim_is_its_own_allocate_as_each_container_of_a_pod_is(node: Node) -> None:
    # The claim the scheduler makes for resources.limits (KEP-5004): one request per container.
    ref = node.api.add(claim_json(1, "pod-vfs", [result(DPDK, VFIO_VFS[0], "container-0-dpdk"),
                                                 result(DPDK, VFIO_VFS[1], "container-1-dpdk")]))
    await node.prepare_one(ref)
    devices = {device["name"]: device["containerEdits"] for device in node.spec(uid(1))["devices"]}
    first, second = devices[f"{uid(1)}-0000-3b-02-2"], devices[f"{uid(1)}-0000-3b-02-3"]
    assert allocation_env(first) == node.device_plugin_envs(DPDK, [VFIO_VFS[0]])
    assert allocation_env(second) == node.device_plugin_envs(DPDK, [VFIO_VFS[1]])
    assert env_of(first)["PCIDEVICE_INTEL_COM_DPDK"] == VFIO_VFS[0]  # never its neighbour's VF


async def test_no_iommu_group_node_needs_host_path_and_cdi_version_0_5(node: Node, host: FakeHost, pci: Pci) -> None:
    host.set_iommu_group(VFIO_VFS[0], 42, noiommu=True)
    node.pools[DPDK] = dataclasses.replace(pci.pools({"resourceName": "dpdk", "allocationApi": "dra",
                                                      "selectors": {"drivers": ["vfio-pci"]}})[DPDK], road=DRA_ROAD)
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0])]))
    await node.prepare_one(ref)
    spec = node.spec(uid(1))
    assert spec["cdiVersion"] == "0.5.0"
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/vfio/vfio", "permissions": "rw"},
        {"path": "/dev/vfio/42", "permissions": "rw", "hostPath": "/dev/vfio/noiommu-42"}]


async def test_devnode_claim_gets_the_node(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vm", [result(KVM, "kvm-1", "kvm")]))
    answer = await node.prepare_one(ref)
    assert [d.device_name for d in answer.devices] == ["kvm-1"]
    (device,) = node.spec(uid(1))["devices"]
    assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/kvm", "permissions": "rw"}]


# -- shared devices (KEP-5075): one device, many claims, a share each --------------------------
def share(request: str = "req", share_id: str = "s-1", consumed: str | None = None) -> dict[str, Any]:
    """A result naming the shared /dev/kvm (published as one device ``kvm``) with its share ID."""
    entry = {"request": request, "driver": DRIVER, "pool": pool_name(NODE, KVM), "device": "kvm", "shareID": share_id}
    if consumed is not None:
        entry["consumedCapacity"] = {"shares": consumed}
    return entry


async def test_two_claims_share_one_device_each_with_its_share_and_unprepare_frees_that_share(node: Node) -> None:
    first = node.api.add(claim_json(1, "vm-a", [share(share_id="aaaa")]))
    second = node.api.add(claim_json(2, "vm-b", [share(share_id="bbbb")]))
    answers = await node.prepare(first, second)
    (a,), (b,) = answers[uid(1)].devices, answers[uid(2)].devices
    # each answered with its result's share ID, each holding a share (a copy) of its own
    assert (a.device_name, a.share_id, b.device_name, b.share_id) == ("kvm", "aaaa", "kvm", "bbbb")
    assert a.device_id != b.device_id and {a.device_id, b.device_id} <= {"kvm-0", "kvm-1", "kvm-2"}
    for n in (1, 2):
        (device,) = node.spec(uid(n))["devices"]
        assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/kvm", "permissions": "rw"}]
    # the third share goes to a third claim; a fourth has none left and is refused, naming why
    third = node.api.add(claim_json(3, "vm-c", [share(share_id="cccc")]))
    assert (await node.prepare_one(third)).error is None
    fourth = node.api.add(claim_json(4, "vm-d", [share(share_id="dddd")]))
    refused = (await node.prepare_one(fourth)).error
    assert "device 'kvm' of devices.kubevirt.io/kvm has 0 of its 3 shares free" in refused
    assert "prepared for claim" in refused
    # an unprepare frees its share for the next claim
    await node.preparer.unprepare([first])
    again = await node.prepare_one(fourth)
    assert again.error is None and again.devices[0].device_id == a.device_id


async def test_one_claim_may_hold_two_shares_of_a_device_and_consume_more_than_one(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vm", [share("one", "s-1"), share("two", "s-2", consumed="2")]))
    answer = await node.prepare_one(ref)
    assert [(d.share_id, d.request_names) for d in answer.devices] == [("s-1", ("one",)), ("s-2", ("two",)),
                                                                       ("s-2", ("two",))]
    assert sorted(d.device_id for d in answer.devices) == ["kvm-0", "kvm-1", "kvm-2"]
    # one CDI device per share, named after it: no two alike in the spec
    names = [device["name"] for device in node.spec(uid(1))["devices"]]
    assert len(set(names)) == 3 and all(name.startswith(f"{uid(1)}-kvm-") for name in names)
    bad = node.api.add(claim_json(2, "bad", [share(share_id="s-3", consumed="1.5")]))
    assert "consumedCapacity shares '1.5' is not a whole number" in (await node.prepare_one(bad)).error
    for number, odd in enumerate(("\u00b2", "9" * 5000), start=3):  # a digit to str.isdigit; too long for int()
        bad = node.api.add(claim_json(number, f"bad-{number}", [share(share_id=f"s-{number}", consumed=odd)]))
        error = (await node.prepare_one(bad)).error
        assert error is not None and "is not a whole number of shares" in error and "internal error" not in error


async def test_an_exclusive_device_named_with_two_share_ids_is_refused_not_prepared_twice(node: Node) -> None:
    first, second = result(NET, NET_VFS[0]), result(NET, NET_VFS[0], "other")
    ref = node.api.add(claim_json(1, "vfs", [{**first, "shareID": "aaaa"}, {**second, "shareID": "bbbb"}]))
    error = (await node.prepare_one(ref)).error
    assert error is not None and error.endswith("is named with different share IDs, but it is not shared")
    assert f"({NET_VFS[0]} of {NET})" in error
    assert claim_labels(node) == {} and not node.spec_path(uid(1)).exists()


async def test_request_names_lose_their_subrequest_and_repeats(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [
        result(NET, NET_VFS[0], "nic/fast", admin=True), result(NET, NET_VFS[0], "nic/slow", admin=True),
        result(NET, NET_VFS[0], "other", admin=True), result(NET, NET_VFS[1], "nic/fast"),
    ]))
    answer = await node.prepare_one(ref)
    assert [(d.device_id, d.request_names) for d in answer.devices] == [(NET_VFS[0], ("nic", "other")),
                                                                        (NET_VFS[1], ("nic",))]


# -- prioritized lists (KEP-4816): results of <main>/<subrequest> ---------------------------


async def test_subrequest_results_are_prepared_for_their_main_request_one_allocate_each(node: Node) -> None:
    # nic: firstAvailable [fast (2 iavf VFs), slow]; two containers' requests with a subrequest each
    ref = node.api.add(claim_json(1, "prioritized", [
        result(NET, NET_VFS[0], "nic/fast"), result(NET, NET_VFS[1], "nic/fast"),
        result(DPDK, VFIO_VFS[0], "container-0/dpdk"), result(DPDK, VFIO_VFS[1], "container-1/dpdk")]))
    answer = await node.prepare_one(ref)
    assert answer.error is None
    assert [(d.device_id, d.request_names, d.cdi_id) for d in answer.devices] == [
        (NET_VFS[0], ("nic",), f"devplugd.io/claim={uid(1)}-0000-3b-02-0"),
        (NET_VFS[1], ("nic",), f"devplugd.io/claim={uid(1)}-0000-3b-02-1"),
        (VFIO_VFS[0], ("container-0",), f"devplugd.io/claim={uid(1)}-0000-3b-02-2"),
        (VFIO_VFS[1], ("container-1",), f"devplugd.io/claim={uid(1)}-0000-3b-02-3")]
    devices = {device["name"]: device["containerEdits"] for device in node.spec(uid(1))["devices"]}
    assert list(devices) == [cdi_id.split("=", 1)[1] for cdi_id in (d.cdi_id for d in answer.devices)]
    # the subrequest's two VFs are one container's: one Allocate of both, as the device plugin gives
    both = node.device_plugin_envs(NET, NET_VFS)
    assert allocation_env(devices[f"{uid(1)}-0000-3b-02-0"]) == allocation_env(devices[f"{uid(1)}-0000-3b-02-1"])
    assert allocation_env(devices[f"{uid(1)}-0000-3b-02-0"]) == both
    # each main request its own container: never its neighbour's VF
    assert env_of(devices[f"{uid(1)}-0000-3b-02-2"])["PCIDEVICE_INTEL_COM_DPDK"] == VFIO_VFS[0]
    assert env_of(devices[f"{uid(1)}-0000-3b-02-3"])["PCIDEVICE_INTEL_COM_DPDK"] == VFIO_VFS[1]
    assert node.devinfo_files() == [f"intel.com-dpdk-{vf}-device.json" for vf in VFIO_VFS] + [
        f"intel.com-sriov_net-{vf}-device.json" for vf in NET_VFS]
    (entry,) = node.checkpoint()["claims"]
    assert [d["request_names"] for d in entry["devices"]] == [["nic"], ["nic"], ["container-0"], ["container-1"]]
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert node.devinfo_files() == [] and not node.spec_path(uid(1)).exists()


@pytest.mark.parametrize(
    ("requests", "applies"),
    [([], True), (["nic"], True), (["nic/fast"], True), (["other", "nic/fast"], True),
     (["nic/slow"], False), (["other"], False), (["nic/fast/x"], False)],
)
async def test_config_naming_the_main_request_or_the_chosen_subrequest_applies(
    node: Node, requests: list[str], applies: bool
) -> None:
    config = [{"source": "FromClass", "requests": requests, "opaque": {"driver": DRIVER, "parameters": VFIO_CONFIG}}]
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "nic/fast")], config=config))
    answer = await node.prepare_one(ref)
    if applies:  # a VfioConfig, for a pool that does not rebind its devices
        assert answer.error == (
            "claim default/vfs: device '0000-3b-02-0' asks for vfio-pci (VfioConfig), but pool intel.com/sriov_net "
            "does not take its devices to vfio-pci on demand (vfioOnDemand is not set)")
    else:  # a config of the subrequest the allocation did not choose is nobody's
        assert answer.error is None and [d.device_id for d in answer.devices] == [NET_VFS[0]]


async def test_config_of_ours_with_no_result_of_ours_applies_to_nothing(node: Node) -> None:
    config = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {}}}]
    ref = node.api.add(claim_json(1, "gpu", [{"request": "gpu", "driver": OTHER_DRIVER, "pool": "x", "device": "g"}],
                                  config=config))
    assert await node.prepare_one(ref) == PrepareResult()


@pytest.mark.parametrize("request_name", ["nic/fast/x", "/fast", "nic/", "/"])
async def test_result_request_that_is_no_request_nor_subrequest_is_refused(node: Node, request_name: str) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], request_name)]))
    assert (await node.prepare_one(ref)).error == (
        "claim default/vfs: malformed claim from the API server: status.allocation.devices.results[0].request "
        f"{request_name!r} is neither <request> nor <request>/<subrequest>")


async def test_prepared_claim_is_checkpointed(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])], namespace="team"))
    await node.prepare_one(ref)
    (entry,) = node.checkpoint()["claims"]
    assert (entry["uid"], entry["namespace"], entry["name"]) == (uid(1), "team", "vfs")
    assert entry["devices"] == [{"resource": NET, "device_id": NET_VFS[0], "pool_name": "node1/intel.com/sriov-net",
                                 "device_name": "0000-3b-02-0", "request_names": ["req"], "admin_access": False,
                                 "cdi_id": f"devplugd.io/claim={uid(1)}-0000-3b-02-0"}]
    assert entry["cdi_spec"] == node.spec(uid(1))


async def test_net_device_pools_write_their_device_info_files(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[1]), result(DPDK, VFIO_VFS[0])]))
    await node.prepare_one(ref)
    assert node.devinfo_files() == ["intel.com-dpdk-0000:3b:02.2-device.json",
                                    "intel.com-sriov_net-0000:3b:02.1-device.json"]


async def test_results_of_other_drivers_are_ignored(node: Node) -> None:
    ref = node.api.add(claim_json(1, "mixed", [result(NET, NET_VFS[0]),
                                               {"request": "gpu", "driver": OTHER_DRIVER, "pool": "x", "device": "g"}]))
    answer = await node.prepare_one(ref)
    assert [d.device_id for d in answer.devices] == [NET_VFS[0]]


async def test_claim_with_no_results_of_ours_has_no_devices_and_no_spec(node: Node) -> None:
    ref = node.api.add(claim_json(1, "gpu", [{"request": "gpu", "driver": OTHER_DRIVER, "pool": "x", "device": "g"}]))
    assert await node.prepare_one(ref) == PrepareResult()
    assert not node.spec_path(uid(1)).exists()
    assert node.book.prepared(uid(1)) is None


async def test_opaque_config_of_another_driver_is_ignored(node: Node) -> None:
    config = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": OTHER_DRIVER, "parameters": {}}}]
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])], config=config))
    assert (await node.prepare_one(ref)).error is None


# -- idempotence and restarts -----------------------------------------------------------------


async def test_second_prepare_is_answered_from_the_book(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    first = await node.prepare_one(ref)
    del node.api.claims[("default", "vfs")]  # not asked again
    assert await node.prepare_one(ref) == first
    assert node.api.calls == [("default", "vfs")]
    assert node.changes == ["claim default/vfs prepared"]


async def test_second_prepare_writes_a_missing_spec_again(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0])]))
    await node.prepare_one(ref)
    written = node.spec_path(uid(1)).read_bytes()
    node.spec_path(uid(1)).unlink()
    assert (await node.prepare_one(ref)).error is None
    assert node.spec_path(uid(1)).read_bytes() == written


async def test_prepare_and_unprepare_work_across_a_restart(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    first = await node.prepare_one(ref)
    node.restart()
    del node.api.claims[("default", "vfs")]
    assert await node.prepare_one(ref) == first
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert not node.spec_path(uid(1)).exists()
    assert node.devinfo_files() == []
    assert node.checkpoint()["claims"] == []


async def test_device_prepared_before_a_restart_is_still_refused_to_another_claim(node: Node) -> None:
    first = node.api.add(claim_json(1, "a", [result(NET, NET_VFS[0])]))
    await node.prepare_one(first)
    node.restart()
    second = node.api.add(claim_json(2, "b", [result(NET, NET_VFS[0])]))
    assert (await node.prepare_one(second)).error == (
        f"claim default/b: device '0000-3b-02-0' ({NET_VFS[0]} of {NET}) is prepared for claim default/a (UID {uid(1)})")


async def test_restore_writes_missing_specs_and_removes_our_stale_ones(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    written = node.spec_path(uid(1)).read_bytes()
    node.spec_path(uid(1)).unlink()  # a reboot emptied /var/run
    node.spec_path(uid(2)).write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "devplugd.io/claim", "devices": []}))
    node.spec_path(uid(3)).write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "example.com/claim", "devices": []}))
    node.restart()
    await node.preparer.restore()
    assert node.spec_path(uid(1)).read_bytes() == written
    assert not node.spec_path(uid(2)).exists()  # crashed before its checkpoint: the kubelet asks again
    assert node.spec_path(uid(3)).exists()  # not ours


async def test_pool_spec_writer_leaves_claim_specs_alone(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    writer = CdiWriter(node.cdi_dir)
    writer.update(node.tree())
    writer.remove_all()
    assert sorted(p.name for p in node.cdi_dir.iterdir()) == [f"devplugd-claim-{uid(1)}.json"]


# -- claims that are refused ------------------------------------------------------------------


async def test_claim_with_another_uid_got_replaced(node: Node) -> None:
    node.api.add(claim_json(2, "vfs", [result(NET, NET_VFS[0])]))
    answer = await node.prepare_one(ClaimRef("default", uid(1), "vfs"))
    assert answer.error == f"claim default/vfs got replaced: the API server has UID {uid(2)}, the kubelet asked for {uid(1)}"


async def test_claim_not_allocated(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [], allocated=False))
    assert (await node.prepare_one(ref)).error == "claim default/vfs not allocated"


async def test_claim_deleted_before_prepare_is_not_found(node: Node) -> None:
    answer = await node.prepare_one(ClaimRef("default", uid(1), "gone"))
    assert answer.error == "claim default/gone not found on the API server (deleted?)"


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"pool": "node1/intel.com/nope"}, "pool 'node1/intel.com/nope' is not a pool of this node (node1)"),
        ({"pool": "node2/intel.com/sriov-net"}, "pool 'node2/intel.com/sriov-net' is not a pool of this node (node1)"),
        ({"device": "0000-3b-09-0"}, "device '0000-3b-09-0' is not in pool 'node1/intel.com/sriov-net'"),
        ({"device": "0000-3b-02-2"}, "device '0000-3b-02-2' is not in pool 'node1/intel.com/sriov-net'"),
    ],
)
async def test_result_naming_an_unknown_pool_or_device_is_refused(node: Node, bad: dict[str, str], error: str) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0]), {**result(NET, NET_VFS[1]), **bad}]))
    assert (await node.prepare_one(ref)).error == f"claim default/vfs: {error}"
    assert not node.spec_path(uid(1)).exists()
    assert node.devinfo_files() == []


async def test_device_of_a_device_plugin_pool_is_refused(node: Node) -> None:
    node.change_pool(NET, road=DEVICE_PLUGIN_ROAD)
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    assert (await node.prepare_one(ref)).error == (
        "claim default/vfs: pool 'node1/intel.com/sriov-net' (intel.com/sriov_net) is not a DRA pool of this node "
        "(it is served through devicePlugin)")
    assert node.devinfo_files() == []


def _unhealthy(pool: ResourcePool, device_id: str) -> dict[str, Any]:
    return {"devices": {**pool.devices, device_id: dataclasses.replace(pool.devices[device_id], health=UNHEALTHY)}}


def _with_taint(pool: ResourcePool, effect: str) -> dict[str, Any]:
    """The pool's ``unhealthyTaint`` set to ``effect``."""
    entry = dataclasses.replace(pool.pool_config.entry, unhealthy_taint=effect)
    return {"pool_config": dataclasses.replace(pool.pool_config, entry=entry)}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda pool: {"leased": frozenset({NET_VFS[0]})}, "is held by a host lease"),
        (lambda pool: {"kubelet_held": frozenset({NET_VFS[0]})},
         "is held by a pod through the device-plugin API (the kubelet's checkpoint)"),
        (lambda pool: {**_unhealthy(pool, NET_VFS[0]), **_with_taint(pool, "omit")}, "is Unhealthy"),
        (lambda pool: {"vanished": frozenset({NET_VFS[0]})}, "is gone from the host"),
    ],
)
async def test_device_that_is_not_free_is_refused(node: Node, change: Any, reason: str) -> None:
    node.change_pool(NET, **change(node.pools[NET]))
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    assert (await node.prepare_one(ref)).error == f"claim default/vfs: device '0000-3b-02-0' ({NET_VFS[0]} of {NET}) {reason}"


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute", "None"])
async def test_an_unhealthy_device_published_with_a_taint_is_prepared_for_the_claim_the_scheduler_gave_it(
        node: Node, effect: str) -> None:
    # the scheduler allocates a tainted device only to a claim that tolerates the taint (effect
    # None needs no toleration), or allocated it before the fault: it is that claim's
    node.change_pool(NET, **_unhealthy(node.pools[NET], NET_VFS[0]), **_with_taint(node.pools[NET], effect))
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    answer = await node.prepare_one(ref)
    assert answer.error is None and [d.device_id for d in answer.devices] == [NET_VFS[0]]
    assert node.spec(uid(1))["devices"][0]["name"] == f"{uid(1)}-0000-3b-02-0"


async def test_an_unhealthy_tainted_device_held_by_a_lease_is_still_refused(node: Node) -> None:
    pool = node.pools[NET]
    node.change_pool(NET, **_unhealthy(pool, NET_VFS[0]), leased=frozenset({NET_VFS[0]}))
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    assert (await node.prepare_one(ref)).error == (
        f"claim default/vfs: device '0000-3b-02-0' ({NET_VFS[0]} of {NET}) is held by a host lease")


@pytest.mark.parametrize(("parameters", "message"), [
    ({"apiVersion": "x/v1", "kind": "VfConfig"},
     "parameters: devplugd takes only kind VfioConfig of devplugd.io/v1alpha1, not apiVersion 'x/v1', kind 'VfConfig'"),
    ({**VFIO_CONFIG, "ifName": "net1"}, "parameters.ifName: unknown field of VfioConfig (it has apiVersion, kind, "
                                        "backend)"),
    ({**VFIO_CONFIG, "backend": "mdev"}, "parameters.backend: 'mdev' is not one of legacy, iommufd, preferIommufd"),
    ("VfioConfig", "parameters is not an object (expected a VfioConfig of devplugd.io/v1alpha1)"),
])
async def test_an_opaque_config_for_our_driver_that_is_no_vfio_config_is_refused_naming_the_field(
        node: Node, parameters: Any, message: str) -> None:
    config = [{"source": "FromClaim", "requests": ["req"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])], config=config))
    assert (await node.prepare_one(ref)).error == (
        f"claim default/vfs: status.allocation.devices.config[0].opaque.{message} (source FromClaim; for "
        f"0000-3b-02-0 of pool node1/intel.com/sriov-net)")
    assert not node.spec_path(uid(1)).exists() and node.book.prepared(uid(1)) is None


@pytest.mark.parametrize(
    ("mangle", "what"),
    [
        (lambda c: c.pop("metadata"), "metadata is not an object"),
        (lambda c: c["metadata"].update(uid=7), "metadata.uid is not a string"),
        (lambda c: c.update(status=[]), "status is not an object"),
        (lambda c: c["status"].update(allocation=[]), "status.allocation is not an object"),
        (lambda c: c["status"]["allocation"]["devices"].update(results={}),
         "status.allocation.devices.results is not a list"),
        (lambda c: c["status"]["allocation"]["devices"]["results"].append("x"),
         "status.allocation.devices.results[1] is not an object"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("pool"),
         "status.allocation.devices.results[0].pool is missing or not a non-empty string"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device=3),
         "status.allocation.devices.results[0].device is missing or not a non-empty string"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(request=""),
         "status.allocation.devices.results[0].request is missing or not a non-empty string"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(driver=None),
         "status.allocation.devices.results[0].driver is not a string"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(adminAccess="yes"),
         "status.allocation.devices.results[0].adminAccess is not true or false"),
        (lambda c: c["status"]["allocation"]["devices"].update(config=[{"opaque": "x"}]),
         "status.allocation.devices.config[0].opaque is not an object"),
    ],
)
async def test_malformed_claim_is_refused_with_what_is_wrong(node: Node, mangle: Any, what: str) -> None:
    claim = claim_json(1, "vfs", [result(NET, NET_VFS[0])])
    mangle(claim)
    node.api.claims[("default", "vfs")] = claim
    answer = await node.prepare_one(ClaimRef("default", uid(1), "vfs"))
    assert answer.error == f"claim default/vfs: malformed claim from the API server: {what}"


async def test_claim_that_is_not_an_object_is_refused(node: Node) -> None:
    node.api.claims[("default", "vfs")] = ["not", "a", "claim"]  # type: ignore[assignment]
    answer = await node.prepare_one(ClaimRef("default", uid(1), "vfs"))
    assert answer.error == "claim default/vfs: malformed claim from the API server: metadata is not an object"


async def test_claim_uid_that_cannot_name_a_file_is_refused(node: Node) -> None:
    answer = await node.prepare_one(ClaimRef("default", "../../etc/x", "vfs"))
    assert answer.error == "claim default/vfs: '../../etc/x' is not a claim UID"
    assert node.api.calls == []
    assert await node.preparer.unprepare([ClaimRef("default", "../../etc/x", "vfs")]) == {"../../etc/x": None}


async def test_api_error_is_the_claims_error(node: Node) -> None:
    node.api.errors[("default", "vfs")] = ConnectionRefusedError(111, "Connection refused")
    answer = await node.prepare_one(ClaimRef("default", uid(1), "vfs"))
    assert answer.error == ("claim default/vfs: cannot read it from the API server: ConnectionRefusedError: "
                            "[Errno 111] Connection refused")


async def test_api_timeout_is_the_claims_error(node: Node) -> None:
    node.restart(get_timeout=0.05)
    slow = node.api.add(claim_json(1, "slow", [result(NET, NET_VFS[0])]))
    fast = node.api.add(claim_json(2, "fast", [result(NET, NET_VFS[1])]))
    node.api.hang.add(("default", "slow"))
    with trio.fail_after(5):
        answers = await node.prepare(slow, fast)
    assert answers[uid(1)].error == "claim default/slow: reading it from the API server timed out after 0.05 s"
    assert answers[uid(2)].error is None


async def test_handler_refusal_is_the_claims_error_and_leaves_nothing(node: Node, host: FakeHost) -> None:
    host.unbind(VFIO_VFS[0])  # since the tree was built: post_allocate reads the driver again
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0]), result(DPDK, VFIO_VFS[0])]))
    answer = await node.prepare_one(ref)
    assert answer.error == (f"claim default/vfs: allocating {VFIO_VFS[0]} of {DPDK} failed: {VFIO_VFS[0]}: no longer "
                            "usable through vfio (not bound to a driver, IOMMU group 42)")
    assert node.devinfo_files() == []  # the sriov_net VF's file, written first, is taken back
    assert not node.spec_path(uid(1)).exists()
    assert node.book.prepared(uid(1)) is None


async def test_spec_that_cannot_be_written_undoes_the_prepare(node: Node) -> None:
    node.cdi_dir.write_text("")  # a file where the directory should be
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    answer = await node.prepare_one(ref)
    assert answer.error is not None and answer.error.startswith(
        f"claim default/vfs: cannot write its CDI spec {node.spec_path(uid(1))}: ")
    assert node.devinfo_files() == []
    assert node.book.prepared(uid(1)) is None
    assert node.changes == []


async def test_checkpoint_that_cannot_be_written_undoes_the_prepare(node: Node) -> None:
    node.state_dir.write_text("")
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    answer = await node.prepare_one(ref)
    assert answer.error is not None and answer.error.startswith(
        f"claim default/vfs: cannot write the checkpoint {node.state_dir / CLAIMS_FILE}: ")
    assert not node.spec_path(uid(1)).exists()
    assert node.devinfo_files() == []
    assert claim_labels(node) == {}


# -- two claims, one device -------------------------------------------------------------------


async def test_device_prepared_for_one_claim_is_refused_to_another(node: Node) -> None:
    first = node.api.add(claim_json(1, "a", [result(NET, NET_VFS[0])]))
    second = node.api.add(claim_json(2, "b", [result(NET, NET_VFS[1]), result(NET, NET_VFS[0])], namespace="other"))
    await node.prepare_one(first)
    answer = await node.prepare_one(second)
    assert answer.error == (f"claim other/b: device '0000-3b-02-0' ({NET_VFS[0]} of {NET}) is prepared for "
                            f"claim default/a (UID {uid(1)})")
    assert claim_labels(node) == {(NET, NET_VFS[0]): "claim default/a"}
    assert not node.spec_path(uid(2)).exists()
    assert node.devinfo_files() == ["intel.com-sriov_net-0000:3b:02.0-device.json"]  # claim a's, not b's


async def test_two_claims_of_one_call_for_one_device_get_it_once(node: Node) -> None:
    first = node.api.add(claim_json(1, "a", [result(NET, NET_VFS[0])]))
    second = node.api.add(claim_json(2, "b", [result(NET, NET_VFS[0])]))
    answers = await node.prepare(first, second)
    assert answers[uid(1)].error is None
    assert answers[uid(2)].error is not None and "is prepared for claim default/a" in answers[uid(2)].error


async def test_admin_access_shares_a_prepared_device(node: Node) -> None:
    owner = node.api.add(claim_json(1, "owner", [result(NET, NET_VFS[0])]))
    admin = node.api.add(claim_json(2, "admin", [result(NET, NET_VFS[0], admin=True)]))
    answers = await node.prepare(owner, admin)
    assert [answers[uid(n)].error for n in (1, 2)] == [None, None]
    assert answers[uid(2)].devices[0].admin_access
    assert claim_labels(node) == {(NET, NET_VFS[0]): "claim default/owner"}


async def test_exclusive_claim_may_follow_an_admin_access_one(node: Node) -> None:
    admin = node.api.add(claim_json(1, "admin", [result(NET, NET_VFS[0], admin=True)]))
    owner = node.api.add(claim_json(2, "owner", [result(NET, NET_VFS[0])]))
    answers = await node.prepare(admin, owner)
    assert [answers[uid(n)].error for n in (1, 2)] == [None, None]


async def test_side_files_stay_while_another_claim_shares_the_device(node: Node) -> None:
    owner = node.api.add(claim_json(1, "owner", [result(NET, NET_VFS[0])]))
    admin = node.api.add(claim_json(2, "admin", [result(NET, NET_VFS[0], admin=True)]))
    await node.prepare(owner, admin)
    await node.preparer.unprepare([admin])
    assert node.devinfo_files() == ["intel.com-sriov_net-0000:3b:02.0-device.json"]
    await node.preparer.unprepare([owner])
    assert node.devinfo_files() == []


async def test_one_bad_claim_never_fails_the_others(node: Node) -> None:
    good = node.api.add(claim_json(1, "good", [result(NET, NET_VFS[0])]))
    bad = node.api.add(claim_json(2, "bad", [result(NET, "0000:3b:09.0")]))
    unallocated = node.api.add(claim_json(3, "later", [], allocated=False))
    also_good = node.api.add(claim_json(4, "vm", [result(KVM, "kvm-0")]))
    answers = await node.prepare(good, bad, ClaimRef("default", uid(5), "deleted"), unallocated, also_good)
    assert sorted(answers) == [uid(n) for n in range(1, 6)]
    assert [answers[uid(n)].error is None for n in range(1, 6)] == [True, False, False, True, False]
    assert node.spec_path(uid(1)).exists() and node.spec_path(uid(4)).exists()


async def test_kubelet_giving_up_mid_call_leaves_no_claim_half_prepared(node: Node) -> None:
    first = node.api.add(claim_json(1, "a", [result(NET, NET_VFS[0])]))
    second = node.api.add(claim_json(2, "b", [result(NET, NET_VFS[1])]))
    with trio.CancelScope() as call:
        node.preparer = ClaimPreparer(DRIVER, NODE, node.cdi_dir, node.book, node.tree, node.hooks,
                                      node.api.get_claim, lambda reason: call.cancel())
        await node.prepare(first, second)  # cancelled as the first claim is checkpointed
        await trio.sleep(0)
    assert call.cancelled_caught
    assert [entry["uid"] for entry in node.checkpoint()["claims"]] == [uid(1), uid(2)]
    assert node.spec_path(uid(1)).exists() and node.spec_path(uid(2)).exists()


# -- unprepare --------------------------------------------------------------------------------


async def test_unprepare_removes_spec_side_files_and_entry(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0]), result(DPDK, VFIO_VFS[1])]))
    await node.prepare_one(ref)
    assert node.devinfo_files() != []
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert not node.spec_path(uid(1)).exists()
    assert node.devinfo_files() == []
    assert node.checkpoint()["claims"] == []
    assert claim_labels(node) == {}
    assert node.changes == ["claim default/vfs prepared", "claim default/vfs unprepared"]


async def test_unprepare_of_a_claim_deleted_from_the_api_server_needs_no_api(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    node.api.claims.clear()
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert node.api.calls == [("default", "vfs")]
    assert not node.spec_path(uid(1)).exists()


async def test_unprepare_of_an_unknown_claim_succeeds(node: Node) -> None:
    assert await node.preparer.unprepare([ClaimRef("default", uid(9), "never")]) == {uid(9): None}
    assert node.changes == []


async def test_unprepared_device_may_be_prepared_for_another_claim(node: Node) -> None:
    first = node.api.add(claim_json(1, "a", [result(NET, NET_VFS[0])]))
    second = node.api.add(claim_json(2, "b", [result(NET, NET_VFS[0])]))
    await node.prepare_one(first)
    await node.preparer.unprepare([first])
    assert (await node.prepare_one(second)).error is None


async def test_unprepare_that_cannot_write_the_checkpoint_keeps_the_device_held(node: Node) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    shutil.rmtree(node.state_dir)
    node.state_dir.write_text("")  # the checkpoint can no longer be written
    errors = await node.preparer.unprepare([ref])
    assert errors[uid(1)] is not None and errors[uid(1)].startswith("claim default/vfs: cannot write the checkpoint")
    assert claim_labels(node) == {(NET, NET_VFS[0]): "claim default/vfs"}


# -- a checkpoint that is lost ----------------------------------------------------------------


async def prepared_then_lost(node: Node) -> ClaimRef:
    """Claim 1 (``old``) prepared, then the checkpoint torn and the daemon restarted: a lost book."""
    old = node.api.add(claim_json(1, "old", [result(NET, NET_VFS[0])]))
    await node.prepare_one(old)
    plant_book(node.state_dir / CLAIMS_FILE, "{ torn")
    node.restart()
    await node.preparer.restore()
    assert node.book.lost is not None
    return old


async def test_lost_checkpoint_refuses_new_claims_until_the_old_ones_are_unprepared(node: Node) -> None:
    old = await prepared_then_lost(node)
    new = node.api.add(claim_json(2, "new", [result(NET, NET_VFS[0])]))
    refused = (await node.prepare_one(new)).error
    assert refused is not None and refused.startswith(f"claim default/new: not prepared: {node.book.lost}")
    assert refused.endswith(f"so no other claim is prepared until each of them is unprepared or prepared again "
                           f"({uid(1)})")
    assert node.spec_path(uid(1)).exists()  # the old claim's spec is kept: its pod may still run
    assert await node.preparer.unprepare([old]) == {uid(1): None}
    assert (await node.prepare_one(new)).error is None


async def test_lost_checkpoint_still_prepares_a_claim_that_was_prepared_before(node: Node) -> None:
    old = node.api.add(claim_json(1, "old", [result(NET, NET_VFS[0])]))
    await node.prepare_one(old)
    plant_book(node.state_dir / CLAIMS_FILE, "[]")
    node.restart()
    assert (await node.prepare_one(old)).error is None  # the same claim holds the same devices
    assert node.book.prepared(uid(1)) is not None


async def test_lost_checkpoint_is_found_again_once_the_old_claims_are_prepared_again(node: Node) -> None:
    """A claim prepared before the loss and prepared again is in the new checkpoint, its devices
    known: with none unaccounted for left, new claims are prepared again."""
    old = await prepared_then_lost(node)
    assert (await node.prepare_one(old)).error is None  # the kubelet asks again (it restarted)
    assert node.book.lost is None
    new = node.api.add(claim_json(2, "new", [result(NET, NET_VFS[1])]))
    assert (await node.prepare_one(new)).error is None
    taken = node.api.add(claim_json(3, "taken", [result(NET, NET_VFS[0])]))  # the old claim's still
    assert "prepared for claim default/old" in ((await node.prepare_one(taken)).error or "")


async def test_lost_checkpoint_with_no_claim_specs_left_prepares_as_usual(node: Node) -> None:
    node.state_dir.mkdir()
    (node.state_dir / CLAIMS_FILE).write_text("not json")
    node.restart()
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    assert (await node.prepare_one(ref)).error is None
    assert [entry["uid"] for entry in node.checkpoint()["claims"]] == [uid(1)]


async def test_unexpected_failure_is_the_claims_error(node: Node) -> None:
    def broken_tree() -> DeviceTree:
        raise RuntimeError("tree unavailable")

    node.preparer = ClaimPreparer(DRIVER, NODE, node.cdi_dir, node.book, broken_tree, node.hooks,
                                  node.api.get_claim, node.changes.append)
    good = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    answer = await node.prepare_one(good)
    assert answer.error == "claim default/vfs: internal error: RuntimeError: tree unavailable"


# -- over gRPC (once the generated DRA modules are there) -------------------------------------


async def test_servicer_answers_every_claim_over_grpc(node: Node, short_tmp: Path) -> None:
    good = node.api.add(claim_json(1, "good", [result(DPDK, VFIO_VFS[0], "dpdk/big")]))
    bad = node.api.add(claim_json(2, "bad", [result(NET, "0000:3b:09.0")]))
    claims = [dra.Claim(namespace=ref.namespace, uid=ref.uid, name=ref.name)
              for ref in (good, bad, ClaimRef("default", uid(3), "deleted"))]
    socket = short_tmp / "dra.sock"

    async def call() -> tuple[Any, Any]:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = dra_grpc.DRAPluginStub(channel)
            prepared = await stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=claims), timeout=45)
            unprepared = await stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=claims),
                                                           timeout=45)
            return prepared, unprepared

    async with trio_asyncio.open_loop():
        server = grpc.aio.server()
        add_to_server(DraPluginServicer(node.preparer), server)
        await aio_as_trio(start_unix_server)(server, str(socket))
        try:
            prepared, unprepared = await aio_as_trio(call)()
        finally:
            await aio_as_trio(server.stop)(0)
    assert sorted(prepared.claims) == [uid(1), uid(2), uid(3)]
    (device,) = prepared.claims[uid(1)].devices
    assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids)) == (
        ["dpdk"], "node1/intel.com/dpdk", "0000-3b-02-2", [f"devplugd.io/claim={uid(1)}-0000-3b-02-2"])
    assert prepared.claims[uid(1)].error == ""
    assert prepared.claims[uid(2)].error == "claim default/bad: device '0000-3b-09-0' is not in pool 'node1/intel.com/sriov-net'"
    assert list(prepared.claims[uid(2)].devices) == []
    assert prepared.claims[uid(3)].error == "claim default/deleted not found on the API server (deleted?)"
    assert {key: value.error for key, value in unprepared.claims.items()} == {uid(1): "", uid(2): "", uid(3): ""}
    assert not node.spec_path(uid(1)).exists()

"""DeviceClasses for the DRA pools (KEP-5004) and the daemon's RBAC: the objects as the
Kubernetes client models read them, each class's CEL selector evaluated by a real CEL engine
against every device our slices publish, and ``devplugd dra device-classes``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import celpy
import pytest
import yaml
from kubernetes.client import ApiClient

from daemon.core import ResourcePool
from daemon.core._config import DaemonConfig, parse_config
from daemon.core._handler import Hooks
from daemon.dra import (
    DeviceClassError,
    device_class_name,
    device_classes,
    pool_name,
    rbac_objects,
    slice_bodies,
    slice_devices,
)
from daemon.handlers.devnode import DevNodeHandler
from tests import trees
from tests.cel import cel_device
from tests.daemonrun import run_cli
from tests.devnodes import mknod
from tests.fakesysfs import FakeHost
from tests.pci import Pci, add_nvme_pf

DRIVER = "devplugd.io"
NODE = "node1"
PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]

CONFIG = {"resourceList": [
    {"resourceName": "sriov_vfs", "allocationApi": "dra", "selectors": {"vendors": ["8086"], "drivers": ["iavf"]}},
    {"resourceName": "nvme_vf", "resourcePrefix": "example.com", "deviceType": "pciDevice", "allocationApi": "dra",
     "selectors": {"vendors": ["1b36"]}},
    {"resourceName": "tun", "resourcePrefix": "devices.kubevirt.io", "deviceType": "devNode",
     "allocationApi": "dra", "count": 3, "selectors": {"paths": ["/dev/net/tun"]}},
    {"resourceName": "plain_vfs", "selectors": {"drivers": ["i40evf"]}},  # the device-plugin API: no class
]}


def config_of(document: dict[str, Any], pci: Pci, devnode: DevNodeHandler) -> DaemonConfig:
    table = {kind: (handler.name, handler.parse_pool)
             for handler in (pci.handler, devnode) for kind in handler.device_types}
    return parse_config(json.dumps(document), "t", "intel.com", table)


@pytest.fixture
def devnode(host: FakeHost) -> DevNodeHandler:
    from daemon.core import HandlerContext

    return DevNodeHandler(HandlerContext(host.sys, host.dev, host.proc, host.root / "devinfo"))


@pytest.fixture
def three_pools(pci: Pci, host: FakeHost, devnode: DevNodeHandler) -> tuple[DaemonConfig, list[ResourcePool]]:
    """Four iavf VFs, two vfio-bound emulated-NVMe VFs and /dev/net/tun (three times), each a
    DRA pool, built by the real handlers from a fake host; and two i40evf VFs for the
    device-plugin pool."""
    host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592")
    host.add_vfs(PF, VFS, driver="iavf", device="1889", iommu_groups=[40, 41, 42, 43])
    host.add_pf("0000:5e:00.0", netdev="ens2f0", driver="i40e", device="1572")
    host.add_vfs("0000:5e:00.0", ["0000:5e:02.0", "0000:5e:02.1"], driver="i40evf", device="154c")
    add_nvme_pf(host, "0000:01:00.0", ["vfio-pci", "vfio-pci"])
    mknod(host.dev, "net/tun", 10, 200)
    config = config_of(CONFIG, pci, devnode)
    pools = []
    for handler in (pci.handler, devnode):
        mine = config.pools_of(handler.name)
        built = handler.build(handler.scan(), mine)
        pools += [trees.pool(p, built[p.resource]) for p in mine if p.entry.allocation_api == "dra"]
    return config, pools


def published_slices(pools: list[ResourcePool], pci: Pci, devnode: DevNodeHandler) -> list[dict[str, Any]]:
    describers = {"pci": Hooks.of(pci.handler).describer, "devnode": Hooks.of(devnode).describer}
    slices = []
    for pool in pools:
        devices = slice_devices(pool, DRIVER, describers[pool.handler])
        slices += slice_bodies(driver=DRIVER, node_name=NODE, node_uid="uid-1", pool_name=pool_name(NODE, pool.resource),
                               generation=1, devices=devices, max_devices=2)
    return slices


def round_trips(body: dict[str, Any], model: str) -> bool:
    """Whether the kubernetes client's model reads ``body`` and writes back the very same."""
    client = ApiClient()
    read = client.deserialize(SimpleNamespace(data=json.dumps(body)), model)
    return bool(client.sanitize_for_serialization(read) == body)


# -- the classes ---------------------------------------------------------------------------------


def test_one_class_per_dra_pool_named_in_its_vendors_domain(three_pools: tuple[DaemonConfig, list[ResourcePool]]) -> None:
    config, _ = three_pools
    classes = device_classes(config, DRIVER)
    assert [(c["metadata"]["name"], c["spec"]["extendedResourceName"]) for c in classes] == [
        ("sriov-vfs.intel.com", "intel.com/sriov_vfs"),
        ("nvme-vf.example.com", "example.com/nvme_vf"),
        ("tun.devices.kubevirt.io", "devices.kubevirt.io/tun"),
    ]
    assert classes[0]["spec"]["selectors"] == [{"cel": {"expression":
        'device.driver == "devplugd.io" && device.attributes["devplugd.io"].resourceName == "intel.com/sriov_vfs"'}}]


def test_classes_and_rbac_are_what_the_kubernetes_client_models_read(
    three_pools: tuple[DaemonConfig, list[ResourcePool]],
) -> None:
    config, _ = three_pools
    for body in device_classes(config, DRIVER):
        assert round_trips(body, "V1DeviceClass")
    account, role, binding = rbac_objects(DRIVER)
    assert round_trips(account, "V1ServiceAccount")
    assert round_trips(role, "V1ClusterRole")
    assert round_trips(binding, "V1ClusterRoleBinding")


def test_each_class_selects_exactly_its_own_pools_devices(
    three_pools: tuple[DaemonConfig, list[ResourcePool]], pci: Pci, devnode: DevNodeHandler
) -> None:
    config, pools = three_pools
    slices = published_slices(pools, pci, devnode)
    devices = [(body["spec"]["pool"]["name"], device) for body in slices for device in body["spec"]["devices"]]
    assert len(devices) == 4 + 2 + 3
    foreign = ("node1/gpu", {"name": "gpu-0", "attributes": {  # another driver's device, our attribute names
        "resourceName": {"string": "intel.com/sriov_vfs"}, "id": {"string": VFS[0]}}})
    environment = celpy.Environment()
    for device_class in device_classes(config, DRIVER):
        (selector,) = device_class["spec"]["selectors"]
        program = environment.program(environment.compile(selector["cel"]["expression"]))
        resource = device_class["spec"]["extendedResourceName"]
        selected = set()
        for pool, device in [*devices, foreign]:
            driver = "gpu.nvidia.com" if device is foreign[1] else DRIVER
            result = program.evaluate({"device": cel_device(driver, device["attributes"])})
            assert isinstance(result, celpy.celtypes.BoolType), f"{device['name']}: {result!r}"  # no CEL error
            if result:
                selected.add((pool, device["name"]))
        assert selected == {(pool, device["name"]) for pool, device in devices if pool == pool_name(NODE, resource)}
        assert selected


def test_the_selector_sees_our_prefixed_attributes_under_their_own_domain(
    three_pools: tuple[DaemonConfig, list[ResourcePool]], pci: Pci, devnode: DevNodeHandler
) -> None:
    _, pools = three_pools
    (first, *_) = published_slices(pools, pci, devnode)
    device = cel_device(DRIVER, first["spec"]["devices"][0]["attributes"])
    environment = celpy.Environment()
    program = environment.program(environment.compile(
        'device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00" && '
        'device.attributes["devplugd.io"].vfIndex == 0 && device.attributes["devplugd.io"].vendor == "8086"'))
    assert program.evaluate({"device": device})


@pytest.mark.parametrize(("resource", "name"), [
    ("intel.com/sriov_vfs", "sriov-vfs.intel.com"),
    ("example.com/NVMe_VF", "nvme-vf.example.com"),
    ("devices.kubevirt.io/kvm", "kvm.devices.kubevirt.io"),
])
def test_device_class_names(resource: str, name: str) -> None:
    assert device_class_name(resource) == name


def test_a_resource_that_cannot_be_a_class_is_refused_naming_it(pci: Pci, devnode: DevNodeHandler) -> None:
    prefix = "devices." + "a" * 50 + ".example.com"
    config = config_of({"resourceList": [{"resourceName": "x", "resourcePrefix": prefix, "allocationApi": "dra",
                                          "selectors": {}}]}, pci, devnode)
    with pytest.raises(DeviceClassError, match="longer than 64 bytes"):
        device_classes(config, DRIVER)
    with pytest.raises(DeviceClassError, match="must be at most 253"):
        device_class_name("d" * 63 + "." + "e" * 63 + "." + "f" * 63 + "." + "g" * 50 + "/" + "n" * 20)


def test_rbac_lets_the_daemon_manage_its_slices_read_claims_and_write_their_device_status() -> None:
    account, role, binding = rbac_objects(DRIVER, namespace="kube-system", service_account="dp")
    assert account["metadata"] == {"name": "dp", "namespace": "kube-system",
                                   "labels": {"app.kubernetes.io/managed-by": "devplugd"}}
    rules = {(rule["apiGroups"][0], rule["resources"][0]): rule["verbs"] for rule in role["rules"]}
    assert rules[("resource.k8s.io", "resourceslices")] == [
        "get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
    assert rules[("", "nodes")] == ["get"]
    assert rules[("resource.k8s.io", "resourceclaims")] == ["get"]
    assert rules[("resource.k8s.io", "resourceclaims/status")] == ["get", "update", "patch"]
    # what 1.36's granular status authorization asks of a node-local driver, for its own driver only
    assert rules[("resource.k8s.io", "resourceclaims/driver")] == ["associated-node:update", "associated-node:patch"]
    assert role["rules"][-1]["resourceNames"] == [DRIVER]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dp-dra"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dp", "namespace": "kube-system"}]


# -- devplugd dra device-classes --------------------------------------------------------------


def write_config(directory: Path, document: dict[str, Any]) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(document))
    return path


def test_cli_prints_the_classes_as_yaml(short_tmp: Path) -> None:
    result = run_cli("dra", "device-classes", "--config", str(write_config(short_tmp, CONFIG)))
    assert result.returncode == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    assert [d["metadata"]["name"] for d in documents] == [
        "sriov-vfs.intel.com", "nvme-vf.example.com", "tun.devices.kubevirt.io"]
    assert all(round_trips(d, "V1DeviceClass") for d in documents)
    assert documents[0]["spec"]["selectors"][0]["cel"]["expression"] == (
        'device.driver == "devplugd.io" && device.attributes["devplugd.io"].resourceName == "intel.com/sriov_vfs"')


def test_cli_with_rbac_a_driver_and_a_prefix(short_tmp: Path) -> None:
    config = {"resourceList": [{"resourceName": "vfs", "allocationApi": "dra", "selectors": {}}]}
    result = run_cli("dra", "device-classes", "--config", str(write_config(short_tmp, config)), "--rbac",
                     "--dra-driver", "net.example.org", "--resource-prefix", "example.org")
    assert result.returncode == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in documents] == ["DeviceClass", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    assert documents[0]["metadata"]["name"] == "vfs.example.org"
    assert documents[0]["spec"]["selectors"][0]["cel"]["expression"].startswith('device.driver == "net.example.org"')
    assert documents[2]["rules"][-1]["resourceNames"] == ["net.example.org"]


def test_cli_with_no_dra_pools_prints_a_comment_and_says_why(short_tmp: Path) -> None:
    config = {"resourceList": [{"resourceName": "vfs", "selectors": {}}]}
    result = run_cli("dra", "device-classes", "--config", str(write_config(short_tmp, config)), "--rbac")
    assert result.returncode == 0
    assert result.stdout.startswith("#") and result.stdout.count("\n") == 1
    assert list(yaml.safe_load_all(result.stdout)) == []
    assert "allocationApi 'dra'" in result.stderr


@pytest.mark.parametrize(("arguments", "message"), [
    (("--dra-driver", "Not_A.Domain"), "--dra-driver 'Not_A.Domain'"),
    ((), "$.resourceList[0].allocationApi: must be 'devicePlugin' or 'dra', not 'DRA'"),
])
def test_cli_refuses_a_bad_config_or_driver_with_exit_2(short_tmp: Path, arguments: tuple[str, ...], message: str) -> None:
    config = {"resourceList": [{"resourceName": "vfs", "allocationApi": "DRA" if not arguments else "dra",
                                "selectors": {}}]}
    result = run_cli("dra", "device-classes", "--config", str(write_config(short_tmp, config)), *arguments)
    assert result.returncode == 2
    assert message in result.stderr and result.stdout == ""


def test_a_vfio_on_demand_pool_gets_a_second_class_that_carries_the_vfio_config(short_tmp: Path) -> None:
    config = {"resourceList": [
        {"resourceName": "nvme_vfs", "resourcePrefix": "example.com", "deviceType": "pciDevice",
         "allocationApi": "dra", "vfioOnDemand": True, "selectors": {"drivers": ["nvme"]}},
        {"resourceName": "gpus", "deviceType": "pciDevice", "allocationApi": "dra", "selectors": {}},
    ]}
    result = run_cli("dra", "device-classes", "--config", str(write_config(short_tmp, config)))
    assert result.returncode == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    assert [d["metadata"]["name"] for d in documents] == ["nvme-vfs.example.com", "nvme-vfs-vfio.example.com",
                                                         "gpus.intel.com"]
    plain, vfio, _ = documents
    assert all(round_trips(d, "V1DeviceClass") for d in documents)
    assert vfio["spec"]["selectors"] == plain["spec"]["selectors"]
    assert "extendedResourceName" not in vfio["spec"]  # resources.limits keeps meaning the pool's own class
    assert vfio["spec"]["config"] == [{"opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig", "backend": "legacy"}}}]

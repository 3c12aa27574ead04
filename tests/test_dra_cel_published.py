"""The DeviceClasses' CEL selectors against the slices the publisher puts on the API server.

The real handlers build the pools from a fake host, the real SlicePublisher publishes them to the
API server stand-in, and a real CEL engine (cel-python) evaluates each class's selector against
every device *as stored there*, next to another driver's device with our attribute names: each
class selects exactly its own pool's devices, on every slice of the pool, and never fails.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import celpy
import pytest
import trio

from daemon.core import HandlerContext, ResourcePool
from daemon.core._config import DaemonConfig, parse_config
from daemon.core._handler import Hooks
from daemon.core._tree import DeviceTree
from daemon.dra import device_classes, pool_name
from daemon.dra._kube import ApiLink
from daemon.dra._pools import DraPools
from daemon.dra._publisher import SlicePublisher
from daemon.handlers.devnode import DevNodeHandler
from daemon.settings import Settings
from tests import trees
from tests.apiserver import ApiServer
from tests.cel import cel_device
from tests.fakesysfs import FakeHost
from tests.pci import Pci, add_nvme_pf

DRIVER = "devplugd.io"
NODE = "node1"
PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]
TUNS = 130  # more than one slice of 128, three of 64

CONFIG = {"resourceList": [
    {"resourceName": "sriov_vfs", "allocationApi": "dra", "selectors": {"vendors": ["8086"], "drivers": ["iavf"]}},
    {"resourceName": "nvme_vf", "resourcePrefix": "example.com", "deviceType": "pciDevice", "allocationApi": "dra",
     "selectors": {"vendors": ["1b36"]}},
    {"resourceName": "tun", "resourcePrefix": "devices.kubevirt.io", "deviceType": "devNode",
     "allocationApi": "dra", "count": TUNS, "selectors": {"paths": ["/dev/net/tun"]}},
    {"resourceName": "plain_vfs", "selectors": {"drivers": ["i40evf"]}},  # the device-plugin API: not published
]}


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        server.add_node(NODE)
        yield server
    assert server.internal_errors == []


@pytest.fixture
def devnode(host: FakeHost) -> DevNodeHandler:
    return DevNodeHandler(HandlerContext(host.sys, host.dev, host.proc, host.root / "devinfo"))


@pytest.fixture
def pools(pci: Pci, host: FakeHost, devnode: DevNodeHandler) -> tuple[DaemonConfig, DeviceTree]:
    """Four iavf VFs, two vfio-bound emulated-NVMe VFs and /dev/net/tun (130 times), each a DRA
    pool built by the real handlers; and two i40evf VFs for a device-plugin pool."""
    host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592")
    host.add_vfs(PF, VFS, driver="iavf", device="1889", iommu_groups=[40, 41, 42, 43])
    host.add_pf("0000:5e:00.0", netdev="ens2f0", driver="i40e", device="1572")
    host.add_vfs("0000:5e:00.0", ["0000:5e:02.0", "0000:5e:02.1"], driver="i40evf", device="154c")
    add_nvme_pf(host, "0000:01:00.0", ["vfio-pci", "vfio-pci"])
    (host.dev / "net").mkdir(parents=True, exist_ok=True)
    os.mknod(host.dev / "net" / "tun", stat.S_IFCHR | 0o660, os.makedev(10, 200))
    handlers = (pci.handler, devnode)
    table = {kind: (handler.name, handler.parse_pool) for handler in handlers for kind in handler.device_types}
    config = parse_config(json.dumps(CONFIG), "test", "intel.com", table)
    built: list[ResourcePool] = []
    for handler in handlers:
        mine = config.pools_of(handler.name)
        devices = handler.build(handler.scan(), mine)
        built += [trees.pool(p, devices[p.resource]) for p in mine]  # on its config's road
    return config, trees.tree(*built, version=1)


def foreign_slice(api: ApiServer) -> None:
    """Another driver's device on this node, with our attribute names and one of our resources."""
    api.create_slice({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": f"00000-gpu.example.com-{NODE}-"},
        "spec": {"driver": "gpu.example.com", "nodeName": NODE,
                 "pool": {"name": f"{NODE}/gpus", "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "attributes": {
                     "resourceName": {"string": "intel.com/sriov_vfs"}, "id": {"string": VFS[0]},
                     f"{DRIVER}/resourceName": {"string": "intel.com/sriov_vfs"}}}]}})


async def publish(api: ApiServer, kubeconfig: Path, hooks: dict[str, Hooks], offered: DeviceTree,
                  expected: int) -> None:
    """Run the publisher until ``expected`` devices of our driver are on the server."""
    def ours() -> int:
        return sum(len(s["spec"].get("devices") or []) for s in api.slices(driver=DRIVER))

    settings = Settings(kubeconfig=kubeconfig, node_name=NODE, dra_driver=DRIVER)
    link = ApiLink(settings)
    publisher = SlicePublisher(settings, link)
    pools = DraPools(DRIVER, NODE, hooks, publisher)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            pools.offer(offered)
            await api.wait_until_async(lambda: ours() == expected, 10, lambda: f"{ours()} of {expected} devices")
            nursery.cancel_scope.cancel()
    finally:
        link.close()


async def test_each_class_selects_exactly_its_own_pools_published_devices(
    api: ApiServer, pools: tuple[DaemonConfig, DeviceTree], pci: Pci, devnode: DevNodeHandler, tmp_path: Path
) -> None:
    config, offered = pools
    foreign_slice(api)
    hooks = {"pci": Hooks.of(pci.handler), "devnode": Hooks.of(devnode)}
    await publish(api, api.kubeconfig(tmp_path / "kubeconfig"), hooks, offered, 4 + 2 + TUNS)

    stored = [(s["spec"]["driver"], s["spec"]["pool"]["name"], device)
              for s in api.slices() for device in s["spec"].get("devices") or []]
    assert len({pool for driver, pool, _ in stored if driver == DRIVER}) == 3  # no device-plugin pool
    # a pool that may carry taints is cut in slices of 64 (the server's cap for a tainted slice)
    assert len([s for s in api.slices(driver=DRIVER) if "tun" in s["spec"]["pool"]["name"]]) == -(-TUNS // 64)
    environment = celpy.Environment()
    classes = device_classes(config, DRIVER)
    assert len(classes) == 3
    for device_class in classes:
        (selector,) = device_class["spec"]["selectors"]
        program = environment.program(environment.compile(selector["cel"]["expression"]))
        own_pool = pool_name(NODE, device_class["spec"]["extendedResourceName"])
        selected = set()
        for driver, pool, device in stored:
            result = program.evaluate({"device": cel_device(driver, device.get("attributes") or {})})
            assert isinstance(result, celpy.celtypes.BoolType), f"{pool}/{device['name']}: {result!r}"  # no error
            if result:
                selected.add((driver, pool, device["name"]))
        assert selected == {(driver, pool, device["name"]) for driver, pool, device in stored
                            if driver == DRIVER and pool == own_pool}
        assert selected, f"{device_class['metadata']['name']} selects nothing"

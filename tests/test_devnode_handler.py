"""devNode pools over real device nodes made with mknod under a temporary dev root (unit tests)."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.core import DeviceSpec
from daemon.core._config import ConfigFileError
from tests.devnodes import DevNodes, mknod
from tests.fakesysfs import FakeHost


@pytest.fixture
def nodes(host: FakeHost) -> DevNodes:
    dev = DevNodes(host)
    mknod(dev.root, "null", 1, 3)
    mknod(dev.root, "kvm", 10, 232)
    mknod(dev.root, "net/tun", 10, 200)
    mknod(dev.root, "vhost-net", 10, 238)
    mknod(dev.root, "dri/card0", 226, 0)
    mknod(dev.root, "dri/card1", 226, 1)
    mknod(dev.root, "dri/renderD128", 226, 128)
    mknod(dev.root, "dri/by-path/pci-card0", 226, 0)
    mknod(dev.root, "loop0", 7, 0, block=True)
    return dev


def pool(name: str, *paths: str, **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": {"paths": list(paths)}, **fields}


@pytest.mark.parametrize(
    ("paths", "ids"),
    [
        (["/dev/kvm"], {"kvm"}),
        (["/dev/net/tun"], {"net_tun"}),
        (["/dev/dri/card*"], {"dri_card0", "dri_card1"}),
        (["/dev/dri/*"], {"dri_card0", "dri_card1", "dri_renderD128"}),
        (["/dev/dri/card[1-9]"], {"dri_card1"}),
        (["/dev/dri/renderD12?"], {"dri_renderD128"}),
        (["/dev/dri/*/*"], {"dri_by-path_pci-card0"}),
        (["/dev/*"], {"null", "kvm", "vhost-net", "loop0"}),
        (["/dev/loop0"], {"loop0"}),
        (["/dev/kvm", "/dev/vhost-net", "/dev/net/tun"], {"kvm", "vhost-net", "net_tun"}),
        (["/dev/DRI/card0"], set()),
        (["/dev/nvidia*"], set()),
    ],
)
def test_globs_select_device_nodes_within_path_components(nodes: DevNodes, paths: list[str], ids: set) -> None:
    assert nodes.ids(pool("p", *paths)) == {"p": ids}


def test_selector_objects_are_all_used(nodes: DevNodes) -> None:
    entry = {"resourceName": "p", "selectors": [{"paths": ["/dev/kvm"]}, {"paths": ["/dev/net/tun"]}]}
    assert nodes.ids(entry) == {"p": {"kvm", "net_tun"}}


@pytest.mark.parametrize(
    ("path", "count", "ids"),
    [
        ("/dev/kvm", 110, {f"kvm-{i}" for i in range(110)}),
        ("/dev/kvm", 1, {"kvm"}),
        ("/dev/kvm", None, {"kvm"}),
        ("/dev/kvm", 2, {"kvm-0", "kvm-1"}),
        ("/dev/net/tun", 3, {"net_tun-0", "net_tun-1", "net_tun-2"}),
    ],
)
def test_count_offers_each_node_that_many_times(nodes: DevNodes, path: str, count: int | None, ids: set) -> None:
    fields = {} if count is None else {"count": count}
    assert nodes.ids(pool("p", path, **fields)) == {"p": ids}


def test_ids_are_the_same_across_scans_and_restarts(nodes: DevNodes, host: FakeHost) -> None:
    entry = pool("p", "/dev/dri/*", "/dev/kvm", count=3)
    first = nodes.build(entry)
    mknod(nodes.root, "dri/card2", 226, 2)
    second = DevNodes(host).build(entry)
    assert set(second["p"]) == set(first["p"]) | {"dri_card2-0", "dri_card2-1", "dri_card2-2"}
    for device_id, info in first["p"].items():
        assert second["p"][device_id] == info


@pytest.mark.parametrize(("fields", "permissions"), [({}, "rw"), ({"permissions": "r"}, "r"),
                                                      ({"permissions": "rwm"}, "rwm")])
def test_specs_expose_the_node_at_its_dev_path(nodes: DevNodes, fields: dict, permissions: str) -> None:
    devices = nodes.build(pool("p", "/dev/net/tun", "/dev/kvm", count=2, **fields))["p"]
    assert {device_id: info.specs for device_id, info in devices.items()} == {
        "net_tun-0": (DeviceSpec("/dev/net/tun", "/dev/net/tun", permissions),),
        "net_tun-1": (DeviceSpec("/dev/net/tun", "/dev/net/tun", permissions),),
        "kvm-0": (DeviceSpec("/dev/kvm", "/dev/kvm", permissions),),
        "kvm-1": (DeviceSpec("/dev/kvm", "/dev/kvm", permissions),),
    }
    assert all(info.health == "Healthy" for info in devices.values())


def test_regular_files_and_directories_are_not_devices(nodes: DevNodes) -> None:
    (nodes.root / "kvm-file").write_text("")
    (nodes.root / "kvm-dir").mkdir()
    (nodes.root / "dri" / "card9").write_text("")
    assert nodes.ids(pool("p", "/dev/kvm*", "/dev/dri/card*")) == {"p": {"kvm", "dri_card0", "dri_card1"}}
    assert nodes.ids(pool("p", "/dev/kvm-dir")) == {"p": set()}


def test_first_pool_wins_a_node(nodes: DevNodes) -> None:
    ids = nodes.ids(pool("card0", "/dev/dri/card0"), pool("dri", "/dev/dri/*"), pool("again", "/dev/dri/card0"))
    assert ids == {"card0": {"dri_card0"}, "dri": {"dri_card1", "dri_renderD128"}, "again": set()}


def test_numa_node_comes_from_the_sysfs_dev_entry(nodes: DevNodes, host: FakeHost) -> None:
    for kind, numbers, numa in (("char", "226:0", "1"), ("char", "226:1", "-1"), ("block", "7:0", "0")):
        entry = host.sys / "dev" / kind / numbers / "device"
        entry.mkdir(parents=True)
        (entry / "numa_node").write_text(numa + "\n")
    devices = nodes.build(pool("p", "/dev/dri/card*", "/dev/loop0", "/dev/kvm"))["p"]
    assert {device_id: info.numa_nodes for device_id, info in devices.items()} == {
        "dri_card0": (1,), "dri_card1": (), "loop0": (0,), "kvm": ()}
    devices = nodes.build(pool("p", "/dev/dri/card0", excludeTopology=True))["p"]
    assert devices["dri_card0"].numa_nodes == ()


@pytest.mark.parametrize(
    ("entry", "json_path", "reason"),
    [
        (pool("p", "kvm"), "$.resourceList[0].selectors.paths[0]", "under /dev/"),
        (pool("p", "/dev/kvm", "/sys/kvm"), "$.resourceList[0].selectors.paths[1]", "under /dev/"),
        (pool("p", "/device/kvm"), "$.resourceList[0].selectors.paths[0]", "under /dev/"),
        (pool("p", "/dev/"), "$.resourceList[0].selectors.paths[0]", "under /dev/"),
        (pool("p", "/dev"), "$.resourceList[0].selectors.paths[0]", "under /dev/"),
        (pool("p", "/dev/../etc/shadow"), "$.resourceList[0].selectors.paths[0]", "'..'"),
        (pool("p", "/dev/./kvm"), "$.resourceList[0].selectors.paths[0]", "'.'"),
        (pool("p", "/dev/kvm", count=0), "$.resourceList[0].count", "between 1 and"),
        (pool("p", "/dev/kvm", count=-3), "$.resourceList[0].count", "between 1 and"),
        (pool("p", "/dev/kvm", count=100_001), "$.resourceList[0].count", "between 1 and"),
        (pool("p", "/dev/kvm", count="2"), "$.resourceList[0].count", "must be an integer"),
        (pool("p", "/dev/kvm", count=True), "$.resourceList[0].count", "must be an integer"),
        (pool("p", "/dev/kvm", count=1.5), "$.resourceList[0].count", "must be an integer"),
        (pool("p", "/dev/kvm", permissions="x"), "$.resourceList[0].permissions", "'rwm'"),
        (pool("p", "/dev/kvm", permissions="rwx"), "$.resourceList[0].permissions", "'rwm'"),
        (pool("p", "/dev/kvm", permissions=""), "$.resourceList[0].permissions", "'rwm'"),
        (pool("p"), "$.resourceList[0].selectors.paths", "is required"),
        ({"resourceName": "p", "selectors": {}}, "$.resourceList[0].selectors.paths", "is required"),
        ({"resourceName": "p", "selectors": {"paths": "/dev/kvm"}}, "$.resourceList[0].selectors.paths",
         "must be a list"),
        ({"resourceName": "p", "selectors": [{"paths": ["/dev/kvm"]}, {"paths": ["kvm"]}]},
         "$.resourceList[0].selectors[1].paths[0]", "under /dev/"),
    ],
)
def test_bad_devnode_pool_names_json_path(nodes: DevNodes, entry: dict, json_path: str, reason: str) -> None:
    with pytest.raises(ConfigFileError) as caught:
        nodes.configure(entry)
    assert caught.value.json_path == json_path
    assert reason in str(caught.value)

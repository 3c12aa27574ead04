"""What a device says of itself in a DRA ResourceSlice: the PCI and devNode handlers' attributes,
read from fake sysfs trees laid out as Linux lays them out, as slice_devices publishes them."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from daemon.core import DeviceInfo, DeviceSpec, ResourcePool
from daemon.core._handler import Hooks
from daemon.dra import device_name, slice_devices
from daemon.handlers.devnode import DevNodeHandler
from daemon.handlers.pci import PciHandler
from daemon.handlers.pci._attributes import hex_id, pci_attributes
from tests import trees
from tests.devnodes import DevNodes, mknod
from tests.fakesysfs import INFINIBAND, FakeHost
from tests.pci import NVME_CLASS, Pci

DRIVER = "devplugd.io"
PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]


def add_nic(host: FakeHost, *, vf_driver: str = "iavf", netdevs: bool = True) -> None:
    """PF ens1f0 (ice) with four VFs; VF i has IOMMU group 40+i and, if ``netdevs``, netdev ens1f0v<i>."""
    host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592", numa_node=1)
    host.add_vfs(PF, VFS, driver=vf_driver, device="1889", numa_node=1, iommu_groups=[40, 41, 42, 43],
                 netdev_names=[f"ens1f0v{i}" for i in range(4)] if netdevs else None)


def published(pci: Pci, pool: ResourcePool) -> dict[str, dict[str, Any]]:
    """Device name -> its attributes, as the pool's ResourceSlices carry them (through JSON)."""
    devices = json.loads(json.dumps(slice_devices(pool, DRIVER, Hooks.of(pci.handler).describer)))
    return {device["name"]: device["attributes"] for device in devices}


def move_below(host: FakeHost, address: str, *parents: str) -> None:
    """Put an (unbound) function's directory under ``sys/devices/<parents...>`` instead, its bus
    entry pointing there, as a host with several root complexes (or a VMD domain) lays it out."""
    old = host.device_dir(address)
    new = host.sys.joinpath("devices", *parents, address)
    new.parent.mkdir(parents=True, exist_ok=True)
    old.rename(new)
    entry = host.sys / "bus" / "pci" / "devices" / address
    entry.unlink()
    entry.symlink_to(os.path.relpath(new, entry.parent))


def test_a_vf_publishes_its_pci_identity_its_pf_and_its_link(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pool = pci.pool({"resourceName": "sriov_vfs", "allocationApi": "dra", "selectors": {"drivers": ["iavf"]}})
    assert published(pci, pool)["0000-3b-02-1"] == {
        "id": {"string": "0000:3b:02.1"},
        "resourceName": {"string": "intel.com/sriov_vfs"},
        "numaNode": {"int": 1},
        "resource.kubernetes.io/numaNode": {"int": 1},
        "resource.kubernetes.io/pciBusID": {"string": "0000:3b:02.1"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        "vendor": {"string": "8086"},
        "deviceId": {"string": "1889"},
        "driver": {"string": "iavf"},
        "pfName": {"string": "ens1f0"},
        "pfPciAddress": {"string": PF},
        "vfIndex": {"int": 1},
        "netdev": {"string": "ens1f0v1"},
        "linkType": {"string": "ether"},
        "iommuGroup": {"int": 40 + 1},
    }
    assert list(published(pci, pool)) == ["0000-3b-02-0", "0000-3b-02-1", "0000-3b-02-2", "0000-3b-02-3"]


def test_a_vfio_bound_vf_has_no_netdev_and_takes_its_link_type_from_its_pf(pci: Pci, host: FakeHost) -> None:
    add_nic(host, vf_driver="vfio-pci", netdevs=False)
    pool = pci.pool({"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}})
    attributes = published(pci, pool)["0000-3b-02-3"]
    assert "netdev" not in attributes
    assert attributes["driver"] == {"string": "vfio-pci"}
    assert attributes["linkType"] == {"string": "ether"}
    assert attributes["vfIndex"] == {"int": 3}
    assert attributes["iommuGroup"] == {"int": 43}


def test_a_function_that_is_not_a_vf_has_no_pf_attributes_and_no_group_when_it_has_none(
    pci: Pci, host: FakeHost
) -> None:
    host.add_pf("0000:5e:00.0", netdev="ib0", vendor="15b3", device="101b", driver="mlx5_core")
    (host.device_dir("0000:5e:00.0") / "net" / "ib0" / "type").write_text(f"{INFINIBAND}\n")
    attributes = published(pci, pci.pool({"resourceName": "ib", "selectors": {"vendors": ["15b3"]}}))["0000-5e-00-0"]
    assert {name: value for name, value in attributes.items() if name not in ("id", "resourceName")} == {
        "numaNode": {"int": 0},
        "resource.kubernetes.io/numaNode": {"int": 0},
        "resource.kubernetes.io/pciBusID": {"string": "0000:5e:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        "vendor": {"string": "15b3"},
        "deviceId": {"string": "101b"},
        "driver": {"string": "mlx5_core"},
        "netdev": {"string": "ib0"},
        "linkType": {"string": "infiniband"},
    }


def test_ints_are_ints_and_not_bools_in_the_json(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    attributes = published(pci, pci.pool({"resourceName": "vfs", "selectors": {"drivers": ["iavf"]}}))["0000-3b-02-0"]
    assert type(attributes["vfIndex"]["int"]) is int and attributes["vfIndex"] == {"int": 0}
    assert type(attributes["numaNode"]["int"]) is int


@pytest.mark.parametrize(
    ("parents", "root"),
    [
        (("pci0000:d7", "0000:d7:00.0"), "pci0000:d7"),  # a second root complex
        (("pci0001:00", "0001:00:00.0"), "pci0001:00"),  # another PCI domain
        # a VMD domain: its own pci10000:e0 below the VMD function; the root is still the first
        (("pci0000:00", "0000:00:0e.0", "pci10000:e0", "10000:e0:1d.0"), "pci0000:00"),
    ],
)
def test_pcie_root_is_the_root_complex_directory_the_function_sits_below(
    pci: Pci, host: FakeHost, parents: tuple[str, ...], root: str
) -> None:
    address = "0000:d8:00.0"
    host.add_pci(address, driver=None)
    move_below(host, address, *parents)
    host.bind(address, "i40e")
    assert pci.handler.scan().devices[address].pcie_root == root
    attributes = published(pci, pci.pool({"resourceName": "nic", "selectors": {}}))["0000-d8-00-0"]
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": root}


def test_a_function_not_below_a_pci_root_directory_has_no_pcie_root(pci: Pci, host: FakeHost) -> None:
    address = "7870:00:00.0"  # as a Hyper-V guest shows a passed-through function: below VMBus
    host.add_pci(address, driver=None)
    move_below(host, address, "LNXSYSTM:00", "LNXSYBUS:00", "VMBUS:01", "a0b1c2d3-0000", "pci7870:00")
    host.bind(address, "mlx5_core")
    assert pci.handler.scan().devices[address].pcie_root is None
    attributes = published(pci, pci.pool({"resourceName": "nic", "selectors": {}}))["7870-00-00-0"]
    assert "resource.kubernetes.io/pcieRoot" not in attributes
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": address}


def test_an_iommu_group_of_several_functions_is_described_by_its_lowest_function(pci: Pci, host: FakeHost) -> None:
    functions = ["0000:01:00.0", "0000:01:00.1", "0000:01:00.2"]
    for address in functions:
        host.add_pci(address, vendor="1b36", device="0010", class_code=NVME_CLASS, driver="vfio-pci",
                     bridge="0000:00:01.0")
        host.set_iommu_group(address, 8)
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    (attributes,) = published(pci, pool).values()
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:01:00.0"}
    assert attributes["iommuGroup"] == {"int": 8}
    assert attributes["vendor"] == {"string": "1b36"}


@pytest.mark.parametrize(("raw", "published_id"), [("8086", "8086"), ("0x8086", "8086"), ("15B3", "15b3"),
                                                    ("0x1af", "01af")])
def test_vendor_and_device_ids_are_four_lower_case_hex_digits(raw: str, published_id: str) -> None:
    assert hex_id(raw) == published_id


def test_pci_attributes_do_not_read_the_host(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pool = pci.pool({"resourceName": "vfs", "selectors": {"drivers": ["iavf"]}})
    before = pci_attributes(pool.devices[VFS[0]].details)
    host.remove_pci(VFS[0])
    assert pci.handler.dra_attributes(pool, VFS[0]) == before


def test_both_handlers_are_describers() -> None:
    assert Hooks.of(PciHandler.__new__(PciHandler)).describer is not None
    assert Hooks.of(DevNodeHandler.__new__(DevNodeHandler)).describer is not None


def test_a_dev_node_publishes_its_path_in_the_container(host: FakeHost) -> None:
    nodes = DevNodes(host)
    mknod(nodes.root, "net/tun", 10, 200)
    (configured,) = nodes.configure({"resourceName": "tun", "allocationApi": "dra", "count": 2,
                                     "selectors": {"paths": ["/dev/net/tun"]}})
    built = nodes.handler.build(nodes.handler.scan(), [configured])
    pool = trees.pool(configured, built[configured.resource])
    assert slice_devices(pool, DRIVER, Hooks.of(nodes.handler).describer) == [
        {"name": device_name(f"net_tun-{index}"), "attributes": {
            "id": {"string": f"net_tun-{index}"},
            "resourceName": {"string": "devices.kubevirt.io/tun"},
            "path": {"string": "/dev/net/tun"},
        }} for index in range(2)
    ]


def test_a_dev_node_device_without_specs_says_nothing() -> None:
    handler = DevNodeHandler.__new__(DevNodeHandler)
    pool = trees.pool("example.com/x", ["a"], handler="devnode")
    assert handler.dra_attributes(pool, "a") == {}
    pool = trees.pool("example.com/x", {"a": DeviceInfo(specs=(DeviceSpec("/dev/kvm", "/dev/kvm"),))}, handler="devnode")
    assert handler.dra_attributes(pool, "a") == {"path": "/dev/kvm"}

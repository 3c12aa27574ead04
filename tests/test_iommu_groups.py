"""An IOMMU group is the unit of passthrough: functions sharing a group are one device, a group
that is not viable is offered nowhere, and IOMMUFD nodes are handed out when the kernel has them.
On the fake sysfs, laid out as Linux lays out a multifunction NVMe and a PCIe-to-PCI bridge."""

from __future__ import annotations

import json
import logging

import pytest

from daemon.core import AllocationError, DeviceSpec, UEvent
from tests.fakesysfs import FakeHost
from tests.pci import NVME_CLASS, Pci, add_nvme_pf

MULTI = ["0000:01:00.0", "0000:01:00.1", "0000:01:00.2"]  # one multifunction NVMe: group 8
BEHIND_BRIDGE = ["0000:03:01.0", "0000:03:02.0"]  # two NVMe behind a pcie-pci-bridge: group 9
BRIDGE = "0000:02:00.0"
PCI_POOL = {"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}}
VFIO = DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio")


def add_multifunction_nvme(host: FakeHost, drivers: list[str | None], group: int = 8) -> None:
    for address, driver in zip(MULTI, drivers):
        host.add_pci(address, vendor="1b36", device="0010", class_code=NVME_CLASS, driver=driver,
                     bridge="0000:00:01.0")
        host.set_iommu_group(address, group)


def add_bridged_nvme(host: FakeHost, drivers: list[str | None], bridge_driver: str | None = None) -> None:
    host.add_pci(BRIDGE, vendor="1b36", device="000e", class_code="060400", driver=bridge_driver,
                 bridge="0000:00:02.0")
    host.set_iommu_group(BRIDGE, 9)
    for address, driver in zip(BEHIND_BRIDGE, drivers):
        host.add_pci(address, vendor="1b36", device="0010", class_code=NVME_CLASS, driver=driver,
                     bridge=f"0000:00:02.0/{BRIDGE}")
        host.set_iommu_group(address, 9)


def bind_event(host: FakeHost, address: str, driver: str | None) -> UEvent:
    """The function bound to ``driver`` (``None``: unbound) in sysfs, and the kernel's uevent."""
    if driver is None:
        host.unbind(address)
        return UEvent("unbind", host.devpath(address), "pci")
    host.bind(address, driver)
    return UEvent("bind", host.devpath(address), "pci", None, {"DRIVER": driver})


def test_functions_sharing_a_group_are_one_device_named_by_the_lowest_address(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci"] * 3)
    pool = pci.pool(PCI_POOL)
    assert list(pool.devices) == [MULTI[0]]
    allocation = pci.allocate(pool, [MULTI[0]])
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/8", "/dev/vfio/8")]
    assert allocation.envs["PCIDEVICE_INTEL_COM_NVME"] == ",".join(MULTI)
    assert allocation.envs["PCI_RESOURCE_INTEL_COM_NVME"] == ",".join(MULTI)
    info = json.loads(allocation.envs["PCIDEVICE_INTEL_COM_NVME_INFO"])
    assert sorted(info) == MULTI
    assert {info[address]["vfio"]["dev-mount"] for address in MULTI} == {"/dev/vfio/8"}


def test_a_group_with_a_function_on_a_host_driver_is_offered_nowhere(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci", "vfio-pci", "nvme"])
    assert pci.pool(PCI_POOL).devices == {}


def test_unbound_functions_and_a_driverless_bridge_leave_the_group_viable(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci", None, "vfio-pci"])
    add_bridged_nvme(host, ["vfio-pci", "vfio-pci"])
    pool = pci.pool(PCI_POOL)
    assert sorted(pool.devices) == [MULTI[0], BEHIND_BRIDGE[0]]
    assert [f.device.address for f in pool.devices[MULTI[0]].details.functions] == [MULTI[0], MULTI[2]]
    assert [f.device.address for f in pool.devices[BEHIND_BRIDGE[0]].details.functions] == BEHIND_BRIDGE


def test_a_bridge_on_pcieport_does_not_keep_its_group_from_being_viable(pci: Pci, host: FakeHost) -> None:
    add_bridged_nvme(host, ["vfio-pci", "vfio-pci"], bridge_driver="pcieport")
    assert list(pci.pool(PCI_POOL).devices) == [BEHIND_BRIDGE[0]]


def test_one_function_groups_keep_their_ids_and_answers(pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, "0000:05:00.0", ["vfio-pci", "vfio-pci"])
    pool = pci.pool(PCI_POOL)
    assert sorted(pool.devices) == vfs
    allocation = pci.allocate(pool, [vfs[1]])
    assert allocation.envs["PCIDEVICE_INTEL_COM_NVME"] == vfs[1]
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/11", "/dev/vfio/11")]


def test_a_function_moved_to_a_host_driver_takes_its_group_out_and_back(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci"] * 3)
    configured = pci.configure(PCI_POOL)
    handler = pci.handler
    facts = handler.scan()
    assert list(handler.build(facts, configured)["intel.com/nvme"]) == [MULTI[0]]
    steps = [(MULTI[1], "nvme", []), (MULTI[1], None, [MULTI[0]]), (MULTI[2], "nvme", []),
             (MULTI[2], "vfio-pci", [MULTI[0]])]
    for address, driver, offered in steps:
        facts = handler.fold(facts, bind_event(host, address, driver))
        built = handler.build(facts, configured)["intel.com/nvme"]
        assert list(built) == offered, (address, driver)
        # the incremental build equals what a fresh scan builds
        assert built == type(handler)(handler._context).build(handler.scan(), configured)["intel.com/nvme"]


def test_a_groups_functions_matched_by_two_pools_go_whole_to_the_pool_of_the_lowest(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci"] * 3)
    pools = pci.pools(
        {"resourceName": "high", "deviceType": "pciDevice", "selectors": {"pciAddresses": MULTI[1:]}},
        {"resourceName": "low", "deviceType": "pciDevice", "selectors": {"pciAddresses": MULTI[:1]}},
    )
    assert pools["intel.com/high"].devices == {}
    assert [f.device.address for f in pools["intel.com/low"].devices[MULTI[0]].details.functions] == MULTI


def test_a_group_device_lists_the_numa_nodes_of_all_its_functions(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci"] * 3)
    host.set_file(MULTI[2], "numa_node", "1\n")
    (device,) = pci.pool(PCI_POOL).devices.values()
    assert device.numa_nodes == (0, 1)


def test_iommufd_nodes_are_handed_out_beside_the_group_node(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["vfio-pci"] * 3)
    for index, address in enumerate(MULTI):
        host.add_vfio_cdev(address, index)
    allocation = pci.allocate(pci.pool(PCI_POOL), [MULTI[0]])
    assert [spec.host_path for spec in allocation.specs] == [
        "/dev/vfio/vfio", "/dev/vfio/8", "/dev/vfio/devices/vfio0", "/dev/iommu",
        "/dev/vfio/devices/vfio1", "/dev/vfio/devices/vfio2",
    ]


def test_a_vfio_dev_entry_without_its_node_is_logged_and_left_out(
    pci: Pci, host: FakeHost, caplog: pytest.LogCaptureFixture
) -> None:
    vfs = add_nvme_pf(host, "0000:05:00.0", ["vfio-pci"])
    host.add_vfio_cdev(vfs[0], 0, node=False)
    caplog.set_level(logging.WARNING, logger="devplugd.pci")
    allocation = pci.allocate(pci.pool(PCI_POOL), vfs)
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/10", "/dev/vfio/10")]
    assert "/dev/vfio/devices/vfio0 is missing" in caplog.text


def test_a_vfio_dev_entry_without_a_cdev_is_no_iommufd_device_and_no_warning(
    pci: Pci, host: FakeHost, caplog: pytest.LogCaptureFixture
) -> None:
    """Linux 6.1 (Debian 12's): ``vfio-dev/vfio0`` for every vfio-pci function, without ``dev``;
    a guest run logged two warnings per function on every rebuild before this."""
    vfs = add_nvme_pf(host, "0000:05:00.0", ["vfio-pci"])
    host.add_vfio_cdev(vfs[0], 0, cdev=False)
    caplog.set_level(logging.WARNING, logger="devplugd.pci")
    allocation = pci.allocate(pci.pool(PCI_POOL), vfs)
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/10", "/dev/vfio/10")]
    assert "is missing" not in caplog.text


def test_a_vfio_dev_uevent_brings_the_iommufd_nodes_in(pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, "0000:05:00.0", ["vfio-pci"])
    configured = pci.configure(PCI_POOL)
    facts = pci.handler.scan()
    assert len(pci.handler.build(facts, configured)["intel.com/nvme"][vfs[0]].specs) == 2
    host.add_vfio_cdev(vfs[0], 0)
    event = UEvent("add", host.devpath(vfs[0], "vfio-dev", "vfio0"), "vfio-dev", "vfio/devices/vfio0")
    assert event.subsystem in pci.handler.subsystems
    facts = pci.handler.fold(facts, event)
    specs = pci.handler.build(facts, configured)["intel.com/nvme"][vfs[0]].specs
    assert [spec.host_path for spec in specs][2:] == ["/dev/vfio/devices/vfio0", "/dev/iommu"]


def test_a_function_found_in_another_devices_group_at_allocate_is_refused_not_split(
    pci: Pci, host: FakeHost
) -> None:
    vfs = add_nvme_pf(host, "0000:05:00.0", ["vfio-pci", "vfio-pci"])
    pool = pci.pool(PCI_POOL)  # two one-function groups, 10 and 11: two devices
    host.set_iommu_group(vfs[1], 10)  # since the last uevent, VF 1 joined VF 0's group
    with pytest.raises(AllocationError, match=f"IOMMU group changed to 10, which also holds {vfs[0]}"):
        pci.allocate(pool, [vfs[1]])
    allocation = pci.allocate(pool, vfs)  # both at once: the whole group, its node once
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/10", "/dev/vfio/10")]

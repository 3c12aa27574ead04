"""``deviceType: pciDevice`` on a fake host: any PCI function for passthrough, chosen by class,
offered only once bound to vfio-pci (or a configured driver), with vfio specs from the real group
link, read again at Allocate."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from daemon.cdi import with_cdi_names
from daemon.core import AllocationError, DeviceChanged, DeviceSpec, HandlerContext, UEvent
from daemon.core._handler import Hooks, HostChanges, allocate_container
from daemon.handlers.pci import PciHandler
from tests.fakesysfs import FakeHost
from tests.pci import Pci, add_nvme_pf, nvme_vfs

NVME_PF = "0000:01:00.0"
NVME_VFS = nvme_vfs(NVME_PF, 4)
GPU = "0000:65:00.0"
VFIO = DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio")


def pool_of(pci: Pci, selectors: dict[str, Any], **extra: Any) -> dict[str, Any]:
    entry = {"resourceName": "nvme", "deviceType": "pciDevice", "selectors": selectors, **extra}
    return dict(pci.pool(entry).devices)


def test_only_vfio_bound_functions_of_the_class_are_offered(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci", None, "nvme"])
    devices = pool_of(pci, {"classes": ["0108"]})
    assert sorted(devices) == NVME_VFS[:2]  # not the unbound VF, the nvme-bound VF, nor the PF with VFs
    assert devices[NVME_VFS[1]].specs == (VFIO, DeviceSpec("/dev/vfio/11", "/dev/vfio/11"))
    assert devices[NVME_VFS[1]].health == "Healthy" and devices[NVME_VFS[1]].numa_nodes == (0,)


def test_a_configured_driver_list_replaces_the_vfio_default(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", None, None, "nvme"])
    assert sorted(pool_of(pci, {"classes": ["0108"], "drivers": ["nvme"]})) == [NVME_VFS[3]]
    assert sorted(pool_of(pci, {"classes": ["0108"], "drivers": ["nvme", "vfio-pci"]})) == [NVME_VFS[0], NVME_VFS[3]]


def test_class_prefixes_pick_functions_of_any_kind(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci"])
    host.add_pci(GPU, vendor="10de", device="20b0", class_code="030200", driver="vfio-pci", bridge="0000:64:00.0")
    host.set_iommu_group(GPU, 77)
    assert sorted(pool_of(pci, {"classes": ["0302"]})) == [GPU]
    assert sorted(pool_of(pci, {"classes": ["03", "0x0108"]})) == [NVME_VFS[0], GPU]
    assert sorted(pool_of(pci, {"vendors": ["10de"]})) == [GPU]  # no classes: every class
    assert sorted(pool_of(pci, {"classes": ["12"]})) == []


def test_a_pf_without_netdev_is_named_by_its_address_with_vf_ranges(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci"] * 4)
    assert sorted(pool_of(pci, {"pfNames": [f"{NVME_PF}#1-2"]})) == NVME_VFS[1:3]
    assert sorted(pool_of(pci, {"rootDevices": [f"{NVME_PF}#0,3"]})) == [NVME_VFS[0], NVME_VFS[3]]
    assert sorted(pool_of(pci, {"pfNames": ["0000:99:00.0"]})) == []


def test_a_netdev_pf_is_named_by_its_netdev(pci: Pci, host: FakeHost) -> None:
    host.add_pf("0000:3b:00.0", netdev="ens1f0", driver="ice")
    host.add_vfs("0000:3b:00.0", ["0000:3b:02.0", "0000:3b:02.1"], driver="vfio-pci", iommu_groups=[40, 41])
    assert sorted(pool_of(pci, {"pfNames": ["ens1f0#1"]})) == ["0000:3b:02.1"]


def test_first_match_wins_across_pci_device_types(pci: Pci, host: FakeHost) -> None:
    host.add_pf("0000:3b:00.0", netdev="ens1f0", driver="ice")
    host.add_vfs("0000:3b:00.0", ["0000:3b:02.0", "0000:3b:02.1"], driver="vfio-pci", iommu_groups=[40, 41])
    add_nvme_pf(host, NVME_PF, ["vfio-pci"])
    pools = pci.pools(
        {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"], "pfNames": ["ens1f0#0"]}},
        {"resourceName": "any", "deviceType": "pciDevice", "selectors": {}},
    )
    assert sorted(pools["intel.com/dpdk"].devices) == ["0000:3b:02.0"]
    assert sorted(pools["intel.com/any"].devices) == [NVME_VFS[0], "0000:3b:02.1"]


def test_allocate_gives_vfio_specs_env_and_info_but_no_devinfo_file(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci"])
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {"classes": ["0108"]}})
    allocation = pci.allocate(pool, [NVME_VFS[1], NVME_VFS[0]])
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/11", "/dev/vfio/11"),
                                DeviceSpec("/dev/vfio/10", "/dev/vfio/10")]
    assert allocation.envs["PCIDEVICE_INTEL_COM_NVME"] == f"{NVME_VFS[1]},{NVME_VFS[0]}"
    info = json.loads(allocation.envs["PCIDEVICE_INTEL_COM_NVME_INFO"])
    assert info[NVME_VFS[0]] == {"generic": {"deviceID": NVME_VFS[0]},
                                 "vfio": {"mount": "/dev/vfio/vfio", "dev-mount": "/dev/vfio/10"}}
    assert not pci.devinfo_dir.exists()


def test_allocate_hands_out_the_group_the_link_names_now(pci: Pci, host: FakeHost, caplog: Any) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci"])
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    host.set_iommu_group(NVME_VFS[0], 31)  # changed under us, no uevent folded yet
    with caplog.at_level(logging.WARNING, logger="devplugd.pci"):
        allocation = pci.allocate(pool, [NVME_VFS[0], NVME_VFS[1]])
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/31", "/dev/vfio/31"),
                                DeviceSpec("/dev/vfio/11", "/dev/vfio/11")]
    info = json.loads(allocation.envs["PCIDEVICE_INTEL_COM_NVME_INFO"])
    assert info[NVME_VFS[0]]["vfio"]["dev-mount"] == "/dev/vfio/31"
    assert "IOMMU group changed from 10 to 31" in caplog.text


@pytest.mark.parametrize("change", ["unbind", "rebind_nvme", "remove"])
def test_allocate_refuses_a_device_no_longer_bound_to_vfio(pci: Pci, host: FakeHost, change: str) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci"])
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    if change == "unbind":
        host.unbind(NVME_VFS[0])
    elif change == "rebind_nvme":
        host.bind(NVME_VFS[0], "nvme")
    else:
        host.remove_pci(NVME_VFS[0])
    with pytest.raises(AllocationError, match=NVME_VFS[0]):
        pci.allocate(pool, [NVME_VFS[0]])


def test_bind_and_unbind_uevents_move_a_vf_in_and_out(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, [None, None])
    configured = pci.configure({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {"classes": ["0108"]}})
    handler = pci.handler
    facts = handler.scan()
    assert handler.build(facts, configured)["intel.com/nvme"] == {}
    host.bind(NVME_VFS[1], "vfio-pci")
    facts = handler.fold(facts, UEvent("bind", host.devpath(NVME_VFS[1]), "pci"))
    assert list(handler.build(facts, configured)["intel.com/nvme"]) == [NVME_VFS[1]]
    host.unbind(NVME_VFS[1])
    facts = handler.fold(facts, UEvent("unbind", host.devpath(NVME_VFS[1]), "pci"))
    assert handler.build(facts, configured)["intel.com/nvme"] == {}


def test_a_vf_gone_before_its_uevent_is_read_is_dropped_quietly(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci"])
    configured = pci.configure({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    facts = pci.handler.scan()
    devpath = host.devpath(NVME_VFS[1])
    host.remove_pci(NVME_VFS[1])  # the VF vanished between the kernel's bind uevent and our read
    facts = pci.handler.fold(facts, UEvent("bind", devpath, "pci"))
    assert list(pci.handler.build(facts, configured)["intel.com/nvme"]) == [NVME_VFS[0]]


@pytest.mark.parametrize(("selectors", "path", "reason"), [
    ({"classes": ["01zz"]}, "resourceList[0].selectors.classes[0]", "'01zz' is not a class code prefix"),
    ({"classes": ["0108", ""]}, "resourceList[0].selectors.classes[1]", "'' is not a class code prefix"),
    ({"classes": ["0108000"]}, "resourceList[0].selectors.classes[0]", "1 to 6 hex digits"),
    ({"classes": [108]}, "resourceList[0].selectors.classes[0]", "string"),
])
def test_bad_classes_are_refused_with_their_json_path(pci: Pci, selectors: dict[str, Any], path: str,
                                                      reason: str) -> None:
    with pytest.raises(Exception) as refused:
        pci.configure({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": selectors})
    assert path in str(refused.value) and reason in str(refused.value)


def test_an_unknown_allocation_policy_is_refused_with_its_json_path(pci: Pci) -> None:
    with pytest.raises(Exception) as refused:
        pci.configure({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {},
                       "allocationPolicy": "fastest"})
    assert "resourceList[0].allocationPolicy" in str(refused.value)
    assert "unknown allocation policy 'fastest' (expected one of: packed, spread)" in str(refused.value)


def test_a_group_change_keeps_the_node_of_a_device_still_in_the_old_group(pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci"])
    host.set_iommu_group(NVME_VFS[1], 10)  # both VFs in group 10, as functions behind one bridge are
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    assert list(pool.devices) == [NVME_VFS[0]]  # one group, one device (issue 11)
    host.set_iommu_group(NVME_VFS[0], 31)
    allocation = pci.allocate(pool, [NVME_VFS[0]])
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/31", "/dev/vfio/31"),
                                DeviceSpec("/dev/vfio/10", "/dev/vfio/10")]
    info = json.loads(allocation.envs["PCIDEVICE_INTEL_COM_NVME_INFO"])
    assert [info[vf]["vfio"]["dev-mount"] for vf in NVME_VFS[:2]] == ["/dev/vfio/31", "/dev/vfio/10"]


def test_a_group_change_is_reported_for_a_re_read_and_kept_out_of_cdi(host: FakeHost, short_tmp: Path) -> None:
    reports: list[Any] = []
    changes = HostChanges()
    changes.connect(reports.append)
    pci = Pci(host, short_tmp / "devinfo", PciHandler(HandlerContext(host.sys, host.dev, host.proc,
                                                                     short_tmp / "devinfo", changes)))
    add_nvme_pf(host, NVME_PF, ["vfio-pci", "vfio-pci"])
    pool = pci.pool({"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {}})
    host.set_iommu_group(NVME_VFS[1], 32)
    allocation = with_cdi_names(allocate_container(Hooks.of(pci.handler), pool, NVME_VFS[:2]), pool, NVME_VFS[:2])
    assert allocation.cdi_devices == [f"intel.com/nvme={NVME_VFS[0]}"]  # the CDI spec still says group 11
    assert [(type(event), event.handler, event.devpath) for event in reports] == [
        (DeviceChanged, "pci", host.devpath(NVME_VFS[1]))]
    facts = pci.handler.fold(pci.handler.scan(), reports[0])
    built = pci.handler.build(facts, [pool.pool_config])["intel.com/nvme"]
    assert built[NVME_VFS[1]].specs[1] == DeviceSpec("/dev/vfio/32", "/dev/vfio/32")


def test_the_nic_carrying_the_default_route_is_never_offered(pci: Pci, host: FakeHost) -> None:
    host.add_pci("0000:19:00.0", driver="ice", bridge="0000:17:00.0")
    host.add_netdev("0000:19:00.0", "eno1")
    host.add_pci("0000:19:00.1", driver="ice", bridge="0000:17:00.0")
    host.add_netdev("0000:19:00.1", "eno2")
    host.add_default_route("eno1")
    assert sorted(pool_of(pci, {"classes": ["02"], "drivers": ["ice"]})) == ["0000:19:00.1"]

"""netDevice's ``vdpaType`` and ``pKeys`` selectors on a fake host laid out as Linux lays out vDPA
devices and InfiniBand ports (tests/auxsysfs.py): which VFs each pool takes, the Allocate answer
and device-info file upstream gives for a vDPA device, the config refusals, and vDPA devices
added, bound, unbound and removed folding to what a fresh scan sees."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest

from daemon.core import DeviceSpec, HandlerContext, LinkChanged, LinkState, UEvent
from daemon.core._config import ConfigFileError
from daemon.handlers.pci import PciHandler
from tests.auxsysfs import VHOST_VDPA, VIRTIO_VDPA, AuxTree
from tests.fakesysfs import FakeHost
from tests.pci import Pci

PF = "0000:03:00.0"
VFS = [f"0000:03:00.{i}" for i in range(2, 6)]
IB_PF = "0000:af:00.0"
IB_VFS = [f"0000:af:00.{i}" for i in range(2, 6)]


def entry(name: str, selectors: Any, **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": selectors, **fields}


@pytest.fixture
def aux(host: FakeHost) -> AuxTree:
    return AuxTree(host)


def add_vdpa_nic(host: FakeHost, aux: AuxTree) -> list[str]:
    """A ConnectX-6 Dx PF with four mlx5 VFs: VF0 and VF1 with vDPA devices bound to vhost_vdpa,
    VF2 with one bound to virtio_vdpa, VF3 with none. Returns the vDPA device names."""
    host.add_pf(PF, netdev="enp3s0f0np0", vendor="15b3", device="101d", driver="mlx5_core")
    host.add_vfs(PF, VFS, vendor="15b3", device="101e", driver="mlx5_core",
                 netdev_names=[f"enp3s0f0v{i}" for i in range(4)])
    return [aux.add_vdpa(VFS[0]), aux.add_vdpa(VFS[1]), aux.add_vdpa(VFS[2], driver=VIRTIO_VDPA, netdev="eth9")]


# -- vdpaType -----------------------------------------------------------------------------------


def test_vdpa_type_keeps_only_vfs_whose_vdpa_device_has_that_driver(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    add_vdpa_nic(host, aux)
    pools = pci.pools(entry("vhost", {"vdpaType": "vhost"}), entry("virtio", {"vdpaType": "virtio"}),
                      entry("rest", {"vendors": ["15b3"]}))
    assert set(pools["intel.com/vhost"].devices) == {VFS[0], VFS[1]}
    assert set(pools["intel.com/virtio"].devices) == {VFS[2]}
    assert set(pools["intel.com/rest"].devices) == {VFS[3]}  # first pool wins; no vDPA device: plain


def test_vhost_vdpa_allocation_hands_out_its_node_and_writes_a_vdpa_device_info_file(
        pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    names = add_vdpa_nic(host, aux)
    pool = pci.pool(entry("vhost", {"vdpaType": "vhost"}))
    allocation = pci.allocate(pool, [VFS[1]])
    assert allocation.specs == [DeviceSpec("/dev/vhost-vdpa-1", "/dev/vhost-vdpa-1")]
    assert allocation.envs["PCIDEVICE_INTEL_COM_VHOST"] == VFS[1]
    assert allocation.envs["PCIDEVICE_INTEL_COM_VHOST_INFO"] == (
        '{"0000:03:00.3":{"generic":{"deviceID":"0000:03:00.3"},"vdpa":{"mount":"/dev/vhost-vdpa-1"}}}')
    assert (pci.devinfo_dir / "intel.com-vhost-0000:03:00.3-device.json").read_text() == (
        f'{{"type":"vdpa","version":"1.1.0","vdpa":{{"parent-device":"{names[1]}","driver":"vhost",'
        '"path":"/dev/vhost-vdpa-1","pci-address":"0000:03:00.3"}}')


def test_virtio_vdpa_allocation_has_no_node_and_an_empty_vdpa_entry(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    names = add_vdpa_nic(host, aux)
    pool = pci.pool(entry("virtio", {"vdpaType": "virtio"}))
    allocation = pci.allocate(pool, [VFS[2]])
    assert allocation.specs == []
    assert allocation.envs["PCIDEVICE_INTEL_COM_VIRTIO_INFO"] == (
        '{"0000:03:00.4":{"generic":{"deviceID":"0000:03:00.4"},"vdpa":{}}}')
    assert (pci.devinfo_dir / "intel.com-virtio-0000:03:00.4-device.json").read_text() == (
        f'{{"type":"vdpa","version":"1.1.0","vdpa":{{"parent-device":"{names[2]}","driver":"virtio",'
        '"pci-address":"0000:03:00.4"}}')


def test_a_vf_taken_without_vdpa_type_gets_the_pci_answer_even_with_a_vdpa_device(
        pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    add_vdpa_nic(host, aux)
    pool = pci.pool(entry("plain", {"vendors": ["15b3"]}))
    allocation = pci.allocate(pool, [VFS[0]])
    assert allocation.specs == []
    assert '"vdpa"' not in allocation.envs["PCIDEVICE_INTEL_COM_PLAIN_INFO"]
    assert (pci.devinfo_dir / "intel.com-plain-0000:03:00.2-device.json").read_text() == (
        '{"type":"pci","version":"1.1.0","pci":{"pci-address":"0000:03:00.2"}}')


@pytest.mark.parametrize(("selectors", "path", "reason"), [
    ({"isRdma": True, "vdpaType": "vhost"}, "resourceList[0].selectors.vdpaType", "isRdma"),
    ([{"drivers": ["mlx5_core"]}, {"IsRdma": True, "VdpaType": "virtio"}], "resourceList[0].selectors[1].vdpaType",
     "isRdma"),
    ({"vdpaType": "vhost-user"}, "resourceList[0].selectors.vdpaType", "unknown vDPA type 'vhost-user'"),
    ({"vdpaType": 1}, "resourceList[0].selectors.vdpaType", "string"),
])
def test_bad_vdpa_type_selectors_are_refused_naming_the_path(pci: Pci, selectors: Any, path: str,
                                                             reason: str) -> None:
    with pytest.raises(ConfigFileError) as refused:
        pci.configure(entry("bad", selectors))
    assert path in str(refused.value) and reason in str(refused.value)


def test_is_rdma_and_vdpa_type_in_two_selector_objects_are_fine(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    add_vdpa_nic(host, aux)
    pool = pci.pool(entry("both", [{"isRdma": True}, {"vdpaType": "vhost"}]))
    assert set(pool.devices) == {VFS[0], VFS[1]}


def test_vdpa_events_fold_to_what_a_fresh_scan_sees(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    host.add_pf(PF, netdev="enp3s0f0np0", vendor="15b3", device="101d", driver="mlx5_core")
    host.add_vfs(PF, VFS, vendor="15b3", device="101e", driver="mlx5_core")
    handler = pci.handler
    configured = pci.configure(entry("vhost", {"vdpaType": "vhost"}), entry("virtio", {"vdpaType": "virtio"}))
    facts = handler.scan()

    def step(action: str, name: str) -> dict[str, set[str]]:
        nonlocal facts
        event = aux.uevent(action, aux.vdpa_dir(name), "vdpa")
        if action == "remove":
            aux.remove_vdpa(name)
        facts = handler.fold(facts, UEvent(event.action, event.devpath, event.subsystem, None, event.properties))
        folded = {resource: set(devices) for resource, devices in handler.build(facts, configured).items()}
        fresh = PciHandler(HandlerContext(host.sys, host.dev, host.proc, pci.devinfo_dir))
        scanned = {resource: set(devices) for resource, devices in fresh.build(fresh.scan(), configured).items()}
        assert folded == scanned, (action, name)
        return folded

    name = aux.add_vdpa(VFS[1], driver=None)
    assert step("add", name) == {"intel.com/vhost": set(), "intel.com/virtio": set()}
    aux.bind_vdpa(name, VHOST_VDPA)
    assert step("bind", name) == {"intel.com/vhost": {VFS[1]}, "intel.com/virtio": set()}
    aux.unbind_vdpa(name)
    assert step("unbind", name) == {"intel.com/vhost": set(), "intel.com/virtio": set()}
    aux.bind_vdpa(name, VIRTIO_VDPA)
    assert step("bind", name) == {"intel.com/vhost": set(), "intel.com/virtio": {VFS[1]}}
    assert step("remove", name) == {"intel.com/vhost": set(), "intel.com/virtio": set()}


# -- pKeys --------------------------------------------------------------------------------------


def add_ib_nic(host: FakeHost, aux: AuxTree, pkeys: list[int]) -> None:
    """An InfiniBand PF with VFs; VF i has RDMA device mlx5_<2+i> whose port 1 table starts with
    ``pkeys[i]`` and IPoIB netdev ib0v<i>; VF 3 is RoCE (an Ethernet netdev) with the same table."""
    host.add_pf(IB_PF, netdev=None, vendor="15b3", device="101b", driver="mlx5_core")
    aux.add_ipoib(IB_PF, "ibp175s0")
    host.add_vfs(IB_PF, IB_VFS, vendor="15b3", device="101c", driver="mlx5_core")
    for index, (vf, pkey) in enumerate(zip(IB_VFS, pkeys)):
        roce = index == 3
        aux.add_ib(vf, f"mlx5_{2 + index}", pkeys=[pkey] if roce else [pkey, 0x8001],
                   link_layer="Ethernet" if roce else "InfiniBand")
        if roce:
            host.add_netdev(vf, f"enp175s0v{index}")
        else:
            aux.add_ipoib(vf, f"ib0v{index}")


def test_pkeys_compare_as_16_bit_numbers_and_only_on_infiniband_links(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    add_ib_nic(host, aux, [0x7FFF, 0x0001, 0xFFFF, 0x7FFF])
    assert host.device_dir(IB_VFS[1]).joinpath("infiniband/mlx5_3/ports/1/pkeys/0").read_text() == "0x0001\n"
    pools = pci.pools(entry("limited", {"pKeys": ["0x7fff"]}), entry("one", {"pKeys": ["0x1", "0x2"]}),
                      entry("full", {"pKeys": ["FFFF"]}), entry("rest", {"vendors": ["15b3"]}))
    assert set(pools["intel.com/limited"].devices) == {IB_VFS[0]}  # not the RoCE VF with the same key
    assert set(pools["intel.com/one"].devices) == {IB_VFS[1]}  # upstream's string compare never matches this
    assert set(pools["intel.com/full"].devices) == {IB_VFS[2]}
    assert set(pools["intel.com/rest"].devices) == {IB_VFS[3]}


def test_pkeys_read_port_1_index_0_only(pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    add_ib_nic(host, aux, [0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF])
    assert set(pci.pool(entry("second", {"pKeys": ["0x8001"]})).devices) == set()  # index 1 is not the default


def test_an_unreadable_pkey_leaves_the_vf_to_other_pools_with_a_log_line(
        pci: Pci, host: FakeHost, aux: AuxTree, caplog: pytest.LogCaptureFixture) -> None:
    add_ib_nic(host, aux, [0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF])
    path = host.device_dir(IB_VFS[0]) / "infiniband/mlx5_2/ports/1/pkeys/0"
    path.write_text("garbage\n")
    with caplog.at_level(logging.WARNING, logger="devplugd.pci"):
        pools = pci.pools(entry("ib", {"pKeys": ["0x7fff"]}), entry("rest", {"linkTypes": ["infiniband"]}))
    assert set(pools["intel.com/ib"].devices) == {IB_VFS[1], IB_VFS[2]}
    assert IB_VFS[0] in pools["intel.com/rest"].devices
    assert any(f"{IB_VFS[0]}/infiniband/mlx5_2/ports/1/pkeys/0: 'garbage' is not a partition key"
               in record.getMessage() for record in caplog.records), caplog.text


@pytest.mark.parametrize(("pkeys", "position", "text"), [
    (["0x10000"], 0, "'0x10000'"), (["0x7fff", "zz"], 1, "'zz'"), ([""], 0, "''"), (["0x"], 0, "'0x'"),
])
def test_pkeys_that_are_not_16_bit_hex_numbers_are_refused_naming_the_entry(
        pci: Pci, pkeys: list[str], position: int, text: str) -> None:
    with pytest.raises(ConfigFileError) as refused:
        pci.configure(entry("bad", {"pKeys": pkeys}))
    assert f"resourceList[0].selectors.pKeys[{position}]" in str(refused.value)
    assert text in str(refused.value) and "partition key" in str(refused.value)


def test_pkeys_and_vdpa_type_are_ignored_by_accelerator_pools_as_upstream(pci: Pci) -> None:
    (configured,) = pci.configure(entry("qat", {"pKeys": ["nonsense"], "vdpaType": "bogus"},
                                        deviceType="accelerator"))
    assert configured.spec.selectors[0].pkeys == frozenset() and configured.spec.selectors[0].vdpa_type is None


def test_the_config_json_with_both_selectors_checks_out(pci: Pci) -> None:
    text = json.dumps({"resourceList": [entry("ib_rdma", {"linkTypes": ["infiniband"], "isRdma": True,
                                                          "pKeys": ["0x7fff"]})]})
    assert pci.configure(*json.loads(text)["resourceList"])[0].spec.selectors[0].pkeys == frozenset({0x7FFF})


def test_a_dangling_vdpa_bus_link_does_not_hide_the_vfs_real_vdpa_device(pci: Pci, host: FakeHost,
                                                                         aux: AuxTree) -> None:
    add_vdpa_nic(host, aux)
    real = aux.vdpa_dir("vdpa0")
    (host.sys / "bus" / "vdpa" / "devices" / "aaa_gone").symlink_to(
        os.path.relpath(real.parent / "aaa_gone", host.sys / "bus" / "vdpa" / "devices"))
    assert set(pci.pool(entry("vhost", {"vdpaType": "vhost"})).devices) == {VFS[0], VFS[1]}


def test_a_pkey_the_subnet_manager_sets_later_is_read_when_the_ipoib_link_comes_up(
        pci: Pci, host: FakeHost, aux: AuxTree) -> None:
    """No uevent says the port's table changed: the IPoIB carrier coming up does."""
    add_ib_nic(host, aux, [0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF])
    handler = pci.handler
    configured = pci.configure(entry("limited", {"pKeys": ["0x7fff"]}))
    facts = handler.scan()
    assert set(handler.build(facts, configured)["intel.com/limited"]) == set()
    (host.device_dir(IB_VFS[1]) / "infiniband/mlx5_3/ports/1/pkeys/0").write_text("0x7fff\n")
    facts = handler.fold(facts, LinkChanged("ib0v1", LinkState(7, admin_up=True, lower_up=False)))
    assert set(handler.build(facts, configured)["intel.com/limited"]) == set()  # no carrier: not read yet
    facts = handler.fold(facts, LinkChanged("ib0v1", LinkState(7, admin_up=True, lower_up=True)))
    assert set(handler.build(facts, configured)["intel.com/limited"]) == {IB_VFS[1]}
    fresh = PciHandler(HandlerContext(host.sys, host.dev, host.proc, pci.devinfo_dir))
    assert dict(fresh.scan().devices) == dict(facts.devices)

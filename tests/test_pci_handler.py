"""PCI discovery, pool building and Allocate extras on a fake host (unit tests, no daemon process)."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Callable
from typing import Any

import pytest

from daemon.core import DeviceSpec
from tests.fakesysfs import INFINIBAND, FakeHost
from tests.pci import Pci

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{i}" for i in range(4)]
VFIO = DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio")


def add_nic(host: FakeHost, *, driver: str = "iavf", netdevs: bool = True, numa: int = 0) -> None:
    """PF ens1f0 (ice) with four VFs; VF i has IOMMU group 40+i and, if ``netdevs``, netdev ens1f0v<i>."""
    host.add_pf(PF, netdev="ens1f0", driver="ice", device="1592", numa_node=numa)
    host.add_vfs(PF, VFS, driver=driver, device="1889", numa_node=numa, iommu_groups=[40, 41, 42, 43],
                 netdev_names=[f"ens1f0v{i}" for i in range(4)] if netdevs else None)


def pool_entry(name: str = "sriov_net_A", selectors: Any = None, **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": {} if selectors is None else selectors, **fields}


# -- discovery ----------------------------------------------------------------------------------


def test_vendor_and_device_ids_select_devices(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    host.add_pf("0000:5e:00.0", netdev="enp94s0", vendor="15b3", device="1017", driver="mlx5_core")
    pools = pci.pools(pool_entry("mlx", {"vendors": ["15b3"], "devices": ["1017"]}),
                      pool_entry("intel", {"vendors": ["8086"], "devices": ["1889"]}))
    assert set(pools["intel.com/mlx"].devices) == {"0000:5e:00.0"}
    assert set(pools["intel.com/intel"].devices) == set(VFS)


@pytest.mark.parametrize(
    ("numa", "fields", "nodes"),
    [(1, {}, (1,)), (0, {}, (0,)), (-1, {}, ()), (1, {"excludeTopology": True}, ()), (None, {}, ())],
)
def test_numa_node_becomes_topology(pci: Pci, host: FakeHost, numa: int | None, fields: dict, nodes: tuple) -> None:
    add_nic(host, numa=numa if numa is not None else 0)
    if numa is None:
        for vf in VFS:
            (host.device_dir(vf) / "numa_node").unlink()
    pool = pci.pool(pool_entry(**fields))
    assert {info.numa_nodes for info in pool.devices.values()} == {nodes}


def test_vf_index_and_pf_name_come_from_virtfn_and_physfn_links(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pools = pci.pools(pool_entry("by_name", {"pfNames": ["ens1f0#1,3"]}),
                      pool_entry("by_root", {"rootDevices": [f"{PF}#0"]}))
    assert set(pools["intel.com/by_name"].devices) == {VFS[1], VFS[3]}
    assert set(pools["intel.com/by_root"].devices) == {VFS[0]}


def test_vf_index_is_found_when_the_pf_is_not_listed_on_the_bus(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    (host.sys / "bus" / "pci" / "devices" / PF).unlink()
    assert set(pci.pool(pool_entry(selectors={"pfNames": ["ens1f0#2"]})).devices) == {VFS[2]}


def test_link_type_comes_from_own_netdev_else_from_the_pf(pci: Pci, host: FakeHost) -> None:
    ib_pf, ib_vfs = "0000:af:00.0", ["0000:af:00.2", "0000:af:00.3", "0000:af:00.4"]
    host.add_pf(ib_pf, netdev=None, vendor="15b3", device="101b", driver="mlx5_core")
    host.add_netdev(ib_pf, "ibp175s0", arphrd=INFINIBAND)
    host.add_vfs(ib_pf, ib_vfs, vendor="15b3", device="101c", driver="mlx5_core")
    host.add_netdev(ib_vfs[0], "ibp175s0v0", arphrd=INFINIBAND)
    host.bind(ib_vfs[1], "vfio-pci")
    host.set_iommu_group(ib_vfs[1], 90)  # no netdev of its own: the PF's type
    host.add_netdev(ib_vfs[2], "ethv2")  # its own ether type wins over the PF's
    add_nic(host)
    pools = pci.pools(pool_entry("ib", {"linkTypes": ["infiniband"]}), pool_entry("eth", {"linkTypes": ["ether"]}))
    assert set(pools["intel.com/ib"].devices) == {ib_vfs[0], ib_vfs[1]}
    assert set(pools["intel.com/eth"].devices) == {ib_vfs[2], *VFS}


@pytest.mark.parametrize(
    ("noiommu", "group_spec"),
    [(False, DeviceSpec("/dev/vfio/41", "/dev/vfio/41")), (True, DeviceSpec("/dev/vfio/41", "/dev/vfio/noiommu-41"))],
)
def test_vf_bound_to_vfio_gets_group_device_specs(pci: Pci, host: FakeHost, noiommu: bool, group_spec) -> None:
    add_nic(host, driver="vfio-pci", netdevs=False)
    host.set_iommu_group(VFS[1], 41, noiommu=noiommu)
    pool = pci.pool(pool_entry())
    assert pool.devices[VFS[1]].specs == (VFIO, group_spec)
    assert group_spec.permissions == "rw"


def test_vfio_device_without_iommu_group_is_not_offered(pci: Pci, host: FakeHost) -> None:
    add_nic(host, driver="vfio-pci", netdevs=False)
    (host.device_dir(VFS[2]) / "iommu_group").unlink()
    assert set(pci.pool(pool_entry()).devices) == {VFS[0], VFS[1], VFS[3]}


@pytest.mark.parametrize(
    ("driver", "specs"),
    [("igb_uio", (DeviceSpec("/dev/uio3", "/dev/uio3"),)), ("uio", (DeviceSpec("/dev/uio3", "/dev/uio3"),)),
     ("uio_pci_generic", ()), ("iavf", ())],
)
def test_uio_bound_vf_gets_its_uio_node(pci: Pci, host: FakeHost, driver: str, specs: tuple) -> None:
    add_nic(host, driver=driver, netdevs=False)
    host.add_uio(VFS[1], 3)
    assert pci.pool(pool_entry()).devices[VFS[1]].specs == specs


def add_rdma_nic(host: FakeHost) -> None:
    add_nic(host, driver="mlx5_core")
    host.add_rdma(VFS[1], "mlx5_3", 3)


def test_is_rdma_mounts_the_rdma_char_devices_and_keeps_only_rdma_devices(pci: Pci, host: FakeHost) -> None:
    add_rdma_nic(host)
    pool = pci.pool(pool_entry(selectors={"isRdma": True}))
    assert set(pool.devices) == {VFS[1]}
    paths = {spec.host_path for spec in pool.devices[VFS[1]].specs}
    assert paths == {f"/dev/infiniband/{name}" for name in ("uverbs3", "umad3", "issm3", "ucm3", "rdma_cm")}


def test_rdma_devices_are_not_mounted_without_is_rdma(pci: Pci, host: FakeHost) -> None:
    add_rdma_nic(host)
    pool = pci.pool(pool_entry())
    assert set(pool.devices) == set(VFS)
    assert pool.devices[VFS[1]].specs == ()


@pytest.mark.parametrize(
    ("need", "nodes", "offered"),
    [(True, ("vhost-net", "net/tun"), True), (True, ("vhost-net",), False), (True, ("net/tun",), False),
     (False, ("vhost-net", "net/tun"), False)],
)
def test_vhost_net_specs_need_the_flag_and_both_nodes(pci: Pci, host: FakeHost, need: bool, nodes, offered) -> None:
    add_nic(host)
    for node in nodes:
        host.add_dev_node(node)
    pool = pci.pool(pool_entry(selectors={"needVhostNet": need}))
    vhost = (DeviceSpec("/dev/vhost-net", "/dev/vhost-net"), DeviceSpec("/dev/net/tun", "/dev/net/tun"))
    assert {info.specs for info in pool.devices.values()} == {vhost if offered else ()}


def add_accelerator(host: FakeHost) -> list[str]:
    acc_pf, acc_vfs = "0000:3d:00.0", ["0000:3d:01.0", "0000:3d:01.1"]
    host.add_pf(acc_pf, netdev=None, device="0d5c", class_code="120000", driver="qat_4xxx")
    host.add_vfs(acc_pf, acc_vfs, device="0d5d", driver="vfio-pci", iommu_groups=[70, 71])
    for vf in acc_vfs:
        host.set_file(vf, "class", "0x120000\n")
    return [acc_pf, *acc_vfs]


def test_pf_with_vfs_is_not_a_net_device_but_is_an_accelerator(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    accelerators = add_accelerator(host)
    host.add_pf("0000:5e:00.0", netdev="eno1")  # SR-IOV capable, 0 VFs: a plain device
    pools = pci.pools(pool_entry("net"), pool_entry("acc", deviceType="accelerator"))
    assert set(pools["intel.com/net"].devices) == {*VFS, "0000:5e:00.0"}
    assert set(pools["intel.com/acc"].devices) == set(accelerators)


def test_unbound_devices_are_not_offered(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    host.unbind(VFS[0])
    host.add_pci("0000:3d:00.0", class_code="120000", driver=None)
    pools = pci.pools(pool_entry("net"), pool_entry("acc", deviceType="accelerator"))
    assert set(pools["intel.com/net"].devices) == set(VFS[1:])
    assert pools["intel.com/acc"].devices == {}


def test_netdev_with_ipv4_default_route_is_not_offered(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    host.add_pf("0000:5e:00.0", netdev="eno1")
    host.add_pf("0000:5e:00.1", netdev="eno2")
    host.add_default_route("eno1")
    host.add_default_route("ens1f0")  # the PF's route does not hide its VFs
    host.add_default_route("ens1f0v2")
    with open(host.proc / "net" / "route", "a") as route:  # a non-default route is harmless
        route.write("eno2\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
    assert set(pci.pool(pool_entry()).devices) == {VFS[0], VFS[1], VFS[3], "0000:5e:00.1"}


def test_pools_see_only_their_pci_class(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    accelerators = add_accelerator(host)
    host.add_pci("0000:65:00.0", vendor="10de", device="20b0", class_code="030200", driver="nvidia")
    host.add_pci("0000:66:00.0", class_code="010802", driver="nvme")
    pools = pci.pools(pool_entry("net"), pool_entry("acc", deviceType="accelerator"))
    assert set(pools["intel.com/net"].devices) == set(VFS)
    assert set(pools["intel.com/acc"].devices) == set(accelerators)


def test_first_pool_in_file_order_wins_a_device(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    narrow = pool_entry("narrow", {"pfNames": ["ens1f0#0-1"]})
    pools = pci.pools(narrow, pool_entry("all"))
    assert (set(pools["intel.com/narrow"].devices), set(pools["intel.com/all"].devices)) == (
        set(VFS[:2]), set(VFS[2:]))
    pools = pci.pools(pool_entry("all"), narrow)
    assert (set(pools["intel.com/all"].devices), pools["intel.com/narrow"].devices) == (set(VFS), {})


def test_first_selector_object_wins_and_its_flags_apply(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    host.add_dev_node("vhost-net")
    host.add_dev_node("net/tun")
    pool = pci.pool(pool_entry(selectors=[{"pfNames": ["ens1f0#0"]}, {"needVhostNet": True}]))
    assert set(pool.devices) == set(VFS)
    assert pool.devices[VFS[0]].specs == ()
    assert all(len(pool.devices[vf].specs) == 2 for vf in VFS[1:])


def _dangling_bus_entry(host: FakeHost) -> None:
    (host.sys / "bus" / "pci" / "devices" / "0000:3b:09.9").symlink_to(
        "../../../devices/pci0000:00/0000:00:02.0/0000:3b:09.9")


@pytest.mark.parametrize(
    ("corrupt", "lost"),
    [
        (lambda host: host.set_file(VFS[1], "vendor", "zzz\n"), {VFS[1]}),
        (lambda host: host.set_file(VFS[1], "device", "0x1889889\n"), {VFS[1]}),
        (lambda host: (host.device_dir(VFS[1]) / "class").write_bytes(b"\xff\xfe"), {VFS[1]}),
        (lambda host: (host.device_dir(VFS[1]) / "class").unlink(), {VFS[1]}),
        (lambda host: host.set_file(VFS[1], "net/ens1f0v1/type", "ether\n"), {VFS[1]}),
        (lambda host: host.set_file(PF, "sriov_numvfs", "many\n"), set()),
        (_dangling_bus_entry, set()),
        (lambda host: shutil.rmtree(host.device_dir(VFS[1])), {VFS[1]}),
    ],
    ids=["vendor", "device", "binary-class", "no-class", "netdev-type", "pf-numvfs", "dangling", "removed"],
)
def test_garbage_sysfs_skips_only_that_device(pci: Pci, host: FakeHost, corrupt: Callable, lost: set) -> None:
    add_nic(host)
    corrupt(host)
    assert set(pci.pool(pool_entry()).devices) == set(VFS) - lost


def test_unreadable_numa_node_keeps_the_device_without_topology(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    host.set_file(VFS[1], "numa_node", "abc\n")
    pool = pci.pool(pool_entry())
    assert set(pool.devices) == set(VFS)
    assert pool.devices[VFS[1]].numa_nodes == ()
    assert pool.devices[VFS[0]].numa_nodes != ()


# -- Allocate extras: env vars, _INFO, device-info files ---------------------------------------


@pytest.mark.parametrize(
    ("prefix", "fields", "env"),
    [
        ("intel.com", {}, "PCIDEVICE_INTEL_COM_SRIOV_NET_A"),
        ("intel.com", {"resourcePrefix": "example.org"}, "PCIDEVICE_EXAMPLE_ORG_SRIOV_NET_A"),
        ("my-co.io", {"resourceName": "vf-a"}, "PCIDEVICE_MY-CO_IO_VF-A"),
        ("intel.com", {"resourceName": "vf-a", "resourcePrefix": "my-co.io"}, "PCIDEVICE_MY-CO_IO_VF-A"),
    ],
)
def test_env_var_name_follows_upstream(pci: Pci, host: FakeHost, prefix: str, fields: dict, env: str) -> None:
    add_nic(host)
    pool = pci.pool({**pool_entry(), **fields}, prefix=prefix)
    envs = pci.allocate(pool, [VFS[0]]).envs
    assert set(envs) == {env, f"{env}_INFO"}
    assert envs[env] == VFS[0]


def test_env_value_lists_ids_in_request_order(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pool = pci.pool(pool_entry())
    assert pci.allocate(pool, [VFS[2], VFS[0], VFS[3]]).envs["PCIDEVICE_INTEL_COM_SRIOV_NET_A"] == (
        "0000:3b:02.2,0000:3b:02.0,0000:3b:02.3")


def test_vfio_allocation_shares_the_container_node_once(pci: Pci, host: FakeHost) -> None:
    add_nic(host, driver="vfio-pci", netdevs=False)
    allocation = pci.allocate(pci.pool(pool_entry()), [VFS[1], VFS[0]])
    assert allocation.specs == [VFIO, DeviceSpec("/dev/vfio/41", "/dev/vfio/41"),
                                DeviceSpec("/dev/vfio/40", "/dev/vfio/40")]


def test_info_env_is_go_json_with_providers_and_additional_info(pci: Pci, host: FakeHost) -> None:
    add_nic(host, driver="vfio-pci", netdevs=False)
    host.bind(VFS[2], "igb_uio")
    host.add_uio(VFS[2], 0)
    host.add_dev_node("vhost-net")
    host.add_dev_node("net/tun")
    info = {"*": {"site": "rack12", "tier": "gold"}, VFS[1]: {"site": "special"}}
    pool = pci.pool(pool_entry(selectors={"needVhostNet": True}, additionalInfo=info))
    envs = pci.allocate(pool, [VFS[2], VFS[1]]).envs
    vhost = '"vhost":{"net-mount":"/dev/vhost-net","tun-mount":"/dev/net/tun"}'
    assert envs["PCIDEVICE_INTEL_COM_SRIOV_NET_A_INFO"] == (
        '{"0000:3b:02.1":{"extra":{"site":"special","tier":"gold"},"generic":{"deviceID":"0000:3b:02.1"},'
        f'"vfio":{{"dev-mount":"/dev/vfio/41","mount":"/dev/vfio/vfio"}},{vhost}}},'
        '"0000:3b:02.2":{"extra":{"site":"rack12","tier":"gold"},"generic":{"deviceID":"0000:3b:02.2"},'
        f'"uio":{{"mount":"/dev/uio0"}},{vhost}}}}}'
    )


def test_info_env_of_rdma_device(pci: Pci, host: FakeHost) -> None:
    add_rdma_nic(host)
    pool = pci.pool(pool_entry(selectors={"isRdma": True}))
    assert pci.allocate(pool, [VFS[1]]).envs["PCIDEVICE_INTEL_COM_SRIOV_NET_A_INFO"] == (
        '{"0000:3b:02.1":{"generic":{"deviceID":"0000:3b:02.1"},"rdma":{"issm":"/dev/infiniband/issm3",'
        '"rdma_cm":"/dev/infiniband/rdma_cm","rdma_dev":"mlx5_3","umad":"/dev/infiniband/umad3",'
        '"uverbs":"/dev/infiniband/uverbs3"}}}'
    )


@pytest.mark.parametrize(
    ("fields", "info"),
    [
        ({}, '{"0000:3b:02.0":{"generic":{"deviceID":"0000:3b:02.0"}}}'),
        ({"additionalInfo": {}}, '{"0000:3b:02.0":{"extra":{},"generic":{"deviceID":"0000:3b:02.0"}}}'),
        ({"additionalInfo": {VFS[1]: {"a": "b"}}},
         '{"0000:3b:02.0":{"extra":{},"generic":{"deviceID":"0000:3b:02.0"}}}'),
        ({"additionalInfo": {"*": {"url": "<a&b>", "note": "caf\u00e9"}}},
         '{"0000:3b:02.0":{"extra":{"note":"caf\u00e9","url":"\\u003ca\\u0026b\\u003e"},'
         '"generic":{"deviceID":"0000:3b:02.0"}}}'),
    ],
)
def test_info_env_extra_provider(pci: Pci, host: FakeHost, fields: dict, info: str) -> None:
    add_nic(host)
    pool = pci.pool(pool_entry(**fields))
    assert pci.allocate(pool, [VFS[0]]).envs["PCIDEVICE_INTEL_COM_SRIOV_NET_A_INFO"] == info


def test_allocate_writes_read_only_device_info_files(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pci.allocate(pci.pool(pool_entry()), [VFS[1], VFS[3]])
    assert sorted(path.name for path in pci.devinfo_dir.iterdir()) == [
        "intel.com-sriov_net_A-0000:3b:02.1-device.json", "intel.com-sriov_net_A-0000:3b:02.3-device.json"]
    path = pci.devinfo_dir / "intel.com-sriov_net_A-0000:3b:02.1-device.json"
    assert path.read_text() == '{"type":"pci","version":"1.1.0","pci":{"pci-address":"0000:3b:02.1"}}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_rdma_device_info_file_names_the_rdma_device(pci: Pci, host: FakeHost) -> None:
    add_rdma_nic(host)
    pci.allocate(pci.pool(pool_entry(selectors={"isRdma": True})), [VFS[1]])
    assert (pci.devinfo_dir / "intel.com-sriov_net_A-0000:3b:02.1-device.json").read_text() == (
        '{"type":"pci","version":"1.1.0","pci":{"pci-address":"0000:3b:02.1","rdma-device":"mlx5_3"}}')


def test_second_allocate_rewrites_the_device_info_file(pci: Pci, host: FakeHost) -> None:
    add_nic(host)
    pool = pci.pool(pool_entry())
    pci.allocate(pool, [VFS[1]])
    path = pci.devinfo_dir / "intel.com-sriov_net_A-0000:3b:02.1-device.json"
    path.chmod(0o644)
    path.write_text("stale")
    path.chmod(0o444)
    pci.allocate(pool, [VFS[1]])
    assert path.read_text() == '{"type":"pci","version":"1.1.0","pci":{"pci-address":"0000:3b:02.1"}}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o444


def test_an_allocate_finds_the_device_info_file_as_it_left_it_or_writes_it_again(pci: Pci, host: FakeHost) -> None:
    """The file a second Allocate finds untouched is kept (same inode); one removed, chmod-ed or
    replaced since is written again, read-only, with the device's content."""
    add_nic(host)
    pool = pci.pool(pool_entry())
    path = pci.devinfo_dir / "intel.com-sriov_net_A-0000:3b:02.1-device.json"
    content = '{"type":"pci","version":"1.1.0","pci":{"pci-address":"0000:3b:02.1"}}'
    pci.allocate(pool, [VFS[1]])
    first = path.stat().st_ino
    pci.allocate(pool, [VFS[1]])
    assert path.stat().st_ino == first and path.read_text() == content
    path.unlink()
    pci.allocate(pool, [VFS[1]])
    assert path.read_text() == content
    path.chmod(0o644)
    pci.allocate(pool, [VFS[1]])
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    replacement = path.with_name("replacement")
    replacement.write_text(content.replace("3b:02.1", "3b:02.7"))  # the same size, another file
    replacement.rename(path)
    pci.allocate(pool, [VFS[1]])
    assert path.read_text() == content and stat.S_IMODE(path.stat().st_mode) == 0o444


def test_accelerator_pools_write_no_device_info_files(pci: Pci, host: FakeHost) -> None:
    accelerators = add_accelerator(host)
    allocation = pci.allocate(pci.pool(pool_entry("qat", deviceType="accelerator")), accelerators[1:])
    assert allocation.envs["PCIDEVICE_INTEL_COM_QAT"] == "0000:3d:01.0,0000:3d:01.1"
    assert not pci.devinfo_dir.exists() or list(pci.devinfo_dir.iterdir()) == []


@pytest.mark.parametrize("hook", ["pools_started", "pools_stopped"])
def test_pool_start_and_stop_remove_only_that_pools_device_info_files(pci: Pci, host: FakeHost, hook: str) -> None:
    add_nic(host)
    entries = (pool_entry("sriov", {"pfNames": ["ens1f0#0-1"]}), pool_entry("sriov-a"))
    pools = pci.pools(*entries)
    pci.allocate(pools["intel.com/sriov"], VFS[:2])
    pci.allocate(pools["intel.com/sriov-a"], VFS[2:])
    (pci.devinfo_dir / "intel.com-sriov-notes.txt").write_text("not ours")
    getattr(pci.handler, hook)([pci.configure(*entries)[0]])
    assert sorted(path.name for path in pci.devinfo_dir.iterdir()) == [
        "intel.com-sriov-a-0000:3b:02.2-device.json", "intel.com-sriov-a-0000:3b:02.3-device.json",
        "intel.com-sriov-notes.txt"]

"""The fake tree of tests/auxsysfs.py is laid out as Linux lays it out: scalable functions on the
auxiliary bus, vDPA devices on VFs, InfiniBand ports with partition keys. Each link is checked as
sysfs shows it (its text) and as a reader follows it (its realpath), and no link anywhere in the
fake sysfs may point outside it or at nothing, except where a test makes a function vanish."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.auxsysfs import (
    CX6DX_VF,
    DEFAULT_SWITCH_ID,
    MELLANOX,
    SF_DRIVER,
    VHOST_VDPA,
    VHOST_VDPA_MAJOR,
    VIRTIO_VDPA,
    AuxTree,
    aux_modalias,
)
from tests.fakesysfs import FakeHost

PF = "0000:03:00.0"
PF_DIR = "devices/pci0000:00/0000:00:02.0/0000:03:00.0"
VFS = ["0000:03:00.2", "0000:03:00.3"]


@pytest.fixture
def tree(ram_host: FakeHost) -> AuxTree:
    return AuxTree(ram_host)


def broken_links(host: FakeHost) -> list[str]:
    """Every symlink under the fake root that resolves to nothing or to a place outside it."""
    root = host.root.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in (*dirnames, *filenames):
            link = Path(dirpath) / entry
            if link.is_symlink():
                target = Path(os.path.realpath(link))
                if not target.exists() or root not in target.parents:
                    found.append(f"{link.relative_to(root)} -> {os.readlink(link)}")
    return found


def read(path: Path) -> str:
    return path.read_text()


def with_sf(tree: AuxTree, *, bound: bool = True) -> str:
    tree.add_mlx5_pf(PF, uplink="enp3s0f0np0", rdma="mlx5_0")
    return tree.add_sf(PF, 88, netdev="enp3s0f0s88", rdma="mlx5_1", bound=bound)


# -- the auxiliary bus --------------------------------------------------------------------------
def test_an_sf_sits_under_its_pf_with_the_bus_link_subsystem_driver_and_sfnum(tree: AuxTree) -> None:
    name = with_sf(tree)
    sys_dir = tree.sys
    assert name == "mlx5_core.sf.1"  # the PF took adev_idx 0 (mlx5_core.eth.0, ...)
    sf = sys_dir / PF_DIR / name
    bus_link = sys_dir / "bus" / "auxiliary" / "devices" / name
    assert os.readlink(bus_link) == f"../../../{PF_DIR}/{name}"
    assert os.path.realpath(bus_link) == str(sf.resolve())
    assert os.readlink(sf / "subsystem") == "../../../../../bus/auxiliary"
    assert (sf / "subsystem").resolve() == (sys_dir / "bus" / "auxiliary").resolve()
    assert os.readlink(sf / "driver") == f"../../../../../bus/auxiliary/drivers/{SF_DRIVER}"
    assert (sys_dir / "bus" / "auxiliary" / "drivers" / SF_DRIVER / name).resolve() == sf.resolve()
    assert read(sf / "uevent") == "DRIVER=mlx5_core.sf\nMODALIAS=auxiliary:mlx5_core.sf\n"
    assert read(sf / "sfnum") == "88\n"
    assert broken_links(tree.host) == []


def test_a_bound_sf_has_its_own_auxiliary_devices_netdev_and_rdma_device_below_it(tree: AuxTree) -> None:
    name = with_sf(tree)
    sf = tree.aux_dir(name)
    for child, driver in (("mlx5_core.eth.1", "mlx5_core.eth"), ("mlx5_core.rdma.1", "mlx5_ib.rdma")):
        assert tree.aux_dir(child) == sf / child  # listed flat on the bus, nested in the tree
        assert (sf / child / "driver").resolve().name == driver
        assert os.readlink(sf / child / "subsystem") == "../../../../../../bus/auxiliary"
        assert read(sf / child / "uevent") == f"DRIVER={driver}\nMODALIAS={aux_modalias(child)}\n"
    netdev = sf / "net" / "enp3s0f0s88"
    assert read(netdev / "type") == "1\n"
    assert (tree.sys / "class" / "net" / "enp3s0f0s88").resolve() == netdev
    assert os.readlink(netdev / "device") == f"../../../{name}"  # kernfs's text: its basename names the SF
    assert (netdev / "device").resolve() == sf
    assert read(netdev / "uevent") == f"INTERFACE=enp3s0f0s88\nIFINDEX={read(netdev / 'ifindex').strip()}\n"
    ib = sf / "infiniband" / "mlx5_1"
    assert (tree.sys / "class" / "infiniband" / "mlx5_1").resolve() == ib
    assert read(ib / "ports" / "1" / "link_layer") == "Ethernet\n"
    assert (tree.sys / "class" / "infiniband_verbs" / "uverbs1").resolve() == sf / "infiniband_verbs" / "uverbs1"
    assert (tree.host.dev / "infiniband" / "uverbs1").exists()
    assert broken_links(tree.host) == []


def test_the_pf_has_its_own_mlx5_auxiliary_devices_and_the_bus_lists_them_beside_the_sf(tree: AuxTree) -> None:
    name = with_sf(tree)
    listed = sorted(os.listdir(tree.sys / "bus" / "auxiliary" / "devices"))
    assert listed == ["mlx5_core.eth-rep.0", "mlx5_core.eth.0", "mlx5_core.eth.1", "mlx5_core.rdma-rep.0",
                      "mlx5_core.rdma.1", name]
    pf = tree.host.device_dir(PF)
    assert {entry for entry in os.listdir(pf) if entry.startswith("mlx5_core.")} == {
        "mlx5_core.eth.0", "mlx5_core.eth-rep.0", "mlx5_core.rdma-rep.0", name}
    assert (pf / "mlx5_core.rdma-rep.0" / "driver").resolve().name == "mlx5_ib.rdma-rep"


def test_switchdev_uplink_and_sf_representor_carry_port_names_and_one_switch_id(tree: AuxTree) -> None:
    with_sf(tree)
    net = tree.host.device_dir(PF) / "net"
    assert sorted(os.listdir(net)) == ["enp3s0f0np0", "pf0sf88"]
    assert read(net / "enp3s0f0np0" / "phys_port_name") == "p0\n"
    assert read(net / "pf0sf88" / "phys_port_name") == "pf0sf88\n"
    for netdev in ("enp3s0f0np0", "pf0sf88"):
        assert read(net / netdev / "phys_switch_id") == f"{DEFAULT_SWITCH_ID}\n"
    assert (tree.sys / "class" / "net" / "pf0sf88").resolve() == net / "pf0sf88"


def test_a_legacy_mode_pf_has_no_switch_id_and_a_plain_rdma_auxiliary_device(tree: AuxTree) -> None:
    tree.add_mlx5_pf(PF, switchdev=False, rdma="mlx5_0")
    pf = tree.host.device_dir(PF)
    assert not (pf / "net" / "enp3s0f0np0" / "phys_switch_id").exists()  # EOPNOTSUPP on a real kernel
    assert read(pf / "net" / "enp3s0f0np0" / "phys_port_name") == "p0\n"
    assert sorted(e for e in os.listdir(pf) if e.startswith("mlx5_core.")) == ["mlx5_core.eth.0", "mlx5_core.rdma.0"]
    assert read(pf / "infiniband" / "mlx5_0" / "ports" / "1" / "pkeys" / "0") == "0xffff\n"


def test_adev_ids_are_the_lowest_free_and_sfnum_is_not_the_id(tree: AuxTree) -> None:
    tree.add_mlx5_pf(PF)
    first = tree.add_sf(PF, 5, netdev="sf5")
    second = tree.add_sf(PF, 3, netdev="sf3")
    assert (first, second) == ("mlx5_core.sf.1", "mlx5_core.sf.2")
    assert read(tree.aux_dir(second) / "sfnum") == "3\n"
    tree.remove_sf(first)
    assert tree.add_sf(PF, 9, netdev="sf9") == "mlx5_core.sf.1"


def test_an_unbound_sf_keeps_only_its_own_files_and_its_representor(tree: AuxTree) -> None:
    name = with_sf(tree, bound=False)
    sf = tree.aux_dir(name)
    assert read(sf / "uevent") == "MODALIAS=auxiliary:mlx5_core.sf\n"
    assert sorted(os.listdir(sf)) == ["power", "sfnum", "subsystem", "uevent"]
    assert not (tree.sys / "bus" / "auxiliary" / "drivers" / SF_DRIVER / name).exists()
    assert not (tree.sys / "class" / "net" / "enp3s0f0s88").exists()
    assert (tree.host.device_dir(PF) / "net" / "pf0sf88").is_dir()


def test_unbind_and_bind_take_away_and_bring_back_what_the_probe_made(tree: AuxTree) -> None:
    name = with_sf(tree)
    tree.unbind_sf(name)
    sf = tree.aux_dir(name)
    assert not (sf / "driver").exists()
    assert not (tree.sys / "bus" / "auxiliary" / "devices" / "mlx5_core.eth.1").is_symlink()
    assert not (tree.sys / "class" / "infiniband" / "mlx5_1").is_symlink()
    assert not (tree.host.dev / "infiniband" / "uverbs1").exists()
    assert read(sf / "uevent") == "MODALIAS=auxiliary:mlx5_core.sf\n"
    assert broken_links(tree.host) == []
    tree.bind_sf(name)
    assert (sf / "net" / "enp3s0f0s88" / "type").exists()
    assert (tree.sys / "class" / "infiniband" / "mlx5_1").resolve() == sf / "infiniband" / "mlx5_1"
    assert read(sf / "uevent") == "DRIVER=mlx5_core.sf\nMODALIAS=auxiliary:mlx5_core.sf\n"
    assert broken_links(tree.host) == []


def test_remove_sf_removes_it_its_children_and_its_representor_with_every_link(tree: AuxTree) -> None:
    name = with_sf(tree)
    tree.remove_sf(name)
    assert not (tree.sys / PF_DIR / name).exists()
    assert not (tree.sys / "bus" / "auxiliary" / "devices" / name).is_symlink()
    assert not (tree.host.device_dir(PF) / "net" / "pf0sf88").exists()
    assert not (tree.sys / "class" / "net" / "pf0sf88").is_symlink()
    assert broken_links(tree.host) == []


def test_removing_the_pf_removes_its_sfs_auxiliary_and_class_devices(tree: AuxTree) -> None:
    with_sf(tree)
    tree.remove_function(PF)
    assert os.listdir(tree.sys / "bus" / "auxiliary" / "devices") == []
    assert os.listdir(tree.sys / "class" / "net") == []
    assert os.listdir(tree.sys / "class" / "infiniband") == []
    assert broken_links(tree.host) == []


def test_a_vanished_pf_leaves_its_sfs_bus_links_dangling(tree: AuxTree) -> None:
    name = with_sf(tree)
    tree.vanish(PF)
    link = tree.sys / "bus" / "auxiliary" / "devices" / name
    assert link.is_symlink() and not link.exists()
    with pytest.raises(FileNotFoundError):
        (link / "sfnum").read_text()
    assert f"sys/bus/auxiliary/devices/{name} -> ../../../{PF_DIR}/{name}" in broken_links(tree.host)


def test_the_uevents_of_an_sf_carry_the_kernels_properties(tree: AuxTree) -> None:
    name = with_sf(tree)
    bound = tree.aux_uevent("bind", name)
    assert (bound.action, bound.devpath, bound.subsystem) == ("bind", f"/{PF_DIR}/{name}", "auxiliary")
    assert dict(bound.properties) == {"DRIVER": SF_DRIVER, "MODALIAS": "auxiliary:mlx5_core.sf"}
    tree.unbind_sf(name)
    assert dict(tree.aux_uevent("unbind", name).properties) == {"MODALIAS": "auxiliary:mlx5_core.sf"}
    assert tree.aux_devpath(name, "net") == f"/{PF_DIR}/{name}/net"


def test_modalias_is_the_name_up_to_its_last_dot() -> None:
    assert aux_modalias("mlx5_core.sf.12") == "auxiliary:mlx5_core.sf"
    assert aux_modalias("mlx5_core.eth-rep.0") == "auxiliary:mlx5_core.eth-rep"


def test_links_have_the_text_kernfs_gives_them(tree: AuxTree) -> None:
    """Up from the link's directory to an ancestor of the target's parent, then down: the
    shortest relative path except where the target is an ancestor of the link."""
    tree.host.add_pf(PF, netdev=None)
    pf = tree.host.device_dir(PF)
    cases = {pf / "a" / "b" / "device": (pf, f"../../../{PF}"),
             pf / "a" / "self": (pf / "a", "../a"),
             pf / "a" / "side": (pf / "c", "../c"),
             pf / "a" / "down": (pf / "a" / "b" / "d", "b/d"),
             tree.sys / "class" / "x" / "y": (pf / "a", f"../../{PF_DIR}/a")}
    for target, _ in cases.values():
        target.mkdir(parents=True, exist_ok=True)
    for link, (target, text) in cases.items():
        tree.link(link, target)
        assert (os.readlink(link), link.resolve()) == (text, target)


# -- vDPA -----------------------------------------------------------------------------------------
def with_vfs(tree: AuxTree) -> None:
    tree.add_mlx5_pf(PF, rdma=None)
    tree.host.add_vfs(PF, VFS, driver="mlx5_core", vendor=MELLANOX, device=CX6DX_VF)


def test_a_vhost_vdpa_device_sits_under_its_vf_with_its_char_device_inside_it(tree: AuxTree) -> None:
    with_vfs(tree)
    name = tree.add_vdpa(VFS[0], driver=VHOST_VDPA)
    assert name == "vdpa0"
    vf = tree.host.device_dir(VFS[0])
    vdpa = vf / name
    bus_link = tree.sys / "bus" / "vdpa" / "devices" / name
    assert os.readlink(bus_link) == f"../../../{PF_DIR.rsplit('/', 1)[0]}/{VFS[0]}/{name}"
    assert os.path.realpath(bus_link) == str(vdpa)
    assert os.readlink(vdpa / "subsystem") == "../../../../../bus/vdpa"
    assert os.readlink(vdpa / "driver") == "../../../../../bus/vdpa/drivers/vhost_vdpa"
    assert (tree.sys / "bus" / "vdpa" / "drivers" / VHOST_VDPA / name).resolve() == vdpa
    assert read(vdpa / "uevent") == "DRIVER=vhost_vdpa\n"
    assert read(vdpa / "driver_override") == "(null)\n"
    char = vdpa / "vhost-vdpa-0"
    assert read(char / "dev") == f"{VHOST_VDPA_MAJOR}:0\n"
    assert read(char / "uevent") == f"MAJOR={VHOST_VDPA_MAJOR}\nMINOR=0\nDEVNAME=vhost-vdpa-0\n"
    assert not (char / "subsystem").exists()  # vhost_vdpa registers no class
    assert not (tree.sys / "class" / "vhost-vdpa").exists()
    assert (tree.sys / "dev" / "char" / f"{VHOST_VDPA_MAJOR}:0").resolve() == char
    assert (tree.host.dev / "vhost-vdpa-0").exists()
    assert (vf / "mlx5_core.vnet.1" / "driver").resolve().name == "mlx5_vdpa.vnet"  # the management device's
    assert broken_links(tree.host) == []


def test_a_virtio_vdpa_device_has_its_virtio_device_beside_it_under_the_vf(tree: AuxTree) -> None:
    with_vfs(tree)
    name = tree.add_vdpa(VFS[0], driver=VIRTIO_VDPA, netdev="eth0")
    vf = tree.host.device_dir(VFS[0])
    assert read(vf / name / "uevent") == "DRIVER=virtio_vdpa\n"
    assert not any(child.startswith("vhost-vdpa") for child in os.listdir(vf / name))
    virtio = vf / "virtio0"
    assert tree.virtio_dir(name) == virtio
    assert (tree.sys / "bus" / "virtio" / "devices" / "virtio0").resolve() == virtio
    assert (virtio / "driver").resolve().name == "virtio_net"
    assert read(virtio / "device") == "0x0001\n"
    assert read(virtio / "vendor") == "0x15b3\n"
    assert read(virtio / "modalias") == "virtio:d00000001v000015B3\n"
    assert read(virtio / "uevent") == "DRIVER=virtio_net\nMODALIAS=virtio:d00000001v000015B3\n"
    assert (tree.sys / "class" / "net" / "eth0").resolve() == virtio / "net" / "eth0"
    assert not (tree.host.dev / "vhost-vdpa-0").exists()
    assert broken_links(tree.host) == []


def test_rebinding_a_vdpa_device_swaps_what_its_driver_made(tree: AuxTree) -> None:
    with_vfs(tree)
    name = tree.add_vdpa(VFS[0], driver=VHOST_VDPA, netdev="eth0")
    tree.bind_vdpa(name, VIRTIO_VDPA)
    vdpa = tree.vdpa_dir(name)
    assert not (vdpa / "vhost-vdpa-0").exists() and not (tree.host.dev / "vhost-vdpa-0").exists()
    assert (vdpa / "driver").resolve().name == VIRTIO_VDPA
    assert not (tree.sys / "bus" / "vdpa" / "drivers" / VHOST_VDPA / name).exists()
    tree.bind_vdpa(name, VHOST_VDPA)
    assert tree.virtio_dir(name) is None and not (vdpa.parent / "virtio0").exists()
    assert (vdpa / "vhost-vdpa-0" / "dev").exists()
    tree.unbind_vdpa(name)
    assert read(vdpa / "uevent") == "" and not (vdpa / "driver").exists()
    assert sorted(os.listdir(vdpa)) == ["driver_override", "power", "subsystem", "uevent"]
    assert broken_links(tree.host) == []


def test_vdpa_names_and_minors_are_the_lowest_free_and_any_name_can_be_given(tree: AuxTree) -> None:
    with_vfs(tree)
    first = tree.add_vdpa(VFS[0])
    second = tree.add_vdpa(VFS[1], name="vdpa-blue")
    assert (tree.vdpa_dir(second) / "vhost-vdpa-1" / "dev").read_text() == f"{VHOST_VDPA_MAJOR}:1\n"
    tree.remove_vdpa(first)
    assert not (tree.sys / "bus" / "vdpa" / "devices" / first).is_symlink()
    assert not (tree.host.dev / "vhost-vdpa-0").exists()
    third = tree.add_vdpa(VFS[0])
    assert third == "vdpa0" and (tree.vdpa_dir(third) / "vhost-vdpa-0").is_dir()
    assert broken_links(tree.host) == []


def test_an_mlx5_vf_takes_one_vdpa_device(tree: AuxTree) -> None:
    with_vfs(tree)
    tree.add_vdpa(VFS[0])
    with pytest.raises(ValueError, match="ENOSPC"):
        tree.add_vdpa(VFS[0], name="another")


def test_removing_a_vf_removes_its_vdpa_device(tree: AuxTree) -> None:
    with_vfs(tree)
    tree.add_vdpa(VFS[1], driver=VIRTIO_VDPA, netdev="eth1")
    tree.remove_function(VFS[1])
    assert os.listdir(tree.sys / "bus" / "vdpa" / "devices") == []
    assert os.listdir(tree.sys / "bus" / "virtio" / "devices") == []
    assert [link for link in broken_links(tree.host) if "virtfn" not in link] == []  # FakeHost keeps the PF's virtfn1


# -- InfiniBand -----------------------------------------------------------------------------------
def test_pkeys_are_printed_0x_percent_04x_in_a_table_of_the_ports_size(tree: AuxTree) -> None:
    tree.host.add_pf(PF, netdev=None, vendor=MELLANOX, device="101b", driver="mlx5_core")
    tree.add_ib(PF, "mlx5_0", pkeys=[0x8001, 0x7FFF], ports=2)
    tree.add_ipoib(PF, "ib0")
    ib = tree.host.device_dir(PF) / "infiniband" / "mlx5_0"
    for port in ("1", "2"):
        pkeys = ib / "ports" / port / "pkeys"
        assert read(pkeys / "0") == "0x8001\n"
        assert read(pkeys / "1") == "0x7fff\n"
        assert read(pkeys / "2") == "0x0000\n"
        assert len(os.listdir(pkeys)) == 128
        assert read(ib / "ports" / port / "link_layer") == "InfiniBand\n"
    assert read(tree.host.device_dir(PF) / "net" / "ib0" / "type") == "32\n"
    assert read(ib / "uevent") == "NAME=mlx5_0\n"
    mad = tree.sys / "class" / "infiniband_mad"
    assert [(read(mad / n / "port"), read(mad / n / "dev")) for n in ("umad0", "umad1", "issm1")] == [
        ("1\n", "231:0\n"), ("2\n", "231:1\n"), ("2\n", "231:65\n")]  # one umad per port
    assert not (tree.sys / "class" / "infiniband_verbs" / "uverbs1").exists()  # one uverbs per device
    assert os.readlink(ib / "device") == f"../../../{PF}"
    assert (ib / "device").resolve() == tree.host.device_dir(PF)
    assert os.readlink(tree.host.device_dir(PF) / "net" / "ib0" / "device") == f"../../../{PF}"
    assert broken_links(tree.host) == []


def test_an_rdma_device_has_its_user_devices_beside_it_with_class_links_and_nodes(tree: AuxTree) -> None:
    tree.host.add_pf(PF, netdev=None, vendor=MELLANOX, device="101b", driver="mlx5_core")
    tree.add_ib(PF, "mlx5_0")
    tree.add_ib(PF, "mlx5_9", link_layer="Ethernet")
    pf = tree.host.device_dir(PF)
    expected = [("infiniband_verbs", "uverbs1", "231:193", None), ("infiniband_mad", "umad1", "231:1", "1\n"),
                ("infiniband_mad", "issm1", "231:65", "1\n")]  # single-port devices: umad follows uverbs
    for class_name, device, dev, port in expected:
        user = pf / class_name / device
        assert (tree.sys / "class" / class_name / device).resolve() == user
        assert read(user / "ibdev") == "mlx5_9\n" and read(user / "dev") == f"{dev}\n"
        assert (user / "port").exists() == (port is not None)
        assert (tree.host.dev / "infiniband" / device).exists()
    assert len(os.listdir(pf / "infiniband" / "mlx5_9" / "ports" / "1" / "pkeys")) == 1
    assert (tree.host.dev / "infiniband" / "rdma_cm").exists()
    assert not (tree.sys / "class" / "infiniband_cm").exists()
    tree.add_ib(PF, "mlx5_8", ucm=True, index=7)  # ib_ucm, on kernels before its removal
    assert (tree.sys / "class" / "infiniband_cm" / "ucm7").resolve() == pf / "infiniband_cm" / "ucm7"
    assert broken_links(tree.host) == []


@pytest.mark.parametrize("pkeys", [[0x10000], [-1]])
def test_a_pkey_must_be_16_bits(tree: AuxTree, pkeys: list[int]) -> None:
    tree.host.add_pf(PF, netdev=None)
    with pytest.raises(ValueError):
        tree.add_ib(PF, "mlx5_0", pkeys=pkeys)


def test_the_module_needs_no_pyudev() -> None:
    probe = "import sys, tests.auxsysfs; assert 'pyudev' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=Path(__file__).resolve().parent.parent)

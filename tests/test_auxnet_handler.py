"""auxNetDevice pools (Mellanox/NVIDIA scalable functions) as the SR-IOV plugin builds them, over
a fake sysfs laid out as Linux lays out SFs on the auxiliary bus (tests/auxsysfs.py): the
selectors and their validation, the pools upstream computes for the same tree, Allocate byte for
byte, DRA attributes and health. Most tests use ``standard_tree`` (tests/auxpools.py); the SFs
coming and going with the kernel's events are tests/test_auxnet_events.py's.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from daemon.core import HEALTHY, UNHEALTHY, Fault, LinkChanged, LinkSnapshot, LinkState, Resync
from daemon.core._config import ConfigFileError
from daemon.core._handler import Hooks
from daemon.core._tree import CARRIER_LOST
from daemon.dra import slice_devices
from tests.auxpools import A_SFS, ALL, B_SFS, PF_A, PF_B, SF, AuxPools, pool, standard_tree
from tests.fakesysfs import INFINIBAND, FakeHost


def one_pool(aux_world: AuxPools, *selectors: dict[str, Any]) -> set[str]:
    return aux_world.ids(pool("p", *selectors))["p"]


# -- config: auxTypes is required and only "sf" --------------------------------------------------
def config_error(aux_world: AuxPools, *entries: dict[str, Any]) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as refused:
        aux_world.configure(*entries)
    return refused.value


@pytest.mark.parametrize("selectors", [{}, {"auxTypes": []}, {"auxTypes": None}, {"AUXTYPES": []}])
def test_a_selector_without_aux_types_is_refused_naming_its_path(aux_world: AuxPools, selectors: dict[str, Any]) -> None:
    error = config_error(aux_world, {"resourceName": "sfs", "selectors": {"pfNames": ["p0"], **selectors}})
    assert error.json_path == "$.resourceList[0].selectors.auxTypes"
    assert "is required" in str(error) and '["sf"]' in str(error)


def test_a_missing_aux_types_in_the_second_selector_object_names_that_object(aux_world: AuxPools) -> None:
    error = config_error(aux_world, {"resourceName": "ok", "selectors": SF},
                         {"resourceName": "sfs", "selectors": [SF, {"pfNames": ["p0"]}]})
    assert error.json_path == "$.resourceList[1].selectors[1].auxTypes"


@pytest.mark.parametrize(("aux_types", "bad"), [(["sf", "eth"], 1), (["SF"], 0), (["sf", "sf", "rdma-rep"], 2)])
def test_an_aux_type_other_than_sf_is_refused_naming_the_entry(aux_world: AuxPools, aux_types: list[str], bad: int) -> None:
    error = config_error(aux_world, {"resourceName": "sfs", "selectors": [{"auxTypes": aux_types}]})
    assert error.json_path == f"$.resourceList[0].selectors[0].auxTypes[{bad}]"
    assert f"{aux_types[bad]!r} is not a supported auxiliary device type" in str(error)


def test_aux_types_must_be_a_list_of_strings(aux_world: AuxPools) -> None:
    assert config_error(aux_world, pool("p", {"auxTypes": "sf"})).json_path == "$.resourceList[0].selectors[0].auxTypes"
    assert config_error(aux_world, pool("p", {"auxTypes": [1]})).json_path == "$.resourceList[0].selectors[0].auxTypes[0]"


def test_operator_written_keys_in_any_case_are_understood(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    assert aux_world.ids({"resourceName": "p", "selectors": {"AuxTypes": ["sf"], "PFNAMES": ["p0"], "IsRdma": True,
                                                          "pciAddresses": ["ignored, as upstream"]}}) == {
        "p": {"mlx5_core.sf.7"}}


# -- what the pools hold ---------------------------------------------------------------------------
def test_pools_are_what_upstream_computes_for_the_same_tree(aux_world: AuxPools) -> None:
    """By hand from the compat doc: first pool and selector in file order wins; ``#`` indices are
    sfnums; unbound SFs are left out (upstream would list sfnum 4, ``mlx5_core.sf.5``, in a_low)."""
    standard_tree(aux_world.tree)
    assert aux_world.ids(
        pool("a_low", {"pfNames": ["enp3s0f0np0#0-5"]}),  # sfnums 3 and 5, not .2 (sfnum 88) though its id is 2
        pool("rdma", {"isRdma": True}),  # .2 and .7
        pool("bf", {"devices": ["a2d6"]}, {"rootDevices": [f"{PF_A}#88"]}),  # .6 (.7 and .2 are taken)
        pool("rest"),
    ) == {"a_low": {"mlx5_core.sf.3", "mlx5_core.sf.4"}, "rdma": {"mlx5_core.sf.2", "mlx5_core.sf.7"},
          "bf": {"mlx5_core.sf.6"}, "rest": set()}


def test_only_bound_sfs_are_offered_never_the_pfs_own_auxiliary_devices(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    assert one_pool(aux_world) == A_SFS | B_SFS


def test_aux_names_that_are_not_module_type_id_are_dropped(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    pf_dir = aux_world.host.device_dir(PF_A)
    for odd in ("mlx5_core.sf", "mlx5_core.sf.x1", "sf.9 "):
        directory = aux_world.tree.add_aux(pf_dir, odd, driver="mlx5_core.sf")
        (directory / "sfnum").write_text("9\n")
        aux_world.tree.add_netdev_at(directory, f"odd{len(odd)}")
    assert one_pool(aux_world) == A_SFS | B_SFS


@pytest.mark.parametrize(("selector", "expected"), [
    ({"vendors": ["15b3"]}, A_SFS | B_SFS),
    ({"vendors": ["8086"]}, set()),
    ({"devices": ["a2d6"]}, B_SFS),
    ({"devices": ["101d", "a2d6"]}, A_SFS | B_SFS),
    ({"drivers": ["mlx5_core"]}, A_SFS | B_SFS),
    ({"drivers": ["mlx5_core.sf"]}, set()),  # the PF's driver is matched, not the SF's own
])
def test_vendors_devices_and_drivers_are_those_of_the_parent_pf(
        aux_world: AuxPools, selector: dict[str, Any], expected: set[str]) -> None:
    standard_tree(aux_world.tree)
    assert one_pool(aux_world, selector) == expected


@pytest.mark.parametrize(("entry", "expected"), [
    ("enp3s0f0np0", A_SFS),
    ("ENP3S0F0NP0", A_SFS),
    ("enp3s0f0np0#2-4", {"mlx5_core.sf.4"}),  # sfnum 3; by aux id it would be .2, .3 and .4
    ("enp3s0f0np0#3,88", {"mlx5_core.sf.4", "mlx5_core.sf.2"}),
    ("enp3s0f0np0#5-3", set()),
    ("enp3s0f0np0#x", set()),
    ("p0#1-4", B_SFS),
    ("pf0sf88", set()),  # an SF representor sits in the PF's net/ with a switch id: not the PF's name
])
def test_pf_names_are_the_uplink_representor_with_ranges_over_sfnum(aux_world: AuxPools, entry: str,
                                                                     expected: set[str]) -> None:
    standard_tree(aux_world.tree)
    assert one_pool(aux_world, {"pfNames": [entry]}) == expected


@pytest.mark.parametrize(("entry", "expected"), [
    (PF_A, A_SFS),
    (f"{PF_A}#3,88", {"mlx5_core.sf.4", "mlx5_core.sf.2"}),
    (f"{PF_A}#2", set()),  # no SF of PF A has sfnum 2, though mlx5_core.sf.2 is its
    (f"{PF_B}#2", {"mlx5_core.sf.7"}),
    ("0000:03:00.0#1#2", set()),
])
def test_root_devices_are_the_pf_address_with_ranges_over_sfnum(aux_world: AuxPools, entry: str,
                                                                expected: set[str]) -> None:
    standard_tree(aux_world.tree)
    assert one_pool(aux_world, {"rootDevices": [entry]}) == expected


def test_a_malformed_range_is_warned_about_with_its_path(aux_world: AuxPools, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        aux_world.configure(pool("p", {"pfNames": ["p0#1-x"]}))
    assert "$.resourceList[0].selectors[0].pfNames[0]: 'p0#1-x'" in caplog.text


def test_the_pf_name_is_the_uplink_even_when_an_sf_representor_sorts_first(aux_world: AuxPools) -> None:
    tree = aux_world.tree
    tree.add_mlx5_pf(PF_A, uplink="sw0p0", rdma=None)
    tree.add_sf(PF_A, 7, netdev="sf7")  # its representor pf0sf7 sorts before sw0p0
    assert sorted(os.listdir(aux_world.host.device_dir(PF_A) / "net")) == ["pf0sf7", "sw0p0"]
    assert one_pool(aux_world, {"pfNames": ["sw0p0#7"]}) == {"mlx5_core.sf.1"}
    assert one_pool(aux_world, {"pfNames": ["pf0sf7"]}) == set()


def test_without_a_readable_switch_id_the_pf_is_named_by_its_first_netdev(aux_world: AuxPools) -> None:
    tree = aux_world.tree
    tree.add_mlx5_pf(PF_A, uplink="sw0p0", rdma=None)
    tree.add_sf(PF_A, 7, netdev="sf7", representor=None)
    tree.add_netdev_at(aux_world.host.device_dir(PF_A), "aux0")  # no port name: never the uplink, but first
    assert one_pool(aux_world, {"pfNames": ["sw0p0"]}) == {"mlx5_core.sf.1"}
    switch_id = aux_world.host.device_dir(PF_A) / "net" / "sw0p0" / "phys_switch_id"
    switch_id.unlink()
    switch_id.mkdir()  # its read fails (EISDIR), as EOPNOTSUPP does on a legacy-mode PF
    assert one_pool(aux_world, {"pfNames": ["sw0p0"]}) == set()
    assert one_pool(aux_world, {"pfNames": ["aux0"]}) == {"mlx5_core.sf.1"}


def test_link_types_are_the_sf_netdevs_and_the_pfs_without_one(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    (aux_world.tree.aux_dir("mlx5_core.sf.6") / "net" / "en4f0s1" / "type").write_text(f"{INFINIBAND}\n")
    aux_world.tree.add_sf(PF_B, 9, netdev=None)  # mlx5_core.sf.8: bound, no netdev: the PF's link type
    assert one_pool(aux_world, {"linkTypes": ["infiniband"]}) == {"mlx5_core.sf.6"}
    assert one_pool(aux_world, {"linkTypes": ["ether"]}) == A_SFS | {"mlx5_core.sf.7", "mlx5_core.sf.8"}


def test_is_rdma_keeps_sfs_with_an_rdma_device_and_hands_out_its_char_devices(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    devices = aux_world.build(aux_world.handler.scan(), pool("p", {"isRdma": True}))["p"]
    assert {name: [spec.host_path for spec in info.specs] for name, info in devices.items()} == {
        "mlx5_core.sf.2": ["/dev/infiniband/issm1", "/dev/infiniband/umad1", "/dev/infiniband/uverbs1",
                           "/dev/infiniband/rdma_cm"],
        "mlx5_core.sf.7": ["/dev/infiniband/issm2", "/dev/infiniband/umad2", "/dev/infiniband/uverbs2",
                           "/dev/infiniband/rdma_cm"]}


def test_flags_apply_to_the_sfs_their_own_selector_object_admitted(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    devices = aux_world.build(aux_world.handler.scan(), pool("p", {"pfNames": ["enp3s0f0np0"]}, {"isRdma": True}))["p"]
    assert set(devices) == A_SFS | {"mlx5_core.sf.7"}
    assert devices["mlx5_core.sf.2"].specs == ()  # taken by the first object, which has no isRdma
    assert "rdma" not in devices["mlx5_core.sf.2"].details.info
    assert len(devices["mlx5_core.sf.7"].specs) == 4 and "rdma" in devices["mlx5_core.sf.7"].details.info


VHOST_NET_SPECS = [("/dev/vhost-net", "/dev/vhost-net", "rw"), ("/dev/net/tun", "/dev/net/tun", "rw")]


@pytest.mark.parametrize("nodes", [("vhost-net", "net/tun"), ("vhost-net",), ("net/tun",), ()])
def test_need_vhost_net_allocates_vhost_net_and_tun_only_when_both_exist(aux_world: AuxPools,
                                                                        nodes: tuple[str, ...]) -> None:
    """As for a netDevice VF: upstream's generic net selectors have needVhostNet, auxNetDevice's too."""
    standard_tree(aux_world.tree)
    for node in nodes:
        aux_world.host.add_dev_node(node)
    sfs = aux_world.pool({"resourceName": "dpdk_sfs", "selectors": {**SF, "pfNames": ["p0#1"], "needVhostNet": True}})
    answer = aux_world.allocate(sfs, ["mlx5_core.sf.6"])
    both = len(nodes) == 2
    assert [(spec.container_path, spec.host_path, spec.permissions) for spec in answer.specs] == (
        VHOST_NET_SPECS if both else [])
    vhost = ',"vhost":{"net-mount":"/dev/vhost-net","tun-mount":"/dev/net/tun"}' if both else ""
    assert answer.envs == {
        "PCIDEVICE_NVIDIA_COM_DPDK_SFS": "mlx5_core.sf.6",
        "PCIDEVICE_NVIDIA_COM_DPDK_SFS_INFO": '{"mlx5_core.sf.6":{"generic":{"deviceID":"mlx5_core.sf.6"}' + vhost + "}}",
    }


def test_need_vhost_net_applies_to_the_sfs_its_own_selector_object_admitted(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    for node in ("vhost-net", "net/tun"):
        aux_world.host.add_dev_node(node)
    sfs = aux_world.pool(pool("p", {"pfNames": ["enp3s0f0np0"]}, {"needVhostNet": True}))
    plain, vhost = aux_world.allocate(sfs, ["mlx5_core.sf.2"]), aux_world.allocate(sfs, ["mlx5_core.sf.7"])
    assert plain.specs == [] and '"vhost"' not in plain.envs["PCIDEVICE_NVIDIA_COM_P_INFO"]
    assert [(spec.container_path, spec.host_path, spec.permissions) for spec in vhost.specs] == VHOST_NET_SPECS
    assert '"vhost":{"net-mount":"/dev/vhost-net","tun-mount":"/dev/net/tun"}' in vhost.envs["PCIDEVICE_NVIDIA_COM_P_INFO"]


def test_an_unbound_pf_offers_no_sfs(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.host.unbind(PF_A)
    assert one_pool(aux_world) == B_SFS


def test_topology_is_the_pfs_numa_node_unless_excluded(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    facts = aux_world.handler.scan()
    built = aux_world.build(facts, pool("a", {"rootDevices": [PF_A]}), pool("b", excludeTopology=True))
    assert {info.numa_nodes for info in built["a"].values()} == {(0,)}
    assert set(built["b"]) == B_SFS and {info.numa_nodes for info in built["b"].values()} == {()}
    (aux_world.host.device_dir(PF_B) / "numa_node").write_text("-1\n")
    assert {info.numa_nodes for info in aux_world.build(aux_world.handler.scan(), ALL)["all"].values()
            if info.details.pf.address == PF_B} == {()}


def test_an_sf_is_unhealthy_while_its_link_is_up_without_carrier(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    lost, back = LinkState(9, admin_up=True, lower_up=False), LinkState(9, admin_up=True, lower_up=True)
    aux_world.fold([LinkChanged("en4f0s2", lost)])
    assert {n: i.health for n, i in aux_world.build(aux_world.facts, ALL)["all"].items() if n in B_SFS} == {
        "mlx5_core.sf.6": HEALTHY, "mlx5_core.sf.7": UNHEALTHY}
    assert aux_world.build(aux_world.facts, ALL)["all"]["mlx5_core.sf.7"].fault == Fault(
        CARRIER_LOST, "en4f0s2", "link en4f0s2 is up without carrier")
    aux_world.fold([LinkChanged("en4f0s2", back), LinkChanged("p0", lost)])  # the PF's link is not the SF's
    assert {i.health for i in aux_world.build(aux_world.facts, ALL)["all"].values()} == {HEALTHY}
    aux_world.fold([LinkSnapshot({"enp3s0f0s88": lost})])
    assert [n for n, i in aux_world.build(aux_world.facts, ALL)["all"].items() if i.health == UNHEALTHY] == ["mlx5_core.sf.2"]
    aux_world.fold([Resync("auxnet", "lost events")])  # a rescan keeps the link states
    assert aux_world.facts == aux_world.scanned()
    assert [n for n, i in aux_world.build(aux_world.facts, ALL)["all"].items() if i.health == UNHEALTHY] == ["mlx5_core.sf.2"]


# -- Allocate ------------------------------------------------------------------------------------
def test_allocate_gives_specs_and_envs_byte_for_byte(aux_world: AuxPools, ram_host: FakeHost) -> None:
    standard_tree(aux_world.tree)
    ram_host.add_dev_node("vhost-net")
    ram_host.add_dev_node("net/tun")
    sfs = aux_world.pool(pool("rdma_sfs", {"isRdma": True, "needVhostNet": True}, additionalInfo={
        "*": {"site": "rack1", "x": "all"}, PF_A: {"x": "pf-a"}, "mlx5_core.sf.2": {"x": "never: SFs go by their PF"}}))
    answer = aux_world.allocate(sfs, ["mlx5_core.sf.7", "mlx5_core.sf.2"])
    assert [(spec.container_path, spec.host_path, spec.permissions) for spec in answer.specs] == [
        ("/dev/infiniband/issm2", "/dev/infiniband/issm2", "rw"),
        ("/dev/infiniband/umad2", "/dev/infiniband/umad2", "rw"),
        ("/dev/infiniband/uverbs2", "/dev/infiniband/uverbs2", "rw"),
        ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),
        ("/dev/vhost-net", "/dev/vhost-net", "rw"),
        ("/dev/net/tun", "/dev/net/tun", "rw"),
        ("/dev/infiniband/issm1", "/dev/infiniband/issm1", "rw"),
        ("/dev/infiniband/umad1", "/dev/infiniband/umad1", "rw"),
        ("/dev/infiniband/uverbs1", "/dev/infiniband/uverbs1", "rw"),
    ]
    rdma = '"rdma":{{"issm":"/dev/infiniband/issm{n}","rdma_cm":"/dev/infiniband/rdma_cm","rdma_dev":"mlx5_{m}",' \
           '"umad":"/dev/infiniband/umad{n}","uverbs":"/dev/infiniband/uverbs{n}"}}'
    vhost = '"vhost":{"net-mount":"/dev/vhost-net","tun-mount":"/dev/net/tun"}'
    assert answer.envs == {
        "PCIDEVICE_NVIDIA_COM_RDMA_SFS": "mlx5_core.sf.7,mlx5_core.sf.2",
        "PCIDEVICE_NVIDIA_COM_RDMA_SFS_INFO":
            '{"mlx5_core.sf.2":{"extra":{"site":"rack1","x":"pf-a"},"generic":{"deviceID":"mlx5_core.sf.2"},'
            + rdma.format(n=1, m=2) + "," + vhost + "},"
            '"mlx5_core.sf.7":{"extra":{"site":"rack1","x":"all"},"generic":{"deviceID":"mlx5_core.sf.7"},'
            + rdma.format(n=2, m=3) + "," + vhost + "}}",
    }
    assert answer.mounts == [] and answer.annotations == {}
    assert not (ram_host.root / "devinfo").exists()  # upstream writes no device-info file for SFs


def test_allocate_without_flags_gives_only_the_generic_info(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    sfs = aux_world.pool({"resourceName": "plain-sfs", "resourcePrefix": "example.org", "selectors": {
        "auxTypes": ["sf"], "pfNames": ["p0"]}})
    answer = aux_world.allocate(sfs, ["mlx5_core.sf.6"])
    assert answer.specs == []
    assert answer.envs == {"PCIDEVICE_EXAMPLE_ORG_PLAIN-SFS": "mlx5_core.sf.6",
                           "PCIDEVICE_EXAMPLE_ORG_PLAIN-SFS_INFO":
                               '{"mlx5_core.sf.6":{"generic":{"deviceID":"mlx5_core.sf.6"}}}'}


def test_an_empty_additional_info_still_gives_an_empty_extra_provider(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    sfs = aux_world.pool(pool("p", {"pfNames": ["p0#1"]}, additionalInfo={}))
    assert aux_world.allocate(sfs, ["mlx5_core.sf.6"]).envs["PCIDEVICE_NVIDIA_COM_P_INFO"] == (
        '{"mlx5_core.sf.6":{"extra":{},"generic":{"deviceID":"mlx5_core.sf.6"}}}')


def test_dra_attributes_say_what_the_selectors_match(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    sfs = aux_world.pool(ALL)
    describer = Hooks.of(aux_world.handler).describer
    assert describer is not None
    assert describer.dra_attributes(sfs, "mlx5_core.sf.2") == {
        "resource.kubernetes.io/pcieRoot": "pci0000:00", "vendor": "15b3", "deviceId": "101d", "auxType": "sf",
        "pfPciAddress": PF_A, "sfnum": 88, "pfName": "enp3s0f0np0", "netdev": "enp3s0f0s88", "linkType": "ether",
        "rdmaDevice": "mlx5_2"}
    published = {d["name"]: d["attributes"] for d in slice_devices(sfs, "devplugd.io", describer)}
    (sf6,) = [attributes for name, attributes in published.items() if name.startswith("mlx5-core-sf-6-")]
    assert (sf6["sfnum"], sf6["pfName"], sf6["resource.kubernetes.io/pcieRoot"]) == (
        {"int": 1}, {"string": "p0"}, {"string": "pci0000:00"})

"""auxNetDevice pools (Mellanox/NVIDIA scalable functions) as the SR-IOV plugin builds them, over
a fake sysfs laid out as Linux lays out SFs on the auxiliary bus (tests/auxsysfs.py): the
selectors and their validation, the pools upstream computes for the same tree, Allocate byte for
byte, DRA attributes, and SFs coming and going with the kernel's events, the folded facts equal
to a fresh scan after every step.

The tree most tests use (``standard``), laid out in this order so that names and RDMA numbers
are fixed (the aux ids are the lowest free, as mlx5's ida gives them; ``sfnum`` is not the id):

* PF A ``0000:03:00.0`` (ConnectX-6 Dx ``101d``, NUMA 0, uplink ``enp3s0f0np0``, RDMA ``mlx5_0``
  with uverbs0): SFs ``mlx5_core.sf.2`` (sfnum 88, ``enp3s0f0s88``, RDMA ``mlx5_2``: uverbs1,
  umad1, issm1), ``.3`` (sfnum 5), ``.4`` (sfnum 3), ``.5`` (sfnum 4, its driver unbound);
* PF B ``0000:04:00.0`` (BlueField-2 ``a2d6``, NUMA 1, uplink ``p0``): SFs ``mlx5_core.sf.6``
  (sfnum 1, ``en4f0s1``), ``.7`` (sfnum 2, ``en4f0s2``, RDMA ``mlx5_3``: uverbs2, umad2, issm2).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.core import HEALTHY, UNHEALTHY, ConfigFileError, Hooks, LinkChanged, LinkSnapshot, LinkState, Resync
from daemon.core import UEvent as KernelEvent
from daemon.dra import slice_devices
from tests.auxpools import AuxPools, add_sf, bind_sf, pci_event, remove_sf, rename_netdev, unbind_sf
from tests.auxsysfs import AuxTree
from tests.fakesysfs import INFINIBAND, FakeHost

PF_A, PF_B = "0000:03:00.0", "0000:04:00.0"
SF = {"auxTypes": ["sf"]}
ALL = {"resourceName": "all", "selectors": SF}
A_SFS = {"mlx5_core.sf.2", "mlx5_core.sf.3", "mlx5_core.sf.4"}  # bound; .5 is not
B_SFS = {"mlx5_core.sf.6", "mlx5_core.sf.7"}


@pytest.fixture
def world(ram_host: FakeHost) -> AuxPools:
    return AuxPools(ram_host)


def standard(world: AuxPools) -> AuxPools:
    tree = world.tree
    tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0", numa_node=0)
    tree.add_mlx5_pf(PF_B, uplink="p0", rdma=None, numa_node=1, device="a2d6", bridge="0000:00:03.0")
    tree.add_sf(PF_A, 88, netdev="enp3s0f0s88", rdma="mlx5_2")
    tree.add_sf(PF_A, 5, netdev="enp3s0f0s5")
    tree.add_sf(PF_A, 3, netdev="enp3s0f0s3")
    tree.add_sf(PF_A, 4, netdev="enp3s0f0s4", bound=False)
    tree.add_sf(PF_B, 1, netdev="en4f0s1")
    tree.add_sf(PF_B, 2, netdev="en4f0s2", rdma="mlx5_3")
    return world


def pool(name: str, *selectors: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": [{**SF, **s} for s in selectors] if selectors else SF, **fields}


def one_pool(world: AuxPools, *selectors: dict[str, Any]) -> set[str]:
    return world.ids(pool("p", *selectors))["p"]


# -- config: auxTypes is required and only "sf" --------------------------------------------------
def config_error(world: AuxPools, *entries: dict[str, Any]) -> ConfigFileError:
    with pytest.raises(ConfigFileError) as refused:
        world.configure(*entries)
    return refused.value


@pytest.mark.parametrize("selectors", [{}, {"auxTypes": []}, {"auxTypes": None}, {"AUXTYPES": []}])
def test_a_selector_without_aux_types_is_refused_naming_its_path(world: AuxPools, selectors: dict[str, Any]) -> None:
    error = config_error(world, {"resourceName": "sfs", "selectors": {"pfNames": ["p0"], **selectors}})
    assert error.json_path == "$.resourceList[0].selectors.auxTypes"
    assert "is required" in str(error) and '["sf"]' in str(error)


def test_a_missing_aux_types_in_the_second_selector_object_names_that_object(world: AuxPools) -> None:
    error = config_error(world, {"resourceName": "ok", "selectors": SF},
                         {"resourceName": "sfs", "selectors": [SF, {"pfNames": ["p0"]}]})
    assert error.json_path == "$.resourceList[1].selectors[1].auxTypes"


@pytest.mark.parametrize(("aux_types", "bad"), [(["sf", "eth"], 1), (["SF"], 0), (["sf", "sf", "rdma-rep"], 2)])
def test_an_aux_type_other_than_sf_is_refused_naming_the_entry(world: AuxPools, aux_types: list[str], bad: int) -> None:
    error = config_error(world, {"resourceName": "sfs", "selectors": [{"auxTypes": aux_types}]})
    assert error.json_path == f"$.resourceList[0].selectors[0].auxTypes[{bad}]"
    assert f"{aux_types[bad]!r} is not a supported auxiliary device type" in str(error)


def test_aux_types_must_be_a_list_of_strings(world: AuxPools) -> None:
    assert config_error(world, pool("p", {"auxTypes": "sf"})).json_path == "$.resourceList[0].selectors[0].auxTypes"
    assert config_error(world, pool("p", {"auxTypes": [1]})).json_path == "$.resourceList[0].selectors[0].auxTypes[0]"


def test_operator_written_keys_in_any_case_are_understood(world: AuxPools) -> None:
    standard(world)
    assert world.ids({"resourceName": "p", "selectors": {"AuxTypes": ["sf"], "PFNAMES": ["p0"], "IsRdma": True,
                                                          "pciAddresses": ["ignored, as upstream"]}}) == {
        "p": {"mlx5_core.sf.7"}}


# -- what the pools hold ---------------------------------------------------------------------------
def test_pools_are_what_upstream_computes_for_the_same_tree(world: AuxPools) -> None:
    """By hand from the compat doc: first pool and selector in file order wins; ``#`` indices are
    sfnums; unbound SFs are left out (upstream would list sfnum 4, ``mlx5_core.sf.5``, in a_low)."""
    standard(world)
    assert world.ids(
        pool("a_low", {"pfNames": ["enp3s0f0np0#0-5"]}),  # sfnums 3 and 5, not .2 (sfnum 88) though its id is 2
        pool("rdma", {"isRdma": True}),  # .2 and .7
        pool("bf", {"devices": ["a2d6"]}, {"rootDevices": [f"{PF_A}#88"]}),  # .6 (.7 and .2 are taken)
        pool("rest"),
    ) == {"a_low": {"mlx5_core.sf.3", "mlx5_core.sf.4"}, "rdma": {"mlx5_core.sf.2", "mlx5_core.sf.7"},
          "bf": {"mlx5_core.sf.6"}, "rest": set()}


def test_only_bound_sfs_are_offered_never_the_pfs_own_auxiliary_devices(world: AuxPools) -> None:
    standard(world)
    assert one_pool(world) == A_SFS | B_SFS


def test_aux_names_that_are_not_module_type_id_are_dropped(world: AuxPools) -> None:
    standard(world)
    pf_dir = world.host.device_dir(PF_A)
    for odd in ("mlx5_core.sf", "mlx5_core.sf.x1", "sf.9 "):
        directory = world.tree.add_aux(pf_dir, odd, driver="mlx5_core.sf")
        (directory / "sfnum").write_text("9\n")
        world.tree.add_netdev_at(directory, f"odd{len(odd)}")
    assert one_pool(world) == A_SFS | B_SFS


@pytest.mark.parametrize(("selector", "expected"), [
    ({"vendors": ["15b3"]}, A_SFS | B_SFS),
    ({"vendors": ["8086"]}, set()),
    ({"devices": ["a2d6"]}, B_SFS),
    ({"devices": ["101d", "a2d6"]}, A_SFS | B_SFS),
    ({"drivers": ["mlx5_core"]}, A_SFS | B_SFS),
    ({"drivers": ["mlx5_core.sf"]}, set()),  # the PF's driver is matched, not the SF's own
])
def test_vendors_devices_and_drivers_are_those_of_the_parent_pf(
        world: AuxPools, selector: dict[str, Any], expected: set[str]) -> None:
    standard(world)
    assert one_pool(world, selector) == expected


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
def test_pf_names_are_the_uplink_representor_with_ranges_over_sfnum(world: AuxPools, entry: str,
                                                                     expected: set[str]) -> None:
    standard(world)
    assert one_pool(world, {"pfNames": [entry]}) == expected


@pytest.mark.parametrize(("entry", "expected"), [
    (PF_A, A_SFS),
    (f"{PF_A}#3,88", {"mlx5_core.sf.4", "mlx5_core.sf.2"}),
    (f"{PF_A}#2", set()),  # no SF of PF A has sfnum 2, though mlx5_core.sf.2 is its
    (f"{PF_B}#2", {"mlx5_core.sf.7"}),
    ("0000:03:00.0#1#2", set()),
])
def test_root_devices_are_the_pf_address_with_ranges_over_sfnum(world: AuxPools, entry: str,
                                                                expected: set[str]) -> None:
    standard(world)
    assert one_pool(world, {"rootDevices": [entry]}) == expected


def test_a_malformed_range_is_warned_about_with_its_path(world: AuxPools, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        world.configure(pool("p", {"pfNames": ["p0#1-x"]}))
    assert "$.resourceList[0].selectors[0].pfNames[0]: 'p0#1-x'" in caplog.text


def test_the_pf_name_is_the_uplink_even_when_an_sf_representor_sorts_first(world: AuxPools) -> None:
    tree = world.tree
    tree.add_mlx5_pf(PF_A, uplink="sw0p0", rdma=None)
    tree.add_sf(PF_A, 7, netdev="sf7")  # its representor pf0sf7 sorts before sw0p0
    assert sorted(os.listdir(world.host.device_dir(PF_A) / "net")) == ["pf0sf7", "sw0p0"]
    assert one_pool(world, {"pfNames": ["sw0p0#7"]}) == {"mlx5_core.sf.1"}
    assert one_pool(world, {"pfNames": ["pf0sf7"]}) == set()


def test_without_a_readable_switch_id_the_pf_is_named_by_its_first_netdev(world: AuxPools) -> None:
    tree = world.tree
    tree.add_mlx5_pf(PF_A, uplink="sw0p0", rdma=None)
    tree.add_sf(PF_A, 7, netdev="sf7", representor=None)
    tree.add_netdev_at(world.host.device_dir(PF_A), "aux0")  # no port name: never the uplink, but first
    assert one_pool(world, {"pfNames": ["sw0p0"]}) == {"mlx5_core.sf.1"}
    switch_id = world.host.device_dir(PF_A) / "net" / "sw0p0" / "phys_switch_id"
    switch_id.unlink()
    switch_id.mkdir()  # its read fails (EISDIR), as EOPNOTSUPP does on a legacy-mode PF
    assert one_pool(world, {"pfNames": ["sw0p0"]}) == set()
    assert one_pool(world, {"pfNames": ["aux0"]}) == {"mlx5_core.sf.1"}


def test_link_types_are_the_sf_netdevs_and_the_pfs_without_one(world: AuxPools) -> None:
    standard(world)
    (world.tree.aux_dir("mlx5_core.sf.6") / "net" / "en4f0s1" / "type").write_text(f"{INFINIBAND}\n")
    world.tree.add_sf(PF_B, 9, netdev=None)  # mlx5_core.sf.8: bound, no netdev: the PF's link type
    assert one_pool(world, {"linkTypes": ["infiniband"]}) == {"mlx5_core.sf.6"}
    assert one_pool(world, {"linkTypes": ["ether"]}) == A_SFS | {"mlx5_core.sf.7", "mlx5_core.sf.8"}


def test_is_rdma_keeps_sfs_with_an_rdma_device_and_hands_out_its_char_devices(world: AuxPools) -> None:
    standard(world)
    devices = world.build(world.handler.scan(), pool("p", {"isRdma": True}))["p"]
    assert {name: [spec.host_path for spec in info.specs] for name, info in devices.items()} == {
        "mlx5_core.sf.2": ["/dev/infiniband/issm1", "/dev/infiniband/umad1", "/dev/infiniband/uverbs1",
                           "/dev/infiniband/rdma_cm"],
        "mlx5_core.sf.7": ["/dev/infiniband/issm2", "/dev/infiniband/umad2", "/dev/infiniband/uverbs2",
                           "/dev/infiniband/rdma_cm"]}


def test_flags_apply_to_the_sfs_their_own_selector_object_admitted(world: AuxPools) -> None:
    standard(world)
    devices = world.build(world.handler.scan(), pool("p", {"pfNames": ["enp3s0f0np0"]}, {"isRdma": True}))["p"]
    assert set(devices) == A_SFS | {"mlx5_core.sf.7"}
    assert devices["mlx5_core.sf.2"].specs == ()  # taken by the first object, which has no isRdma
    assert "rdma" not in devices["mlx5_core.sf.2"].details.info
    assert len(devices["mlx5_core.sf.7"].specs) == 4 and "rdma" in devices["mlx5_core.sf.7"].details.info


@pytest.mark.parametrize("nodes", [("vhost-net", "net/tun"), ("vhost-net",), ("net/tun",)])
def test_need_vhost_net_adds_vhost_and_tun_only_when_both_exist(world: AuxPools, nodes: tuple[str, ...]) -> None:
    standard(world)
    for node in nodes:
        world.host.add_dev_node(node)
    info = world.build(world.handler.scan(), pool("p", {"pfNames": ["p0#1"], "needVhostNet": True}))["p"]
    (sf,) = info.values()
    both = len(nodes) == 2
    assert [spec.host_path for spec in sf.specs] == (["/dev/vhost-net", "/dev/net/tun"] if both else [])
    assert ("vhost" in sf.details.info) == both


def test_an_unbound_pf_offers_no_sfs(world: AuxPools) -> None:
    standard(world)
    world.host.unbind(PF_A)
    assert one_pool(world) == B_SFS


def test_topology_is_the_pfs_numa_node_unless_excluded(world: AuxPools) -> None:
    standard(world)
    facts = world.handler.scan()
    built = world.build(facts, pool("a", {"rootDevices": [PF_A]}), pool("b", excludeTopology=True))
    assert {info.numa_nodes for info in built["a"].values()} == {(0,)}
    assert set(built["b"]) == B_SFS and {info.numa_nodes for info in built["b"].values()} == {()}
    (world.host.device_dir(PF_B) / "numa_node").write_text("-1\n")
    assert {info.numa_nodes for info in world.build(world.handler.scan(), ALL)["all"].values()
            if info.details.pf.address == PF_B} == {()}


def test_an_sf_is_unhealthy_while_its_link_is_up_without_carrier(world: AuxPools) -> None:
    standard(world)
    world.start()
    lost, back = LinkState(9, admin_up=True, lower_up=False), LinkState(9, admin_up=True, lower_up=True)
    world.fold([LinkChanged("en4f0s2", lost)])
    assert {n: i.health for n, i in world.build(world.facts, ALL)["all"].items() if n in B_SFS} == {
        "mlx5_core.sf.6": HEALTHY, "mlx5_core.sf.7": UNHEALTHY}
    world.fold([LinkChanged("en4f0s2", back), LinkChanged("p0", lost)])  # the PF's link is not the SF's
    assert {i.health for i in world.build(world.facts, ALL)["all"].values()} == {HEALTHY}
    world.fold([LinkSnapshot({"enp3s0f0s88": lost})])
    assert [n for n, i in world.build(world.facts, ALL)["all"].items() if i.health == UNHEALTHY] == ["mlx5_core.sf.2"]
    world.fold([Resync("auxnet", "lost events")])  # a rescan keeps the link states
    assert world.facts == world.scanned()
    assert [n for n, i in world.build(world.facts, ALL)["all"].items() if i.health == UNHEALTHY] == ["mlx5_core.sf.2"]


# -- Allocate ------------------------------------------------------------------------------------
def test_allocate_gives_specs_and_envs_byte_for_byte(world: AuxPools, ram_host: FakeHost) -> None:
    standard(world)
    ram_host.add_dev_node("vhost-net")
    ram_host.add_dev_node("net/tun")
    sfs = world.pool(pool("rdma_sfs", {"isRdma": True, "needVhostNet": True}, additionalInfo={
        "*": {"site": "rack1", "x": "all"}, PF_A: {"x": "pf-a"}, "mlx5_core.sf.2": {"x": "never: SFs go by their PF"}}))
    answer = world.allocate(sfs, ["mlx5_core.sf.7", "mlx5_core.sf.2"])
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


def test_allocate_without_flags_gives_only_the_generic_info(world: AuxPools) -> None:
    standard(world)
    sfs = world.pool({"resourceName": "plain-sfs", "resourcePrefix": "example.org", "selectors": {
        "auxTypes": ["sf"], "pfNames": ["p0"]}})
    answer = world.allocate(sfs, ["mlx5_core.sf.6"])
    assert answer.specs == []
    assert answer.envs == {"PCIDEVICE_EXAMPLE_ORG_PLAIN-SFS": "mlx5_core.sf.6",
                           "PCIDEVICE_EXAMPLE_ORG_PLAIN-SFS_INFO":
                               '{"mlx5_core.sf.6":{"generic":{"deviceID":"mlx5_core.sf.6"}}}'}


def test_an_empty_additional_info_still_gives_an_empty_extra_provider(world: AuxPools) -> None:
    standard(world)
    sfs = world.pool(pool("p", {"pfNames": ["p0#1"]}, additionalInfo={}))
    assert world.allocate(sfs, ["mlx5_core.sf.6"]).envs["PCIDEVICE_NVIDIA_COM_P_INFO"] == (
        '{"mlx5_core.sf.6":{"extra":{},"generic":{"deviceID":"mlx5_core.sf.6"}}}')


def test_dra_attributes_say_what_the_selectors_match(world: AuxPools) -> None:
    standard(world)
    sfs = world.pool(ALL)
    describer = Hooks.of(world.handler).describer
    assert describer is not None
    assert describer.dra_attributes(sfs, "mlx5_core.sf.2") == {
        "resource.kubernetes.io/pcieRoot": "pci0000:00", "vendor": "15b3", "deviceId": "101d", "auxType": "sf",
        "pfPciAddress": PF_A, "sfnum": 88, "pfName": "enp3s0f0np0", "netdev": "enp3s0f0s88", "linkType": "ether",
        "rdmaDevice": "mlx5_2"}
    published = {d["name"]: d["attributes"] for d in slice_devices(sfs, "devplugd.io", describer)}
    (sf6,) = [attributes for name, attributes in published.items() if name.startswith("mlx5-core-sf-6-")]
    assert (sf6["sfnum"], sf6["pfName"], sf6["resource.kubernetes.io/pcieRoot"]) == (
        {"int": 1}, {"string": "p0"}, {"string": "pci0000:00"})


# -- events: the folded facts are a fresh scan's after every step ---------------------------------
def ids_after(world: AuxPools, events: list[KernelEvent], *entries: dict[str, Any]) -> dict[str, set[str]]:
    """Fold ``events``; check the facts are a fresh scan's; the pools' IDs."""
    world.fold(events)
    assert world.facts == world.scanned()
    return {name: set(devices) for name, devices in world.build(world.facts, *entries).items()}


def test_an_sf_joins_when_its_driver_binds_and_leaves_when_unbound_or_removed(world: AuxPools) -> None:
    world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma=None)
    world.start()
    name, added = add_sf(world.tree, PF_A, 12, netdev="enp3s0f0s12", bound=False)
    assert [e.subsystem for e in added] == ["net", "auxiliary"]  # the representor, then the SF
    assert ids_after(world, added, ALL) == {"all": set()}  # no driver yet: no netdev to hand out
    assert ids_after(world, bind_sf(world.tree, name), ALL) == {"all": {name}}
    assert world.facts.sfs[name].netdevs == ("enp3s0f0s12",)
    assert ids_after(world, unbind_sf(world.tree, name), ALL) == {"all": set()}
    assert ids_after(world, bind_sf(world.tree, name), ALL) == {"all": {name}}
    assert ids_after(world, remove_sf(world.tree, name), ALL) == {"all": set()}
    assert world.facts.sfs == {} and world.facts.pfs == {}


def test_a_bound_sf_added_at_once_is_offered_with_its_rdma_device(world: AuxPools) -> None:
    world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0")
    world.start()
    name, added = add_sf(world.tree, PF_A, 3, netdev="enp3s0f0s3", rdma="mlx5_1")
    world.fold(added)
    assert world.facts == world.scanned()
    ((offered, info),) = world.build(world.facts, pool("p", {"isRdma": True}))["p"].items()
    assert offered == name
    assert info.details.info["rdma"]["uverbs"] == "/dev/infiniband/uverbs1"


def test_an_rdma_device_appearing_later_brings_the_sf_into_an_rdma_pool(world: AuxPools) -> None:
    standard(world)
    world.start()
    rdma_pool = pool("p", {"isRdma": True})
    assert "mlx5_core.sf.6" not in ids_after(world, [], rdma_pool)["p"]
    ib_dir = world.tree.add_ib("mlx5_core.sf.6", "mlx5_9", link_layer="Ethernet")
    sf_dir = world.tree.aux_dir("mlx5_core.sf.6")
    events = [world.tree.uevent("add", ib_dir, "infiniband")]
    events += [world.tree.uevent("add", sf_dir / kind / entry, kind)
               for kind in ("infiniband_verbs", "infiniband_mad") for entry in sorted(os.listdir(sf_dir / kind))]
    assert ids_after(world, events, rdma_pool) == {"p": {"mlx5_core.sf.2", "mlx5_core.sf.6", "mlx5_core.sf.7"}}
    (info,) = [i for n, i in world.build(world.facts, rdma_pool)["p"].items() if n == "mlx5_core.sf.6"]
    assert info.details.info["rdma"]["rdma_dev"] == "mlx5_9" and len(info.specs) == 4


def test_an_sf_netdev_renamed_is_read_again(world: AuxPools) -> None:
    standard(world)
    world.start()
    moved = rename_netdev(world.tree, world.tree.aux_dir("mlx5_core.sf.6"), "en4f0s1", "blue1")
    world.fold([moved])
    assert world.facts == world.scanned()
    assert world.facts.sfs["mlx5_core.sf.6"].netdevs == ("blue1",)


def test_the_uplink_renamed_moves_the_sfs_between_pf_name_pools(world: AuxPools) -> None:
    standard(world)
    world.start()
    pools = (pool("old", {"pfNames": ["p0"]}), pool("new", {"pfNames": ["ens4np0"]}))
    assert ids_after(world, [], *pools) == {"old": B_SFS, "new": set()}
    moved = rename_netdev(world.tree, world.host.device_dir(PF_B), "p0", "ens4np0")
    assert ids_after(world, [moved], *pools) == {"old": set(), "new": B_SFS}


def test_the_pfs_driver_unbound_takes_its_sfs_out_and_bound_brings_them_back(world: AuxPools) -> None:
    standard(world)
    world.start()
    world.host.unbind(PF_B)
    assert ids_after(world, [pci_event(world.tree, "unbind", PF_B)], ALL) == {"all": A_SFS}
    world.host.bind(PF_B, "mlx5_core")
    assert ids_after(world, [pci_event(world.tree, "bind", PF_B)], ALL) == {"all": A_SFS | B_SFS}


def test_the_pf_removed_takes_its_sfs_even_without_their_own_events(world: AuxPools) -> None:
    standard(world)
    world.start()
    removed = pci_event(world.tree, "remove", PF_B)
    world.tree.remove_function(PF_B)
    assert ids_after(world, [removed], ALL) == {"all": A_SFS}
    assert set(world.facts.pfs) == {PF_A}


def test_an_sf_whose_pf_vanished_mid_read_is_logged_and_dropped_and_the_rest_served(
        world: AuxPools, caplog: pytest.LogCaptureFixture) -> None:
    standard(world)
    world.start()
    change = world.tree.aux_uevent("change", "mlx5_core.sf.7")
    world.tree.vanish(PF_B)
    with caplog.at_level(logging.INFO, "devplugd.auxnet"):
        world.fold([change])
    assert "auxiliary device mlx5_core.sf.7 left out" in caplog.text  # at INFO: a removal's late events say it too
    assert set(world.build(world.facts, ALL)["all"]) == A_SFS | {"mlx5_core.sf.6"}  # not read again yet
    caplog.clear()
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        assert world.ids(ALL) == {"all": A_SFS}  # a scan: PF B's bus links lead nowhere
    assert "auxiliary device mlx5_core.sf.6 left out" in caplog.text
    world.fold([world.tree.uevent("add", world.host.device_dir(PF_A) / "net" / "enp3s0f0np0", "net"),
                KernelEvent("change", "/devices/pci0000:00/0000:00:03.0/0000:04:00.0/mlx5_core.sf.6", "auxiliary")])
    assert world.facts == world.scanned()


def test_a_pf_that_cannot_be_read_leaves_its_sfs_out_and_says_so(world: AuxPools,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    standard(world)
    (world.host.device_dir(PF_B) / "vendor").write_text("0xnothex\n")
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        assert world.ids(ALL) == {"all": A_SFS}
    assert f"auxiliary devices mlx5_core.sf.6, mlx5_core.sf.7 left out: their PF {PF_B} cannot be read" in caplog.text


def test_events_that_do_not_concern_sfs_leave_the_facts_as_they_are(world: AuxPools) -> None:
    standard(world)
    world.start()
    before = world.facts
    pf_dir = world.host.device_dir(PF_A)
    world.fold([
        KernelEvent("add", "/devices/virtual/net/veth0", "net"),
        world.tree.aux_uevent("bind", "mlx5_core.eth.0"),  # the PF's own auxiliary device
        world.tree.uevent("change", pf_dir / "net" / "enp3s0f0np0", "net"),
        KernelEvent("bind", "/devices/pci0000:00/0000:00:05.0/0000:05:00.0", "pci"),
        LinkChanged("en4f0s1", None),
    ])
    assert world.facts is before


# -- property: any sequence of changes folds to what a scan reads --------------------------------------
OPERATIONS = st.lists(st.tuples(st.sampled_from(["add", "add_unbound", "bind", "unbind", "remove", "rename_uplink",
                                                 "rename_sf", "pf_unbind", "pf_bind", "rdma"]),
                                st.integers(0, 1), st.integers(0, 7)), max_size=14)


def _apply(world: AuxPools, operation: str, which_pf: int, number: int) -> list[Any]:
    tree, pf = world.tree, (PF_A, PF_B)[which_pf]
    mine = sorted(name for name, sf in tree.sfs.items() if sf.pf == pf)
    pick = mine[number % len(mine)] if mine else None
    bound = pick is not None and (tree.aux_dir(pick) / "driver").is_symlink()
    pf_dir = world.host.device_dir(pf)
    if operation in ("add", "add_unbound"):
        if any(tree.sfs[name].sfnum == number for name in mine):
            return []
        return add_sf(tree, pf, number, netdev=f"s{which_pf}n{number}", bound=operation == "add",
                      rdma=f"mlx5_{10 + 10 * which_pf + number}" if number % 2 else None)[1]
    if operation == "bind" and pick is not None and not bound:
        return bind_sf(tree, pick)
    if operation == "unbind" and bound:
        return unbind_sf(tree, pick)
    if operation == "remove" and pick is not None:
        return remove_sf(tree, pick)
    if operation == "rename_uplink":
        uplink = next(n for n in os.listdir(pf_dir / "net")
                      if re.fullmatch(r"p[0-9]+", (pf_dir / "net" / n / "phys_port_name").read_text().strip()))
        return [rename_netdev(tree, pf_dir, uplink, f"up{which_pf}r{number}" if uplink != f"up{which_pf}r{number}"
                              else f"up{which_pf}s{number}")]
    if operation == "rename_sf" and bound:
        sf_dir = tree.aux_dir(pick)
        netdevs = os.listdir(sf_dir / "net")
        return [rename_netdev(tree, sf_dir, netdevs[0], f"r{netdevs[0]}"[:15])] if netdevs else []
    if operation == "pf_unbind" and (pf_dir / "driver").is_symlink():
        world.host.unbind(pf)
        return [pci_event(tree, "unbind", pf)]
    if operation == "pf_bind" and not (pf_dir / "driver").is_symlink():
        world.host.bind(pf, "mlx5_core")
        return [pci_event(tree, "bind", pf)]
    if operation == "rdma" and bound and not (tree.aux_dir(pick) / "infiniband").exists():
        sf_dir = tree.aux_dir(pick)
        ib_dir = tree.add_ib(pick, f"mlx5_{40 + number + 10 * which_pf}", link_layer="Ethernet")
        return [tree.uevent("add", ib_dir, "infiniband"),
                *(tree.uevent("add", sf_dir / kind / entry, kind)
                  for kind in ("infiniband_verbs", "infiniband_mad") for entry in sorted(os.listdir(sf_dir / kind)))]
    return []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPERATIONS)
def test_any_sequence_of_sf_changes_folds_to_what_a_fresh_scan_reads(operations: list[tuple[str, int, int]]) -> None:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="dp", dir=base))
    try:
        host = FakeHost(root / "host")
        world = AuxPools(host, AuxTree(host))
        world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0")
        world.tree.add_mlx5_pf(PF_B, uplink="p0", rdma=None, numa_node=1, bridge="0000:00:03.0")
        world.start()
        entries = (pool("low", {"pfNames": ["enp3s0f0np0#0-3", "p0#4-5"]}), pool("rdma", {"isRdma": True}),
                   pool("rest"))
        for operation in operations:
            world.fold(_apply(world, *operation))
            scanned = world.scanned()
            assert world.facts == scanned, operation
            assert world.handler.build(world.facts, world.configure(*entries)) == AuxPools(host, world.tree).handler \
                .build(scanned, world.configure(*entries))
    finally:
        shutil.rmtree(root, ignore_errors=True)

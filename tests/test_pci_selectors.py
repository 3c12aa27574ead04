"""PCI selectors of netDevice/accelerator pools, matched as the SR-IOV plugin matches them (unit tests)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from daemon.core import ConfigError, ConfigObject
from daemon.handlers._sriov_selectors import entry_problem, index_selected, pick_pf_entry
from daemon.handlers.pci._facts import PciDevice
from daemon.handlers.pci._selectors import ACCELERATOR, NET_DEVICE, PciSelector, parse_selector

GTP = "GTPv1-C/U IPv4/IPv6 payload"


def vf(**overrides: Any) -> PciDevice:
    """VF 1 of PF ens1f0 (0000:3b:00.0), an iavf-bound Intel E810 VF, unless overridden."""
    fields: dict[str, Any] = {
        "address": "0000:3b:02.1", "vendor": "8086", "device": "1889", "class_code": "020000",
        "driver": "iavf", "numa_node": 0, "acpi_index": None, "is_pf": False, "num_vfs": 0,
        "pf_address": "0000:3b:00.0", "vf_index": 1, "pf_netdev": "ens1f0", "netdevs": ("ens1f0v1",),
        "link_type": "ether", "iommu_group": None, "noiommu": False, "uio_devices": (),
        "rdma_devices": (), "has_default_route": False,
    }
    fields.update(overrides)
    return PciDevice(**fields)


def plain_nic(**overrides: Any) -> PciDevice:
    """A NIC that is not a VF: no PF name, no PF address."""
    fields: dict[str, Any] = {"address": "0000:5e:00.0", "pf_address": None, "pf_netdev": None, "vf_index": -1,
                              "netdevs": ("eno1",)}
    return vf(**{**fields, **overrides})


def no_ddp(address: str) -> str | None:
    return None


def select(device: PciDevice, ddp: Any = no_ddp, **fields: Any) -> bool:
    return PciSelector(json_path="$.t", **fields).matches(device, ddp)


# -- the '#' index syntax -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "index", "selected"),
    [
        ("ens1f0", 0, True),
        ("ens1f0", 63, True),
        *[("ens1f0#0,2-7", i, i in (0, 2, 3, 4, 5, 6, 7)) for i in range(10)],
        ("ens1f0#5", 5, True),
        ("ens1f0#5", 4, False),
        ("ens1f0#7-2", 2, False),
        ("ens1f0#7-2", 5, False),
        ("ens1f0#7-2", 7, False),
        ("ens1f0#3-3", 3, True),
        ("ens1f0#1#2", 1, False),
        ("ens1f0#1#2", 2, False),
        ("ens1f0##1", 1, False),
        ("ens1f0#1,,2", 1, True),
        ("ens1f0#1,,2", 2, False),
        ("ens1f0#3,x,5", 3, True),
        ("ens1f0#3,x,5", 5, False),
        ("ens1f0#0, 2", 0, True),
        ("ens1f0#0, 2", 2, False),
        ("ens1f0# 1", 1, False),
        ("ens1f0#1 -3", 2, False),
        ("ens1f0#1- 3", 2, False),
        ("ens1f0#1,", 1, True),
        ("ens1f0#1,", 2, False),
        ("ens1f0#", 0, False),
        ("ens1f0#+3", 3, True),
        ("ens1f0#+1-+3", 2, True),
        ("ens1f0#-1", 0, False),
        ("ens1f0#1-2-3", 2, False),
        ("ens1f0#a", 0, False),
        ("ens1f0#0x1", 1, False),
        ("ens1f0#\u0661", 1, False),
        ("0000:3b:00.0#0-3", 3, True),
        ("0000:3b:00.0#0-3", 4, False),
    ],
)
def test_index_selection_follows_upstream(entry: str, index: int, selected: bool) -> None:
    assert index_selected(entry, index) is selected


@pytest.mark.parametrize(
    ("entries", "pf", "picked"),
    [
        (("ens1f0",), "ens1f0", "ens1f0"),
        (("ENS1F0#1",), "ens1f0", "ENS1F0#1"),
        (("ens1f1#0", "ens1f0#2-3", "ens1f0#0-9"), "ens1f0", "ens1f0#2-3"),
        (("ens1",), "ens1f0", None),
        (("ens1f0",), "ens1f01", None),
        (("ens1.*",), "ens1f0", None),
        (("0000:3B:00.0#0",), "0000:3b:00.0", "0000:3B:00.0#0"),
        ((), "ens1f0", None),
    ],
)
def test_first_entry_naming_the_pf_is_picked(entries: tuple[str, ...], pf: str, picked: str | None) -> None:
    assert pick_pf_entry(entries, pf) == picked


def test_first_matching_entry_decides_even_if_a_later_one_would_include_the_index() -> None:
    device = vf(vf_index=5)
    assert not select(device, pf_names=("ens1f0#0-3", "ens1f0#4-7"))
    assert not select(device, root_devices=("0000:3b:00.0#0-3", "0000:3b:00.0#4-7"))
    assert select(device, pf_names=("ens1f1#0-3", "ens1f0#4-7"))


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("ens1f0", None),
        ("ens1f0#0,2-7,9", None),
        ("ens1f0#+3", None),
        ("ens1f0#1#2", "more than one '#'"),
        ("ens1f0#1,,2", "'' is not an index"),
        ("ens1f0#1-2-3", "'1-2-3' is not an index"),
        ("ens1f0#0, 2", "' 2' is not an index"),
        ("ens1f0#a-3", "'a-3' is not an index"),
        ("ens1f0#", "'' is not an index"),
    ],
)
def test_malformed_entries_are_explained(entry: str, problem: str | None) -> None:
    found = entry_problem(entry)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_malformed_pf_entry_is_logged_with_its_json_path(caplog: pytest.LogCaptureFixture) -> None:
    raw = ConfigObject({"pfNames": ["ens1f0#0-3", "ens1f0#1,,2"], "rootDevices": ["0000:3b:00.0#1#2"]}, "$.s")
    with caplog.at_level(logging.WARNING, logger="devplugd.pci"):
        parse_selector(raw, NET_DEVICE)
    messages = [record.getMessage() for record in caplog.records]
    assert any("$.s.pfNames[1]" in m and "ens1f0#1,,2" in m for m in messages)
    assert any("$.s.rootDevices[0]" in m and "more than one '#'" in m for m in messages)
    assert not any("pfNames[0]" in m for m in messages)


# -- every selector field -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "device", "selected"),
    [
        ({}, vf(), True),
        ({"vendors": ("8086",)}, vf(), True),
        ({"vendors": ("15b3", "8086")}, vf(), True),
        ({"vendors": ("15b3",)}, vf(), False),
        ({"vendors": ("0x8086",)}, vf(), False),
        ({"devices": ("1889",)}, vf(), True),
        ({"devices": ("154c",)}, vf(), False),
        ({"drivers": ("iavf", "vfio-pci")}, vf(), True),
        ({"drivers": ("vfio-pci",)}, vf(), False),
        ({"drivers": ("iavf",)}, vf(driver="vfio-pci"), False),
        ({"pci_addresses": ("0000:3b:02.1",)}, vf(), True),
        ({"pci_addresses": ("3b:02.1",)}, vf(), False),
        ({"pci_addresses": ("0000:3B:02.1",)}, vf(), False),
        ({"pci_addresses": ("0000:3b:02.2",)}, vf(), False),
        ({"acpi_indexes": ("101",)}, vf(acpi_index="101"), True),
        ({"acpi_indexes": ("101",)}, vf(acpi_index="102"), False),
        ({"acpi_indexes": ("101",)}, vf(acpi_index=None), False),
        ({"pf_names": ("ens1f0",)}, vf(), True),
        ({"pf_names": ("Ens1F0#1",)}, vf(), True),
        ({"pf_names": ("ens1f0#0,2-7",)}, vf(), False),
        ({"pf_names": ("ens1f1",)}, vf(), False),
        ({"root_devices": ("0000:3b:00.0",)}, vf(), True),
        ({"root_devices": ("0000:3B:00.0#1",)}, vf(), True),
        ({"root_devices": ("0000:3b:00.0#2",)}, vf(), False),
        ({"root_devices": ("0000:3b:00.1",)}, vf(), False),
        ({"link_types": ("ether",)}, vf(), True),
        ({"link_types": ("infiniband",)}, vf(), False),
        ({"link_types": ("infiniband", "ether")}, vf(link_type="infiniband"), True),
        ({"is_rdma": True}, vf(rdma_devices=("mlx5_3",)), True),
        ({"is_rdma": True}, vf(), False),
        ({"is_rdma": False}, vf(), True),
        ({"need_vhost_net": True}, vf(), True),
        ({"vendors": ("8086",), "drivers": ("vfio-pci",)}, vf(), False),
        ({"vendors": ("8086",), "drivers": ("iavf",), "pf_names": ("ens1f0#1",)}, vf(), True),
    ],
)
def test_selector_fields_combine_with_and_values_with_or(
    fields: dict[str, Any], device: PciDevice, selected: bool
) -> None:
    assert select(device, **fields) is selected


@pytest.mark.parametrize(
    ("profiles", "address", "selected"),
    [
        ((GTP,), "0000:3b:02.1", True),
        (("PPPoE",), "0000:3b:02.1", False),
        (("PPPoE", GTP), "0000:3b:02.1", True),
        ((GTP,), "0000:3b:02.2", False),
    ],
)
def test_ddp_profiles_compare_the_active_profile(profiles: tuple[str, ...], address: str, selected: bool) -> None:
    loaded = {"0000:3b:02.1": GTP}
    assert select(vf(address=address), loaded.get, ddp_profiles=profiles) is selected


def test_ddp_profile_is_not_looked_up_without_a_ddp_selector() -> None:
    looked_up: list[str] = []

    def lookup(address: str) -> str | None:
        looked_up.append(address)
        return GTP

    assert select(vf(), lookup, vendors=("8086",), pf_names=("ens1f0",))
    assert looked_up == []


@pytest.mark.parametrize("fields", [{"pf_names": ("eno1",)}, {"root_devices": ("0000:5e:00.0",)},
                                    {"pf_names": ("eno1#0-7",)}, {"root_devices": ("0000:5e:00.0#0-7",)}])
def test_devices_without_a_pf_are_never_selected_by_pf_selectors(fields: dict[str, Any]) -> None:
    assert not select(plain_nic(), **fields)
    assert select(plain_nic())


def test_vf_whose_pf_has_no_netdev_is_not_selected_by_pf_name_but_by_root_device() -> None:
    device = vf(pf_netdev=None)
    assert not select(device, pf_names=("ens1f0",))
    assert select(device, root_devices=("0000:3b:00.0",))


# -- parsing per deviceType ---------------------------------------------------------------------

NET_ONLY = {
    "acpiIndexes": ["1"], "pfNames": ["ens1f0#0"], "rootDevices": ["0000:3b:00.0#0"],
    "linkTypes": ["infiniband"], "ddpProfiles": [GTP], "isRdma": True, "needVhostNet": True,
}


def test_accelerator_ignores_net_device_only_selector_fields() -> None:
    raw = ConfigObject({"vendors": ["8086"], "devices": ["37c9"], "drivers": ["vfio-pci"],
                        "pciAddresses": ["0000:3d:01.0"], **NET_ONLY}, "$.s")
    selector = parse_selector(raw, ACCELERATOR)
    assert selector == PciSelector(json_path="$.s", vendors=("8086",), devices=("37c9",),
                                   drivers=("vfio-pci",), pci_addresses=("0000:3d:01.0",))
    qat_vf = plain_nic(address="0000:3d:01.0", device="37c9", class_code="120000", driver="vfio-pci",
                       link_type="", netdevs=())
    assert selector.matches(qat_vf, no_ddp)


@pytest.mark.parametrize("key", sorted(NET_ONLY))
def test_accelerator_does_not_type_check_fields_it_ignores(key: str) -> None:
    raw = ConfigObject({key: 5}, "$.s")
    assert parse_selector(raw, ACCELERATOR) == PciSelector(json_path="$.s")
    with pytest.raises(ConfigError) as caught:
        parse_selector(raw, NET_DEVICE)
    assert caught.value.json_path == f"$.s.{key}"


def test_net_device_reads_every_field() -> None:
    selector = parse_selector(ConfigObject({"vendors": ["8086"], **NET_ONLY}, "$.s"), NET_DEVICE)
    assert selector == PciSelector(
        json_path="$.s", vendors=("8086",), acpi_indexes=("1",), pf_names=("ens1f0#0",),
        root_devices=("0000:3b:00.0#0",), link_types=("infiniband",), ddp_profiles=(GTP,),
        is_rdma=True, need_vhost_net=True,
    )

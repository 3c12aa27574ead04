"""auxNetDevice pools following the kernel: SFs created, bound, unbound and removed, their
netdevs renamed, RDMA devices appearing, the PF's driver and uplink changing, a PF vanishing
while it is read; after every step the folded facts must be what a fresh scan of the same fake
sysfs reads (tests/auxsysfs.py, the events in the kernel's order from tests/auxpools.py), and
for random sequences of such steps too."""

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

from daemon.core import LinkChanged
from daemon.core import UEvent as KernelEvent
from tests.auxpools import (
    A_SFS,
    ALL,
    B_SFS,
    PF_A,
    PF_B,
    AuxPools,
    add_sf,
    bind_sf,
    pci_event,
    pool,
    remove_sf,
    rename_netdev,
    standard_tree,
    unbind_sf,
)
from tests.auxsysfs import AuxTree
from tests.fakesysfs import FakeHost


def ids_after(aux_world: AuxPools, events: list[KernelEvent], *entries: dict[str, Any]) -> dict[str, set[str]]:
    """Fold ``events``; check the facts are a fresh scan's; the pools' IDs."""
    aux_world.fold(events)
    assert aux_world.facts == aux_world.scanned()
    return {name: set(devices) for name, devices in aux_world.build(aux_world.facts, *entries).items()}


def test_an_sf_joins_when_its_driver_binds_and_leaves_when_unbound_or_removed(aux_world: AuxPools) -> None:
    aux_world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma=None)
    aux_world.start()
    name, added = add_sf(aux_world.tree, PF_A, 12, netdev="enp3s0f0s12", bound=False)
    assert [e.subsystem for e in added] == ["net", "auxiliary"]  # the representor, then the SF
    assert ids_after(aux_world, added, ALL) == {"all": set()}  # no driver yet: no netdev to hand out
    assert ids_after(aux_world, bind_sf(aux_world.tree, name), ALL) == {"all": {name}}
    assert aux_world.facts.sfs[name].netdevs == ("enp3s0f0s12",)
    assert ids_after(aux_world, unbind_sf(aux_world.tree, name), ALL) == {"all": set()}
    assert ids_after(aux_world, bind_sf(aux_world.tree, name), ALL) == {"all": {name}}
    assert ids_after(aux_world, remove_sf(aux_world.tree, name), ALL) == {"all": set()}
    assert aux_world.facts.sfs == {} and aux_world.facts.pfs == {}


def test_a_bound_sf_added_at_once_is_offered_with_its_rdma_device(aux_world: AuxPools) -> None:
    aux_world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0")
    aux_world.start()
    name, added = add_sf(aux_world.tree, PF_A, 3, netdev="enp3s0f0s3", rdma="mlx5_1")
    aux_world.fold(added)
    assert aux_world.facts == aux_world.scanned()
    ((offered, info),) = aux_world.build(aux_world.facts, pool("p", {"isRdma": True}))["p"].items()
    assert offered == name
    assert info.details.info["rdma"]["uverbs"] == "/dev/infiniband/uverbs1"


def test_an_rdma_device_appearing_later_brings_the_sf_into_an_rdma_pool(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    rdma_pool = pool("p", {"isRdma": True})
    assert "mlx5_core.sf.6" not in ids_after(aux_world, [], rdma_pool)["p"]
    ib_dir = aux_world.tree.add_ib("mlx5_core.sf.6", "mlx5_9", link_layer="Ethernet")
    sf_dir = aux_world.tree.aux_dir("mlx5_core.sf.6")
    events = [aux_world.tree.uevent("add", ib_dir, "infiniband")]
    events += [aux_world.tree.uevent("add", sf_dir / kind / entry, kind)
               for kind in ("infiniband_verbs", "infiniband_mad") for entry in sorted(os.listdir(sf_dir / kind))]
    assert ids_after(aux_world, events, rdma_pool) == {"p": {"mlx5_core.sf.2", "mlx5_core.sf.6", "mlx5_core.sf.7"}}
    (info,) = [i for n, i in aux_world.build(aux_world.facts, rdma_pool)["p"].items() if n == "mlx5_core.sf.6"]
    assert info.details.info["rdma"]["rdma_dev"] == "mlx5_9" and len(info.specs) == 4


def test_rdma_cm_going_away_is_seen_by_every_sf_at_the_next_uevent(aux_world: AuxPools) -> None:
    """rdma_ucm unloaded: ``/dev/infiniband/rdma_cm`` goes with no uevent we follow; the next
    uevent of any SF takes it out of every SF's RDMA devices, as a scan would."""
    standard_tree(aux_world.tree)
    aux_world.start()
    (aux_world.host.dev / "infiniband" / "rdma_cm").unlink()
    _, added = add_sf(aux_world.tree, PF_A, 40, netdev="enp3s0f0s40")
    aux_world.fold(added)
    assert aux_world.facts == aux_world.scanned()
    rdma = aux_world.build(aux_world.facts, pool("p", {"isRdma": True}))["p"]
    assert rdma and all("rdma_cm" not in info.details.info["rdma"] for info in rdma.values())


def test_an_sf_netdev_renamed_is_read_again(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    moved = rename_netdev(aux_world.tree, aux_world.tree.aux_dir("mlx5_core.sf.6"), "en4f0s1", "blue1")
    aux_world.fold([moved])
    assert aux_world.facts == aux_world.scanned()
    assert aux_world.facts.sfs["mlx5_core.sf.6"].netdevs == ("blue1",)


def test_the_uplink_renamed_moves_the_sfs_between_pf_name_pools(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    pools = (pool("old", {"pfNames": ["p0"]}), pool("new", {"pfNames": ["ens4np0"]}))
    assert ids_after(aux_world, [], *pools) == {"old": B_SFS, "new": set()}
    moved = rename_netdev(aux_world.tree, aux_world.host.device_dir(PF_B), "p0", "ens4np0")
    assert ids_after(aux_world, [moved], *pools) == {"old": set(), "new": B_SFS}


def test_the_pfs_driver_unbound_takes_its_sfs_out_and_bound_brings_them_back(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    aux_world.host.unbind(PF_B)
    assert ids_after(aux_world, [pci_event(aux_world.tree, "unbind", PF_B)], ALL) == {"all": A_SFS}
    aux_world.host.bind(PF_B, "mlx5_core")
    assert ids_after(aux_world, [pci_event(aux_world.tree, "bind", PF_B)], ALL) == {"all": A_SFS | B_SFS}


def test_the_pf_removed_takes_its_sfs_even_without_their_own_events(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    removed = pci_event(aux_world.tree, "remove", PF_B)
    aux_world.tree.remove_function(PF_B)
    assert ids_after(aux_world, [removed], ALL) == {"all": A_SFS}
    assert set(aux_world.facts.pfs) == {PF_A}


def test_an_sf_whose_pf_vanished_mid_read_is_logged_and_dropped_and_the_rest_served(
        aux_world: AuxPools, caplog: pytest.LogCaptureFixture) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    change = aux_world.tree.aux_uevent("change", "mlx5_core.sf.7")
    aux_world.tree.vanish(PF_B)
    with caplog.at_level(logging.INFO, "devplugd.auxnet"):
        aux_world.fold([change])
    assert "auxiliary device mlx5_core.sf.7 left out" in caplog.text  # at INFO: a removal's late events say it too
    assert set(aux_world.build(aux_world.facts, ALL)["all"]) == A_SFS | {"mlx5_core.sf.6"}  # not read again yet
    caplog.clear()
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        assert aux_world.ids(ALL) == {"all": A_SFS}  # a scan: PF B's bus links lead nowhere
    assert "auxiliary device mlx5_core.sf.6 left out" in caplog.text
    aux_world.fold([aux_world.tree.uevent("add", aux_world.host.device_dir(PF_A) / "net" / "enp3s0f0np0", "net"),
                KernelEvent("change", "/devices/pci0000:00/0000:00:03.0/0000:04:00.0/mlx5_core.sf.6", "auxiliary")])
    assert aux_world.facts == aux_world.scanned()


def test_a_pf_that_cannot_be_read_leaves_its_sfs_out_and_says_so(aux_world: AuxPools,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    standard_tree(aux_world.tree)
    (aux_world.host.device_dir(PF_B) / "vendor").write_text("0xnothex\n")
    with caplog.at_level(logging.WARNING, "devplugd.auxnet"):
        assert aux_world.ids(ALL) == {"all": A_SFS}
    assert f"auxiliary devices mlx5_core.sf.6, mlx5_core.sf.7 left out: their PF {PF_B} cannot be read" in caplog.text


def test_events_that_do_not_concern_sfs_leave_the_facts_as_they_are(aux_world: AuxPools) -> None:
    standard_tree(aux_world.tree)
    aux_world.start()
    before = aux_world.facts
    pf_dir = aux_world.host.device_dir(PF_A)
    aux_world.fold([
        KernelEvent("add", "/devices/virtual/net/veth0", "net"),
        aux_world.tree.aux_uevent("bind", "mlx5_core.eth.0"),  # the PF's own auxiliary device
        aux_world.tree.uevent("change", pf_dir / "net" / "enp3s0f0np0", "net"),
        KernelEvent("bind", "/devices/pci0000:00/0000:00:05.0/0000:05:00.0", "pci"),
        LinkChanged("en4f0s1", None),
    ])
    assert aux_world.facts is before


# -- property: any sequence of changes folds to what a scan reads --------------------------------------
OPERATIONS = st.lists(st.tuples(st.sampled_from(["add", "add_unbound", "bind", "unbind", "remove", "rename_uplink",
                                                 "rename_sf", "pf_unbind", "pf_bind", "rdma"]),
                                st.integers(0, 1), st.integers(0, 7)), max_size=14)


def _apply(aux_world: AuxPools, operation: str, which_pf: int, number: int) -> list[Any]:
    tree, pf = aux_world.tree, (PF_A, PF_B)[which_pf]
    mine = sorted(name for name, sf in tree.sfs.items() if sf.pf == pf)
    pick = mine[number % len(mine)] if mine else None
    bound = pick is not None and (tree.aux_dir(pick) / "driver").is_symlink()
    pf_dir = aux_world.host.device_dir(pf)
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
        aux_world.host.unbind(pf)
        return [pci_event(tree, "unbind", pf)]
    if operation == "pf_bind" and not (pf_dir / "driver").is_symlink():
        aux_world.host.bind(pf, "mlx5_core")
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
        aux_world = AuxPools(host, AuxTree(host))
        aux_world.tree.add_mlx5_pf(PF_A, uplink="enp3s0f0np0", rdma="mlx5_0")
        aux_world.tree.add_mlx5_pf(PF_B, uplink="p0", rdma=None, numa_node=1, bridge="0000:00:03.0")
        aux_world.start()
        entries = (pool("low", {"pfNames": ["enp3s0f0np0#0-3", "p0#4-5"]}), pool("rdma", {"isRdma": True}),
                   pool("rest"))
        for operation in operations:
            aux_world.fold(_apply(aux_world, *operation))
            scanned = aux_world.scanned()
            assert aux_world.facts == scanned, operation
            assert aux_world.handler.build(aux_world.facts, aux_world.configure(*entries)) == AuxPools(host, aux_world.tree).handler \
                .build(scanned, aux_world.configure(*entries))
    finally:
        shutil.rmtree(root, ignore_errors=True)

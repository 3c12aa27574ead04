"""Folding events into PCI facts gives exactly what a fresh full scan of the same sysfs gives.

A property test drives random hotplug on a fake host in the kernel's layout (VFs created and
destroyed, drivers rebound, netdevs added, removed and renamed, NUMA changed, a PF appearing),
sends the uevents the kernel would send, and compares the folded pools with a fresh scan's
after every step. Link events are checked the same way against a snapshot of the final state.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.core import (
    HEALTHY,
    UNHEALTHY,
    Fault,
    HandlerContext,
    LinkChanged,
    LinkSnapshot,
    LinkState,
    UEvent,
)
from daemon.core._config import DaemonConfig, parse_config
from daemon.core._tree import CARRIER_LOST
from daemon.handlers.pci import PciHandler
from tests.fakesysfs import FakeHost

PF_A, PF_B, PF_NEW = "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"
CONFIG = {"resourceList": [
    {"resourceName": "passthrough", "deviceType": "pciDevice", "selectors": {"pfNames": ["ensb#0-3"]}},
    {"resourceName": "vfio", "selectors": {"drivers": ["vfio-pci"]}},
    {"resourceName": "kernel_a", "selectors": {"pfNames": ["ensa#0-2"]}},
    {"resourceName": "kernel_rest", "selectors": [{"drivers": ["iavf"]}, {"rootDevices": [PF_B]}]},
    {"resourceName": "plain", "selectors": {"drivers": ["i40e"]}},
]}


def vf_address(pf: str, index: int) -> str:
    return f"{pf[:8]}{2 + index // 8:02x}.{index % 8}"


def uevent(action: str, devpath: str, subsystem: str) -> UEvent:
    return UEvent(action=action, devpath=devpath, subsystem=subsystem)


class World:
    """A fake host, the handler, its folded facts, and the uevents a kernel would send."""

    def __init__(self, root: Path) -> None:
        self.host = FakeHost(root)
        self.handler = PciHandler(HandlerContext(self.host.sys, self.host.dev, self.host.proc, root / "devinfo"))
        self.config: DaemonConfig = parse_config(json.dumps(CONFIG), "test", "intel.com",
                                                 {t: ("pci", self.handler.parse_pool) for t in self.handler.device_types})
        self.host.add_pf(PF_A, netdev="ensa", numa_node=0)
        self.host.add_pf(PF_B, netdev="ensb", numa_node=1, bridge="0000:00:03.0")
        self.vfs: dict[str, list[str]] = {PF_A: [], PF_B: []}
        self.facts = self.handler.scan()

    def fold(self, *events: Any) -> None:
        for event in events:
            self.facts = self.handler.fold(self.facts, event)

    def pools(self, facts: Any) -> dict[str, Any]:
        return {resource: dict(devices) for resource, devices in self.handler.build(facts, self.config.pools).items()}

    def fresh_pools(self) -> dict[str, Any]:
        scanned = self.handler.scan()
        from dataclasses import replace
        return PciHandler(self.handler._context).build(replace(scanned, links=self.facts.links), self.config.pools)

    # -- operations: change the fake sysfs, then fold the uevents the kernel would send -------
    def create_vf(self, pf: str, driver: str) -> None:
        if pf not in self.vfs or len(self.vfs[pf]) >= 12:
            return
        index = len(self.vfs[pf])
        address = vf_address(pf, index)
        netdev = f"{'ab'[pf == PF_B]}v{index}" if driver == "iavf" else None
        pf_dir = self.host.device_dir(pf)
        vf_dir = self.host.add_pci(address, device="154c", driver=None, numa_node=int(pf == PF_B),
                                   bridge=pf_dir.parent.name)
        (vf_dir / "physfn").symlink_to(f"../{pf}")
        (pf_dir / f"virtfn{index}").symlink_to(f"../{address}")
        self.host.set_iommu_group(address, 100 + index + 20 * (pf == PF_B))
        self.host.bind(address, driver)
        if netdev:
            self.host.add_netdev(address, netdev)
        self.vfs[pf].append(address)
        (pf_dir / "sriov_numvfs").write_text(f"{len(self.vfs[pf])}\n")
        self.fold(uevent("add", self.host.devpath(address), "pci"), uevent("bind", self.host.devpath(address), "pci"))
        if netdev:
            self.fold(uevent("add", self.host.devpath(address, "net", netdev), "net"))

    def destroy_last_vf(self, pf: str) -> None:
        if not self.vfs.get(pf):
            return
        address = self.vfs[pf].pop()
        devpath = self.host.devpath(address)
        (self.host.device_dir(pf) / f"virtfn{len(self.vfs[pf])}").unlink()
        self.host.remove_pci(address)
        (self.host.device_dir(pf) / "sriov_numvfs").write_text(f"{len(self.vfs[pf])}\n")
        self.fold(uevent("remove", devpath, "pci"))

    def rebind(self, pf: str, position: int, driver: str) -> None:
        if not self.vfs.get(pf):
            return
        address = self.vfs[pf][position % len(self.vfs[pf])]
        net_dir = self.host.device_dir(address) / "net"
        for name in sorted(p.name for p in net_dir.iterdir()) if net_dir.is_dir() else []:
            self.host.remove_netdev(address, name)
            self.fold(uevent("remove", self.host.devpath(address, "net", name), "net"))
        self.host.unbind(address)
        self.fold(uevent("unbind", self.host.devpath(address), "pci"))
        if driver != "none":
            self.host.bind(address, driver)
            if driver == "iavf":
                name = f"r{address[-4:].replace(':', '').replace('.', '')}"
                self.host.add_netdev(address, name)
                self.fold(uevent("add", self.host.devpath(address, "net", name), "net"))
            self.fold(uevent("bind", self.host.devpath(address), "pci"))

    def rename_pf_netdev(self, pf: str, new_name: str) -> None:
        net_dir = self.host.device_dir(pf) / "net"
        old_names = [p.name for p in net_dir.iterdir()] if net_dir.is_dir() else []
        for name in old_names:
            self.host.remove_netdev(pf, name)
        self.host.add_netdev(pf, new_name)
        self.fold(uevent("move", self.host.devpath(pf, "net", new_name), "net"))

    def set_numa(self, pf: str, position: int, numa: int) -> None:
        if not self.vfs.get(pf):
            return
        address = self.vfs[pf][position % len(self.vfs[pf])]
        self.host.set_file(address, "numa_node", f"{numa}\n")
        self.fold(uevent("change", self.host.devpath(address), "pci"))

    def add_new_pf(self) -> None:
        if PF_NEW in self.vfs:
            return
        self.host.add_pf(PF_NEW, netdev="ensc", numa_node=0, bridge="0000:00:04.0")
        self.vfs[PF_NEW] = []
        self.fold(uevent("add", self.host.devpath(PF_NEW), "pci"),
                  uevent("add", self.host.devpath(PF_NEW, "net", "ensc"), "net"))


PFS = st.sampled_from([PF_A, PF_B, PF_NEW])
OPERATIONS = st.one_of(
    st.tuples(st.just("create_vf"), PFS, st.sampled_from(["iavf", "vfio-pci"])),
    st.tuples(st.just("destroy_last_vf"), PFS),
    st.tuples(st.just("rebind"), PFS, st.integers(0, 11), st.sampled_from(["iavf", "vfio-pci", "none"])),
    st.tuples(st.just("rename_pf_netdev"), PFS, st.sampled_from(["ensa", "ensb", "ensx", "ensa2"])),
    st.tuples(st.just("set_numa"), PFS, st.integers(0, 11), st.integers(-1, 3)),
    st.tuples(st.just("add_new_pf")),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPERATIONS, min_size=1, max_size=25))
def test_folded_events_equal_a_fresh_scan_after_every_step(operations):
    with tempfile.TemporaryDirectory(prefix="dpprop", dir="/dev/shm") as root:
        world = World(Path(root))
        for name, *arguments in operations:
            if name in ("rename_pf_netdev",) and arguments[0] not in world.vfs:
                continue
            getattr(world, name)(*arguments)
            assert world.pools(world.facts) == world.fresh_pools(), f"after {name}{tuple(arguments)}"


LINK_NAMES = st.sampled_from(["ensa", "ensb", "av0", "av1", "bv0", "lo"])
LINK_STATES = st.one_of(st.none(), st.builds(LinkState, st.integers(1, 9), st.booleans(), st.booleans()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(LINK_NAMES, LINK_STATES), max_size=30))
def test_link_events_equal_a_snapshot_of_the_final_state(changes):
    with tempfile.TemporaryDirectory(prefix="dpprop", dir="/dev/shm") as root:
        world = World(Path(root))
        for _ in range(2):
            world.create_vf(PF_A, "iavf")
            world.create_vf(PF_B, "iavf")
        world.create_vf(PF_A, "vfio-pci")
        world.pools(world.facts)
        final: dict[str, LinkState] = {}
        for ifname, state in changes:
            world.fold(LinkChanged(ifname, state))
            if state is None:
                final.pop(ifname, None)
            else:
                final[ifname] = state
            world.pools(world.facts)  # build after every step, as the kernel does
        incremental = world.pools(world.facts)
        snapshot_world_facts = world.handler.fold(world.facts, LinkSnapshot(dict(final)))
        assert incremental == {r: dict(d) for r, d in
                               PciHandler(world.handler._context).build(snapshot_world_facts, world.config.pools).items()}


def test_vf_loses_health_with_its_pf_carrier_and_gets_it_back(short_tmp):
    world = World(short_tmp / "host")
    world.create_vf(PF_A, "vfio-pci")
    vf = world.vfs[PF_A][0]
    world.fold(LinkSnapshot({"ensa": LinkState(5, True, True)}))
    assert world.pools(world.facts)["intel.com/vfio"][vf].health == HEALTHY
    world.fold(LinkChanged("ensa", LinkState(5, True, False)))
    sick = world.pools(world.facts)["intel.com/vfio"][vf]
    # the cause travels with the health: a DRA slice's taint is named after it
    assert (sick.health, sick.fault) == (UNHEALTHY, Fault(CARRIER_LOST, "ensa", "link ensa is up without carrier"))
    world.fold(LinkChanged("ensa", LinkState(5, True, True)))
    well = world.pools(world.facts)["intel.com/vfio"][vf]
    assert (well.health, well.fault) == (HEALTHY, None)


def test_admin_down_vf_netdev_is_not_unhealthy(short_tmp):
    world = World(short_tmp / "host")
    world.create_vf(PF_A, "iavf")
    vf = world.vfs[PF_A][0]
    world.fold(LinkSnapshot({"ensa": LinkState(5, True, True), "av0": LinkState(6, False, False)}))
    assert world.pools(world.facts)["intel.com/kernel_a"][vf].health == HEALTHY
    world.fold(LinkChanged("av0", LinkState(6, True, False)))
    sick = world.pools(world.facts)["intel.com/kernel_a"][vf]
    assert (sick.health, sick.fault) == (UNHEALTHY, Fault(CARRIER_LOST, "av0", "link av0 is up without carrier"))


def test_uevent_for_a_vanished_device_drops_it_and_a_garbage_path_changes_nothing(short_tmp):
    world = World(short_tmp / "host")
    world.create_vf(PF_A, "vfio-pci")
    vf = world.vfs[PF_A][0]
    before = world.facts
    world.fold(uevent("change", "/devices/virtual/net/nothing", "net"))
    world.fold(uevent("add", "/devices/pci0000:00/0000:00:02.0/0000:99:00.0", "pci"))
    assert world.facts is before
    world.host.remove_pci(vf)  # gone before its uevent is read
    world.fold(uevent("change", world.host.devpath(PF_A), "pci"))
    assert vf not in world.pools(world.facts)["intel.com/vfio"]


def test_rdma_uevents_fold_each_functions_char_devices_to_what_a_scan_reads(tmp_path: Path) -> None:
    """An RDMA device and its user devices appearing on VFs, and going, as their uevents come: the
    folded facts hold exactly the char devices a full scan reads (only the function's own
    directory is read per event, everyone's when ``rdma_cm`` came or went), and the isRdma pool
    hands them out."""
    host = FakeHost(tmp_path)
    handler = PciHandler(HandlerContext(host.sys, host.dev, host.proc, tmp_path / "devinfo"))
    config = parse_config(json.dumps({"resourceList": [{"resourceName": "rdma", "selectors": {"isRdma": True}}]}),
                          "test", "intel.com", {t: ("pci", handler.parse_pool) for t in handler.device_types})
    host.add_pf(PF_A, netdev="ensa", vendor="15b3", device="101d", driver="mlx5_core")
    vfs = [vf_address(PF_A, index) for index in range(3)]
    host.add_vfs(PF_A, vfs, vendor="15b3", device="101e", driver="mlx5_core",
                 netdev_names=[f"ensav{index}" for index in range(3)])
    facts = handler.scan()

    def rdma_events(address: str, index: int, action: str) -> list[UEvent]:
        return [uevent(action, host.devpath(address, *below), subsystem) for below, subsystem in (
            (("infiniband", f"mlx5_{index}"), "infiniband"), (("infiniband_verbs", f"uverbs{index}"), "infiniband_verbs"),
            (("infiniband_mad", f"umad{index}"), "infiniband_mad"), (("infiniband_mad", f"issm{index}"), "infiniband_mad"))]

    def check(expected: dict[str, int]) -> None:
        scanned = handler.scan()
        assert dict(facts.rdma_char_devices) == dict(scanned.rdma_char_devices)
        pool = handler.build(facts, config.pools)["intel.com/rdma"]
        assert {address: len(info.specs) for address, info in pool.items()} == expected

    for index, address in enumerate(vfs[:2]):
        host.add_rdma(address, f"mlx5_{index}", index)
        for event in rdma_events(address, index, "add"):
            facts = handler.fold(facts, event)
    check({vfs[0]: 5, vfs[1]: 5})  # ucm, issm, umad, uverbs and rdma_cm each
    (host.dev / "infiniband" / "rdma_cm").unlink()  # rdma_ucm unloaded: no RDMA uevent of its own
    host.add_rdma(vfs[2], "mlx5_2", 2)  # ... which puts rdma_cm back: take it away again
    (host.dev / "infiniband" / "rdma_cm").unlink()
    for event in rdma_events(vfs[2], 2, "add"):
        facts = handler.fold(facts, event)
    check({vfs[0]: 4, vfs[1]: 4, vfs[2]: 4})  # every function's list lost it, not only the new one's
    gone = vfs[0]
    events = rdma_events(gone, 0, "remove")
    for name in ("infiniband", "infiniband_verbs", "infiniband_mad", "infiniband_cm"):
        shutil.rmtree(host.device_dir(gone) / name)
    for class_name, prefix in (("infiniband_verbs", "uverbs"), ("infiniband_mad", "umad"),
                               ("infiniband_mad", "issm"), ("infiniband_cm", "ucm")):
        (host.sys / "class" / class_name / f"{prefix}0").unlink()
    for event in events:
        facts = handler.fold(facts, event)
    check({vfs[1]: 4, vfs[2]: 4})

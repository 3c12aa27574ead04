"""What a ``vfioOnDemand`` loan checks and says of a function it takes from the host:

* a function whose NVMe namespace is mounted is refused also under native NVMe multipath
  (``nvme_core.multipath=Y``, the default of Debian, Ubuntu and RHEL kernels), where what is
  mounted is the shared head ``nvme<S>n<N>`` under ``devices/virtual/nvme-subsystem/`` and the
  function has only the hidden path ``nvme<S>c<C>n<N>``: with the head's ``multipath/`` links
  (Linux 6.15 on) and without (older kernels), its partitions and its holders alike;
* a NIC function lent to vfio-pci is described (attributes, device metadata) without what its
  host driver made: the interface went with the driver;
* an IPv6 default route (``/proc/net/ipv6_route``) keeps a NIC out of pools and on its driver,
  as an IPv4 one does.

On the fake sysfs, laid out as Linux lays out NVMe VFs, their controllers and subsystems, and a
NIC with VFs; the rebinding itself is done by the fake PCI driver core."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from daemon.core import AllocationError, Lent, UEvent
from daemon.core._handler import Hooks
from daemon.core._tree import DRA_ROAD, DeviceTree
from daemon.dra import device_name, pool_name
from daemon.dra._metadata import DeviceMetadataFiles
from daemon.dra._prepare import ClaimPreparer
from daemon.dra._prepared import ClaimBook
from daemon.handlers.pci._discovery import read_default_route_interfaces
from daemon.handlers.pci._facts import PciFacts
from tests import trees
from tests.fakedriver import FakeDriverCore
from tests.fakesysfs import FakeHost, write_file
from tests.pci import Pci, add_nvme_pf
from tests.test_dra_metadata import json_stream
from tests.test_dra_prepare import DRIVER, NODE, FakeApi, claim_json

PF = "0000:04:00.0"
ON_DEMAND: dict[str, Any] = {"resourceName": "nvme", "deviceType": "pciDevice", "allocationApi": "dra",
                             "vfioOnDemand": True, "selectors": {"drivers": ["nvme"], "vendors": ["1b36"]}}
NIC_PF, NIC_VF = "0000:05:00.0", "0000:05:00.1"
NICS: dict[str, Any] = {"resourceName": "nics", "resourcePrefix": "example.com", "deviceType": "pciDevice",
                        "allocationApi": "dra", "vfioOnDemand": True, "selectors": {"drivers": ["iavf"]}}
KERNELS = pytest.mark.parametrize("path_links", [True, False], ids=["linux-6.15-multipath-links", "older-kernel"])


@pytest.fixture
def nvme(host: FakeHost) -> list[str]:
    """Three NVMe VFs on nvme, vfio-pci loaded; the VFs' addresses."""
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme", "nvme"])
    (host.sys / "bus" / "pci" / "drivers" / "vfio-pci").mkdir()
    return vfs


def mount(host: FakeHost, numbers: str, source: str) -> None:
    """``numbers`` mounted on /data in the host's mount table (PID 1's)."""
    write_file(host.proc / "1" / "mountinfo", f"36 25 {numbers} / /data rw,relatime shared:1 - ext4 {source} rw\n")


def check(pci: Pci, address: str) -> None:
    pci.handler.check_loan(pci.handler.plan_loan(pci.pool(ON_DEMAND), address))


def drivers(host: FakeHost, *addresses: str) -> list[str]:
    return [(host.device_dir(address) / "driver").resolve().name for address in addresses]


# -- NVMe native multipath --------------------------------------------------------------------------


@KERNELS
def test_a_vf_whose_multipath_namespace_is_mounted_is_refused(pci: Pci, host: FakeHost, nvme: list[str],
                                                              path_links: bool) -> None:
    host.add_nvme_multipath_namespace(nvme[0], subsystem=1, controller=1, numbers="259:0", path_links=path_links)
    mount(host, "259:0", "/dev/nvme1n1")
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: its block device nvme1n1 \(259:0; NVMe multipath, "
                                              r"through its path nvme1c1n1\) is mounted or used as swap$"):
        check(pci, nvme[0])
    assert drivers(host, *nvme) == ["nvme"] * 3


@KERNELS
def test_a_vf_whose_multipath_namespace_has_a_mounted_partition_is_refused(pci: Pci, host: FakeHost,
                                                                           nvme: list[str], path_links: bool) -> None:
    head = host.add_nvme_multipath_namespace(nvme[1], subsystem=2, controller=2, numbers="259:0",
                                             path_links=path_links)
    host.add_partition(head, 1, "259:1")
    host.add_partition(head, 2, "259:2")
    mount(host, "259:2", "/dev/nvme2n1p2")
    with pytest.raises(AllocationError, match=rf"^{nvme[1]}: its block device nvme2n1p2 \(259:2; on NVMe multipath "
                                              r"nvme2n1, through its path nvme2c2n1\) is mounted"):
        check(pci, nvme[1])


@KERNELS
def test_a_vf_whose_multipath_namespace_is_held_by_device_mapper_or_md_is_refused(
        pci: Pci, host: FakeHost, nvme: list[str], path_links: bool) -> None:
    head = host.add_nvme_multipath_namespace(nvme[0], subsystem=1, controller=1, numbers="259:0",
                                             path_links=path_links)
    (head / "holders" / "dm-0").mkdir()
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: its block device nvme1n1 \(NVMe multipath, through "
                                              r"its path nvme1c1n1\) is held by dm-0$"):
        check(pci, nvme[0])
    (head / "holders" / "dm-0").rmdir()
    partition = host.add_partition(head, 1, "259:1")
    (partition / "holders" / "md127").mkdir()
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: its block device nvme1n1p1 \(on NVMe multipath "
                                              r"nvme1n1, through its path nvme1c1n1\) is held by md127$"):
        check(pci, nvme[0])


@KERNELS
def test_a_namespace_shared_by_two_controllers_stops_each_function_with_a_path_to_it(
        pci: Pci, host: FakeHost, nvme: list[str], path_links: bool) -> None:
    # subsystem 0: nvme0 on the PF, nvme1 on the first VF, both with a path to namespace 1
    host.add_nvme_multipath_namespace(PF, subsystem=0, controller=0, numbers="259:0", path_links=path_links)
    host.add_nvme_multipath_namespace(nvme[0], subsystem=0, controller=1, numbers="259:0", path_links=path_links)
    # the second VF's own namespace 2 in the same subsystem, not mounted
    own = host.add_nvme_multipath_namespace(nvme[1], subsystem=0, controller=2, numbers="259:1", nsid=2,
                                            path_links=path_links)
    host.add_partition(own, 1, "259:2")
    mount(host, "259:0", "/dev/nvme0n1")
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: its block device nvme0n1 \(259:0; NVMe multipath, "
                                              r"through its path nvme0c1n1\) is mounted"):
        check(pci, nvme[0])
    check(pci, nvme[1])  # its namespace (and the partition on it) is not mounted
    check(pci, nvme[2])  # no controller of it is in the subsystem


# -- a NIC function lent to vfio-pci ----------------------------------------------------------------


def add_nic(host: FakeHost) -> None:
    """An i40e PF ``ens5f0`` with one iavf VF ``ens5f0v0`` (with an RDMA device), group 30."""
    host.add_pf(NIC_PF, netdev="ens5f0", driver="i40e", bridge="0000:00:05.0", total_vfs=8)
    host.add_vfs(NIC_PF, [NIC_VF], driver="iavf", netdev_names=["ens5f0v0"], iommu_groups=[30])
    host.add_rdma(NIC_VF, "irdma1", 1)


class NicRig:
    """The pci handler's facts folded from the fake kernel's uevents and the Lent events; the
    tree built from them, as the daemon's loop builds it."""

    def __init__(self, host: FakeHost, pci: Pci) -> None:
        self.host, self.pci = host, pci
        self.configured = pci.configure(NICS)
        self.facts: PciFacts = pci.handler.scan()
        self.core = FakeDriverCore(host, drivers=("vfio-pci", "iavf"), id_table={"8086:154c": "iavf"},
                                   on_uevent=lambda event: self.post(event.event()))

    def post(self, event: UEvent | Lent) -> None:
        self.facts = self.pci.handler.fold(self.facts, event)

    def tree(self) -> DeviceTree:
        self.core.settle()
        built = self.pci.handler.build(self.facts, self.configured)
        return trees.tree(*(trees.pool(p, built[p.resource], road=DRA_ROAD) for p in self.configured))

    def iavf_let_go(self) -> None:
        """What the kernel does when iavf lets go of the VF: its interface goes."""
        self.host.remove_netdev(NIC_VF, "ens5f0v0")
        self.post(UEvent("remove", self.host.devpath(NIC_VF, "net", "ens5f0v0"), "net"))


def test_a_nic_vf_lent_to_vfio_pci_is_described_as_a_rescan_of_it_on_vfio_pci_would(
        host: FakeHost, pci: Pci) -> None:
    add_nic(host)
    rig = NicRig(host, pci)
    with rig.core:
        (pool,) = rig.tree().pools.values()
        assert pci.handler.dra_attributes(pool, NIC_VF)["netdev"] == "ens5f0v0"
        loan = pci.handler.plan_loan(pool, NIC_VF)
        rig.post(Lent("pci", loan.parts, "test"))
        lent = pci.handler.lend(pool, loan, "legacy")
        rig.iavf_let_go()
        (rebuilt,) = rig.tree().pools.values()
    device = lent.details.device
    assert (device.driver, device.netdevs, device.rdma_devices, device.has_default_route) == ("vfio-pci", (), (),
                                                                                              False)
    attributes = pci.handler.dra_attributes(replace(pool, devices={NIC_VF: lent}), NIC_VF)
    assert "netdev" not in attributes
    assert {key: attributes.get(key) for key in ("pfName", "pfPciAddress", "vfIndex", "iommuGroup", "driver",
                                                 "linkType")} == {
        "pfName": "ens5f0", "pfPciAddress": NIC_PF, "vfIndex": 0, "iommuGroup": 30, "driver": "vfio-pci",
        "linkType": "ether"}  # a VF without an interface: its PF's link type, as discovery reads it
    assert attributes == pci.handler.dra_attributes(rebuilt, NIC_VF)
    assert [spec.host_path for spec in lent.specs] == ["/dev/vfio/vfio", "/dev/vfio/30"]
    assert set(lent.details.info) == {"generic", "vfio"}


async def test_the_device_metadata_of_a_lent_nic_vf_names_no_interface(short_tmp: Path, host: FakeHost,
                                                                       pci: Pci) -> None:
    add_nic(host)
    rig = NicRig(host, pci)
    hooks = {"pci": Hooks.of(pci.handler)}
    book = ClaimBook(short_tmp / "state")
    book.load()
    plugin = short_tmp / "plugins" / DRIVER
    api = FakeApi()
    preparer = ClaimPreparer(DRIVER, NODE, short_tmp / "cdi", book, rig.tree, hooks, api.get_claim, lambda r: None,
                             post=rig.post, metadata=DeviceMetadataFiles(DRIVER, plugin, short_tmp / "cdi", hooks))
    config = [{"source": "FromClaim", "requests": ["vm"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig"}}}]
    ref = api.add(claim_json(1, "vm-1", [{"request": "vm", "driver": DRIVER, "device": device_name(NIC_VF),
                                          "pool": pool_name(NODE, "example.com/nics")}], config=config))
    with rig.core:
        answer = (await preparer.prepare([ref]))[ref.uid]
    assert answer.error is None
    assert drivers(host, NIC_VF) == ["vfio-pci"]
    (document,) = json_stream((plugin / "dra-device-metadata" / "default_vm-1" / "vm" / "metadata.json").read_text())
    (device,) = document["requests"][0]["devices"]
    assert "networkData" not in device, json.dumps(device)
    assert "netdev" not in device["attributes"]
    assert device["attributes"]["driver"] == {"string": "vfio-pci"}
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": NIC_VF}
    assert device["attributes"]["pfName"] == {"string": "ens5f0"}


# -- IPv6 default routes ------------------------------------------------------------------------------

IPV6_ROUTES = (
    # 2001:db8:1::/64 on ens1: not a default route
    f"20010db8000100000000000000000000 40 {'0' * 32} 00 {'0' * 32} 00000100 00000001 00000000 00000001     ens1\n"
    # ::/0 via fe80::1 on eno1: the default route
    f"{'0' * 32} 00 {'0' * 32} 00 fe80{'0' * 27}1 00000400 00000001 00000000 00000003     eno1\n"
    # ::/0 with RTF_UP missing (not up) on ens2
    f"{'0' * 32} 00 {'0' * 32} 00 fe80{'0' * 27}1 00000400 00000001 00000000 00000002     ens2\n"
    # the unreachable default routes the kernel keeps on lo (RTF_REJECT|RTF_NONEXTHOP, no RTF_UP), and one up
    f"{'0' * 32} 00 {'0' * 32} 00 {'0' * 32} ffffffff 00000001 00000000 00200200       lo\n"
    f"{'0' * 32} 00 {'0' * 32} 00 {'0' * 32} ffffffff 00000001 00000000 00000001       lo\n"
    # lines that are not routes: skipped
    "garbage\n"
    f"{'0' * 32} 00 {'0' * 32} 00 fe80{'0' * 27}1 00000400 00000001 00000000 nothex00     ens3\n"
)


def test_interfaces_with_an_ipv6_default_route_are_read_from_proc_net_ipv6_route(host: FakeHost) -> None:
    (host.proc / "net" / "ipv6_route").write_text(IPV6_ROUTES)
    host.add_default_route("eth0")
    assert read_default_route_interfaces(str(host.proc)) == {"eno1", "eth0"}
    (host.proc / "net" / "ipv6_route").write_bytes(b"\xff\xfe\x00 not text\n" + IPV6_ROUTES.encode())
    assert read_default_route_interfaces(str(host.proc)) == {"eno1", "eth0"}  # what is not a route is skipped
    (host.proc / "net" / "ipv6_route").unlink()  # a kernel without IPv6
    (host.proc / "net" / "route").unlink()
    assert read_default_route_interfaces(str(host.proc)) == frozenset()


def test_a_nic_carrying_only_an_ipv6_default_route_is_not_offered(host: FakeHost, pci: Pci) -> None:
    host.add_pf("0000:06:00.0", netdev="eno1", driver="ice", bridge="0000:00:06.0")
    host.add_pf("0000:07:00.0", netdev="ens7", driver="ice", bridge="0000:00:07.0")
    host.add_default_route6("eno1")
    pool = pci.pool({"resourceName": "nics", "deviceType": "netDevice", "selectors": {"drivers": ["ice"]}})
    assert sorted(pool.devices) == ["0000:07:00.0"]


def test_a_vf_carrying_an_ipv6_only_default_route_is_refused(pci: Pci, host: FakeHost, nvme: list[str]) -> None:
    host.add_netdev(nvme[1], "ens9")
    pool = pci.pool(ON_DEMAND)  # built before the route came: the check reads the routes again
    host.add_default_route6("ens9")
    with pytest.raises(AllocationError, match=rf"^{nvme[1]} carries the host's default route \(interface ens9\)"):
        pci.handler.check_loan(pci.handler.plan_loan(pool, nvme[1]))


def test_a_route_table_that_cannot_be_read_refuses_the_loan_naming_it(pci: Pci, host: FakeHost,
                                                                      nvme: list[str]) -> None:
    pool = pci.pool(ON_DEMAND)
    (host.proc / "net" / "ipv6_route").unlink()
    (host.proc / "net" / "ipv6_route").mkdir()
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: cannot tell whether the host still uses it: "
                                              r".*/net/ipv6_route: cannot read: Is a directory$"):
        pci.handler.check_loan(pci.handler.plan_loan(pool, nvme[0]))


def test_a_mount_far_down_a_long_mount_table_is_seen(pci: Pci, host: FakeHost, nvme: list[str]) -> None:
    host.add_block_device(host.device_dir(nvme[0]) / "nvme" / "nvme1" / "nvme1n1", "259:0")  # no multipath
    pods = "".join(f"{100 + n} 25 0:{50 + n} / /var/lib/kubelet/pods/{n:032x}/volumes/kubernetes.io~projected/"
                   f"kube-api-access rw,relatime shared:{n} - tmpfs tmpfs rw,size=4096k\n" for n in range(1000))
    write_file(host.proc / "1" / "mountinfo", pods + "36 25 259:0 / /data rw,relatime - ext4 /dev/nvme1n1 rw\n")
    assert len(pods) > 65536
    with pytest.raises(AllocationError, match=rf"^{nvme[0]}: its block device nvme1n1 \(259:0\) is mounted"):
        check(pci, nvme[0])

"""``devplugd explain``: for each pool of the config in order, what it did with one device and why,
through a running daemon (with its ID, health, road and holder) and without one (``--config``);
and a lease from a pool with no devices says why the pool is empty."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.daemonrun import control_cli, run_cli, wait_for_control
from tests.fakesysfs import FakeHost

PF = "0000:3b:00.0"
VFS = ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]
UPLINK = "0000:5e:00.0"
GROUPED = ["0000:af:00.0", "0000:af:00.1"]
CONFIG = {"resourceList": [
    {"resourceName": "vf_dpdk", "selectors": {"drivers": ["vfio-pci"], "pfNames": ["ens1f0#0-1"]}},
    {"resourceName": "vf_kernel", "selectors": [{"vendors": ["15b3"]}, {"drivers": ["iavf"]}]},
    {"resourceName": "vf_any", "selectors": {"pfNames": ["ens1f0"]}},
    {"resourceName": "passthrough", "deviceType": "pciDevice", "selectors": {"vendors": ["144d", "8086"]}},
    {"resourceName": "kvm", "resourcePrefix": "devplugd.io", "deviceType": "devNode",
     "selectors": {"paths": ["/dev/kvm"]}},
]}


@pytest.fixture
def explained_host(host: FakeHost) -> FakeHost:
    """Three VFs (two on vfio-pci, one on iavf), the host's uplink (a NIC carrying the default
    route), and an IOMMU group of two NVMe functions, one on vfio-pci and one still on nvme;
    no /dev/kvm."""
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12], numa_node=0)
    host.bind(VFS[2], "iavf")
    host.add_pci(UPLINK, driver="ice", bridge="0000:00:03.0")
    host.add_netdev(UPLINK, "eno1")
    host.add_default_route("eno1")
    for address, driver in zip(GROUPED, ("vfio-pci", "nvme")):
        host.add_pci(address, vendor="144d", device="a808", class_code="010802", driver=driver,
                     bridge="0000:00:04.0")
        host.set_iommu_group(address, 40)
    return host


def cli(short_tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return control_cli(short_tmp / "control.sock", *arguments)


def lines_of(answer: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert answer.returncode == 0, answer.stderr
    said = {}
    for line in answer.stdout.splitlines():
        key, _, rest = line.partition(" ") if line.startswith("=> ") else line.partition(": ")
        said[key] = rest
    return said


def test_the_daemon_names_the_first_selector_that_refuses_and_the_pool_that_offers(explained_host, short_tmp,
                                                                                     run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp / "control.sock")

    said = lines_of(cli(short_tmp, "explain", "3b:02.2"))  # the domain may be left out
    assert said["0000:3b:02.2"].startswith("PCI function 8086:154c, class 020000, driver iavf, VF 2 of ens1f0")
    assert said["pool intel.com/vf_dpdk"] == "drivers: wants [vfio-pci], device has iavf"
    assert said["pool intel.com/vf_kernel"] == ("takes it as 0000:3b:02.2 (selectors[1] admit it): Healthy, free, "
                                                "through devicePlugin")
    assert said["pool intel.com/vf_any"].startswith("its selectors admit it too, but the earlier pool "
                                                    "intel.com/vf_kernel admits it first")
    assert said["pool devplugd.io/kvm"] == "takes devNode devices, not this kind"
    assert said["=>"] == "intel.com/vf_kernel offers it as 0000:3b:02.2, Healthy, free, through devicePlugin"

    # a selector object each: the first key that refuses it in each, with the device's value
    said = lines_of(cli(short_tmp, "explain", VFS[0]))
    assert said["pool intel.com/vf_kernel"] == ("selectors[0]: vendors: wants [15b3], device has 8086; "
                                                "selectors[1]: drivers: wants [iavf], device has vfio-pci")

    # the holder comes from the daemon: a host lease
    lease = cli(short_tmp, "allocate", "intel.com/vf_dpdk", "--device", VFS[0], "--owner", "vm-7")
    assert lease.returncode == 0, lease.stderr
    answer = json.loads(cli(short_tmp, "explain", VFS[0], "-o", "json").stdout)
    taken = [pool for pool in answer["pools"] if pool["outcome"] == "took"]
    assert [pool["resource"] for pool in taken] == ["intel.com/vf_dpdk"]
    assert taken[0]["device"]["holder"] == "lease" and taken[0]["device"]["owner"] == "vm-7"
    assert taken[0]["allocation_api"] == "devicePlugin"
    assert [pool["resource"] for pool in answer["pools"]] == [
        "intel.com/vf_dpdk", "intel.com/vf_kernel", "intel.com/vf_any", "intel.com/passthrough", "devplugd.io/kvm"]


def test_a_device_nobody_offers_says_why(explained_host, short_tmp, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp / "control.sock")

    said = lines_of(cli(short_tmp, "explain", GROUPED[0]))
    assert said["pool intel.com/passthrough"] == (
        "left out: its selectors admit it, but its IOMMU group 40 is not viable: 0000:af:00.1 is bound to nvme "
        "(every function of a group must be on vfio-pci, pci-stub or no driver)")
    assert said["=>"].startswith("no pool offers it: intel.com/passthrough: its selectors admit it, but its IOMMU")

    said = lines_of(cli(short_tmp, "explain", "eno1"))  # a netdev names its function
    assert said["pool intel.com/vf_dpdk"] == "it carries the host's default route (the uplink is never offered)"
    assert said["pool intel.com/passthrough"] == "it carries the host's default route (the uplink is never offered)"

    said = lines_of(cli(short_tmp, "explain", "/dev/kvm"))
    assert said["/dev/kvm"] == "no character or block device node /dev/kvm on this host"
    assert said["pool devplugd.io/kvm"] == ("left out: its selectors would take /dev/kvm, but this host has no such "
                                            "node (under --dev-root)")
    assert said["=>"] == ("no pool offers it: devplugd.io/kvm: its selectors would take /dev/kvm, but this host has "
                          "no such node (under --dev-root)")

    unknown = cli(short_tmp, "explain", "0000:99:00.0")
    assert unknown.returncode == 0, unknown.stderr
    assert "devplugd sees no device '0000:99:00.0'" in unknown.stdout


def test_a_lease_from_a_pool_with_no_devices_says_the_host_has_none(explained_host, short_tmp, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp / "control.sock")
    refused = cli(short_tmp, "allocate", "devplugd.io/kvm")
    assert refused.returncode == 1
    assert refused.stderr.strip() == ("devplugd: devplugd.io/kvm has no devices on this host: this host has no "
                                      "device node its paths name (/dev/kvm) (1 requested)")
    # list shows the empty pool with the same reason, where it showed nothing
    listed = cli(short_tmp, "list")
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith("devplugd.io/kvm")]
    assert row.endswith("no devices: this host has no device node its paths name (/dev/kvm)")
    pools = {pool["resource"]: pool for pool in json.loads(cli(short_tmp, "list", "-o", "json").stdout)}
    assert pools["devplugd.io/kvm"]["no_devices"] == "this host has no device node its paths name (/dev/kvm)"
    assert "no_devices" not in pools["intel.com/vf_dpdk"]
    # a PCI pool whose functions earlier pools took
    assert pools["intel.com/vf_any"]["no_devices"] == ("the 3 functions its selectors match were taken by earlier "
                                                       "pools (7 PCI functions on this host)")


def test_explain_without_a_daemon_answers_from_the_config_and_a_scan(explained_host, short_tmp):
    config = short_tmp / "config.json"
    config.write_text(json.dumps(CONFIG))
    os.mknod(explained_host.dev / "kvm", 0o660 | stat.S_IFCHR, os.makedev(10, 232))
    roots = ["--sysfs-root", str(explained_host.sys), "--dev-root", str(explained_host.dev),
             "--proc-root", str(explained_host.proc)]

    said = lines_of(run_cli("explain", "--config", str(config), *roots, "3b:02.2"))
    assert said["pool intel.com/vf_dpdk"] == "drivers: wants [vfio-pci], device has iavf"
    assert said["pool intel.com/vf_kernel"] == ("takes it as 0000:3b:02.2 (selectors[1] admit it): Healthy, "
                                                "through devicePlugin")

    said = lines_of(run_cli("explain", "--config", str(config), *roots, "/dev/kvm"))
    assert said["/dev/kvm"].startswith("char device node 10:232")
    assert said["pool devplugd.io/kvm"] == "takes it as kvm (its selectors take it): Healthy, through devicePlugin"
    assert said["pool intel.com/vf_dpdk"] == "takes netDevice devices, not this kind"

    bad = run_cli("explain", "--config", str(short_tmp / "missing.json"), "3b:02.2")
    assert bad.returncode == 2 and "missing.json" in bad.stderr


def test_explain_exits_3_when_no_daemon_runs(short_tmp):
    answer = cli(short_tmp, "explain", VFS[0])
    assert answer.returncode == 3
    assert "devplugd is not running" in answer.stderr

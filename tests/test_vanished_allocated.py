"""The real daemon on a fake host: a VF that vanishes while a pod holds it (the kubelet's
checkpoint names it) stays in the kubelet's list, Unhealthy, until the checkpoint lets it go;
one nobody holds leaves at once."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from tests.daemonrun import control_cli
from tests.fakesysfs import FakeHost
from tests.kubelet import CHECKPOINT, FakeKubelet
from tests.seam import PF, Seam, remove_vf, run_with_seam, vf_address
from tests.waiting import wait_until

DPDK = "intel.com/dpdk"
VFS = [vf_address(n) for n in range(4)]
CONFIG = {"resourceList": [
    {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}},
    {"resourceName": "kernel", "selectors": {"drivers": ["iavf"]}},
]}


@pytest.fixture
def sriov(host: FakeHost) -> FakeHost:
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12, 13], numa_node=0)
    return host


def wait_for_list(kubelet: FakeKubelet, expected: dict[str, str], resource: str = DPDK) -> None:
    """Until the stand-in's list of ``resource`` is exactly ``expected`` (ID -> health)."""
    kubelet.wait_for(lambda k: {i: h for i, (h, _) in k.state(resource).devices.items()} == expected,
                     what=f"{resource} listed as {expected}")


def listed(short_tmp: Path) -> dict[str, dict]:
    pools = json.loads(control_cli(short_tmp / "control.sock", "list", "-o", "json").stdout)
    return {d["id"]: d for p in pools if p["resource"] == DPDK for d in p["devices"]}


def cdi_devices(short_tmp: Path) -> list[str]:
    spec = short_tmp / "cdi" / "devplugd-intel.com-dpdk.json"
    return [d["name"] for d in json.loads(spec.read_text())["devices"]] if spec.exists() else []


def test_a_vf_removed_while_allocated_stays_unhealthy_until_the_checkpoint_lets_it_go(
        sriov, short_tmp, kubelet, run_daemon, seam: Seam):
    run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices(DPDK, 4)
    kubelet.allocate(DPDK, [VFS[1]])
    kubelet.write_checkpoint({DPDK: [VFS[1]]})
    assert remove_vf(sriov, seam, 1) == VFS[1]
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[1]: "Unhealthy", VFS[2]: "Healthy", VFS[3]: "Healthy"})
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(DPDK, [VFS[1]])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert listed(short_tmp)[VFS[1]] == {"id": VFS[1], "health": "Unhealthy", "holder": "kubelet",
                                         "owner": "pod uid-1/app", "numa_nodes": [0]}
    lease = control_cli(short_tmp / "control.sock", "allocate", DPDK, "--device", VFS[1], "--owner", "vm")
    assert lease.returncode == 1 and "is gone" in lease.stderr
    wait_until(lambda: cdi_devices(short_tmp) == [VFS[0], VFS[2], VFS[3]], 10, "the CDI spec without the VF")
    kubelet.write_checkpoint({})  # the pod went away
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[2]: "Healthy", VFS[3]: "Healthy"})
    assert VFS[1] not in listed(short_tmp)


def test_a_vf_removed_while_nobody_holds_it_leaves_at_once(sriov, short_tmp, kubelet, run_daemon, seam: Seam):
    run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices(DPDK, 4)
    kubelet.write_checkpoint({DPDK: [VFS[0]]})
    assert remove_vf(sriov, seam, 2) == VFS[2]
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[1]: "Healthy", VFS[3]: "Healthy"})


def test_a_corrupt_checkpoint_is_logged_and_the_vanished_vf_stays_listed(
        sriov, short_tmp, kubelet, run_daemon, seam: Seam):
    daemon = run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices(DPDK, 4)
    kubelet.write_checkpoint({DPDK: [VFS[3]]})
    remove_vf(sriov, seam, 3)
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[1]: "Healthy", VFS[2]: "Healthy", VFS[3]: "Unhealthy"})
    (short_tmp / "device-plugins" / CHECKPOINT).write_text('{"Data": {"PodDeviceEntries": [')
    daemon.wait_for_log("cannot read the kubelet checkpoint")
    remove_vf(sriov, seam, 2)  # still serving; who held this one is unknown now: kept visible, Unhealthy
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[1]: "Healthy", VFS[2]: "Unhealthy", VFS[3]: "Unhealthy"})
    kubelet.write_checkpoint({DPDK: [VFS[3]]})
    wait_for_list(kubelet, {VFS[0]: "Healthy", VFS[1]: "Healthy", VFS[3]: "Unhealthy"})
    assert daemon.process.poll() is None and "Traceback" not in daemon.log


def test_a_vf_unbound_from_vfio_while_allocated_stays_unhealthy_in_its_pool(
        sriov, short_tmp, kubelet, run_daemon, seam: Seam):
    """It leaves the pool its pod took it from (rebound to iavf): that pool keeps it Unhealthy
    while the pod holds it there; the kernel pool gets it as a fresh, healthy device."""
    run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices(DPDK, 4)
    kubelet.write_checkpoint({DPDK: [VFS[0]]})
    sriov.unbind(VFS[0])
    seam.send("unbind", sriov.devpath(VFS[0]), "pci")
    sriov.bind(VFS[0], "iavf")
    sriov.add_netdev(VFS[0], "ens1f0v0")
    seam.send("add", sriov.devpath(VFS[0], "net", "ens1f0v0"), "net", INTERFACE="ens1f0v0")
    seam.send("bind", sriov.devpath(VFS[0]), "pci", DRIVER="iavf")
    wait_for_list(kubelet, {VFS[0]: "Healthy"}, "intel.com/kernel")
    wait_for_list(kubelet, {VFS[0]: "Unhealthy", VFS[1]: "Healthy", VFS[2]: "Healthy", VFS[3]: "Healthy"})
    kubelet.write_checkpoint({})
    wait_for_list(kubelet, {VFS[1]: "Healthy", VFS[2]: "Healthy", VFS[3]: "Healthy"})

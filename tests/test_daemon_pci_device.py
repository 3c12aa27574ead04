"""The real daemon serving ``pciDevice`` pools to the kubelet stand-in: bind uevents bring a
function in, GetPreferredAllocation is offered only with a policy, a bad policy on reload is
refused while the old pools stay served."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from tests.daemonrun import DaemonProcess
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.pci import add_nvme_pf
from tests.seam import Seam, run_with_seam

PF_A, PF_B = "0000:01:00.0", "0000:02:00.0"


def vfio_bound(count: int, bound: int) -> list[str | None]:
    """Drivers for ``count`` VFs: the first ``bound`` on vfio-pci, the rest unbound."""
    return ["vfio-pci"] * bound + [None] * (count - bound)


CONFIG = {"resourceList": [
    {"resourceName": "nvme_a", "deviceType": "pciDevice", "allocationPolicy": "packed",
     "selectors": {"classes": ["0108"], "rootDevices": [PF_A]}},
    {"resourceName": "nvme_rest", "deviceType": "pciDevice", "selectors": {"classes": ["0108"]}},
]}


def two_pf_config(policy: str | None) -> dict[str, Any]:
    pool: dict[str, Any] = {"resourceName": "nvme", "deviceType": "pciDevice", "selectors": {"classes": ["0108"]}}
    if policy is not None:
        pool["allocationPolicy"] = policy
    return {"resourceList": [pool]}


def start(run_daemon: Callable[..., DaemonProcess], seam: Seam, config: dict[str, Any] = CONFIG) -> DaemonProcess:
    return run_with_seam(run_daemon, seam, config)


def test_a_bind_uevent_brings_a_vf_in_with_its_group(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam
) -> None:
    vfs = add_nvme_pf(host, PF_A, vfio_bound(3, 1), first_group=10)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/nvme_a", 1)
    host.bind(vfs[2], "vfio-pci")
    seam.send("bind", host.devpath(vfs[2]), "pci", DRIVER="vfio-pci", PCI_SLOT_NAME=vfs[2])
    state = kubelet.wait_for_devices("intel.com/nvme_a", 2)
    assert state.healthy == {vfs[0], vfs[2]}
    response = kubelet.allocate("intel.com/nvme_a", [vfs[2]])
    specs = [(spec.container_path, spec.host_path) for spec in response.container_responses[0].devices]
    assert specs == [("/dev/vfio/vfio", "/dev/vfio/vfio"), ("/dev/vfio/12", "/dev/vfio/12")]
    assert response.container_responses[0].envs["PCIDEVICE_INTEL_COM_NVME_A"] == vfs[2]
    host.unbind(vfs[0])
    seam.send("unbind", host.devpath(vfs[0]), "pci", PCI_SLOT_NAME=vfs[0])
    assert kubelet.wait_for_devices("intel.com/nvme_a", 1).healthy == {vfs[2]}


def test_preferred_allocation_is_offered_only_with_a_policy(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam
) -> None:
    add_nvme_pf(host, PF_A, vfio_bound(4, 4), first_group=10)
    vfs_b = add_nvme_pf(host, PF_B, vfio_bound(4, 4), first_group=20)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/nvme_a", 4)
    kubelet.wait_for_devices("intel.com/nvme_rest", 4)
    assert kubelet.offers_preferred_allocation("intel.com/nvme_a")
    assert not kubelet.offers_preferred_allocation("intel.com/nvme_rest")
    with pytest.raises(grpc.RpcError) as refused:
        request = dp.PreferredAllocationRequest(container_requests=[dp.ContainerPreferredAllocationRequest(
            available_deviceIDs=vfs_b, allocation_size=1)])
        kubelet.call("intel.com/nvme_rest", "GetPreferredAllocation", request)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_packed_fills_one_pf_and_spread_alternates_as_the_kubelet_asks(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam, short_tmp: Path
) -> None:
    vfs_a = add_nvme_pf(host, PF_A, vfio_bound(4, 4), first_group=10)
    vfs_b = add_nvme_pf(host, PF_B, vfio_bound(4, 4), first_group=20)
    daemon = start(run_daemon, seam, two_pf_config("packed"))
    kubelet.wait_for_devices("intel.com/nvme", 8)
    assert kubelet.offers_preferred_allocation("intel.com/nvme")
    every = vfs_a + vfs_b
    # Case B, nothing reused: two devices from one PF (ties: lower PCI address), in any order asked
    assert kubelet.preferred_allocation("intel.com/nvme", every[::-1], [], 2) == vfs_a[:2]
    # one reused device of PF B: the rest comes from PF B too
    assert kubelet.preferred_allocation("intel.com/nvme", every, [vfs_b[3]], 3) == [vfs_b[3], *vfs_b[:2]]
    # PF A fully free, PF B with two free: one device comes from the fuller PF B, keeping A whole
    assert kubelet.preferred_allocation("intel.com/nvme", vfs_a + vfs_b[2:], [], 1) == [vfs_b[2]]

    # packed -> spread: the option stays on, so the same registration answers with the new policy
    (short_tmp / "config-0.json").write_text(json.dumps(two_pf_config("spread")))
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for_log("config reloaded")
    assert kubelet.preferred_allocation("intel.com/nvme", every, [], 4) == [vfs_a[0], vfs_b[0], vfs_a[1], vfs_b[1]]
    assert kubelet.state("intel.com/nvme").registrations == 1


def test_a_policy_removed_on_reload_is_no_longer_offered(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam, short_tmp: Path
) -> None:
    add_nvme_pf(host, PF_A, vfio_bound(2, 2), first_group=10)
    daemon = start(run_daemon, seam, two_pf_config("packed"))
    kubelet.wait_for_devices("intel.com/nvme", 2)
    assert kubelet.offers_preferred_allocation("intel.com/nvme")
    (short_tmp / "config-0.json").write_text(json.dumps(two_pf_config(None)))
    daemon.process.send_signal(signal.SIGHUP)
    kubelet.wait_for(lambda k: k.state("intel.com/nvme").registrations == 2 and k.state("intel.com/nvme").connected,
                     what="re-registered after the reload")
    assert not kubelet.offers_preferred_allocation("intel.com/nvme")
    assert "options of intel.com/nvme changed: serving it again" in daemon.log
    (short_tmp / "config-0.json").write_text(json.dumps(two_pf_config(None)))
    daemon.process.send_signal(signal.SIGHUP)  # the same options again: nothing to redo
    daemon.wait_until(lambda: daemon.log.count("config reloaded") >= 2, "the second reload")
    assert kubelet.state("intel.com/nvme").registrations == 2
    # A needless re-registration would follow that reload; a reload that does change the options
    # comes after it, so once the kubelet sees the policy back, it has seen that one (or none).
    (short_tmp / "config-0.json").write_text(json.dumps(two_pf_config("packed")))
    daemon.process.send_signal(signal.SIGHUP)
    kubelet.wait_for(lambda k: k.offers_preferred_allocation("intel.com/nvme") and k.state("intel.com/nvme").connected,
                     what="re-registered with the policy back")
    assert kubelet.state("intel.com/nvme").registrations == 3


def test_an_unknown_policy_on_reload_is_refused_and_the_pools_stay(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam, short_tmp: Path
) -> None:
    vfs = add_nvme_pf(host, PF_A, vfio_bound(2, 1), first_group=10)
    daemon = start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/nvme_a", 1)
    broken = json.loads(json.dumps(CONFIG))
    broken["resourceList"][0]["allocationPolicy"] = "random"
    (short_tmp / "config-0.json").write_text(json.dumps(broken))
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for_log("config reload refused, still serving the previous config")
    assert "$.resourceList[0].allocationPolicy: unknown allocation policy 'random'" in daemon.log
    host.bind(vfs[1], "vfio-pci")
    seam.send("bind", host.devpath(vfs[1]), "pci", DRIVER="vfio-pci")
    kubelet.wait_for_devices("intel.com/nvme_a", 2)
    assert kubelet.offers_preferred_allocation("intel.com/nvme_a")


def test_a_group_changed_without_a_uevent_is_handed_out_fresh_and_read_into_cdi(
    host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    vfs = add_nvme_pf(host, PF_A, vfio_bound(2, 2), first_group=10)
    daemon = run_daemon(two_pf_config(None), "--uevent-source", "none", "--cdi")
    kubelet.wait_for_devices("intel.com/nvme", 2)
    spec_file = short_tmp / "cdi" / "devplugd-intel.com-nvme.json"
    host.set_iommu_group(vfs[0], 31)  # no uevent source at all: only Allocate can notice
    answer = kubelet.allocate("intel.com/nvme", vfs).container_responses[0]
    assert [spec.host_path for spec in answer.devices] == ["/dev/vfio/vfio", "/dev/vfio/31", "/dev/vfio/11"]
    assert [cdi.name for cdi in answer.cdi_devices] == [f"intel.com/nvme={vfs[1]}"]
    daemon.wait_until(lambda: "/dev/vfio/31" in (spec_file.read_text() if spec_file.exists() else ""),
                      "the CDI spec following the new group")
    assert "/dev/vfio/10" not in spec_file.read_text()
    assert "IOMMU group changed from 10 to 31" in daemon.log
    again = kubelet.allocate("intel.com/nvme", vfs).container_responses[0]
    assert [cdi.name for cdi in again.cdi_devices] == [f"intel.com/nvme={vf}" for vf in vfs]

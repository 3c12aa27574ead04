"""The real daemon serving auxNetDevice pools (Mellanox/NVIDIA scalable functions) to the kubelet
stand-in: SFs created, bound, unbound and removed on a fake sysfs (tests/auxsysfs.py), their
uevents sent in the kernel's order through the unix seam; a bad ``auxTypes`` at start exits 2
naming its JSON path, and on reload is refused while the pools stay served."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon.core import UEvent
from tests.auxpools import add_sf, bind_sf, remove_sf, unbind_sf
from tests.auxsysfs import AuxTree
from tests.daemonrun import DaemonProcess
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import Seam, run_with_seam
from tests.waiting import wait_until

PF = "0000:03:00.0"
SFS, RDMA = "nvidia.com/bf_sfs", "nvidia.com/rdma_sfs"
CONFIG: dict[str, Any] = {"resourceList": [
    {"resourceName": "bf_sfs", "resourcePrefix": "nvidia.com", "deviceType": "auxNetDevice",
     "selectors": [{"pfNames": ["p0#1-4"], "auxTypes": ["sf"]}], "additionalInfo": {"*": {"site": "rack12"}}},
    {"resourceName": "rdma_sfs", "resourcePrefix": "nvidia.com", "deviceType": "auxNetDevice",
     "selectors": {"auxTypes": ["sf"], "isRdma": True}},
]}


@pytest.fixture
def tree(host: FakeHost) -> AuxTree:
    """A BlueField-2 PF in switchdev mode (uplink ``p0``) with SF 1 (``mlx5_core.sf.1``) bound and SF 9
    (``mlx5_core.sf.2``, RDMA ``mlx5_1``: uverbs1) bound."""
    tree = AuxTree(host)
    tree.add_mlx5_pf(PF, uplink="p0", rdma="mlx5_0", device="a2d6", numa_node=1)
    tree.add_sf(PF, 1, netdev="en3f0pf0sf1")
    tree.add_sf(PF, 9, netdev="en3f0pf0sf9", rdma="mlx5_1")
    return tree


def send(seam: Seam, events: Iterable[UEvent]) -> None:
    for event in events:
        properties = {k: v for k, v in event.properties.items() if k not in ("ACTION", "DEVPATH", "SUBSYSTEM")}
        seam.send(event.action, event.devpath, event.subsystem, **properties)


def listed(kubelet: FakeKubelet, resource: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    return dict(kubelet.state(resource).devices)


def wait_for_list(kubelet: FakeKubelet, resource: str, expected: set[str]) -> None:
    kubelet.wait_for(lambda k: k.state(resource).connected and set(listed(k, resource)) == expected,
                     what=f"{resource} listed as {sorted(expected)}")


def test_sfs_join_when_bound_leave_when_unbound_or_removed_and_allocate_gives_the_envs(
        tree: AuxTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam) -> None:
    run_with_seam(run_daemon, seam, CONFIG)
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1"})
    wait_for_list(kubelet, RDMA, {"mlx5_core.sf.2"})  # sfnum 9: outside p0#1-4, so the second pool's
    assert listed(kubelet, SFS) == {"mlx5_core.sf.1": ("Healthy", (1,))}

    name, added = add_sf(tree, PF, 3, netdev="en3f0pf0sf3", bound=False)
    assert name == "mlx5_core.sf.3"
    send(seam, added)
    unbound = tree.aux_uevent("change", name)  # a later event of the SF, still unbound: still not offered
    send(seam, [unbound])
    send(seam, bind_sf(tree, name))
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1", name})

    answer = kubelet.allocate(SFS, [name, "mlx5_core.sf.1"]).container_responses[0]
    assert list(answer.devices) == [] and list(answer.mounts) == []
    assert dict(answer.envs) == {
        "PCIDEVICE_NVIDIA_COM_BF_SFS": "mlx5_core.sf.3,mlx5_core.sf.1",
        "PCIDEVICE_NVIDIA_COM_BF_SFS_INFO":
            '{"mlx5_core.sf.1":{"extra":{"site":"rack12"},"generic":{"deviceID":"mlx5_core.sf.1"}},'
            '"mlx5_core.sf.3":{"extra":{"site":"rack12"},"generic":{"deviceID":"mlx5_core.sf.3"}}}'}
    rdma = kubelet.allocate(RDMA, ["mlx5_core.sf.2"]).container_responses[0]
    assert [spec.host_path for spec in rdma.devices] == [
        "/dev/infiniband/issm1", "/dev/infiniband/umad1", "/dev/infiniband/uverbs1", "/dev/infiniband/rdma_cm"]
    assert json.loads(rdma.envs["PCIDEVICE_NVIDIA_COM_RDMA_SFS_INFO"])["mlx5_core.sf.2"]["rdma"]["rdma_dev"] == "mlx5_1"

    send(seam, unbind_sf(tree, name))
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1"})
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(SFS, [name])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    send(seam, bind_sf(tree, name))
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1", name})
    send(seam, remove_sf(tree, name))
    send(seam, remove_sf(tree, "mlx5_core.sf.2"))
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1"})
    wait_for_list(kubelet, RDMA, set())


@pytest.mark.parametrize(("selectors", "json_path"), [
    ({"pfNames": ["p0"]}, "$.resourceList[0].selectors.auxTypes"),
    ([{"auxTypes": ["sf"]}, {"auxTypes": ["sf", "eth"]}], "$.resourceList[0].selectors[1].auxTypes[1]"),
])
def test_a_bad_aux_types_makes_the_daemon_exit_2_naming_the_json_path(
        tree: AuxTree, run_daemon: Callable[..., DaemonProcess], selectors: Any, json_path: str) -> None:
    config = {"resourceList": [{"resourceName": "sfs", "deviceType": "auxNetDevice", "selectors": selectors}]}
    daemon = run_daemon(config, "--uevent-source", "none", registration="none")
    assert daemon.process.wait(30) == 2
    assert json_path in daemon.log


def test_a_bad_aux_types_on_reload_is_refused_and_the_pools_stay_served(
        tree: AuxTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam,
        short_tmp: Path) -> None:
    daemon = run_with_seam(run_daemon, seam, CONFIG)
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1"})
    broken = json.loads(json.dumps(CONFIG))
    broken["resourceList"][0]["selectors"][0]["auxTypes"] = ["sf", "vnet"]
    (short_tmp / "config-0.json").write_text(json.dumps(broken))
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for_log("config reload refused, still serving the previous config")
    assert "$.resourceList[0].selectors[0].auxTypes[1]: 'vnet' is not a supported auxiliary device type" in daemon.log
    name, added = add_sf(tree, PF, 2, netdev="en3f0pf0sf2")
    send(seam, added)
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1", name})  # the old pools still follow the kernel
    assert kubelet.state(SFS).connected and kubelet.state(SFS).registrations == 1
    assert daemon.process.poll() is None


def test_cdi_specs_and_names_of_sfs_use_upstreams_net_sf_kind(
        tree: AuxTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam,
        short_tmp: Path) -> None:
    """As the SR-IOV plugin's CDI mode names them: kind ``<prefix>/net-sf`` for every auxNetDevice
    pool of that prefix, each pool in its own spec file."""
    run_daemon(CONFIG, "--uevent-source", f"unix:{seam.path}", "--cdi")
    seam.wait_ready()
    wait_for_list(kubelet, SFS, {"mlx5_core.sf.1"})
    wait_for_list(kubelet, RDMA, {"mlx5_core.sf.2"})
    answer = kubelet.allocate(SFS, ["mlx5_core.sf.1"]).container_responses[0]
    assert [device.name for device in answer.cdi_devices] == ["nvidia.com/net-sf=mlx5_core.sf.1"]

    def specs() -> dict[str, Any]:
        return {path.name: json.loads(path.read_text()) for path in sorted((short_tmp / "cdi").glob("devplugd-*.json"))}

    wait_until(lambda: len(specs()) == 2, what=lambda: f"two CDI specs, found {sorted(specs())}")
    written = specs()
    assert {spec["kind"] for spec in written.values()} == {"nvidia.com/net-sf"}
    assert sorted(device["name"] for spec in written.values() for device in spec["devices"]) == [
        "mlx5_core.sf.1", "mlx5_core.sf.2"]

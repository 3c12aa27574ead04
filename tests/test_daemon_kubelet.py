"""The real daemon process against the kubelet stand-in, over real unix sockets, on a fake host.

What a user with an SR-IOV network device plugin config sees: the same resources, the same
Allocate answers, registration in both modes, and a daemon that survives kubelet restarts.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import grpc
import pytest

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{n}" for n in range(8)]


def sriov_host(host: FakeHost, *, vf_driver: str = "vfio-pci") -> None:
    """One Intel PF (ens1f0, NUMA 1) with 8 VFs bound to ``vf_driver``."""
    host.add_pf(PF, netdev="ens1f0", numa_node=1)
    host.add_vfs(PF, VFS, driver=vf_driver, iommu_groups=list(range(60, 68)), numa_node=1)


SRIOV_CONFIG = {
    "resourceList": [
        {"resourceName": "dpdk_a", "selectors": {"drivers": ["vfio-pci"], "pfNames": ["ens1f0#0-3"]}},
        {"resourceName": "dpdk_b", "selectors": [{"pfNames": ["ens1f0#4,6"]}, {"rootDevices": [f"{PF}#5"]}]},
    ]
}


def test_sriov_config_yields_same_resources_and_devices(host, kubelet, run_daemon):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    dpdk_a = kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    dpdk_b = kubelet.wait_for_devices("intel.com/dpdk_b", 3)
    assert dpdk_a.devices == {vf: ("Healthy", (1,)) for vf in VFS[:4]}
    assert set(dpdk_b.devices) == {VFS[4], VFS[5], VFS[6]}
    assert dpdk_a.options == dp.DevicePluginOptions()
    assert "intel.com/sriov_dpdk" not in kubelet.resources


def test_allocate_gives_vfio_specs_envs_and_devinfo_file(host, kubelet, run_daemon, short_tmp):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    response = kubelet.allocate("intel.com/dpdk_a", [VFS[2], VFS[0]])
    (container,) = response.container_responses
    assert dict(container.envs) == {
        "PCIDEVICE_INTEL_COM_DPDK_A": f"{VFS[2]},{VFS[0]}",
        "PCIDEVICE_INTEL_COM_DPDK_A_INFO": json.dumps(
            {
                VFS[0]: {"generic": {"deviceID": VFS[0]}, "vfio": {"dev-mount": "/dev/vfio/60", "mount": "/dev/vfio/vfio"}},
                VFS[2]: {"generic": {"deviceID": VFS[2]}, "vfio": {"dev-mount": "/dev/vfio/62", "mount": "/dev/vfio/vfio"}},
            },
            separators=(",", ":"),
        ),
        # KubeVirt's variable for vfio devices from an external provider (issue 11)
        "PCI_RESOURCE_INTEL_COM_DPDK_A": f"{VFS[2]},{VFS[0]}",
    }
    specs = {(d.host_path, d.container_path, d.permissions) for d in container.devices}
    assert specs == {
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"),
        ("/dev/vfio/60", "/dev/vfio/60", "rw"),
        ("/dev/vfio/62", "/dev/vfio/62", "rw"),
    }
    assert len(container.devices) == 3
    devinfo = short_tmp / "devinfo" / f"intel.com-dpdk_a-{VFS[2]}-device.json"
    assert devinfo.read_text() == f'{{"type":"pci","version":"1.1.0","pci":{{"pci-address":"{VFS[2]}"}}}}'
    assert stat.S_IMODE(devinfo.stat().st_mode) == 0o444


@pytest.mark.parametrize(
    ("device_ids", "reason"),
    [
        (["0000:99:00.0"], "unknown device IDs for intel.com/dpdk_a: '0000:99:00.0'"),
        ([VFS[5]], "unknown device IDs"),
        ([VFS[0], VFS[0]], "requested more than once"),
        ([], "no devices_ids"),
    ],
)
def test_bad_allocate_is_refused_and_daemon_keeps_serving(host, kubelet, run_daemon, device_ids, reason):
    sriov_host(host)
    daemon = run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate("intel.com/dpdk_a", device_ids)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in refused.value.details()
    assert kubelet.allocate("intel.com/dpdk_a", [VFS[1]]).container_responses[0].envs
    assert daemon.process.poll() is None


def test_allocate_without_container_requests_is_refused(host, kubelet, run_daemon):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.call("intel.com/dpdk_a", "Allocate", dp.AllocateRequest())
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no container_requests" in refused.value.details()


def test_allocate_with_thousands_of_unknown_ids_names_a_few(host, kubelet, run_daemon):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate("intel.com/dpdk_a", [f"dev-{n}" for n in range(5000)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'dev-0'" in refused.value.details() and "and 4995 more" in refused.value.details()
    assert len(refused.value.details()) < 300


def test_kubelet_restart_is_answered_by_serving_and_registering_again(host, kubelet, run_daemon):
    sriov_host(host)
    daemon = run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    # both registered before the first restart: one still in flight would land on the new kubelet
    # and count once where the loop expects two
    kubelet.wait_for_devices("intel.com/dpdk_b", 3)
    first_endpoint = kubelet.state("intel.com/dpdk_a").endpoint
    for restart in range(3):
        kubelet.restart()
        kubelet.wait_for(
            lambda k: all(k.state(r).registrations >= restart + 2 and k.state(r).connected and len(k.state(r).devices) > 0
                          for r in ("intel.com/dpdk_a", "intel.com/dpdk_b")),
            what=f"re-registration after restart {restart + 1}",
        )
    state = kubelet.state("intel.com/dpdk_a")
    assert state.endpoint != first_endpoint  # a fresh socket name per start
    assert set(state.devices) == set(VFS[:4])
    assert Path(state.endpoint).exists()
    assert daemon.process.poll() is None


def test_daemon_started_before_the_kubelet_registers_when_it_appears(host, short_tmp, run_daemon):
    sriov_host(host)
    daemon = run_daemon(SRIOV_CONFIG)
    daemon.wait_for_log("serving intel.com/dpdk_a")
    late_kubelet = FakeKubelet(short_tmp / "device-plugins")
    try:
        late_kubelet.start()
        late_kubelet.wait_for_devices("intel.com/dpdk_a", 4)
        late_kubelet.wait_for_devices("intel.com/dpdk_b", 3)
    finally:
        late_kubelet.close()


def test_removed_socket_is_served_again(host, kubelet, run_daemon):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    Path(kubelet.state("intel.com/dpdk_a").endpoint).unlink()
    kubelet.wait_for(lambda k: k.state("intel.com/dpdk_a").registrations == 2 and k.state("intel.com/dpdk_a").connected,
                     what="re-registration after socket removal")
    assert Path(kubelet.state("intel.com/dpdk_a").endpoint).exists()


def test_watcher_mode_registers_through_plugins_registry(host, short_tmp, run_daemon):
    sriov_host(host)
    watcher_kubelet = FakeKubelet(short_tmp / "device-plugins", short_tmp / "plugins_registry")
    try:
        watcher_kubelet.start()
        daemon = run_daemon(SRIOV_CONFIG, registration="watcher")
        state = watcher_kubelet.wait_for_devices("intel.com/dpdk_a", 4)
        assert Path(state.endpoint).parent == short_tmp / "plugins_registry"
        assert watcher_kubelet.watcher_errors == []
        assert watcher_kubelet.register_errors == []  # kubelet.sock is never called in this mode
        response = watcher_kubelet.allocate("intel.com/dpdk_a", [VFS[3]])
        assert response.container_responses[0].envs["PCIDEVICE_INTEL_COM_DPDK_A"] == VFS[3]
        daemon.wait_for_log("kubelet registered intel.com/dpdk_a through plugins_registry")
        assert daemon.stop() == 0
        assert not any((short_tmp / "plugins_registry").iterdir())
    finally:
        watcher_kubelet.close()


def test_auto_mode_picks_watcher_when_plugins_registry_exists(host, short_tmp, run_daemon):
    sriov_host(host)
    (short_tmp / "plugins_registry").mkdir()
    daemon = run_daemon(SRIOV_CONFIG, registration="auto")
    daemon.wait_for_log("registration mode: watcher")
    daemon.wait_for_log("serving intel.com/dpdk_a on " + str(short_tmp / "plugins_registry"))


def test_sigterm_removes_sockets_and_devinfo_files_and_exits_0(host, kubelet, run_daemon, short_tmp):
    sriov_host(host)
    daemon = run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    kubelet.allocate("intel.com/dpdk_a", [VFS[0]])
    assert any((short_tmp / "devinfo").iterdir())
    assert daemon.stop(signal.SIGTERM) == 0
    leftover = [p.name for p in (short_tmp / "device-plugins").iterdir() if p.name.startswith("devplugd-")]
    assert leftover == []
    assert list((short_tmp / "devinfo").iterdir()) == []
    kubelet.wait_for(lambda k: not k.state("intel.com/dpdk_a").connected, what="stream ended")


def test_sigint_stops_cleanly(host, kubelet, run_daemon):
    sriov_host(host)
    daemon = run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    assert daemon.stop(signal.SIGINT) == 0


def test_stale_sockets_and_devinfo_files_from_a_previous_run_are_removed(host, kubelet, run_daemon, short_tmp):
    import socket

    sriov_host(host)
    stale = short_tmp / "device-plugins" / "devplugd-intel.com_dpdk_a-old.1.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()
    other_plugin = short_tmp / "device-plugins" / "other-plugin.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(other_plugin))
    listener.close()
    (short_tmp / "devinfo").mkdir()
    stale_devinfo = short_tmp / "devinfo" / f"intel.com-dpdk_a-{VFS[7]}-device.json"
    stale_devinfo.write_text("{}")
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    assert not stale.exists()
    assert other_plugin.exists()  # never touch another plugin's socket
    assert not stale_devinfo.exists()


def test_empty_pool_is_not_registered(host, kubelet, run_daemon):
    sriov_host(host)
    config = {"resourceList": SRIOV_CONFIG["resourceList"] + [
        {"resourceName": "nothing_here", "selectors": {"vendors": ["15b3"]}}]}
    daemon = run_daemon(config)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    daemon.wait_for_log("intel.com/nothing_here: 0 devices")
    assert "intel.com/nothing_here" not in kubelet.resources


def test_resource_prefix_flag_and_pool_override(host, kubelet, run_daemon):
    sriov_host(host)
    config = {"resourceList": [
        {"resourceName": "dpdk_a", "selectors": {"pfNames": ["ens1f0#0-3"]}},
        {"resourceName": "dpdk_b", "resourcePrefix": "example.org", "selectors": {"pfNames": ["ens1f0#4-7"]}},
    ]}
    run_daemon(config, "--resource-prefix", "corp.example.com")
    kubelet.wait_for_devices("corp.example.com/dpdk_a", 4)
    kubelet.wait_for_devices("example.org/dpdk_b", 4)
    response = kubelet.allocate("example.org/dpdk_b", [VFS[4]])
    assert "PCIDEVICE_EXAMPLE_ORG_DPDK_B" in response.container_responses[0].envs


def test_devnode_pool_offers_a_real_node_count_times(short_tmp, host, kubelet, run_daemon):
    os.makedirs(host.dev / "net", exist_ok=True)
    os.mknod(host.dev / "net" / "tun", 0o600 | stat.S_IFCHR, os.makedev(10, 200))
    config = {"resourceList": [{"resourceName": "tun", "resourcePrefix": "devices.example.com",
                                "deviceType": "devNode", "selectors": {"paths": ["/dev/net/tun"]}, "count": 5}]}
    run_daemon(config)
    state = kubelet.wait_for_devices("devices.example.com/tun", 5)
    assert sorted(state.devices) == [f"net_tun-{n}" for n in range(5)]
    response = kubelet.allocate("devices.example.com/tun", ["net_tun-1", "net_tun-3"])
    (container,) = response.container_responses
    assert [(d.host_path, d.container_path, d.permissions) for d in container.devices] == [
        ("/dev/net/tun", "/dev/net/tun", "rw")]


def test_unhealthy_and_foreign_requests_leave_other_resources_alone(host, kubelet, run_daemon):
    sriov_host(host)
    run_daemon(SRIOV_CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk_a", 4)
    kubelet.wait_for_devices("intel.com/dpdk_b", 3)
    with pytest.raises(grpc.RpcError):
        kubelet.allocate("intel.com/dpdk_b", [VFS[0]])  # belongs to dpdk_a
    assert kubelet.state("intel.com/dpdk_a").connected
    assert kubelet.state("intel.com/dpdk_b").connected

"""The real daemon reacting to events: hotplug through the uevent seam on a fake PCI host,
config reloads, and real kernel devices (zram) with real uevents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.daemonrun import REPO_ROOT, daemon_command
from tests.seam import PF, Seam, create_vfs, remove_vf, run_with_seam, vf_address

VFIO_CONFIG = {"resourceList": [
    {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}},
    {"resourceName": "kernel", "selectors": {"drivers": ["iavf"]}},
]}


def start(run_daemon, seam: Seam, config: dict = VFIO_CONFIG):
    return run_with_seam(run_daemon, seam, config)


def test_vfs_created_at_runtime_reach_the_kubelet(host, kubelet, run_daemon, seam):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)  # present at start (no daemon yet)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    added = create_vfs(host, seam, 2, 3)
    state = kubelet.wait_for_devices("intel.com/dpdk", 5)
    assert set(added) <= set(state.devices)
    response = kubelet.allocate("intel.com/dpdk", [added[0]])
    assert response.container_responses[0].envs["PCIDEVICE_INTEL_COM_DPDK"] == added[0]


def test_vf_rebound_from_vfio_to_iavf_moves_to_the_kernel_pool(host, kubelet, run_daemon, seam):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 3)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 3)
    moved = vf_address(1)
    host.unbind(moved)
    seam.send("unbind", host.devpath(moved), "pci")
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    host.bind(moved, "iavf")
    host.add_netdev(moved, "ens1f0v1")
    seam.send("add", host.devpath(moved, "net", "ens1f0v1"), "net", INTERFACE="ens1f0v1")
    seam.send("bind", host.devpath(moved), "pci", DRIVER="iavf")
    state = kubelet.wait_for_devices("intel.com/kernel", 1)
    assert set(state.devices) == {moved}
    assert moved not in kubelet.state("intel.com/dpdk").devices


def test_removed_vf_leaves_the_list_and_allocate_refuses_it(host, kubelet, run_daemon, seam):
    import grpc

    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 3)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 3)
    gone = remove_vf(host, seam, 2)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate("intel.com/dpdk", [gone])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_burst_of_256_vfs_becomes_a_few_messages(host, kubelet, run_daemon, seam):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 1)
    start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 1)
    before = len(kubelet.state("intel.com/dpdk").messages)
    create_vfs(host, seam, 1, 255)
    kubelet.wait_for_devices("intel.com/dpdk", 256)
    # Nothing more should follow the final list: one more VF after it, and its list, show that the
    # daemon got past the burst; every message before that one is the burst's.
    (marker,) = create_vfs(host, seam, 256, 1)
    state = kubelet.wait_for_devices("intel.com/dpdk", 257)
    received = list(state.messages)
    messages = received[before:next(i for i, devices in enumerate(received) if marker in devices)]
    assert len(messages[-1]) == 256
    assert len(messages) <= 8, f"{len(messages)} ListAndWatch messages for one burst"
    assert all(messages[i] != messages[i + 1] for i in range(len(messages) - 1))


def test_garbage_uevents_are_logged_and_the_daemon_keeps_serving(host, kubelet, run_daemon, seam):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 1)
    daemon = start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 1)
    seam.socket.sendto(b"\xff\xfe garbage", str(seam.path))
    seam.send("add", "/devices/pci0000:00/0000:00:02.0/0000:3b:09.7", "pci")  # path that does not exist
    seam.send("change", "/devices/virtual/net/nothing", "net")
    create_vfs(host, seam, 1, 1)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    assert daemon.process.poll() is None
    daemon.wait_for_log("devplugd.uevents")


# -- config reload ---------------------------------------------------------------------------


def test_sighup_reload_adds_withdraws_and_keeps_unchanged_streams(host, kubelet, run_daemon, seam, short_tmp):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 4)
    config = {"resourceList": [
        {"resourceName": "stay", "selectors": {"pfNames": ["ens1f0#0-1"]}},
        {"resourceName": "leave", "selectors": {"pfNames": ["ens1f0#2"]}},
    ]}
    daemon = start(run_daemon, seam, config)
    kubelet.wait_for_devices("intel.com/stay", 2)
    leave = kubelet.wait_for_devices("intel.com/leave", 1)
    leave_socket = Path(leave.endpoint)
    stay_messages = len(kubelet.state("intel.com/stay").messages)
    config["resourceList"][1] = {"resourceName": "arrive", "selectors": {"pfNames": ["ens1f0#3"]}}
    (short_tmp / "config-0.json").write_text(json.dumps(config))
    daemon.process.send_signal(signal.SIGHUP)
    kubelet.wait_for_devices("intel.com/arrive", 1)
    kubelet.wait_for(lambda k: not k.state("intel.com/leave").connected, what="leave withdrawn")
    assert not leave_socket.exists()
    stay = kubelet.state("intel.com/stay")
    assert stay.connected and stay.registrations == 1 and len(stay.messages) == stay_messages


def test_a_broken_config_on_reload_keeps_the_old_one_served(host, kubelet, run_daemon, seam, short_tmp):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    daemon = start(run_daemon, seam)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    (short_tmp / "config-0.json").write_text('{"resourceList": [{"resourceName": "x", "deviceType": "gpu"')
    daemon.wait_for_log("config reload refused, still serving the previous config")
    assert "not valid JSON" in daemon.log
    create_vfs(host, seam, 2, 1)
    kubelet.wait_for_devices("intel.com/dpdk", 3)
    assert kubelet.state("intel.com/dpdk").connected


def test_configmap_style_symlink_swap_is_reloaded(host, kubelet, short_tmp, seam):
    """A ConfigMap volume: config.json -> ..data/config.json, ..data -> ..<timestamp>."""
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    volume = short_tmp / "cm"
    (volume / "..v1").mkdir(parents=True)
    (volume / "..v1" / "config.json").write_text(json.dumps(VFIO_CONFIG))
    (volume / "..data").symlink_to("..v1")
    (volume / "config.json").symlink_to("..data/config.json")
    log_path = short_tmp / "cm.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            daemon_command(
                "run", "--config", str(volume / "config.json"),
                "--sysfs-root", str(host.sys), "--dev-root", str(host.dev), "--proc-root", str(host.proc),
                "--device-plugin-dir", str(short_tmp / "device-plugins"), "--registration", "kubelet",
                "--devinfo-dir", str(short_tmp / "devinfo"), "--uevent-source", f"unix:{seam.path}",
                "--control-socket", str(short_tmp / "control.sock"),
                "--cdi-dir", str(short_tmp / "cdi"), "--state-dir", str(short_tmp / "state")),
            stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        kubelet.wait_for_devices("intel.com/dpdk", 2)
        renamed = {"resourceList": [{"resourceName": "dpdk_renamed", "selectors": {"drivers": ["vfio-pci"]}}]}
        (volume / "..v2").mkdir()
        (volume / "..v2" / "config.json").write_text(json.dumps(renamed))
        (volume / "..data_tmp").symlink_to("..v2")
        os.rename(volume / "..data_tmp", volume / "..data")  # the kubelet's atomic swap
        kubelet.wait_for_devices("intel.com/dpdk_renamed", 2)
        kubelet.wait_for(lambda k: not k.state("intel.com/dpdk").connected, what="old pool withdrawn")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, log_path.read_text()


# -- real kernel devices ---------------------------------------------------------------------


def test_real_zram_nodes_join_and_leave_a_devnode_pool(short_tmp, kubelet, run_daemon, zram):
    first = zram.add()  # the pool must have a device to be registered at all
    config = {"resourceList": [{"resourceName": "zram", "resourcePrefix": "devices.example.com",
                                "deviceType": "devNode", "selectors": {"paths": ["/dev/zram*"]}}]}
    run_daemon(config, "--dev-root", "/dev", "--uevent-source", "kernel")
    kubelet.wait_for(lambda k: f"zram{first}" in k.state("devices.example.com/zram").devices, what="first zram")
    second = zram.add()
    kubelet.wait_for(lambda k: f"zram{second}" in k.state("devices.example.com/zram").devices, what="hot_add")
    response = kubelet.allocate("devices.example.com/zram", [f"zram{second}"])
    assert [d.host_path for d in response.container_responses[0].devices] == [f"/dev/zram{second}"]
    zram.remove(second)
    kubelet.wait_for(lambda k: f"zram{second}" not in k.state("devices.example.com/zram").devices, what="hot_remove")

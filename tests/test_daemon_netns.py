"""Real link events and real device nodes: the daemon runs inside a network namespace we make,
where veth pairs named like the fake host's netdevs give real rtnetlink carrier changes, and a
macvtap on a veth gives a real /dev/tapN with a real uevent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemonrun import REPO_ROOT, daemon_command
from tests.fakesysfs import FakeHost

PF = "0000:3b:00.0"
VFS = ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]


def ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True)


def veth(namespace: str, name: str, up: bool = True) -> None:
    """A veth pair ``name``/``name``p in ``namespace``, both ends up (carrier present)."""
    ip("-n", namespace, "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    if up:
        ip("-n", namespace, "link", "set", name, "up")
        ip("-n", namespace, "link", "set", f"{name}p", "up")


@pytest.fixture
def daemon_in(short_tmp: Path, host: FakeHost) -> Iterator:
    processes: list[subprocess.Popen[bytes]] = []

    def start(namespace: str, config: dict, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        config_path = short_tmp / "config.json"
        config_path.write_text(json.dumps(config))
        log_path = short_tmp / "daemon.log"
        command = ["ip", "netns", "exec", namespace, *daemon_command(
            "run", "--config", str(config_path), "--sysfs-root", str(host.sys), "--dev-root", str(host.dev),
            "--proc-root", str(host.proc), "--device-plugin-dir", str(short_tmp / "device-plugins"),
            "--devinfo-dir", str(short_tmp / "devinfo"), "--registration", "kubelet", *extra,
            "--control-socket", str(short_tmp / "control.sock"),
            "--cdi-dir", str(short_tmp / "cdi"), "--state-dir", str(short_tmp / "state"))]
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        processes.append(process)
        return process, log_path

    yield start
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def health(kubelet, resource: str) -> dict[str, str]:
    return {device_id: state for device_id, (state, _) in kubelet.state(resource).devices.items()}


def test_pf_carrier_loss_makes_its_vfs_unhealthy_and_recovery_heals_them(host, kubelet, netns, daemon_in):
    veth(netns, "dpf0")  # the PF's netdev
    veth(netns, "dpv2")  # VF 2's own netdev
    host.add_pf(PF, netdev="dpf0")
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[70, 71, 72])
    host.unbind(VFS[2])
    host.bind(VFS[2], "iavf")
    host.add_netdev(VFS[2], "dpv2")
    config = {"resourceList": [
        {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}},
        {"resourceName": "kernel", "selectors": {"drivers": ["iavf"]}},
    ]}
    daemon_in(netns, config, "--uevent-source", "none")
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    kubelet.wait_for_devices("intel.com/kernel", 1)
    assert set(health(kubelet, "intel.com/dpdk").values()) == {"Healthy"}

    ip("-n", netns, "link", "set", "dpf0p", "down")  # the PF loses carrier
    kubelet.wait_for(lambda k: set(health(k, "intel.com/dpdk").values()) == {"Unhealthy"}, what="vfio VFs unhealthy")
    kubelet.wait_for(lambda k: health(k, "intel.com/kernel") == {VFS[2]: "Unhealthy"}, what="kernel VF unhealthy")
    ip("-n", netns, "link", "set", "dpf0p", "up")
    kubelet.wait_for(lambda k: set(health(k, "intel.com/dpdk").values()) == {"Healthy"}, what="vfio VFs healthy")
    kubelet.wait_for(lambda k: health(k, "intel.com/kernel") == {VFS[2]: "Healthy"}, what="kernel VF healthy")

    ip("-n", netns, "link", "set", "dpv2p", "down")  # only VF 2's own link
    kubelet.wait_for(lambda k: health(k, "intel.com/kernel") == {VFS[2]: "Unhealthy"}, what="own link down")
    assert set(health(kubelet, "intel.com/dpdk").values()) == {"Healthy"}


def test_vfio_vf_ignores_pf_link_when_the_pool_says_so(host, kubelet, netns, daemon_in):
    veth(netns, "dpf1")
    host.add_pf(PF, netdev="dpf1")
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[80, 81, 82])
    config = {"resourceList": [
        {"resourceName": "pf_blind", "checkHealthOnPf": False, "selectors": {"pciAddresses": VFS[:2]}},
        {"resourceName": "pf_watched", "selectors": {"pciAddresses": [VFS[2]]}},
    ]}
    daemon_in(netns, config, "--uevent-source", "none")
    kubelet.wait_for_devices("intel.com/pf_blind", 2)
    kubelet.wait_for_devices("intel.com/pf_watched", 1)
    messages = len(kubelet.state("intel.com/pf_blind").messages)
    ip("-n", netns, "link", "set", "dpf1p", "down")
    kubelet.wait_for(lambda k: health(k, "intel.com/pf_watched") == {VFS[2]: "Unhealthy"}, what="watched VF down")
    assert set(health(kubelet, "intel.com/pf_blind").values()) == {"Healthy"}
    assert len(kubelet.state("intel.com/pf_blind").messages) == messages


def test_macvtap_node_joins_and_leaves_a_devnode_pool(host, kubelet, netns, daemon_in):
    veth(netns, "dpm0")
    ip("-n", netns, "link", "add", "link", "dpm0", "name", "dpmt1", "type", "macvtap")
    first_tap = f"tap{_ifindex(netns, 'dpmt1')}"
    config = {"resourceList": [{"resourceName": "tap", "resourcePrefix": "devices.example.com",
                                "deviceType": "devNode", "selectors": {"paths": ["/dev/tap*"]}}]}
    daemon_in(netns, config, "--dev-root", "/dev", "--uevent-source", "kernel")
    kubelet.wait_for(lambda k: first_tap in k.state("devices.example.com/tap").devices, what=first_tap)
    ip("-n", netns, "link", "add", "link", "dpm0", "name", "dpmt2", "type", "macvtap")
    second_tap = f"tap{_ifindex(netns, 'dpmt2')}"
    kubelet.wait_for(lambda k: second_tap in k.state("devices.example.com/tap").devices, what=f"{second_tap} added")
    response = kubelet.allocate("devices.example.com/tap", [second_tap])
    assert [d.host_path for d in response.container_responses[0].devices] == [f"/dev/{second_tap}"]
    ip("-n", netns, "link", "del", "dpmt2")
    kubelet.wait_for(lambda k: second_tap not in k.state("devices.example.com/tap").devices,
                     what=f"{second_tap} removed")
    assert first_tap in kubelet.state("devices.example.com/tap").devices


def _ifindex(namespace: str, name: str) -> int:
    output = subprocess.run(["ip", "-n", namespace, "-j", "link", "show", name], check=True,
                            capture_output=True, text=True).stdout
    return int(json.loads(output)[0]["ifindex"])

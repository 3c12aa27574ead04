"""The image `make image` builds, run by a real podman exactly as deploy/daemonset.yaml runs it
(tests/e2e/daemonset.py translates the pod spec), against the kubelet stand-in on the host.

The node is a temporary directory: the kubelet's directories, CDI, device-info, NFD and the
state live below it, as the pod's hostPath volumes name them; ``/sys``, ``/dev`` and
``/run/udev`` are the host's own, read-only, as on a node. The pools are real device nodes
(``/dev/net/tun``, then ``/dev/loop-control``). The stand-in watches the node's
``plugins_registry`` like the kubelet's plugin watcher (the DaemonSet mounts it, so the daemon
registers there).

Needs root, podman, runc and debootstrap (CI installs them): missing ones fail the test.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import __version__
from tests.conftest import report_line
from tests.daemonrun import REPO_ROOT
from tests.e2e.daemonset import ConfigMapVolume, PodCommand, load_pod_spec, pod_command
from tests.e2e.package import DebBuild
from tests.kubelet import FakeKubelet
from tests.waiting import wait_until

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# This VM's podman cannot raise rlimits past the host's (runtime-notes.md); a kubelet's runtime
# gives the pod the node's own, which these are below.
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
NODE_NAME = "node-1"
FIELD_VALUES = {"spec.nodeName": NODE_NAME, "status.hostIP": "127.0.0.1",
                "metadata.uid": "0f3c2b1a-5d6e-4f70-8a9b-0c1d2e3f4a5b"}
TUN, LOOP = "devplugd.io/tun", "devplugd.io/loop_control"


def pool(name: str, path: str, count: int) -> dict[str, object]:
    return {"resourceName": name, "resourcePrefix": "devplugd.io", "deviceType": "devNode",
            "selectors": {"paths": [path]}, "count": count}


CONFIG = {"resourceList": [pool("tun", "/dev/net/tun", 2)]}
SWAPPED = {"resourceList": [pool("tun", "/dev/net/tun", 3), pool("loop_control", "/dev/loop-control", 1)]}


@dataclass
class Pod:
    name: str
    node: Path
    kubelet: FakeKubelet
    config_map: ConfigMapVolume
    command: PodCommand
    pid: int

    def podman(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*PODMAN, *argv], capture_output=True, text=True, check=check, timeout=60)

    def logs(self) -> str:
        done = self.podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def state(self, field: str) -> str:
        return self.podman("inspect", "--format", f"{{{{.State.{field}}}}}", self.name).stdout.strip()


def _build_image(request: pytest.FixtureRequest) -> str:
    build = DebBuild()
    try:
        deb = build.result()
    finally:
        build.cancel()
    done = subprocess.run([str(REPO_ROOT / "packaging" / "image" / "build")], env={**os.environ, "DEB": str(deb)},
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"packaging/image/build exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    report_line(request, f"\n{done.stdout.strip().splitlines()[-1]}")
    return f"localhost/devplugd:{__version__}"


@pytest.fixture(scope="module")
def pod(request: pytest.FixtureRequest) -> Iterator[Pod]:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    assert not missing, f"missing {missing}: apt-get install {' '.join(missing)}"
    spec = load_pod_spec()
    image = _build_image(request)
    assert spec["containers"][0]["image"] == image, "the DaemonSet runs the image make image builds"
    node = Path(tempfile.mkdtemp(prefix="ds", dir="/tmp"))
    kubelet = FakeKubelet(node / "var/lib/kubelet/device-plugins", node / "var/lib/kubelet/plugins_registry")
    kubelet.start()
    (node / "var/lib/kubelet/plugins").mkdir(parents=True)  # the kubelet makes it at start too
    config_map = ConfigMapVolume(node / "configmaps" / "devplugd-config", {"config.json": json.dumps(CONFIG)})
    name = f"devplugd-test-{secrets.token_hex(4)}"
    command = pod_command(spec, name=name, node_root=node, config_map=config_map, field_values=FIELD_VALUES)
    try:
        started = subprocess.run([*PODMAN, "run", "--detach", "--log-driver", "k8s-file", *ULIMITS, *command.argv],
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, f"podman run: {started.stderr}"
        pid = int(subprocess.run([*PODMAN, "inspect", "--format", "{{.State.Pid}}", name], capture_output=True,
                                 text=True, check=True).stdout)
        yield Pod(name, node, kubelet, config_map, command, pid)
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "20", name], capture_output=True, timeout=60)
        kubelet.close()
        shutil.rmtree(node, ignore_errors=True)


def test_the_pod_registers_its_pools_through_the_plugin_watcher_and_allocates(pod: Pod) -> None:
    state = pod.kubelet.wait_for_devices(TUN, 2, timeout=60)
    assert set(state.devices) == {"net_tun-0", "net_tun-1"}
    # the plugin watcher's way (the DaemonSet mounts plugins_registry): the registration socket
    # is the endpoint too, at the node's path of the container's socket
    assert state.endpoint == str(pod.node / "var/lib/kubelet/plugins_registry/devplugd-devplugd.io_tun.sock")
    answer = pod.kubelet.allocate(TUN, ["net_tun-1"])
    (container,) = answer.container_responses
    assert [(d.host_path, d.container_path) for d in container.devices] == [("/dev/net/tun", "/dev/net/tun")]


def test_the_liveness_probe_answers_and_metrics_count_the_pool(pod: Pod) -> None:
    pod.kubelet.wait_for_devices(TUN, 2, timeout=60)
    with urllib.request.urlopen(pod.command.liveness_url, timeout=5) as response:
        assert (response.status, response.read()) == (200, b"ok\n")
    metrics_url = pod.command.liveness_url.replace("/healthz", "/metrics")
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    assert f'devplugd_pool_devices{{resource="{TUN}"}} 2.0' in text


def test_the_readiness_probe_says_ready_once_the_pod_is_the_active_instance(pod: Pod) -> None:
    """The probe as the kubelet runs it (in the container, its environment: POD_UID): this pod's
    devplugd holds the state directory, and a pod of another UID would not be ready."""
    pod.kubelet.wait_for_devices(TUN, 2, timeout=60)
    ready = pod.podman("exec", pod.name, *pod.command.readiness, check=False)
    assert ready.returncode == 0, ready.stderr
    other = pod.podman("exec", "--env", "POD_UID=another-pod", pod.name, *pod.command.readiness, check=False)
    assert other.returncode == 1 and "is active, not this pod's devplugd" in other.stderr, other.stderr


def test_the_container_is_root_with_only_net_admin_no_new_privileges_and_a_read_only_root(
        pod: Pod, request: pytest.FixtureRequest) -> None:
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pod.pid}/status").read_text().splitlines()
                  if ":\t" in line)
    report_line(request, f"image: the pod's daemon: VmRSS {status['VmRSS'].strip()}, VmHWM {status['VmHWM'].strip()}")
    assert status["Uid"].split() == ["0"] * 4
    net_admin = 1 << 12
    assert int(status["CapEff"], 16) == net_admin and int(status["CapBnd"], 16) == net_admin
    assert status["NoNewPrivs"].strip() == "1"
    assert os.readlink(f"/proc/{pod.pid}/ns/net") == os.readlink("/proc/self/ns/net"), "the host's network"
    wrote = pod.podman("exec", pod.name, "/bin/sh", "-c", "touch /usr/lib/devplugd/x", check=False)
    assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr


def test_node_labels_and_device_info_land_on_the_nodes_paths(pod: Pod) -> None:
    features = pod.node / "etc/kubernetes/node-feature-discovery/features.d/devplugd"
    wait_until(lambda: features.exists() and "tun.count=2" in features.read_text(), timeout=30,
               what=f"{features} with the tun pool's count")
    assert pod.state("Restarting") == "false"


def test_a_configmap_update_swapping_data_reloads_the_pools_in_place(pod: Pod) -> None:
    pod.kubelet.wait_for_devices(TUN, 2, timeout=60)
    pod.config_map.update({"config.json": json.dumps(SWAPPED)})
    pod.kubelet.wait_for_devices(LOOP, 1, timeout=30)
    pod.kubelet.wait_for_devices(TUN, 3, timeout=30)
    assert re.search(r"config reloaded: 2 pools \(1 added, 0 removed\)", pod.logs()), pod.logs()[-3000:]
    assert pod.state("Pid") == str(pod.pid), "reloaded by the same process, not restarted"


def test_a_bad_configmap_update_is_refused_and_the_pools_stay_served(pod: Pod) -> None:
    pod.kubelet.wait_for_devices(LOOP, 1, timeout=60)
    pod.config_map.update({"config.json": '{"resourceList": [{"resourceName": "x", "deviceType": "nope"}]}'})
    wait_until(lambda: "config reload refused" in pod.logs(), timeout=30, what=lambda: pod.logs()[-3000:])
    assert "$.resourceList[0].selectors: is required" in pod.logs()
    assert len(pod.kubelet.state(TUN).devices) == 3 and len(pod.kubelet.state(LOOP).devices) == 1
    pod.config_map.update({"config.json": json.dumps(SWAPPED)})  # back to the good one for what follows


def test_stopping_the_pod_removes_its_sockets_from_the_node(pod: Pod) -> None:
    pod.kubelet.wait_for_devices(TUN, 3, timeout=60)
    started = time.monotonic()
    pod.podman("stop", "--time", str(pod.command.stop_timeout), pod.name)
    seconds = time.monotonic() - started
    assert pod.state("ExitCode") == "0", pod.logs()[-3000:]
    assert seconds < pod.command.stop_timeout, f"stopped by SIGKILL after {seconds:.1f} s, not by SIGTERM"
    left = [path.name for directory in ("device-plugins", "plugins_registry")
            for path in (pod.node / "var/lib/kubelet" / directory).iterdir() if path.is_socket()
            and path.name != "kubelet.sock"]
    assert left == [], left

"""A PCIe recovery of a fraction of a millisecond reaches every stream that follows the tree:
the kubelet's ListAndWatch (a device-plugin pool), the kubelet's DRA health stream (a DRA pool)
and a host ``devplugd watch``, each showing the devices Unhealthy, then Healthy again. The real
daemon, the kernel's uevents through the seam, the kubelet and API server stand-ins, on a busy
node (a kubelet checkpoint of several megabytes)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.apiserver import ApiServer
from tests.daemonrun import REPO_ROOT, DaemonProcess, daemon_command, wait_for_control
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet, busy_node_checkpoint
from tests.seam import PF, Seam, create_vfs
from tests.test_dra_daemon import DRIVER, dra_daemon
from tests.test_dra_daemon import api as api  # a fixture
from tests.test_dra_daemon import dra_kubelet as dra_kubelet  # a fixture
from tests.waiting import wait_until

RECOVERIES = 20
QAT, VFS_POOL = "intel.com/qat_pf", "intel.com/sriov_vfs"
CONFIG = {"resourceList": [
    {"resourceName": "qat_pf", "deviceType": "accelerator", "selectors": {"drivers": ["qat"]}},
    {"resourceName": "sriov_vfs", "allocationApi": "dra", "selectors": {"drivers": ["vfio-pci"]}},
]}


class HostWatch:
    """``devplugd watch -o json``, its lines collected by a thread."""

    def __init__(self, control_socket: Path) -> None:
        self.lines: list[dict[str, Any]] = []
        self._process = subprocess.Popen(daemon_command("watch", "-o", "json", "--control-socket", str(control_socket)),
                                         cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self.lines.append(json.loads(line))

    def unhealthy_since(self, start: int) -> bool:
        return any(line.get("kind") == "changed" and line["device"]["health"] == "Unhealthy"
                   for line in self.lines[start:])

    def healthy(self) -> bool:
        """Every device healthy as the snapshot and the deltas add up."""
        state: dict[tuple[str, str], str] = {}
        for line in self.lines:
            if line["kind"] == "snapshot":
                state = {(p["resource"], d["id"]): d["health"] for p in line["pools"] for d in p["devices"]}
            elif line["kind"] == "removed":
                state.pop((line["resource"], line["device"]["id"]), None)
            else:
                state[(line["resource"], line["device"]["id"])] = line["device"]["health"]
        return bool(state) and set(state.values()) == {"Healthy"}

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(10)


def recover(seam: Seam, host: FakeHost, addresses: list[str]) -> None:
    """What the kernel sends for a non-fatal error below the port, recovered in 0.3 ms."""
    for address in addresses:
        seam.send("change", host.devpath(address), "pci", ERROR_EVENT="BEGIN_RECOVERY", DEVICE_ONLINE="0",
                  PCI_SLOT_NAME=address)
    time.sleep(0.0003)
    for address in addresses:
        seam.send("change", host.devpath(address), "pci", ERROR_EVENT="SUCCESSFUL_RECOVERY", DEVICE_ONLINE="1",
                  PCI_SLOT_NAME=address)


def test_every_recovery_shows_unhealthy_then_healthy_on_listandwatch_dra_health_and_host_watch(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam,
    short_tmp: Path,
) -> None:
    host.add_pf(PF, netdev=None, class_code="120000", driver="qat")
    vfs = create_vfs(host, None, 0, 2)
    busy_node_checkpoint(short_tmp / "device-plugins")
    dra_daemon(run_daemon, seam, short_tmp, CONFIG, "--kubeconfig", str(api.kubeconfig(short_tmp / "kubeconfig")))
    dra_kubelet.wait_for_devices(QAT, 1)
    dra_kubelet.wait_for_dra(DRIVER)
    health = dra_kubelet.dra_state(DRIVER)
    wait_until(lambda: bool(health.health_messages) and len(health.health_messages[-1]) == 2,
               what="the first health report, of both VFs")
    wait_for_control(short_tmp / "control.sock")
    watch = HostWatch(short_tmp / "control.sock")
    try:
        wait_until(watch.healthy, what="devplugd watch: every device Healthy")
        for recovery in range(1, RECOVERIES + 1):
            lists, reports, lines = len(dra_kubelet.state(QAT).messages), len(health.health_messages), len(watch.lines)

            def listed_unhealthy() -> bool:
                return any("Unhealthy" in {h for h, _ in m.values()} for m in dra_kubelet.state(QAT).messages[lists:])

            def reported_unhealthy() -> bool:
                return any(r.health == "Unhealthy" for m in health.health_messages[reports:] for r in m.values())

            recover(seam, host, [PF, *vfs])
            # ListAndWatch has always shown them: its Healthy list again says both trees are out
            dra_kubelet.wait_for(lambda k: listed_unhealthy() and k.state(QAT).healthy == {PF},
                                 what=f"recovery {recovery}: ListAndWatch: the PF Unhealthy, then Healthy again")
            wait_until(lambda: reported_unhealthy() and all(
                r.health == "Healthy" for r in health.health_messages[-1].values()), interval=0.005,
                what=f"recovery {recovery}: DRA health: the VFs Unhealthy, then Healthy again")
            wait_until(lambda: watch.unhealthy_since(lines) and watch.healthy(), interval=0.005,
                       what=f"recovery {recovery}: devplugd watch: Unhealthy, then every device Healthy again")
    finally:
        watch.close()

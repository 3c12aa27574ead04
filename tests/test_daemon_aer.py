"""PCIe error recovery reaching the kubelet: the real daemon on the fake host, the uevents the
kernel sends (``change`` with ERROR_EVENT and DEVICE_ONLINE for every function below the port, in
bus-walk order: see docs/real-kernel-devices.md section 1) through the uevent seam, and the
kubelet stand-in's ListAndWatch messages over real sockets."""

from __future__ import annotations

import signal
import time

from tests.fakesysfs import FakeHost
from tests.seam import PF, Seam, create_vfs, run_with_seam

CONFIG = {"resourceList": [
    {"resourceName": "qat_pf", "deviceType": "accelerator", "selectors": {"drivers": ["qat"]}},
    {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}},
]}
UNHEALTHY, HEALTHY = "Unhealthy", "Healthy"


def setup(host: FakeHost) -> list[str]:
    host.add_pf(PF, netdev=None, class_code="120000", driver="qat")
    return create_vfs(host, None, 0, 2)


def send_error(seam: Seam, host: FakeHost, address: str, value: str, online: str) -> None:
    seam.send("change", host.devpath(address), "pci", ERROR_EVENT=value, DEVICE_ONLINE=online, DRIVER="vfio-pci",
              PCI_SLOT_NAME=address)


def healths(messages: list[dict[str, tuple[str, tuple[int, ...]]]]) -> list[set[str]]:
    return [{health for health, _ in devices.values()} for devices in messages]


def test_a_recovery_of_a_fraction_of_a_millisecond_shows_unhealthy_then_healthy(host, kubelet, run_daemon, seam):
    vfs = setup(host)
    daemon = run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices("intel.com/qat_pf", 1)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    before = {r: len(kubelet.state(r).messages) for r in ("intel.com/qat_pf", "intel.com/dpdk")}
    for address in (PF, *vfs):
        send_error(seam, host, address, "BEGIN_RECOVERY", "0")
    time.sleep(0.0003)
    for address in (PF, *vfs):
        send_error(seam, host, address, "SUCCESSFUL_RECOVERY", "1")
    for resource, count in (("intel.com/qat_pf", 1), ("intel.com/dpdk", 2)):
        kubelet.wait_for(lambda k, r=resource, n=before[resource]: UNHEALTHY in set().union(
            *healths(k.state(r).messages[n:])) and k.state(r).healthy == set(k.state(r).devices),
            what=f"{resource} Unhealthy, then Healthy")
        messages = kubelet.state(resource).messages[before[resource]:]
        seen = healths(messages)
        first_unhealthy = next(i for i, h in enumerate(seen) if UNHEALTHY in h)
        assert seen[-1] == {HEALTHY} and first_unhealthy < len(seen) - 1, messages
        assert {UNHEALTHY} in seen, f"{resource}: never all Unhealthy at once: {messages}"
        assert len(messages[-1]) == count
        assert all(messages[i] != messages[i + 1] for i in range(len(messages) - 1))
    log = daemon.log
    for address in (PF, *vfs):
        for event in ("BEGIN_RECOVERY", "SUCCESSFUL_RECOVERY"):
            assert any(f"PCI_ADDR={address}" in line and f"EVENT={event}" in line for line in log.splitlines()), \
                f"no log line for {address} {event}:\n{log}"


def test_a_failed_recovery_stays_unhealthy_until_a_re_probe_and_a_removal(host, kubelet, run_daemon, seam):
    vfs = setup(host)
    daemon = run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    for address in (PF, *vfs):
        send_error(seam, host, address, "BEGIN_RECOVERY", "0")
    for address in (PF, *vfs):
        send_error(seam, host, address, "FAILED_RECOVERY", "0")
    kubelet.wait_for(lambda k: not k.state("intel.com/dpdk").healthy and not k.state("intel.com/qat_pf").healthy,
                     what="every function Unhealthy")
    (added,) = create_vfs(host, seam, 2, 1)  # an unrelated event: a new VF
    state = kubelet.wait_for_devices("intel.com/dpdk", 3)
    assert state.healthy == {added}
    seam.send("change", host.devpath(vfs[0]), "pci")  # a plain change of a failed device
    daemon.process.send_signal(signal.SIGHUP)  # a reload builds the pools again
    daemon.wait_for_log("config reloaded")
    assert kubelet.state("intel.com/dpdk").healthy == {added}
    seam.send("bind", host.devpath(vfs[0]), "pci", DRIVER="vfio-pci")  # re-probed
    kubelet.wait_for(lambda k: k.state("intel.com/dpdk").healthy == {added, vfs[0]}, what="re-probed VF Healthy")
    daemon.wait_for_log(f"{vfs[0]}: bind after PCIe error recovery failed")
    (host.device_dir(PF) / "virtfn1").unlink()
    devpath = host.devpath(vfs[1])
    host.remove_pci(vfs[1])
    seam.send("remove", devpath, "pci")
    kubelet.wait_for(lambda k: vfs[1] not in k.state("intel.com/dpdk").devices, what="removed VF gone")
    assert kubelet.state("intel.com/qat_pf").healthy == set()  # the PF was not re-probed


def test_an_unknown_error_event_is_one_warning_and_changes_nothing(host, kubelet, run_daemon, seam):
    vfs = setup(host)
    daemon = run_with_seam(run_daemon, seam, CONFIG)
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    messages = len(kubelet.state("intel.com/dpdk").messages)
    send_error(seam, host, vfs[0], "PARTIAL_RECOVERY", "1")
    daemon.wait_for_log("unknown ERROR_EVENT='PARTIAL_RECOVERY'")
    (added,) = create_vfs(host, seam, 2, 1)  # the next event is served as usual
    state = kubelet.wait_for_devices("intel.com/dpdk", 3)
    assert state.healthy == {*vfs, added}
    assert len(state.messages) == messages + 1
    lines = [line for line in daemon.log.splitlines() if "PARTIAL_RECOVERY" in line]
    assert len(lines) == 1 and " WARNING " in lines[0] and f"PCI_ADDR={vfs[0]}" in lines[0], lines
    assert daemon.process.poll() is None

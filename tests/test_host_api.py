"""The host API and its CLI against the real daemon: inventory, leases that survive anything,
leased devices hidden from the kubelet, refusals with reasons, and Watch deltas that add up."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from daemon.holdings._slots import TwinSlots
from tests.books import book_document
from tests.daemonrun import REPO_ROOT, control_cli, daemon_command
from tests.daemonrun import wait_for_control as wait_for_control_socket
from tests.fakesysfs import FakeHost
from tests.seam import create_vfs, remove_vf, run_with_seam
from tests.waiting import wait_until

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{n}" for n in range(4)]
CONFIG = {"resourceList": [{"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}}]}


def cli(short_tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return control_cli(short_tmp / "control.sock", *arguments)


def wait_for_control(short_tmp: Path, timeout: float = 10) -> None:
    wait_for_control_socket(short_tmp / "control.sock", timeout)


@pytest.fixture
def sriov(host: FakeHost) -> FakeHost:
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12, 13], numa_node=0)
    return host


def test_list_shows_every_device_free_with_its_health(sriov, short_tmp, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    pools = json.loads(cli(short_tmp, "list", "-o", "json").stdout)
    assert pools == [{"resource": "intel.com/dpdk", "allocation_api": "devicePlugin", "devices": [
        {"id": vf, "health": "Healthy", "holder": "free", "numa_nodes": [0]} for vf in VFS]}]
    table = cli(short_tmp, "list").stdout
    assert "RESOURCE" in table and VFS[0] in table


def test_a_lease_hides_devices_from_the_kubelet_until_released(sriov, short_tmp, kubelet, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none")
    kubelet.wait_for_devices("intel.com/dpdk", 4)
    granted = cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "2", "--owner", "vm-7", "-o", "json")
    assert granted.returncode == 0, granted.stderr
    lease = json.loads(granted.stdout)
    assert {"lease", "resource", "owner", "devices", "envs", "cdi_devices"} <= lease.keys()
    assert lease["owner"] == "vm-7" and len(lease["devices"]) == 2
    assert lease["envs"]["PCIDEVICE_INTEL_COM_DPDK"] == ",".join(lease["devices"])
    assert lease["cdi_devices"] == [f"intel.com/dpdk={d}" for d in lease["devices"]]
    assert {s["container_path"] for s in lease["device_specs"]} >= {"/dev/vfio/vfio"}
    kubelet.wait_for_devices("intel.com/dpdk", 2)
    assert not set(lease["devices"]) & set(kubelet.state("intel.com/dpdk").devices)
    listed = json.loads(cli(short_tmp, "list", "-o", "json").stdout)[0]["devices"]
    held = {d["id"]: d for d in listed if d["holder"] == "lease"}
    assert set(held) == set(lease["devices"]) and all(d["lease"] == lease["lease"] for d in held.values())
    assert cli(short_tmp, "release", lease["lease"]).returncode == 0
    kubelet.wait_for_devices("intel.com/dpdk", 4)
    again = cli(short_tmp, "release", lease["lease"])
    assert again.returncode == 1 and "no lease" in again.stderr


@pytest.mark.parametrize(("arguments", "reason"), [
    (("allocate", "intel.com/nothing"), "no resource 'intel.com/nothing'"),
    (("allocate", "intel.com/dpdk", "-n", "9"), "9 devices of intel.com/dpdk requested, 4 free"),
    (("allocate", "intel.com/dpdk", "--device", "0000:99:00.0"), "device '0000:99:00.0' is not in intel.com/dpdk"),
    (("release", "lease-000000000000"), "no lease 'lease-000000000000'"),
])
def test_refusals_exit_1_with_the_reason(sriov, short_tmp, run_daemon, arguments, reason):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    refused = cli(short_tmp, *arguments)
    assert refused.returncode == 1
    assert reason in refused.stderr
    assert json.loads(cli(short_tmp, "leases", "-o", "json").stdout) == []


def test_a_clear_message_when_the_daemon_is_not_running(short_tmp):
    result = cli(short_tmp, "list")
    assert result.returncode == 3
    assert "devplugd is not running" in result.stderr


def test_a_device_the_kubelet_allocated_is_refused(sriov, short_tmp, kubelet, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none")
    kubelet.wait_for_devices("intel.com/dpdk", 4)
    checkpoint = {"Data": {"PodDeviceEntries": [{"PodUID": "uid-1", "ContainerName": "app",
                                                 "ResourceName": "intel.com/dpdk", "DeviceIDs": {"0": [VFS[1]]},
                                                 "AllocResp": ""}], "RegisteredDevices": {}}, "Checksum": 1}
    (short_tmp / "device-plugins" / "kubelet_internal_checkpoint").write_text(json.dumps(checkpoint))
    refused = cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[1])
    assert refused.returncode == 1
    assert f"device '{VFS[1]}' of intel.com/dpdk is held by the kubelet (pod uid-1/app)" in refused.stderr
    listed = json.loads(cli(short_tmp, "list", "-o", "json").stdout)[0]["devices"]
    assert next(d for d in listed if d["id"] == VFS[1])["holder"] == "kubelet"
    granted = json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "3", "-o", "json").stdout)
    assert VFS[1] not in granted["devices"]


def test_a_kubelet_allocate_naming_a_leased_device_is_refused_by_the_lease(sriov, short_tmp, kubelet, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none")
    kubelet.wait_for_devices("intel.com/dpdk", 4)
    lease = json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[2], "--owner", "vm-9",
                           "-o", "json").stdout)
    kubelet.wait_for_devices("intel.com/dpdk", 3)
    with pytest.raises(grpc.RpcError) as refused:  # a stale list: the kubelet names it anyway
        kubelet.allocate("intel.com/dpdk", [VFS[2]])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{VFS[2]}' is held by host lease {lease['lease']} (owner vm-9)" in refused.value.details()
    assert "unknown" not in refused.value.details()


def test_leases_survive_a_restart_and_kill_9(sriov, short_tmp, run_daemon):
    daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    leases = [json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "-o", "json").stdout) for _ in range(2)]
    assert daemon.stop() == 0
    for _ in range(3):
        daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
        wait_for_control(short_tmp)
        kept = json.loads(cli(short_tmp, "leases", "-o", "json").stdout)
        assert [x["lease"] for x in kept] == [x["lease"] for x in leases]
        assert [x["devices"] for x in kept] == [x["devices"] for x in leases]
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait()


def test_a_stopped_daemon_leaves_the_whole_lease_book_in_leases_json_for_an_earlier_devplugd(
        sriov, short_tmp, run_daemon):
    """Two grants are two writes, the second to ``leases.b.json``; a devplugd of before the
    slots (a rollback) reads only ``leases.json``, so a clean stop leaves the book whole there."""
    daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    leases = [json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "-o", "json").stdout) for _ in range(3)]
    assert (short_tmp / "state" / "leases.b.json").exists()  # the slots are in use while it runs
    assert daemon.stop() == 0
    assert not (short_tmp / "state" / "leases.b.json").exists()
    as_an_earlier_devplugd_reads_it = json.loads((short_tmp / "state" / "leases.json").read_text())
    assert sorted(x["lease"] for x in as_an_earlier_devplugd_reads_it["leases"]) == sorted(x["lease"] for x in leases)


def test_kill_9_during_grants_leaves_a_whole_lease_file(sriov, short_tmp, run_daemon):
    """Grant and release in a loop while the daemon is killed at random moments: every start
    finds a readable file, and never a device held twice."""
    for round_number in range(4):
        daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
        wait_for_control(short_tmp)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(cli, short_tmp, "allocate", "intel.com/dpdk", "-o", "json") for _ in range(4)]
            time.sleep(0.05 * (round_number + 1))
            daemon.process.send_signal(signal.SIGKILL)
            [f.result() for f in futures]
        daemon.process.wait()
        book = TwinSlots(short_tmp / "state" / "leases.json").read()
        if book.document is not None or book.problems:  # killed before the first grant: "no leases"
            document = book_document(short_tmp / "state" / "leases.json")
            devices = [d for lease in document["leases"] for d in lease["devices"]]
            assert len(devices) == len(set(devices))
        daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
        wait_for_control(short_tmp)
        for lease in json.loads(cli(short_tmp, "leases", "-o", "json").stdout):
            assert cli(short_tmp, "release", lease["lease"]).returncode == 0
        assert daemon.stop() == 0
    assert not list((short_tmp / "state").glob("leases.json.corrupt-*"))


def test_two_clients_racing_for_the_last_device_exactly_one_wins(sriov, short_tmp, run_daemon):
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    assert cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "3").returncode == 0
    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda owner: cli(short_tmp, "allocate", "intel.com/dpdk", "--owner", owner,
                                                      "-o", "json"), ["a", "b"]))
        assert sorted(r.returncode for r in results) == [0, 1]
        winner = json.loads(next(r for r in results if r.returncode == 0).stdout)
        assert "0 free" in next(r for r in results if r.returncode == 1).stderr
        assert cli(short_tmp, "release", winner["lease"]).returncode == 0


def test_a_corrupt_lease_file_is_moved_aside_and_the_daemon_starts(sriov, short_tmp, run_daemon):
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "leases.json").write_text('{"leases": [{"lease": ')
    daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    assert json.loads(cli(short_tmp, "leases", "-o", "json").stdout) == []
    assert list((short_tmp / "state").glob("leases.json.corrupt-*"))
    daemon.wait_for_log("is corrupt")


@pytest.mark.parametrize("content", [b'{"leases": [{"lease": ', b"\xff\xfe\x00 not text", b'{"version": 1}',
                                     b"[" * 200_000], ids=["torn", "not-utf8", "no-list", "nested-too-deeply"])
def test_a_lost_lease_book_holds_every_device_until_an_operator_clears_it(sriov, short_tmp, kubelet, run_daemon,
                                                                          content):
    """Nobody can tell which devices the unreadable book held: none is offered anew on any road
    (the kubelet's list, new leases) until `devplugd clear-lost leases`; then all are again."""
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "leases.json").write_bytes(content)
    daemon = run_daemon(CONFIG, "--uevent-source", "none")
    wait_for_control(short_tmp)
    (aside,) = (short_tmp / "state").glob("leases.json.corrupt-*")
    assert aside.read_bytes() == content  # kept for the operator
    # the first list the kubelet gets (a full list) is empty: nothing offered to the kubelet
    kubelet.wait_for(lambda k: "intel.com/dpdk" in k.resources and k.resources["intel.com/dpdk"].messages,
                     what="the first list")
    assert kubelet.state("intel.com/dpdk").messages[0] == {} and kubelet.state("intel.com/dpdk").devices == {}
    listed = cli(short_tmp, "list", "-o", "json")
    assert {d["holder"] for d in json.loads(listed.stdout)[0]["devices"]} == {"lost-lease-book"}
    assert f"LOST BOOK: the lease book {short_tmp / 'state' / 'leases.json'}" in listed.stderr
    assert str(aside) in cli(short_tmp, "leases").stderr
    refused = cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[0])
    assert refused.returncode == 1 and "is held by the lost lease book" in refused.stderr
    assert "devplugd clear-lost leases" in refused.stderr
    assert "0 free (4 held by a lost book)" in cli(short_tmp, "allocate", "intel.com/dpdk").stderr  # why none is
    assert daemon.process.poll() is None and "Traceback" not in daemon.log
    cleared = cli(short_tmp, "clear-lost", "leases", "--operator", "ops@node1")
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    kubelet.wait_for_devices("intel.com/dpdk", 4)
    assert cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[0]).returncode == 0
    assert {d["holder"] for d in json.loads(cli(short_tmp, "list", "-o", "json").stdout)[0]["devices"]} == {
        "free", "lease"}
    daemon.wait_for_log("cleared by ops@node1")
    assert "not lost" in cli(short_tmp, "clear-lost", "leases").stdout


def test_a_refusal_names_the_lost_book_before_an_unreadable_checkpoint(sriov, short_tmp, run_daemon):
    """Both unknowns at once (a lost lease book, a kubelet checkpoint that cannot be read): the
    refusal names the one the operator can act on, with its command."""
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "leases.json").write_bytes(b'{"leases": [{"lease": ')
    (short_tmp / "device-plugins").mkdir()
    (short_tmp / "device-plugins" / "kubelet_internal_checkpoint").write_text("{torn")
    daemon = run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    refused = cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[0])
    assert refused.returncode == 1 and "is held by the lost lease book" in refused.stderr
    assert "devplugd clear-lost leases" in refused.stderr
    cli(short_tmp, "clear-lost", "leases")
    refused = cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[0])  # the checkpoint still holds it
    assert refused.returncode == 1 and "checkpoint" in refused.stderr, refused.stderr
    assert daemon.process.poll() is None


def test_a_lease_whose_device_vanishes_is_kept_and_marked(sriov, short_tmp, run_daemon, seam):
    run_with_seam(run_daemon, seam, CONFIG, registration="none")
    wait_for_control(short_tmp)
    lease = json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[3], "-o", "json").stdout)
    assert remove_vf(sriov, seam, 3) == VFS[3]
    def kept_with_the_device_missing() -> list:
        kept = json.loads(cli(short_tmp, "leases", "-o", "json").stdout)
        return kept if kept and kept[0]["missing_devices"] == [VFS[3]] else []

    kept = wait_until(kept_with_the_device_missing, 10, "the lease marked with its missing device", interval=0.05)
    assert kept[0]["lease"] == lease["lease"]


def test_watch_deltas_under_hotplug_add_up_to_list(sriov, short_tmp, run_daemon, seam):
    run_with_seam(run_daemon, seam, CONFIG, registration="none")
    wait_for_control(short_tmp)
    watcher = subprocess.Popen(daemon_command("watch", "-o", "json", "--control-socket", str(short_tmp / "control.sock")),
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        snapshot = json.loads(watcher.stdout.readline())
        assert snapshot["kind"] == "snapshot"
        state = {(p["resource"], d["id"]): d for p in snapshot["pools"] for d in p["devices"]}
        create_vfs(sriov, seam, 4, 4)
        lease = json.loads(cli(short_tmp, "allocate", "intel.com/dpdk", "--device", VFS[0], "-o", "json").stdout)
        assert remove_vf(sriov, seam, 2) == VFS[2]
        deadline = time.monotonic() + 10
        versions = [snapshot["version"]]
        while True:
            final = {(p["resource"], d["id"]): d for p in json.loads(cli(short_tmp, "list", "-o", "json").stdout)
                     for d in p["devices"]}
            if len(final) == 7 and final[("intel.com/dpdk", VFS[0])]["holder"] == "lease" and state == final:
                break
            assert time.monotonic() < deadline, (state, final)
            line = json.loads(watcher.stdout.readline())
            versions.append(line["version"])
            key = (line["resource"], line["device"]["id"])
            if line["kind"] == "removed":
                del state[key]
            else:
                assert (line["kind"] == "added") == (key not in state), line  # never double-counted
                state[key] = line["device"]
        assert versions == sorted(versions)
        assert state[("intel.com/dpdk", VFS[0])]["lease"] == lease["lease"]
    finally:
        watcher.kill()
        watcher.wait()


def test_a_client_that_disconnects_mid_watch_changes_nothing(sriov, short_tmp, run_daemon, seam):
    daemon = run_with_seam(run_daemon, seam, CONFIG, registration="none")
    wait_for_control(short_tmp)
    for _ in range(3):
        watcher = subprocess.Popen(daemon_command("watch", "-o", "json", "--control-socket",
                                                  str(short_tmp / "control.sock")),
                                   cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        assert json.loads(watcher.stdout.readline())["kind"] == "snapshot"
        watcher.kill()
        watcher.wait()
    create_vfs(sriov, seam, 4, 1)  # a change with the dead streams' subscriptions (if any) still there
    wait_until(lambda: len(json.loads(cli(short_tmp, "list", "-o", "json").stdout)[0]["devices"]) == 5, 10,
               "the new VF listed", interval=0.05)
    assert daemon.process.poll() is None
    assert "Traceback" not in daemon.log


def test_a_lease_by_count_follows_the_pools_allocation_policy(host, short_tmp, run_daemon):
    """Packed: with PF B already half leased, two more come from PF B (not sorted order's PF A)."""
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12, 13], numa_node=0)
    pf_b, vfs_b = "0000:5e:00.0", [f"0000:5e:02.{n}" for n in range(4)]
    host.add_pf(pf_b, netdev="ens2f0", numa_node=0, bridge="0000:00:03.0")
    host.add_vfs(pf_b, vfs_b, driver="vfio-pci", iommu_groups=[20, 21, 22, 23], numa_node=0)
    config = {"resourceList": [{"resourceName": "dpdk", "allocationPolicy": "packed",
                                "selectors": {"drivers": ["vfio-pci"]}}]}
    run_daemon(config, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    first = cli(short_tmp, "allocate", "intel.com/dpdk", "--device", vfs_b[0], "--device", vfs_b[1], "-o", "json")
    assert first.returncode == 0, first.stderr
    packed = cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "2", "-o", "json")
    assert packed.returncode == 0, packed.stderr
    assert json.loads(packed.stdout)["devices"] == vfs_b[2:]


def test_a_numa_preference_takes_that_nodes_devices_first(host, short_tmp, run_daemon):
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12, 13], numa_node=0)
    pf_b, vfs_b = "0000:5e:00.0", [f"0000:5e:02.{n}" for n in range(2)]
    host.add_pf(pf_b, netdev="ens2f0", numa_node=1, bridge="0000:00:03.0")
    host.add_vfs(pf_b, vfs_b, driver="vfio-pci", iommu_groups=[20, 21], numa_node=1)
    run_daemon(CONFIG, "--uevent-source", "none", registration="none")
    wait_for_control(short_tmp)
    one = cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "1", "--numa-node", "1", "-o", "json")
    assert json.loads(one.stdout)["devices"] == vfs_b[:1], one.stderr
    more = cli(short_tmp, "allocate", "intel.com/dpdk", "-n", "3", "--numa-node", "1", "-o", "json")
    assert json.loads(more.stdout)["devices"] == [vfs_b[1], *VFS[:2]], more.stderr  # node 1 first, then the rest

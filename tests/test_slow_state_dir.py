"""A slow disk under the state directory must not stall the daemon: while a lease's write sits in
fsync for seconds, ListAndWatch changes still reach the kubelet and systemd's watchdog is still fed,
and two clients still never get one device.

The state directory is on ``slow_disk`` (tests/slowdisk.py): a real FUSE filesystem whose fsync
and fsyncdir sleep, so the daemon is blocked in the kernel exactly as on a slow disk. The delay is
switched on only once the daemon is up; every assertion is about the order of events (what
happened while a write was still in flight), not about how fast the daemon is.
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon._generated.devplugd.host.v1 import host_pb2_grpc as host_grpc
from tests.books import book_document
from tests.daemonrun import control_cli, wait_for_control
from tests.fakesysfs import FakeHost
from tests.notify import NotifySocket
from tests.seam import Seam, create_vfs
from tests.slowdisk import SlowDisk

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{n}" for n in range(4)]
CONFIG = {"resourceList": [{"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}}]}


def cli(short_tmp: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return control_cli(short_tmp / "control.sock", *arguments)

RESOURCE = "intel.com/dpdk"
DELAY = 1.5  # seconds in each fsync: a lease write (file, then directory) takes twice that
WATCHDOG_USEC = "200000"  # a ping every 100 ms


@dataclass
class Outcome:
    """One Allocate call on the host API, timed with the clock the FUSE server logs with."""

    sent: float
    returned: float
    lease: host.Lease | None
    code: grpc.StatusCode | None = None
    details: str = ""


def allocate(short_tmp: Path, owner: str, count: int = 1) -> Outcome:
    with grpc.insecure_channel(f"unix://{short_tmp / 'control.sock'}") as channel:
        stub = host_grpc.HostStub(channel)
        request = host.AllocateRequest(resource=RESOURCE, count=count, owner=owner)
        sent = time.monotonic()
        try:
            lease = stub.Allocate(request, timeout=30)
        except grpc.RpcError as error:
            return Outcome(sent, time.monotonic(), None, error.code(), error.details())
        return Outcome(sent, time.monotonic(), lease)


def lease_file(disk: SlowDisk) -> list[dict]:
    return book_document(disk.path / "leases.json")["leases"]


@pytest.fixture
def sriov(host: FakeHost) -> FakeHost:
    host.add_pf(PF, netdev="ens1f0", numa_node=0)
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12, 13], numa_node=0)
    return host


@pytest.fixture
def notify(short_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    """NOTIFY_SOCKET and WATCHDOG_USEC for the daemon that run_daemon starts next."""
    stand_in = NotifySocket(short_tmp / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(stand_in.path))
    monkeypatch.setenv("WATCHDOG_USEC", WATCHDOG_USEC)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield stand_in
    stand_in.close()


def test_list_and_watch_and_watchdog_keep_flowing_while_a_lease_write_is_in_fsync(
        slow_disk, sriov, short_tmp, kubelet, notify, run_daemon):
    seam = Seam(short_tmp / "uevents.sock")
    daemon = run_daemon(CONFIG, "--uevent-source", f"unix:{seam.path}", "--state-dir", str(slow_disk.path))
    seam.wait_ready()
    kubelet.wait_for_devices(RESOURCE, 4)
    notify.read_until(lambda m: m == "WATCHDOG=1")

    slow_disk.delay = DELAY
    with ThreadPoolExecutor(1) as pool:
        grant = pool.submit(allocate, short_tmp, "vm-1")
        write_began = slow_disk.wait_for_fsync().began  # the daemon is inside fsync(2) of the lease file
        added = create_vfs(sriov, seam, 4, 1)[0]  # a VF appears meanwhile
        kubelet.wait_for(lambda k: added in k.state(RESOURCE).devices, timeout=20,
                         what=f"a ListAndWatch list with the new VF {added}")
        outcome = grant.result(30)

    state = kubelet.state(RESOURCE)
    listed_at = next(t for t, m in zip(state.received_at, state.messages) if added in m)
    write = [f for f in slow_disk.fsyncs() if f.began >= write_began]
    pings = [t for t, m in notify.messages if m == "WATCHDOG=1"]

    def timeline() -> str:
        def at(moment: float | None) -> str:
            return "-" if moment is None else f"{moment - write_began:+.2f}s"
        lines = [f"  fsync of {f.kind} {f.path}: {at(f.began)} .. {at(f.ended)}" for f in write]
        lines.append(f"  ListAndWatch list with {added}: {at(listed_at)}")
        lines.append(f"  Allocate returned: {at(outcome.returned)}")
        lines.append(f"  WATCHDOG=1 pings: {[at(t) for t in pings if write_began - 1 <= t <= outcome.returned + 1]}")
        return "timeline (0 = the lease write's first fsync began):\n" + "\n".join(lines)

    assert outcome.lease is not None, f"the grant failed: {outcome.code} {outcome.details}\n{daemon.log}"
    granted_at = outcome.returned
    assert listed_at < granted_at, f"the kubelet heard of the new VF only after the lease write\n{timeline()}"
    assert any(f.covers(listed_at) for f in write), f"the new VF's list was not sent during an fsync\n{timeline()}"
    for fsync in write:
        if fsync.ended is not None and fsync.ended <= outcome.returned:
            during = [t for t in pings if fsync.covers(t)]
            assert len(during) >= 2, f"the watchdog went hungry during fsync of {fsync.path}\n{timeline()}"

    # Still durable: both fsyncs (the file, then its directory) were done before the answer, and
    # the file on the slow disk holds the lease.
    done = [f for f in write if f.ended is not None and f.ended <= outcome.returned]
    assert {f.kind for f in done} == {"file", "dir"}, timeline()
    saved = lease_file(slow_disk)
    assert [(x["lease"], x["devices"]) for x in saved] == [(outcome.lease.lease, list(outcome.lease.devices))]
    assert daemon.process.poll() is None


def test_two_clients_for_the_last_device_while_the_first_write_is_in_fsync_exactly_one_wins(
        slow_disk, sriov, short_tmp, run_daemon):
    daemon = run_daemon(CONFIG, "--uevent-source", "none", "--state-dir", str(slow_disk.path), registration="none")
    wait_for_control(short_tmp / "control.sock")
    held = allocate(short_tmp, "earlier", count=3)
    assert held.lease is not None, held.details
    last_free = sorted(set(VFS) - set(held.lease.devices))

    slow_disk.delay = DELAY
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(allocate, short_tmp, "a")
        in_fsync = slow_disk.wait_for_fsync()  # a's lease is being written
        second = pool.submit(allocate, short_tmp, "b").result(30)
        first = first.result(30)

    assert in_fsync.covers(second.sent), "b's request was meant to go out while a's write was in flight"
    assert first.lease is not None, f"a failed: {first.code} {first.details}\n{daemon.log}"
    assert list(first.lease.devices) == last_free
    assert second.lease is None, f"one device granted twice: a {first.lease.lease}, b {second.lease.lease}"
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (second.code, second.details)
    assert "1 devices of intel.com/dpdk requested, 0 free" in second.details

    saved = lease_file(slow_disk)
    assert sorted(x["lease"] for x in saved) == sorted([held.lease.lease, first.lease.lease])
    devices = [d for x in saved for d in x["devices"]]
    assert sorted(devices) == sorted(VFS)  # every device once, none twice
    listed = json.loads(cli(short_tmp, "list", "-o", "json").stdout)[0]["devices"]
    assert {d["id"]: d.get("lease") for d in listed}[last_free[0]] == first.lease.lease

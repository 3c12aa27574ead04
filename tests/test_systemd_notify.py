"""What the daemon tells systemd, read from a datagram socket standing in for NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemonrun import REPO_ROOT, control_cli
from tests.fakesysfs import FakeHost
from tests.notify import NotifySocket
from tests.waiting import wait_until

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{n}" for n in range(4)]
CONFIG = '{"resourceList": [{"resourceName": "a", "selectors": {"pfNames": ["ens1f0#0-1"]}},' \
         ' {"resourceName": "b", "selectors": {"pfNames": ["ens1f0#2-3"]}}]}'


@pytest.fixture
def notify(short_tmp: Path) -> Iterator[NotifySocket]:
    stand_in = NotifySocket(short_tmp / "notify.sock")
    yield stand_in
    stand_in.close()


@pytest.fixture
def start_daemon(short_tmp: Path, host: FakeHost, notify: NotifySocket) -> Iterator:
    host.add_pf(PF, netdev="ens1f0")
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[1, 2, 3, 4])
    (short_tmp / "config.json").write_text(CONFIG)
    processes: list[subprocess.Popen[bytes]] = []

    def start(**environment: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "daemon", "run", "--config", str(short_tmp / "config.json"),
                   "--sysfs-root", str(host.sys), "--dev-root", str(host.dev), "--proc-root", str(host.proc),
                   "--device-plugin-dir", str(short_tmp / "device-plugins"), "--registration", "kubelet",
                   "--devinfo-dir", str(short_tmp / "devinfo"), "--uevent-source", "none", "--control-socket", str(short_tmp / "control.sock"),
                   "--cdi-dir", str(short_tmp / "cdi"), "--state-dir", str(short_tmp / "state")]
        env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), **environment}
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                   stderr=open(short_tmp / "daemon.log", "wb"))
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ready_comes_after_every_pool_is_registered_with_the_kubelet(kubelet, notify, start_daemon):
    start_daemon()
    notify.read_until(lambda m: m == "READY=1")
    ready_at = next(t for t, m in notify.messages if m == "READY=1")
    for resource in ("intel.com/a", "intel.com/b"):
        state = kubelet.state(resource)
        assert state.registrations == 1 and state.registered_at < ready_at
    status = notify.read_until(lambda m: m.startswith("STATUS=") and "all 2 registered" in m)
    assert status == "STATUS=2 pools, 4 devices, 0 unhealthy; kubelet: all 2 registered"


def test_without_a_kubelet_ready_comes_once_serving(short_tmp, notify, start_daemon):
    start_daemon()
    notify.read_until(lambda m: m == "READY=1")
    assert len(list((short_tmp / "device-plugins").glob("devplugd-*.sock"))) == 2
    notify.read_until(lambda m: m == "STATUS=2 pools, 4 devices, 0 unhealthy; kubelet: not connected")


def test_reload_is_bracketed_by_reloading_and_ready_and_stop_says_stopping(short_tmp, notify, start_daemon):
    process = start_daemon()
    notify.read_until(lambda m: m == "READY=1")
    (short_tmp / "config.json").write_text(CONFIG.replace('"b"', '"c"'))
    process.send_signal(signal.SIGHUP)
    notify.read_until(lambda m: m == "RELOADING=1")
    reloading_index = [m for _, m in notify.messages].index("RELOADING=1")
    notify.read_until(lambda m: m == "READY=1" and [x for _, x in notify.messages].count("READY=1") >= 2)
    assert [m for _, m in notify.messages][reloading_index:].count("READY=1") >= 1
    process.send_signal(signal.SIGTERM)
    try:  # SIGTERM right after a reload started a new pool's server: it must still stop cleanly
        code = process.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError((short_tmp / "daemon.log").read_text()) from None
    assert code == 0, (short_tmp / "daemon.log").read_text()
    notify.read_until(lambda m: m == "STOPPING=1")


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T for stopped, ...); the field after the
    command name, which is in parentheses and may itself hold spaces or parentheses."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def wait_until_stopped(pid: int, stopped: bool, timeout: float = 5.0) -> None:
    """Until the process is in state T (stopped by a signal), or, with ``stopped=False``, no longer."""
    wait_until(lambda: (process_state(pid) == "T") == stopped, timeout,
               lambda: f"process {pid} in state {process_state(pid)!r}", interval=0.01)


def test_watchdog_is_fed_by_the_event_loop_and_stops_when_it_wedges(short_tmp, notify, start_daemon):
    """Wedged from outside (SIGSTOP: nothing in the daemon runs, as in a loop stuck in a call),
    the process stays, stopped; on SIGCONT the pings resume and the daemon still stops cleanly."""
    process = start_daemon(WATCHDOG_USEC="200000")
    notify.read_until(lambda m: m == "READY=1")
    notify.wait_for(lambda texts: texts[texts.index("READY=1"):].count("WATCHDOG=1") >= 5, what="pings after READY")
    texts = [m for _, m in notify.messages]
    assert texts.index("WATCHDOG=1") < texts.index("READY=1")  # fed from the start, not once ready
    assert "watchdog: pinging every 0.1s" in (short_tmp / "daemon.log").read_text()  # half of WATCHDOG_USEC
    process.send_signal(signal.SIGSTOP)
    try:
        wait_until_stopped(process.pid, True)
        assert process.poll() is None and process_state(process.pid) == "T"  # wedged, not dead
    finally:
        process.send_signal(signal.SIGCONT)
    wait_until_stopped(process.pid, False)
    resumed = len(notify.messages)
    notify.wait_for(lambda texts: texts[resumed:].count("WATCHDOG=1") >= 5, what="pings after SIGCONT")
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError((short_tmp / "daemon.log").read_text()) from None
    assert code == 0, (short_tmp / "daemon.log").read_text()
    notify.read_until(lambda m: m == "STOPPING=1")


def test_no_watchdog_pings_unless_systemd_asks(notify, start_daemon):
    start_daemon()
    notify.read_until(lambda m: m == "READY=1")
    # the watchdog task pings as soon as it runs, long before READY (see the test above): none came
    assert "WATCHDOG=1" not in [m for _, m in notify.messages]


def test_a_lost_book_is_in_the_status_line_until_it_is_cleared(short_tmp, notify, start_daemon):
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "leases.json").write_bytes(b"\xff\xfe")
    start_daemon()
    status = notify.read_until(lambda m: m.startswith("STATUS=") and "LOST BOOK" in m)
    assert status.startswith("STATUS=2 pools, 4 devices, 0 unhealthy; kubelet: ")
    assert f"; LOST BOOK: the lease book {short_tmp / 'state' / 'leases.json'} is corrupt" in status
    assert "moved aside to" in status
    cleared = control_cli(short_tmp / "control.sock", "clear-lost", "leases")
    assert cleared.returncode == 0, cleared.stderr
    notify.read_until(lambda m: m == "STATUS=2 pools, 4 devices, 0 unhealthy; kubelet: not connected")

"""Shared pieces of the benchmarks: fake hosts, the daemon process, waiting, statistics.

Nothing here asserts a timing. Failures of the daemon (exit, hang) raise ``DaemonFailure`` with
the daemon's log, which the scripts print verbatim.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
LOG_TAIL_LINES = 60


class DaemonFailure(Exception):
    """The daemon exited or did not get where it should in time; ``log`` is its whole log."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


def check_exit(code: int | None, log: str) -> None:
    """Raise DaemonFailure unless the daemon exited 0 after SIGTERM (``None``: it had to be killed)."""
    if code != 0:
        raise DaemonFailure(f"daemon exit code after SIGTERM: {code} (None = had to be killed)", log)


# -- temp dirs and fake hosts -----------------------------------------------------------------
@contextlib.contextmanager
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (unix socket paths must fit in 108 bytes), always removed."""
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def host_tmp() -> Iterator[Path]:
    """Where a fake host is built: tmpfs (/dev/shm) when there is one, always removed.

    sysfs lives in memory, and a disk-backed /tmp made building 4096 VFs take 8-50 s here
    (5 s on tmpfs). The host tree holds no sockets, so its path length does not matter.
    """
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    directory = Path(tempfile.mkdtemp(prefix="dphost", dir=parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def bytecode_env(base: Path, *, enabled: bool = True) -> dict[str, str]:
    """The daemon's environment. With ``enabled``, bytecode goes to ``base/pyc`` (outside the
    source tree) and is warmed by one ``check-config`` run, so timed starts read .pyc files as an
    installed package would. This shell sets PYTHONDONTWRITEBYTECODE=1 and the repo has no
    ``daemon/__pycache__``: without this, every start compiles the daemon's modules again.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not enabled:
        return env
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(base / "pyc")
    config = base / "warmup-config.json"
    config.write_text(json.dumps(netdevice_config([("warmup", ["ens0f0"])])))
    subprocess.run([PYTHON, "-m", "compileall", "-q", str(REPO_ROOT / "daemon")], cwd=REPO_ROOT, env=env,
                   check=False, stdout=subprocess.DEVNULL)
    subprocess.run([PYTHON, "-m", "daemon", "check-config", str(config)], cwd=REPO_ROOT, env=env,
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return env


def pf_address(pf: int) -> str:
    return f"0000:{pf + 1:02x}:00.0"


def vf_address(pf: int, vf: int) -> str:
    """VFs on the PF's bus from devfn 0x10 up, as SR-IOV NICs place them."""
    devfn = 0x10 + vf
    return f"0000:{pf + 1:02x}:{devfn >> 3:02x}.{devfn & 7}"


def pf_netdev(pf: int) -> str:
    return f"ens{pf}f0"


def build_sriov_host(root: Path, pfs: int, vfs_per_pf: int, *, vf_driver: str = "vfio-pci") -> FakeHost:
    """``pfs`` i40e PFs (netdev ``ens<i>f0``, NUMA node ``i % 2``), each with ``vfs_per_pf`` VFs
    bound to ``vf_driver``, each VF in its own IOMMU group."""
    host = FakeHost(root)
    for pf in range(pfs):
        numa = pf % 2
        host.add_pf(pf_address(pf), netdev=pf_netdev(pf), total_vfs=max(vfs_per_pf, 1), numa_node=numa,
                    bridge=f"0000:00:{pf // 8 + 1:02x}.{pf % 8}")
        host.add_vfs(
            pf_address(pf),
            [vf_address(pf, vf) for vf in range(vfs_per_pf)],
            driver=vf_driver,
            iommu_groups=[1000 + pf * vfs_per_pf + vf for vf in range(vfs_per_pf)],
            numa_node=numa,
        )
    return host


def netdevice_config(pools: Sequence[tuple[str, Sequence[str]]], *, drivers: Sequence[str] = ("vfio-pci",)) -> dict[str, Any]:
    """A config of netDevice pools, each ``(resourceName, pfNames entries)``."""
    return {
        "resourceList": [
            {"resourceName": name, "deviceType": "netDevice",
             "selectors": {"drivers": list(drivers), "pfNames": list(pf_names)}}
            for name, pf_names in pools
        ]
    }


# -- the daemon process -----------------------------------------------------------------------
class Daemon:
    """``python -m daemon run`` against a fake host, logging to a file, always killed at the end."""

    def __init__(self, workdir: Path, host: FakeHost, config: dict[str, Any], *, registration: str = "kubelet",
                 log_level: str = "info", name: str = "daemon", env: dict[str, str] | None = None,
                 devinfo_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.env = env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.config_path = workdir / f"{name}-config.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = workdir / f"{name}.log"
        self.device_plugin_dir = workdir / "device-plugins"
        self.arguments = [
            PYTHON, "-m", "daemon", "run", "--config", str(self.config_path),
            "--sysfs-root", str(host.sys), "--dev-root", str(host.dev), "--proc-root", str(host.proc),
            "--device-plugin-dir", str(self.device_plugin_dir),
            "--plugins-registry-dir", str(workdir / "plugins_registry"),
            "--devinfo-dir", str(devinfo_dir or workdir / "devinfo"),
            "--cdi-dir", str(workdir / "cdi"), "--state-dir", str(workdir / "state"),
            "--registration", registration, "--log-level", log_level,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.started_wall = 0.0
        self.started_mono = 0.0

    def start(self) -> Daemon:
        with open(self.log_path, "wb") as log_file:
            self.started_wall = time.time()
            self.started_mono = time.monotonic()
            self.process = subprocess.Popen(self.arguments, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                            env=self.env)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise DaemonFailure(f"daemon exited with code {self.process.returncode}", self.log)

    def status_kib(self, field: str) -> int:
        """A ``/proc/<pid>/status`` field in KiB (VmRSS, VmHWM, ...)."""
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    def cpu_seconds(self) -> float:
        """utime + stime of the daemon process (all its threads)."""
        return process_cpu_seconds(self.pid)

    def stop(self, timeout: float = 10.0) -> tuple[int | None, float]:
        """SIGTERM, wait; SIGKILL if it hangs. Returns (exit code or None if killed, seconds taken)."""
        if self.process is None:
            return None, 0.0
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None, time.monotonic() - started
        return self.process.returncode, time.monotonic() - started

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_times(self) -> list[tuple[float, str]]:
        """(wall-clock seconds, message) of each log line (asctime has millisecond resolution)."""
        return parse_log_times(self.log)


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def parse_log_times(text: str) -> list[tuple[float, str]]:
    lines = []
    for line in text.splitlines():
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        lines.append((stamp, line[24:]))
    return lines


def first_log_time(times: list[tuple[float, str]], predicate: Callable[[str], bool]) -> float | None:
    for stamp, message in times:
        if predicate(message):
            return stamp
    return None


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def wait_kubelet(kubelet: FakeKubelet, daemon: Daemon, predicate: Callable[[FakeKubelet], bool], timeout: float,
                 what: str) -> float:
    """Wait for ``predicate`` on the stand-in, watching that the daemon stays alive.
    Returns the monotonic time at which the predicate was seen true."""
    deadline = time.monotonic() + timeout
    while True:
        daemon.check_alive()
        try:
            kubelet.wait_for(predicate, timeout=min(0.25, max(deadline - time.monotonic(), 0.001)), what=what)
            return time.monotonic()
        except AssertionError:
            if time.monotonic() >= deadline:
                raise DaemonFailure(f"timed out after {timeout:.1f}s waiting for {what}; "
                                    f"stand-in state: {kubelet.snapshot()}; register errors: "
                                    f"{kubelet.register_errors[-5:]}", daemon.log) from None


# -- statistics and printing ------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def verdict(value: float, target: float) -> str:
    """A plain comparison for the report (never an assertion)."""
    return "within target" if value <= target else "OVER target"


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so ``finally`` blocks still kill the
    daemon and remove the temp dirs (Python's default for SIGTERM skips them)."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def machine_line() -> str:
    """CPUs and load average: these figures come from shared, noisy machines. (Also installs the
    SIGTERM handler: every benchmark prints this line first.)"""
    exit_cleanly_on_sigterm()
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    return f"machine: {os.cpu_count()} CPUs, load average {load}, python {sys.version.split()[0]}"


def report_failure(error: DaemonFailure) -> None:
    print(f"\nDAEMON FAILURE: {error}", flush=True)
    print("---- daemon log (last lines) ----")
    print(tail(error.log))
    print("---- end of daemon log ----", flush=True)

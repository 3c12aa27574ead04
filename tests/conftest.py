"""Fixtures: a fake host in the kernel's layout, a kubelet stand-in, the real daemon process,
and real kernel devices and namespaces the tests make.

``REPO_ROOT`` and ``report_line`` are still imported from here by the systemd and e2e tests;
other modules import helpers from the support modules (see ``tests/__init__.py``)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.auxpools import AuxPools
from tests.daemonrun import REPO_ROOT, DaemonProcess, daemon_command
from tests.fakesysfs import FakeHost
from tests.guest import GuestResult, run_in_guest
from tests.kubelet import FakeKubelet
from tests.pci import Pci
from tests.seam import Seam
from tests.slowdisk import SlowDisk
from tests.uevents import ZramDevices

# The fixtures that start what a marker names (pyproject.toml registers the markers): a test that
# uses one, directly or through another fixture, gets the marker, and ./scripts/test --fast leaves
# it out (pytest -m "not (qemu or nspawn or podman or prometheus or arm64)").
NEEDS = {
    "qemu_guest": "qemu",  # below: a QEMU guest with emulated SR-IOV NVMe, USB, AER
    "deployment": "nspawn",  # test_e2e_systemd: the .deb in a bookworm container booted by systemd-nspawn
    "podman": "podman",  # test_podman_cdi: podman and runc, confined to the test
    "pod": "podman",  # test_image_daemonset: the image run by podman as the DaemonSet runs it
    "prometheus": "prometheus",  # test_metrics_daemon: a real Prometheus server scraping the daemon
    # test_arm64: the arm64 .deb (built under qemu-user), an arm64 bookworm running it, the arm64 image
    "arm64_debs": "arm64",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in NEEDS.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(NEEDS[fixture])


@pytest.fixture
def qemu_guest() -> Callable[..., GuestResult]:
    """``tests.guest.run_in_guest``: boots a QEMU guest for the test (which is marked ``qemu``)."""
    return run_in_guest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: unix socket paths must fit in 108 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def host(short_tmp: Path) -> FakeHost:
    return FakeHost(short_tmp / "host")


@pytest.fixture
def ram_host() -> Iterator[FakeHost]:
    """A fake host on tmpfs (``/dev/shm``) where there is one, for unit tests that lay out many
    files: a USB tree with udev's database takes about 40 ms there and over 0.4 s on this disk."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = Path(tempfile.mkdtemp(prefix="dp", dir=base))
    yield FakeHost(directory / "host")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def aux_world(ram_host: FakeHost) -> AuxPools:
    """An AuxNetHandler on a fake host on tmpfs, with the AuxTree that lays out its SFs."""
    return AuxPools(ram_host)


@pytest.fixture
def pci(host: FakeHost, short_tmp: Path) -> Pci:
    """A PciHandler on the fake host, writing device info under ``short_tmp/devinfo``."""
    return Pci(host, short_tmp / "devinfo")


@pytest.fixture
def seam(short_tmp: Path) -> Seam:
    """Uevents for a daemon started with ``--uevent-source unix:<short_tmp>/uevents.sock``."""
    return Seam(short_tmp / "uevents.sock")


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[FakeKubelet]:
    stand_in = FakeKubelet(short_tmp / "device-plugins")
    stand_in.start()
    yield stand_in
    stand_in.close()


@pytest.fixture
def slow_disk(short_tmp: Path) -> Iterator[SlowDisk]:
    """A directory (``slow_disk.path``) whose fsyncs sleep ``slow_disk.delay`` seconds: see tests/slowdisk.py."""
    with SlowDisk(short_tmp / "slow") as disk:
        yield disk


@pytest.fixture
def zram() -> Iterator[ZramDevices]:
    """Real zram block devices (real nodes, real uevents) the test makes; removed after it."""
    devices = ZramDevices()
    yield devices
    devices.cleanup()


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace ``dpt-<random>``, deleted (with the links made in it) afterwards."""
    name = f"dpt-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def run_daemon(short_tmp: Path, host: FakeHost) -> Iterator[Callable[..., DaemonProcess]]:
    """Start ``devplugd run`` against the fake host with a config (dict or text)."""
    started: list[DaemonProcess] = []

    def start(config: dict[str, Any] | str, *extra: str, registration: str = "kubelet") -> DaemonProcess:
        config_path = short_tmp / f"config-{len(started)}.json"
        config_path.write_text(config if isinstance(config, str) else json.dumps(config))
        log_path = short_tmp / f"daemon-{len(started)}.log"
        arguments = [
            "run", "--config", str(config_path),
            "--sysfs-root", str(host.sys), "--dev-root", str(host.dev), "--proc-root", str(host.proc),
            "--device-plugin-dir", str(short_tmp / "device-plugins"),
            "--plugins-registry-dir", str(short_tmp / "plugins_registry"),
            "--devinfo-dir", str(short_tmp / "devinfo"),
            "--control-socket", str(short_tmp / "control.sock"), "--cdi-dir", str(short_tmp / "cdi"),
            "--nfd-features-dir", str(short_tmp / "nfd"),
            "--state-dir", str(short_tmp / "state"),
            "--registration", registration, "--log-level", "debug", *extra,
        ]
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(daemon_command(*arguments), stdout=log_file, stderr=subprocess.STDOUT,
                                       cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        daemon = DaemonProcess(process, log_path, short_tmp)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGKILL)
            daemon.process.wait()


def report_line(request: pytest.FixtureRequest, line: str) -> None:
    """Print ``line`` in a normal run, not only on failure as captured output is (timings of the
    e2e and guest tests are worth seeing in CI)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)

"""arm64 (issue 24): the .deb ``make deb ARCH=arm64`` builds on this amd64 machine, installed with
apt on an arm64 bookworm and run there under qemu-user emulation against the kubelet stand-in
running natively here; and the image ``make image ARCH=arm64`` builds, run by podman with
``--arch arm64``, in the manifest list beside the amd64 one.

- Both .debs: ``dist/devplugd_<version>_{amd64,arm64}.deb``, built (side by side, in the
  background) when missing or older than their sources (tests/e2e/package.py). Cold, the arm64
  one first makes its build chroot (~6 min, cached in /var/cache/devplugd-build).
- The arm64 system: ``debootstrap --arch arm64 --variant=minbase`` plus the .deb's Depends, cached
  under /var/cache/devplugd-e2e keyed by those Depends (~4 min cold); each run unpacks it on
  tmpfs and installs the .deb with ``apt-get install``.
- The daemon runs chrooted there with a directory under /tmp bound at its own path: its sockets,
  the fake sysfs and /dev it serves, the uevent seam's socket and its state are there, so the
  stand-in and the seam reach it at the paths it was given.

Needs root, debootstrap, qemu-user-static and binfmt-support (``make deb ARCH=arm64`` installs
and enables them), lintian and podman (CI installs them): missing tools fail the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon import __version__
from tests.conftest import report_line
from tests.daemonrun import REPO_ROOT
from tests.e2e import BookwormImage, Container
from tests.e2e.arm64 import (
    DEB_CPU,
    depends_names,
    elf_machines,
    enable_emulation,
    lintian,
    lintian_errors,
    spawn_in_root,
)
from tests.e2e.package import HOST_ARCH, DebBuild, deb_fields, install_in_chroot, relations
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import PF, Seam, create_vfs
from tests.waiting import wait_until

ARCH = "arm64"
SMOKE_TARGET = 300.0  # seconds: the arm64 system made ready, the package installed, the daemon proven
SIZE_TOLERANCE = 0.10  # the arm64 .deb's size within 10 % of the amd64 one's
DPDK, TUN = "intel.com/dpdk", "devices.example.com/tun"
CONFIG = {"resourceList": [
    {"resourceName": "dpdk", "deviceType": "netDevice", "selectors": {"drivers": ["vfio-pci"]}},
    {"resourceName": "tun", "resourcePrefix": "devices.example.com", "deviceType": "devNode",
     "selectors": {"paths": ["/dev/net/tun"]}, "count": 3},
]}
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]  # as in test_image_daemonset


@dataclass
class Debs:
    by_arch: dict[str, Path]
    seconds: dict[str, float]


@pytest.fixture(scope="module")
def arm64_debs(request: pytest.FixtureRequest) -> Debs:
    """This machine's .deb and the arm64 one, built side by side when missing or stale."""
    assert HOST_ARCH == "amd64", f"the arm64 proof runs on amd64 (this is {HOST_ARCH})"
    enable_emulation(ARCH)
    builds = {arch: DebBuild(arch) for arch in (HOST_ARCH, ARCH)}
    try:
        debs = {arch: build.result(timeout=2400) for arch, build in builds.items()}
    finally:
        for build in builds.values():
            build.cancel()
    seconds = {arch: build.seconds for arch, build in builds.items()}
    report_line(request, "\narm64: " + ", ".join(
        f"{deb.name} {deb.stat().st_size / 1e6:.2f} MB" + (f" (built in {seconds[arch]:.0f} s)" if seconds[arch] else "")
        for arch, deb in debs.items()))
    return Debs(debs, seconds)


@dataclass
class Arm64System:
    container: Container
    deb: Path
    started: float  # when the fixture began: the smoke's time runs from there to the daemon's exit
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.container.root

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.container.chroot(list(argv), timeout=300)


@pytest.fixture(scope="module")
def arm64_system(arm64_debs: Debs, request: pytest.FixtureRequest) -> Iterator[Arm64System]:
    """An arm64 bookworm (minbase plus the .deb's Depends) with the arm64 .deb installed by apt."""
    deb = arm64_debs.by_arch[ARCH]
    started = time.monotonic()
    image = BookwormImage(include=(), arch=ARCH)
    tarball = image.with_depends(relations(deb_fields(deb)))
    ready = time.monotonic()
    with Container(tarball, boot=False) as container:
        system = Arm64System(container, deb, started)
        installing = time.monotonic()
        output = install_in_chroot(container, deb)
        assert "Setting up devplugd" in output, output[-3000:]
        system.timings.update({f"image_{name}": value for name, value in image.timings.items()})
        system.timings.update(image_ready=ready - started, install=time.monotonic() - installing,
                              unpack=container.timings.get("unpack", 0.0))
        yield system
        system.timings.setdefault("smoke", time.monotonic() - started)
        # a figure against its target, printed, not asserted: it follows the machine (on fresh
        # VMs, 195 s on one and 383 s on a slower one, most of it debootstrap under emulation)
        verdict = "within" if system.timings["smoke"] <= SMOKE_TARGET else "OVER"
        report_line(request, "\narm64 smoke timings (s): "
                    + ", ".join(f"{name} {value:.1f}" for name, value in system.timings.items())
                    + f"; target smoke <= {SMOKE_TARGET:.0f}: {verdict}")


# -- the packages --------------------------------------------------------------------------------------


def test_make_deb_arch_arm64_packages_aarch64_objects_only(arm64_debs: Debs) -> None:
    for arch, deb in arm64_debs.by_arch.items():
        assert deb.name == f"devplugd_{__version__}_{arch}.deb"
        assert deb_fields(deb)["Architecture"] == arch
        machines = elf_machines(deb)
        # grpc's, protobuf's upb, greenlet's, PyYAML's, charset-normalizer's wheels, and systemd-python,
        # compiled in the build: each architecture's own
        assert any("/systemd/_daemon." in path for path in machines), sorted(machines)
        assert any("/grpc/_cython/cygrpc." in path for path in machines), sorted(machines)
        wrong = {path: machine for path, machine in machines.items() if machine != DEB_CPU[arch]}
        assert not wrong, f"{deb.name}: ELF objects not for {DEB_CPU[arch]}: {wrong}"


def test_both_debs_depend_on_the_same_packages_and_weigh_the_same(arm64_debs: Debs,
                                                                  request: pytest.FixtureRequest) -> None:
    amd64, arm64 = arm64_debs.by_arch[HOST_ARCH], arm64_debs.by_arch[ARCH]
    names = {arch: depends_names(deb_fields(deb)["Depends"]) for arch, deb in arm64_debs.by_arch.items()}
    assert names[ARCH] == names[HOST_ARCH]
    assert {"python3", "libudev1", "procps", "libsystemd0", "libc6"} <= names[ARCH]
    ratio = arm64.stat().st_size / amd64.stat().st_size
    report_line(request, f"arm64 .deb / amd64 .deb: {ratio:.3f} ({arm64.stat().st_size} / {amd64.stat().st_size} bytes)")
    assert abs(ratio - 1) <= SIZE_TOLERANCE, f"arm64 .deb is {ratio:.2f} times the amd64 one"


def test_lintian_reports_no_error_on_either_deb(arm64_debs: Debs) -> None:
    assert shutil.which("lintian"), "lintian is missing: apt-get install lintian"
    runs = {arch: lintian(deb) for arch, deb in arm64_debs.by_arch.items()}
    outputs = {arch: run.communicate(timeout=600)[0] for arch, run in runs.items()}
    errors = {arch: lintian_errors(output) for arch, output in outputs.items()}
    assert errors == {arch: [] for arch in runs}, outputs
    for arch, run in runs.items():
        assert run.returncode == 0, f"lintian on the {arch} .deb exited {run.returncode}:\n{outputs[arch]}"


# -- the arm64 system, under emulation ------------------------------------------------------------------


def test_on_arm64_apt_installs_the_package_and_it_runs(arm64_system: Arm64System) -> None:
    assert arm64_system.run("uname", "-m").stdout.strip() == "aarch64"
    assert arm64_system.run("dpkg", "--print-architecture").stdout.strip() == ARCH
    status = arm64_system.run("dpkg-query", "-W", "-f=${Status} ${Architecture} ${Version}", "devplugd").stdout
    assert status == f"install ok installed {ARCH} {__version__}"
    assert arm64_system.run("devplugd", "--version").stdout.strip() == f"devplugd {__version__}"
    checked = arm64_system.run("devplugd", "check-config", "/etc/devplugd/config.json")
    assert checked.returncode == 0, checked.stderr


@dataclass
class Arm64Daemon:
    process: subprocess.Popen[bytes]
    log_path: Path
    shared: Path
    host: FakeHost
    kubelet: FakeKubelet
    seam: Seam
    started: float

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def arm64_daemon(arm64_system: Arm64System) -> Iterator[Arm64Daemon]:
    """``devplugd run`` in the arm64 system, on a fake host in the shared directory: two VFs on
    vfio-pci (the netDevice pool) and /dev/net/tun (the devNode pool)."""
    shared = Path(tempfile.mkdtemp(prefix="dpa", dir="/tmp"))  # short: unix socket paths
    host = FakeHost(shared / "host")
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    (host.dev / "net").mkdir(parents=True, exist_ok=True)
    os.mknod(host.dev / "net" / "tun", 0o600 | stat.S_IFCHR, os.makedev(10, 200))
    (shared / "config.json").write_text(json.dumps(CONFIG))
    kubelet = FakeKubelet(shared / "device-plugins")
    kubelet.start()
    seam = Seam(shared / "uevents.sock")
    argv = ["devplugd", "run", "--config", str(shared / "config.json"),
            "--sysfs-root", str(host.sys), "--dev-root", str(host.dev), "--proc-root", str(host.proc),
            "--device-plugin-dir", str(shared / "device-plugins"),
            "--plugins-registry-dir", str(shared / "plugins_registry"),
            "--devinfo-dir", str(shared / "devinfo"), "--control-socket", str(shared / "control.sock"),
            "--cdi-dir", str(shared / "cdi"), "--nfd-features-dir", str(shared / "nfd"),
            "--state-dir", str(shared / "state"), "--uevent-source", f"unix:{seam.path}",
            "--registration", "kubelet"]
    log_path = shared / "daemon.log"
    started = time.monotonic()
    process = spawn_in_root(arm64_system.root, shared, argv, log_path, env=["PYTHONUNBUFFERED=1"])
    daemon = Arm64Daemon(process, log_path, shared, host, kubelet, seam, started)
    try:
        yield daemon
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        kubelet.close()
        shutil.rmtree(shared, ignore_errors=True)


def _served(daemon: Arm64Daemon, resource: str, count: int, timeout: float) -> set[str]:
    def enough() -> set[str]:
        if daemon.process.poll() is not None:
            raise AssertionError(f"the arm64 daemon exited {daemon.process.returncode}:\n{daemon.log[-4000:]}")
        devices = set(daemon.kubelet.state(resource).devices)
        return devices if len(devices) == count else set()
    return wait_until(enough, timeout, lambda: f"{resource} with {count} devices:\n{daemon.log[-4000:]}",
                      interval=0.1)


def test_the_emulated_daemon_serves_a_netdevice_and_a_devnode_pool_to_the_native_kubelet(
        arm64_daemon: Arm64Daemon, arm64_system: Arm64System) -> None:
    vfs = _served(arm64_daemon, DPDK, 2, timeout=120)
    tun = _served(arm64_daemon, TUN, 3, timeout=30)
    arm64_system.timings["daemon_serving"] = time.monotonic() - arm64_daemon.started
    assert tun == {"net_tun-0", "net_tun-1", "net_tun-2"}
    (first, _) = sorted(vfs)
    answer = arm64_daemon.kubelet.allocate(DPDK, [first], timeout=30)
    assert answer.container_responses[0].envs["PCIDEVICE_INTEL_COM_DPDK"] == first
    answer = arm64_daemon.kubelet.allocate(TUN, ["net_tun-2"], timeout=30)
    assert [(d.host_path, d.container_path) for d in answer.container_responses[0].devices] == [
        ("/dev/net/tun", "/dev/net/tun")]


def test_a_hotplugged_vf_reaches_the_native_kubelet_through_the_uevent_seam(
        arm64_daemon: Arm64Daemon, arm64_system: Arm64System) -> None:
    _served(arm64_daemon, DPDK, 2, timeout=120)
    arm64_daemon.seam.wait_ready()
    sent = time.monotonic()
    (added,) = create_vfs(arm64_daemon.host, arm64_daemon.seam, 2, 1)
    assert added in _served(arm64_daemon, DPDK, 3, timeout=30)
    arm64_system.timings["hotplug"] = time.monotonic() - sent


def test_sigterm_stops_the_emulated_daemon_with_status_0(arm64_daemon: Arm64Daemon,
                                                        arm64_system: Arm64System) -> None:
    _served(arm64_daemon, TUN, 3, timeout=120)
    arm64_daemon.process.send_signal(signal.SIGTERM)
    assert arm64_daemon.process.wait(60) == 0, arm64_daemon.log[-4000:]
    arm64_system.timings["smoke"] = time.monotonic() - arm64_system.started
    left = sorted(path.name for path in (arm64_daemon.shared / "device-plugins").iterdir()
                  if path.is_socket() and path.name != "kubelet.sock")
    assert left == [], f"plugin sockets left behind: {left}"


# -- the images -------------------------------------------------------------------------------------------


def _podman(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, *argv], capture_output=True, text=True, timeout=timeout)


def _build_image(arch: str, deb: Path) -> tuple[str, float]:
    started = time.monotonic()
    done = subprocess.run([str(REPO_ROOT / "packaging" / "image" / "build")],
                          env={**os.environ, "ARCH": arch, "DEB": str(deb)}, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, f"packaging/image/build ARCH={arch} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip().splitlines()[-1], time.monotonic() - started


def _list_entries(name: str) -> dict[str, str]:
    inspected = _podman("manifest", "inspect", name)
    assert inspected.returncode == 0, inspected.stderr
    return {entry["platform"]["architecture"]: entry["digest"] for entry in json.loads(inspected.stdout)["manifests"]}


def _digest(image: str) -> str:
    return _podman("image", "inspect", "--format", "{{.Digest}}", image).stdout.strip()


@pytest.fixture(scope="module")
def arm64_image(arm64_debs: Debs, request: pytest.FixtureRequest) -> str:
    """``make image`` for arm64, then for amd64 (the list keeps the arm64 entry); the list's name."""
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    assert not missing, f"missing {missing}: apt-get install {' '.join(missing)}"
    for arch in (ARCH, HOST_ARCH):
        line, seconds = _build_image(arch, arm64_debs.by_arch[arch])
        report_line(request, f"\n{line} [{seconds:.0f} s]")
    return f"localhost/devplugd:{__version__}"


def test_the_manifest_list_names_the_amd64_and_the_arm64_image(arm64_image: str) -> None:
    entries = _list_entries(arm64_image)
    assert set(entries) == {HOST_ARCH, ARCH}, entries
    for arch, digest in entries.items():
        assert digest == _digest(f"{arm64_image}-{arch}"), f"the list's {arch} entry is not {arm64_image}-{arch}"
    arm64_config = _podman("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", f"{arm64_image}-{ARCH}")
    assert arm64_config.stdout.strip() == f"linux/{ARCH}"


def test_the_arm64_image_runs_devplugd_under_podman_with_arch_arm64(arm64_image: str) -> None:
    for image in (f"{arm64_image}-{ARCH}", arm64_image):  # by its own tag, and picked from the list
        ran = _podman("run", "--rm", "--arch", ARCH, "--pull", "never", *ULIMITS, image, "--version", timeout=300)
        assert (ran.returncode, ran.stdout.strip()) == (0, f"devplugd {__version__}"), ran.stderr
    machine = _podman("run", "--rm", "--arch", ARCH, "--pull", "never", *ULIMITS, "--entrypoint", "/usr/bin/uname",
                      arm64_image, "-m", timeout=300)
    assert machine.stdout.strip() == "aarch64", machine.stderr
    native = _podman("run", "--rm", "--pull", "never", *ULIMITS, "--entrypoint", "/usr/bin/uname", arm64_image, "-m")
    assert native.stdout.strip() == "x86_64", "on this amd64 host the list runs its amd64 image"

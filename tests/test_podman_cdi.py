"""A real podman (Debian 12: 4.3, with runc) takes a device by its CDI name from devplugd's spec.

The daemon serves a devNode pool over the real ``/dev/net/tun`` (``--dev-root /dev``) and writes
its CDI spec to a private directory; ``devplugd allocate ... -o podman`` hands out a lease and
the ``--device`` argument; podman runs a busybox rootfs with it and the container must see the
character device (same major:minor as the host's, openable: the device cgroup lets it through)
and ``DEVPLUGD_DEVICES_EXAMPLE_COM_TUN=<leased id>``.

Nothing is left on the machine:

* podman 4.3 reads CDI specs only from ``/etc/cdi`` and ``/var/run/cdi`` (its containers.conf has
  no ``cdi_spec_dirs`` yet), so podman runs in a private mount namespace (``unshare --mount``)
  with a tmpfs over ``/run`` (hence ``/var/run``), the daemon's spec directory bound at
  ``/run/cdi`` and an empty tmpfs over ``/etc/cdi`` when there is one: the host's directories are
  never touched and only devplugd's spec is visible;
* podman's storage, run root, libpod tmpdir, network config and TMPDIR live in the test's temp
  directory, with its own containers.conf and storage.conf (``CONTAINERS_CONF``,
  ``CONTAINERS_STORAGE_CONF``: the host's are ignored), vfs driver, ``--events-backend none``;
* the container's cgroups are under a parent of our own (``--cgroup-parent``), killed and removed
  afterwards (podman leaves the parent and its ``conmon`` child behind otherwise).

Needs root and the Debian packages podman, runc and busybox-static: the test fails (not skips)
when they are missing, so CI cannot silently stop running it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemonrun import control_cli
from tests.waiting import wait_until

PACKAGES = ("podman", "runc", "busybox-static")
BUSYBOX = Path("/bin/busybox")
NODE = "/dev/net/tun"
RESOURCE = "devices.example.com/tun"
KIND = "devices.example.com/tun"
ENV_NAME = "DEVPLUGD_DEVICES_EXAMPLE_COM_TUN"
SPEC_NAME = "devplugd-devices.example.com-tun.json"
COUNT = 4
DEVICE_IDS = [f"net_tun-{index}" for index in range(COUNT)]
CONFIG = {"resourceList": [{
    "resourceName": "tun", "resourcePrefix": "devices.example.com", "deviceType": "devNode",
    "selectors": {"paths": [NODE]}, "count": COUNT,
}]}
CGROUP_ROOT = Path("/sys/fs/cgroup")
PODMAN_TIMEOUT = 60.0

# The name rules of the CDI package podman 4.3 vendors (pkg/cdi/qualified-device.go).
CDI_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
CDI_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?")
CDI_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")

# Runs as `sh -euc SCRIPT sh CDI_DIR PODMAN ARGS...` inside `unshare --mount` (private propagation).
NAMESPACE_SCRIPT = """
mount -t tmpfs -o mode=0755 devplugd-test "$(readlink -f /var/run)"
mkdir /var/run/cdi
mount --bind "$1" /var/run/cdi
if [ -d /etc/cdi ]; then mount -t tmpfs -o mode=0755 devplugd-test /etc/cdi; fi
shift
exec "$@"
"""

# What the container runs: the node, the env, then opening the node (EBADFD once open: allowed).
CONTAINER_SCRIPT = f"""
echo '--- ls'; ls -l {NODE} 2>&1 || true
echo '--- env'; env
echo '--- open'; cat {NODE} 2>&1 || true
echo '--- end'
"""


def _is_static_elf(path: Path) -> bool:
    """True for an ELF executable with no PT_INTERP (no dynamic loader needed in the rootfs)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only: what Debian amd64/arm64 ship
        return False
    endian = "<" if data[5] == 1 else ">"
    phoff, = struct.unpack_from(endian + "Q", data, 0x20)
    phentsize, phnum = struct.unpack_from(endian + "HH", data, 0x36)
    return all(struct.unpack_from(endian + "I", data, phoff + i * phentsize)[0] != 3 for i in range(phnum))


def _require_host() -> None:
    missing = [tool for tool in ("podman", "runc", "unshare", "mount") if shutil.which(tool) is None]
    if not BUSYBOX.is_file() or not _is_static_elf(BUSYBOX):
        missing.append(f"a static {BUSYBOX}")
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install {' '.join(PACKAGES)}", pytrace=False)
    try:
        mode = os.stat(NODE).st_mode
    except OSError as error:
        pytest.fail(f"{NODE} is needed as a real character device: {error}", pytrace=False)
    if not stat.S_ISCHR(mode):
        pytest.fail(f"{NODE} is not a character device", pytrace=False)


def _cgroup_mounts() -> list[Path]:
    """Every cgroup (v1 or v2) hierarchy mounted under /sys/fs/cgroup."""
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            fs_type = fields[fields.index("-") + 1]
            mount_point = Path(fields[4])
            if fs_type in ("cgroup", "cgroup2") and (mount_point == CGROUP_ROOT or CGROUP_ROOT in mount_point.parents):
                found.append(mount_point)
    return found


def _host_dir_state(path: Path) -> tuple[bool, list[str]]:
    return path.is_dir(), sorted(os.listdir(path)) if path.is_dir() else []


class Podman:
    """podman 4.3 confined to a temp directory, a private mount namespace and its own cgroup parent."""

    def __init__(self, workdir: Path, cdi_dir: Path) -> None:
        self.workdir = workdir
        self.cdi_dir = cdi_dir
        self.cgroup_parent = f"devplugd-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.rootfs = workdir / "rootfs"
        for name in ("root", "runroot", "tmp", "networks", "tmpdir"):
            (workdir / name).mkdir(parents=True)
        (workdir / "containers.conf").write_text("")
        (workdir / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\nrunroot = "{workdir / "runroot"}"\ngraphroot = "{workdir / "root"}"\n')
        self._build_rootfs()

    def _build_rootfs(self) -> None:
        bin_dir = self.rootfs / "bin"
        bin_dir.mkdir(parents=True)
        shutil.copy2(BUSYBOX, bin_dir / "busybox")
        for applet in ("sh", "ls", "cat", "env"):
            (bin_dir / applet).symlink_to("busybox")

    def command(self, *run_arguments: str) -> list[str]:
        work = self.workdir
        podman = [
            "podman", "--root", str(work / "root"), "--runroot", str(work / "runroot"),
            "--tmpdir", str(work / "tmp"), "--network-config-dir", str(work / "networks"),
            "--storage-driver", "vfs", "--events-backend", "none",
            "--runtime", "runc", "--cgroup-manager", "cgroupfs",
            "run", "--rm", "--cgroup-parent", f"/{self.cgroup_parent}", "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            *run_arguments,
        ]
        return ["unshare", "--mount", "--propagation", "private",
                "sh", "-euc", NAMESPACE_SCRIPT, "sh", str(self.cdi_dir), *podman]

    def run(self, *device_arguments: str) -> subprocess.CompletedProcess[str]:
        command = self.command(*device_arguments, "--rootfs", str(self.rootfs), "sh", "-c", CONTAINER_SCRIPT)
        environment = {**os.environ, "CONTAINERS_CONF": str(self.workdir / "containers.conf"),
                       "CONTAINERS_STORAGE_CONF": str(self.workdir / "storage.conf"),
                       "TMPDIR": str(self.workdir / "tmpdir")}
        return subprocess.run(command, capture_output=True, text=True, timeout=PODMAN_TIMEOUT, env=environment,
                              stdin=subprocess.DEVNULL)

    def cgroup_directories(self) -> list[Path]:
        return [mount / self.cgroup_parent for mount in _cgroup_mounts() if (mount / self.cgroup_parent).is_dir()]

    def cleanup(self, timeout: float = 10.0) -> None:
        """Kill whatever podman left in our cgroup parent, remove it (deepest first), then the workdir."""
        failures: list[OSError] = []

        def removed() -> bool:
            directories = self.cgroup_directories()
            for directory in directories:
                for procs in directory.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        for pid in procs.read_text().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)
            try:
                for directory in directories:
                    for parent, _, _ in os.walk(directory, topdown=False):
                        os.rmdir(parent)  # a cgroup directory goes with rmdir, control files and all
            except OSError as error:  # busy until the killed processes are gone
                failures.append(error)
                return False
            return True

        try:
            wait_until(removed, timeout, interval=0.05)
        except AssertionError:
            raise failures[-1] from None
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def podman(short_tmp: Path) -> Iterator[Podman]:
    _require_host()
    host_dirs = {path: _host_dir_state(path) for path in (Path("/var/run/cdi"), Path("/etc/cdi"))}
    confined = Podman(short_tmp / "podman", short_tmp / "cdi")
    try:
        yield confined
    finally:
        confined.cleanup()
    assert not confined.cgroup_directories()
    assert not confined.workdir.exists()
    assert {path: _host_dir_state(path) for path in host_dirs} == host_dirs, "the host's CDI directories changed"


def sections(stdout: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("--- "):
            current = found.setdefault(line[4:], [])
        elif current is not None:
            current.append(line)
    return found


def check_spec(spec: dict[str, Any]) -> None:
    assert spec["cdiVersion"] == "0.3.0"  # no hostPath: the lowest version podman 4.3 reads
    assert spec["kind"] == KIND
    vendor, _, cdi_class = spec["kind"].partition("/")
    assert CDI_VENDOR.fullmatch(vendor) and CDI_CLASS.fullmatch(cdi_class), spec["kind"]
    names = [device["name"] for device in spec["devices"]]
    assert names == DEVICE_IDS  # one CDI device per device ID
    for device in spec["devices"]:
        assert CDI_DEVICE.fullmatch(device["name"]), device["name"]
        edits = device["containerEdits"]
        assert edits["deviceNodes"] == [{"path": NODE, "permissions": "rw"}]
        assert f"{ENV_NAME}={device['name']}" in edits["env"]


def test_podman_runs_a_container_with_a_device_from_the_cdi_spec(short_tmp, run_daemon, podman):
    cdi_dir = short_tmp / "cdi"
    spec_path = cdi_dir / SPEC_NAME
    control_socket = short_tmp / "control.sock"
    daemon = run_daemon(CONFIG, "--dev-root", "/dev", "--uevent-source", "none", registration="none")
    daemon.wait_until(spec_path.exists, f"CDI spec {spec_path}", timeout=15.0)
    daemon.wait_until(control_socket.exists, f"control socket {control_socket}", timeout=15.0)

    # The spec: the only file in the directory, one device per ID, what podman 4.3 reads.
    assert sorted(os.listdir(cdi_dir)) == [SPEC_NAME]
    check_spec(json.loads(spec_path.read_text()))
    listed = control_cli(control_socket, "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    pools = {pool["resource"]: pool for pool in json.loads(listed.stdout)}
    assert sorted(device["id"] for device in pools[RESOURCE]["devices"]) == DEVICE_IDS

    # allocate -o json: the lease with its env and CDI name.
    allocated = control_cli(control_socket, "allocate", RESOURCE, "--owner", "podman-test-json", "-o", "json")
    assert allocated.returncode == 0, allocated.stderr
    as_json = json.loads(allocated.stdout)
    assert as_json["resource"] == RESOURCE and as_json["owner"] == "podman-test-json"
    assert len(as_json["devices"]) == 1 and as_json["devices"][0] in DEVICE_IDS
    assert as_json["cdi_devices"] == [f"{KIND}={as_json['devices'][0]}"]
    assert isinstance(as_json["envs"], dict) and as_json["lease"]

    # allocate -o podman: exactly the --device arguments, for another device.
    allocated = control_cli(control_socket, "allocate", RESOURCE, "--owner", "podman-test-run", "-o", "podman")
    assert allocated.returncode == 0, allocated.stderr
    device_arguments = shlex.split(allocated.stdout)
    leases = control_cli(control_socket, "leases", "-o", "json")
    assert leases.returncode == 0, leases.stderr
    (run_lease,) = [lease for lease in json.loads(leases.stdout) if lease["owner"] == "podman-test-run"]
    (device_id,) = run_lease["devices"]
    assert device_id != as_json["devices"][0]
    assert device_arguments == [f"--device={KIND}={device_id}"] == [f"--device={n}" for n in run_lease["cdi_devices"]]

    # Without the device: no node, no env (so what follows comes from CDI, not from podman's defaults).
    bare = podman.run()
    assert bare.returncode == 0, f"podman failed ({bare.returncode}):\n{bare.stderr}"
    bare_output = sections(bare.stdout)
    assert "No such file or directory" in "\n".join(bare_output["ls"]), bare.stdout
    assert not any(line.startswith(ENV_NAME + "=") for line in bare_output["env"]), bare.stdout

    # With the device from the lease: the node (same major:minor as the host's), openable, and the env.
    result = podman.run(*device_arguments)
    assert result.returncode == 0, f"podman rejected the devplugd CDI spec ({result.returncode}):\n{result.stderr}"
    output = sections(result.stdout)
    host_node = os.stat(NODE).st_rdev
    (ls_line,) = output["ls"]
    listed_node = re.fullmatch(r"c[-rwxsStT]{9}\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s" + re.escape(NODE), ls_line)
    assert listed_node, f"not a character device at {NODE} in the container: {ls_line!r}"
    assert (int(listed_node[1]), int(listed_node[2])) == (os.major(host_node), os.minor(host_node))
    opened = "\n".join(output["open"])
    assert "Operation not permitted" not in opened and "No such" not in opened, opened
    assert "File descriptor in bad state" in opened, opened  # open() succeeded; a tun fd with no interface
    assert [line for line in output["env"] if line.startswith(ENV_NAME + "=")] == [f"{ENV_NAME}={device_id}"]
    for key, value in run_lease["envs"].items():
        assert f"{key}={value}" in output["env"]

    # Releases, then SIGTERM takes the spec with it.
    for lease in (as_json["lease"], run_lease["lease"]):
        released = control_cli(control_socket, "release", lease)
        assert released.returncode == 0, released.stderr
    assert daemon.stop(signal.SIGTERM) == 0, daemon.log
    assert not spec_path.exists()
    assert not [name for name in os.listdir(cdi_dir) if name.startswith("devplugd-")]

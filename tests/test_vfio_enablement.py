"""vfioOnDemand on a host that has not enabled it (docs/passthrough.md, "Enabling it"): the shipped
unit and DaemonSet keep /sys read-only, so the daemon says so once at start and once at each
reload, naming the pools and the fix, and refuses a claim before anything is checkpointed or
unbound; a sysfs write refused all the same says what to do. The read-only sysfs is the fake
one bind-mounted read-only on itself, as ``ProtectKernelTunables=yes`` mounts /sys (needs root).

And the fix itself: the unit's drop-in (``systemd/vfio-on-demand.conf``) opens exactly the two
subtrees the daemon writes and systemd accepts it on the unit as it is; the .deb ships it.
tests/test_deploy_manifests.py checks the DaemonSet's component, tests/test_e2e_systemd.py the
drop-in in a booted system.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.core import AllocationError
from daemon.dra import device_name
from daemon.handlers.pci._enablement import WRITTEN
from tests import test_dra_daemon as daemon_tests
from tests.apiserver import ApiServer
from tests.books import book_document
from tests.daemonrun import REPO_ROOT, DaemonProcess
from tests.e2e.daemonset import ConfigMapVolume, load_pod_spec, pod_command
from tests.fakedriver import FakeDriverCore
from tests.fakesysfs import FakeHost
from tests.kubelet import DraCallError, FakeKubelet
from tests.pci import Pci, add_nvme_pf
from tests.test_deploy_manifests import vfio_daemonset
from tests.test_dra_daemon import DRIVER, wait_published
from tests.test_dra_vfio_daemon import CONFIG, MULTI, POOL, VFS, core, drivers, vm_claim
from tests.test_image_daemonset import FIELD_VALUES, PODMAN, ULIMITS
from tests.test_pci_vfio_on_demand import ON_DEMAND, PF, VFIO_POOL
from tests.uevents import ZramDevices

api, dra_kubelet, start_dra = daemon_tests.api, daemon_tests.dra_kubelet, daemon_tests.start_dra
__all__ = ["core"]  # a fixture of this module's tests

DROP_IN = REPO_ROOT / "systemd" / "vfio-on-demand.conf"
UNIT = REPO_ROOT / "systemd" / "devplugd.service"
ENABLING = ('see "Enabling it" in docs/passthrough.md (/usr/share/doc/devplugd/docs/passthrough.md): the systemd '
            "drop-in vfio-on-demand.conf, or the DaemonSet's component deploy/vfio-on-demand")
PROBLEM = "every claim with a VfioConfig will be refused"


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` bind-mounted read-only on itself until the end, as systemd makes /sys read-only."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def problems(pci: Pci, *entries: dict[str, object]) -> list[str]:
    return pci.handler.host_problems(pci.configure(*entries))


# -- the handler ----------------------------------------------------------------------------------


def test_vfio_on_demand_pools_on_a_read_only_sysfs_are_one_problem_naming_them_the_reason_and_the_fix(
        pci: Pci, host: FakeHost) -> None:
    add_nvme_pf(host, PF, ["nvme", "nvme"])
    gpus = {**ON_DEMAND, "resourceName": "gpus", "deviceType": "accelerator", "selectors": {"drivers": ["amdgpu"]}}
    assert problems(pci, ON_DEMAND, gpus, VFIO_POOL) == []  # writable: nothing to say
    with read_only(host.sys):
        assert problems(pci, ON_DEMAND, gpus, VFIO_POOL) == [
            f"vfioOnDemand pools intel.com/nvme, intel.com/gpus: {PROBLEM}, since {host.sys}/bus/pci and "
            f"{host.sys}/devices are read-only for devplugd (the unit's ProtectKernelTunables=yes, or the DaemonSet's "
            f"read-only /sys); {ENABLING}"]
        assert problems(pci, VFIO_POOL) == []  # a host without vfioOnDemand pools wants /sys read-only


def test_a_claim_is_refused_on_a_read_only_sysfs_before_anything_moves(pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme"])
    (host.sys / "bus" / "pci" / "drivers" / "vfio-pci").mkdir()
    loan = pci.handler.plan_loan(pci.pool(ON_DEMAND), vfs[0])
    with read_only(host.sys), pytest.raises(AllocationError) as refused:
        pci.handler.check_loan(loan)  # what the DRA driver asks before it checkpoints the loan
    assert str(refused.value) == (f"{vfs[0]}: {host.sys}/bus/pci and {host.sys}/devices are read-only for devplugd, "
                                  f"and the rebinding writes there; {ENABLING}")
    assert (host.device_dir(vfs[0]) / "driver").resolve().name == "nvme"
    pci.handler.check_loan(loan)  # writable again: nothing to refuse


def test_a_sysfs_write_refused_as_read_only_says_how_to_enable_it(pci: Pci, host: FakeHost) -> None:
    """The backstop, where a write fails all the same (a prepared claim made whole again at start,
    or given back, after the host went back to the shipped unit)."""
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme"])
    (host.sys / "bus" / "pci" / "drivers" / "vfio-pci").mkdir()
    host.set_file(vfs[0], "driver_override", "(null)\n")
    pool = pci.pool(ON_DEMAND)
    loan = pci.handler.plan_loan(pool, vfs[0])
    with read_only(host.sys):
        for step in (lambda: pci.handler.lend(pool, loan, "legacy"), lambda: pci.handler.give_back(loan)):
            with pytest.raises(AllocationError) as refused:
                step()
            assert str(refused.value) == (
                f"{vfs[0]}: cannot open {host.sys}/bus/pci/devices/{vfs[0]}/driver_override: Read-only file system; "
                f"sysfs is read-only for devplugd: {ENABLING}")


def test_the_drop_in_opens_the_two_subtrees_the_daemon_writes_and_keeps_the_rest_of_sys_read_only() -> None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(DROP_IN.read_text())
    assert {section: dict(parser[section]) for section in parser.sections()} == {
        "Service": {"readwritepaths": " ".join(f"/sys/{part}" for part in WRITTEN)}}
    assert re.search(r"^ProtectKernelTunables=yes$", UNIT.read_text(), re.MULTILINE)
    shipped = (REPO_ROOT / "packaging" / "deb" / "debian" / "devplugd.examples").read_text().split()
    assert "systemd/vfio-on-demand.conf" in shipped  # /usr/share/doc/devplugd/examples/, as the docs say


@pytest.fixture
def unit_root(tmp_path: Path) -> Path:
    """A root for ``systemd-analyze --root``: the unit as the .deb installs it, the programs its
    Exec lines name (stubs), and systemd's own units for its default dependencies."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd")
    root = tmp_path / "root"
    units = root / "usr" / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    for unit in Path("/usr/lib/systemd/system").glob("*"):
        if unit.suffix in (".target", ".slice") and unit.is_file():
            shutil.copy(unit, units)
    shutil.copy(UNIT, units)
    for program in ("usr/bin/devplugd", "bin/mkdir", "bin/kill"):
        (root / program).parent.mkdir(parents=True, exist_ok=True)
        (root / program).write_text("#!/bin/sh\n")
        (root / program).chmod(0o755)
    return root


def analyze(root: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *arguments, f"--root={root}", "devplugd.service"],
                          capture_output=True, text=True, timeout=60)


def test_systemd_accepts_the_drop_in_and_scores_the_unit_as_without_it(unit_root: Path) -> None:
    def exposure() -> str:
        report = analyze(unit_root, "security", "--offline=yes", "--no-pager")
        found = re.search(r"Overall exposure level for devplugd\.service: (\S+)", report.stdout)
        assert found, report.stdout + report.stderr
        return found[1]

    shipped = exposure()
    drop_ins = unit_root / "etc" / "systemd" / "system" / "devplugd.service.d"
    drop_ins.mkdir(parents=True)
    shutil.copy(DROP_IN, drop_ins)
    verified = analyze(unit_root, "verify")
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, "")
    assert exposure() == shipped
    (drop_ins / "vfio-on-demand.conf").write_text("[Service]\nReadWritePath=/sys/bus/pci\n")  # the check checks
    assert "Unknown key 'ReadWritePath'" in analyze(unit_root, "verify").stderr


# -- the daemon -----------------------------------------------------------------------------------


def host_problem_lines(daemon: DaemonProcess) -> list[str]:
    return [line for line in daemon.log.splitlines() if PROBLEM in line]


def test_the_daemon_says_it_at_start_and_at_each_reload_and_refuses_the_claim_before_moving_anything(
    api: ApiServer, core: FakeDriverCore, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    host: FakeHost, short_tmp: Path
) -> None:
    with read_only(host.sys):
        daemon = start_dra(CONFIG)
        wait_published(api, {device_name(a) for a in (*VFS, MULTI[0])}, pool=POOL)  # the pool is served all the same
        dra_kubelet.wait_for_dra(DRIVER)
        (line,) = host_problem_lines(daemon)
        assert "ERROR" in line and "vfioOnDemand pool example.com/nvme:" in line and ENABLING in line, line

        daemon.process.send_signal(signal.SIGHUP)
        daemon.wait_for_log("config reloaded")
        assert len(host_problem_lines(daemon)) == 2, daemon.log

        ref = vm_claim(api, "vm", VFS[0])
        with pytest.raises(DraCallError) as refused:
            dra_kubelet.prepare([ref])
        assert f"cannot go to vfio-pci: {VFS[0]}: {host.sys}/bus/pci and" in str(refused.value), refused.value
        assert ENABLING in str(refused.value)
        assert drivers(core, VFS[0]) == ["nvme"]
        book = short_tmp / "state" / "dra-claims.json"
        assert not book.exists() or book_document(book)["claims"] == []  # nothing to give back at the next start
        assert daemon.stop() == 0
    assert len(host_problem_lines(daemon)) == 2


# -- the DaemonSet's component, run --------------------------------------------------------------

PROBE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from daemon.handlers.pci._enablement import read_only_paths
try:
    descriptor = os.open(sys.argv[2], os.O_WRONLY)
    os.write(descriptor, b"0\\n")
    os.close(descriptor)
    write = "wrote"
except OSError as error:
    write = error.strerror
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
host = os.path.isdir("/host/proc/1")
print(json.dumps({"read_only": read_only_paths("/sys"), "write": write, "capabilities": status["CapEff"].strip(),
                  "pid_1_mounts": open("/host/proc/1/mountinfo" if host else "/proc/1/mountinfo").readline(),
                  "routes": open("/host/proc/net/route" if host else "/proc/net/route").read()}))
"""


@pytest.fixture
def podman() -> list[str]:
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool) is None]
    assert not missing, f"missing {missing}: apt-get install {' '.join(missing)}"
    return PODMAN


def run_pod(podman: list[str], spec: dict[str, Any], node: Path, command: list[str]) -> dict[str, Any]:
    """``command`` in the pod's container as tests/e2e/daemonset.py translates ``spec`` (its
    mounts, security context, host network), with this machine's root (an overlay of it) in
    place of the image: no image build, and this checkout's daemon code to ask."""
    config_map = ConfigMapVolume(node / "configmaps" / secrets.token_hex(4), {"config.json": "{}"})
    for kubelet_directory in ("device-plugins", "plugins", "plugins_registry"):
        (node / "var" / "lib" / "kubelet" / kubelet_directory).mkdir(parents=True, exist_ok=True)
    pod = pod_command(spec, name=f"devplugd-test-{secrets.token_hex(4)}", node_root=node, config_map=config_map,
                      field_values=FIELD_VALUES)
    options = pod.argv[:pod.argv.index(spec["containers"][0]["image"])]
    options = [option for option in options if option not in ("--pull", "never")]  # no image
    # an emptyDir on tmpfs starts empty, not with a copy of what this root has there
    options = [f"{option},notmpcopyup" if before == "--tmpfs" else option
               for before, option in zip(["", *options[:-1]], options, strict=True)]
    done = subprocess.run([*podman, "run", "--rm", *ULIMITS, *options, "--rootfs", "/:O", *command],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_only_the_component_lets_the_unprivileged_pod_rebind_and_see_the_hosts_mount_table(
        podman: list[str], tmp_path: Path, zram: ZramDevices) -> None:
    """Under runc, the pod as deploy/ runs it and as the vfio-on-demand component makes it: with
    no capability but NET_ADMIN, a write to a device attribute under /sys/devices (driver_override
    lives there; here the mem_limit of a zram device the test makes, not one of the machine's PCI
    functions) fails read-only in the first and is done in the second, which also reads the
    host's mount table and, under hostNetwork, its routes."""
    attribute = f"/sys/devices/virtual/block/zram{zram.add()}/mem_limit"
    command = [sys.executable, "-c", PROBE, str(REPO_ROOT), attribute]
    host = {"pid_1_mounts": Path("/proc/1/mountinfo").read_text().splitlines(keepends=True)[0],
            "routes": Path("/proc/net/route").read_text()}

    base = run_pod(podman, load_pod_spec(), tmp_path / "node", command)
    assert (base["read_only"], base["write"]) == (["/sys/bus/pci", "/sys/devices"], "Read-only file system")
    assert base["pid_1_mounts"] != host["pid_1_mounts"]  # the container's own mount table

    vfio = run_pod(podman, vfio_daemonset()["spec"]["template"]["spec"], tmp_path / "node", command)
    assert (vfio["read_only"], vfio["write"]) == ([], "wrote")
    assert {key: vfio[key] for key in host} == host
    assert base["capabilities"] == vfio["capabilities"] == f"{1 << 12:016x}"  # CAP_NET_ADMIN alone

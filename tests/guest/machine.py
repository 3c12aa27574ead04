"""Boot a QEMU guest with emulated NVMe SR-IOV PFs and VT-d, run one command in it, stop.

The guest runs Debian's kernel (image.py) with the host's ``/`` mounted read-only over 9p and
chrooted into, so a command like ``[guest_python(), "scenario.py"]`` runs the repo's venv on a
kernel that has real PFs, VFs, IOMMU groups, vfio and uevents. Scenario scripts and results go
through ``share``, a host directory mounted read-write in the guest *at the same path*: a script
can write ``Path(os.environ["GUEST_SHARE"]) / "result.json"`` and the test reads the same path.

QEMU (Debian's 7.2, TCG: no KVM on these machines) gets, per PF, a PCIe root port, an
nvme-subsys and an nvme controller whose SR-IOV resources are computed from its VF count (the
constraints QEMU checks are in ``nvme_pf_properties``); plus ``intel-iommu`` (vfio-pci needs a
translating IOMMU: Debian's kernel has no vfio no-IOMMU mode, so without it binding fails with
-22), with intremap and caching-mode on a q35 with a split irqchip exactly as in the measured
recipe (shared/docs/real-kernel-sriov.md). The PFs sit behind the vIOMMU, so every VF gets its own
IOMMU group; the two virtio-9p devices do not use it (no VIRTIO_F_ACCESS_PLATFORM).

Boot to command is ~4-5 s, plus ~2 s for the first Python start and ~5-7 s to import grpc, trio
and the daemon (TCG runs Python ~15-20x slower than the host); plan scenarios accordingly.

Topology: ``pfs=[4, 8]`` is shorthand for ``ports=[SriovNvme(4), SriovNvme(8)]``; ``ports`` adds
more, each on its own ``pcie-root-port`` with qdev id ``rp<index>`` at ``00:<index + 1>.0``
(``pfs`` first): ``SriovNvme`` (one SR-IOV PF), ``MultifunctionNvme`` (N nvme functions in one
slot: one IOMMU group, nvme has no ACS) and ``BridgedNvme`` (N nvme behind a ``pcie-pci-bridge``:
one group with the bridge). ``slow_link=True`` gives a port ``x-speed=2_5,x-width=1``: QEMU 7.2's
default port advertises Data-Link-Layer-Active reporting but never sets DLLLA, so a *fatal* AER
recovery below it fails; at 2.5GT/s x1 it succeeds (shared/docs/real-kernel-devices.md, section
1). ``share/.guest/topology.json`` lists the ports for the guest (``tests.guest.devices.ports``).

Options: ``udevd=True`` starts a real ``systemd-udevd`` (the host's, Debian package ``udev``) in
the chroot before the command, triggers and settles, so the daemon's ``--uevent-source auto``
picks ``udev`` as on a real host; ``monitor=True`` gives QEMU a QMP socket and relays HMP
commands the guest writes into the share (tests/guest/monitor.py: ``hmp``, ``inject_aer``);
``usb=True`` adds a ``qemu-xhci`` controller (qdev id ``xhci``, at ``USB_CONTROLLER_ADDRESS``)
with nothing on it: the guest hot-plugs keyboards, FTDI serials and storage through the monitor
(tests/guest/usb.py; shared/docs/real-kernel-devices.md section 3).

Files QEMU and /init leave in ``share/.guest/``: ``console.log`` (ttyS0), ``qemu.log``
(QEMU's stderr), ``output.log`` (the command's stdout+stderr), ``exit-status``, ``timing``,
``topology.json``; with ``udevd``, ``udevd.log``; with ``monitor``, ``monitor.log`` and ``req/``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.guest.image import GuestImage, ensure_image
from tests.guest.monitor import MonitorRelay
from tests.guest.usb import CHARDEV_DIR, DISK_IMAGE, write_disk_image

REPO_ROOT = Path(__file__).resolve().parents[2]


def _venv_python() -> Path:
    """The venv the tests run in (a git worktree has none of its own: it borrows the main
    checkout's, and ``PYTHONPATH`` below makes its own packages win), else the checkout's."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin" / "python"
    return REPO_ROOT / ".venv" / "bin" / "python"


GUEST_PYTHON = _venv_python()
CONTROL_DIR = ".guest"
MAX_VFS_PER_PF = 127  # QEMU 7.2's nvme refuses more
# intel_iommu=on: Debian's default leaves VT-d off, and without it there are no IOMMU groups and
# vfio-pci refuses every device (-22). panic=-1 with QEMU's -no-reboot: a panic ends QEMU at once.
# The rest only saves boot time under TCG (~0.7 s of ~3.5 s kernel init, measured): quiet (every
# console byte is an emulated UART write), cryptomgr.notests (crypto self-tests), rodata=off (no
# W+X page-table walk), 8250.nr_uarts=1 (no probing for absent UARTs), audit=0, apparmor=0
# (nothing in the guest uses them), nowatchdog.
KERNEL_CMDLINE = ("console=ttyS0 panic=-1 intel_iommu=on quiet cryptomgr.notests rodata=off "
                  "8250.nr_uarts=1 audit=0 apparmor=0 nowatchdog")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",  # the host's /root is read-only in the guest
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONDONTWRITEBYTECODE": "1",  # the root is read-only: no __pycache__ writes
    "PYTHONUNBUFFERED": "1",  # output reaches output.log and the console in order, even on a crash
    "PYTHONPATH": str(REPO_ROOT),  # `import daemon` and `import tests.…` from the checkout
}
TAIL_LINES = 60
# After the command's exit status is written /init runs `poweroff -f`; a guest whose device
# shutdown hangs (dead VFs after a failed fatal AER recovery) is killed after this long.
POWEROFF_GRACE_SECONDS = 10.0
UDEVD = "/lib/systemd/systemd-udevd"  # Debian's udev package (.ci/run installs it)
UDEV_SETTLE_SECONDS = 60


class GuestError(AssertionError):
    """The guest did not run the command to completion (pytest shows the message whole)."""


class GuestTimeout(GuestError):
    """QEMU ran past the timeout and was killed."""


class GuestBootFailed(GuestError):
    """QEMU stopped without the command's exit status: QEMU refused to start, a panic, or /init failed."""


class GuestCommandFailed(GuestError):
    """The command exited non-zero (raised by ``run_in_guest(check=True)``)."""

    def __init__(self, message: str, result: GuestResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class GuestResult:
    """One finished guest run. ``share`` holds whatever the command wrote."""

    exit_code: int
    console_log: str
    output: str  # the command's stdout and stderr, interleaved
    share: Path
    boot_seconds: float  # guest uptime when the command started (kernel start to command)
    command_seconds: float  # how long the command ran, by the guest's clock
    wall_seconds: float  # QEMU started to QEMU gone, on the host
    udevd_seconds: float | None = None  # udevd started to trigger+settle done (part of command_seconds)
    poweroff_hung: bool = False  # QEMU was killed POWEROFF_GRACE_SECONDS after the command ended

    def describe(self) -> str:
        """The command's output and the console's tail, for assertion messages."""
        return (f"guest command exited {self.exit_code}\n--- command output (tail) ---\n{_tail(self.output)}\n"
                f"--- console (tail) ---\n{_tail(self.console_log)}")


def guest_python(*arguments: str | os.PathLike[str]) -> list[str]:
    """argv for the repo's venv Python in the guest (its interpreter is the host's /usr/bin/python3)."""
    return [str(GUEST_PYTHON), *(str(argument) for argument in arguments)]


@dataclass(frozen=True)
class SriovNvme:
    """An NVMe PF offering ``vfs`` VFs (``sriov_totalvfs``), alone on its root port's bus (its VFs,
    routing ID offset 1, stride 1, with ARI past function 7, all fit)."""

    vfs: int
    slow_link: bool = False  # the port at 2.5GT/s x1: a fatal AER recovery below it succeeds
    # > 0: a shared namespace (nsid 1) of this size in the PF's subsystem, which every VF sees too
    # (a QEMU null-co block device: reads give zeros, writes vanish); the VFs can then run on nvme,
    # each with its /dev/nvmeXn1, once tests/guest/nvme_virt.py gives them resources
    namespace_mib: int = 0

    def describe(self) -> dict[str, object]:
        namespace = {"namespace_mib": self.namespace_mib} if self.namespace_mib else {}
        return {"kind": "sriov", "vfs": self.vfs, **namespace}


@dataclass(frozen=True)
class MultifunctionNvme:
    """``functions`` nvme controllers as functions 0..N-1 of one slot: one IOMMU group for all."""

    functions: int = 3
    slow_link: bool = False

    def describe(self) -> dict[str, object]:
        return {"kind": "multifunction", "functions": self.functions}


@dataclass(frozen=True)
class BridgedNvme:
    """A ``pcie-pci-bridge`` with ``count`` nvme controllers behind it (slots 1..N): one IOMMU group
    holding the bridge (no driver) and the controllers."""

    count: int = 2
    slow_link: bool = False

    def describe(self) -> dict[str, object]:
        return {"kind": "bridge", "functions": self.count}


Port = SriovNvme | MultifunctionNvme | BridgedNvme
MAX_PORTS = 24  # root ports go in slots 1..24 of pcie.0 (the 9p devices take free slots after them)
USB_CONTROLLER_ID = "xhci"  # its bus is "xhci.0"; 4 QEMU ports, each both USB 2 (bus 1) and 3 (bus 2)
USB_CONTROLLER_ADDRESS = "0000:00:19.0"  # slot 25, just past the root ports: the same with any topology


def run_in_guest(
    command: Sequence[str | os.PathLike[str]],
    *,
    pfs: Sequence[int] = (),
    ports: Sequence[Port] = (),
    share: Path,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO_ROOT,
    memory_mb: int = 1024,
    check: bool = True,
    udevd: bool = False,
    monitor: bool = False,
    usb: bool = False,
    image: GuestImage | None = None,
) -> GuestResult:
    """Boot a guest with one NVMe PF per entry of ``pfs`` (its ``sriov_totalvfs``) and then the
    ``ports`` (see the module docstring), run ``command`` in the host-root chroot with cwd ``cwd``
    and ``DEFAULT_ENV`` + ``GUEST_SHARE`` + ``env``, and power off.

    ``udevd``: start systemd-udevd in the chroot first (trigger + settle; see ``udevd_prelude``).
    ``monitor``: relay HMP commands from the guest to QEMU (tests/guest/monitor.py).
    ``usb``: an empty qemu-xhci controller to hot-plug USB devices on (needs ``monitor``).

    Raises GuestTimeout (QEMU killed), GuestBootFailed (no exit status) and, with ``check``,
    GuestCommandFailed for a non-zero exit; every message carries the console's tail and the
    command's output."""
    share = share.resolve()
    control = _prepare_control_dir(share)
    topology = [*(SriovNvme(count) for count in pfs), *ports]
    (control / "topology.json").write_text(json.dumps(topology_document(topology), indent=1) + "\n")
    _write_run_script(control, command, cwd=cwd, env=_guest_env(share, env), udevd=udevd, usb=usb)
    if usb:  # usb-storage's drive: QEMU opens it on the host at drive_add
        write_disk_image(control / DISK_IMAGE)
    image = image or ensure_image()
    with tempfile.TemporaryDirectory(prefix="dpqmp", dir="/tmp") as sockets:  # a short path for sun_path
        qmp = Path(sockets) / "qmp.sock" if monitor else None
        argv = qemu_command(image, ports=topology, share=share, console=control / "console.log",
                            memory_mb=memory_mb, qmp=qmp, usb=usb)
        (control / "qemu-command").write_text(shlex.join(argv) + "\n")
        relay = MonitorRelay(qmp, control) if qmp is not None else None
        wall, hung = _run_qemu(argv, control, timeout, relay)
    result = _collect(control, share, wall, hung)
    if check and result.exit_code != 0:
        raise GuestCommandFailed(result.describe(), result)
    return result


def port_id(index: int) -> str:
    """The qdev id of the index-th root port (``pcie_aer_inject_error`` takes it)."""
    return f"rp{index}"


def port_address(index: int) -> str:
    """Where the index-th root port sits: slot index + 1 of pcie.0 (qemu_command pins it)."""
    return f"0000:00:{index + 1:02x}.0"


def topology_document(topology: Sequence[Port]) -> list[dict[str, object]]:
    """What the guest reads from ``.guest/topology.json``: each port's qdev id, address, kind."""
    return [{"id": port_id(index), "address": port_address(index), "slow_link": port.slow_link, **port.describe()}
            for index, port in enumerate(topology)]


def _prepare_control_dir(share: Path) -> Path:
    """A fresh ``share/.guest`` (results of an earlier run must not be read as this one's)."""
    control = share / CONTROL_DIR
    control.mkdir(parents=True, exist_ok=True)
    for leftover in ("exit-status", "output.log", "console.log", "qemu.log", "timing", "init-failed",
                     "udevd.log", "monitor.log", "topology.json", DISK_IMAGE):
        (control / leftover).unlink(missing_ok=True)
    for directory in ("req", CHARDEV_DIR):
        shutil.rmtree(control / directory, ignore_errors=True)
    return control


def _guest_env(share: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    return {**DEFAULT_ENV, "GUEST_SHARE": str(share), **(env or {})}


def _write_run_script(control: Path, command: Sequence[str | os.PathLike[str]], *, cwd: Path,
                      env: Mapping[str, str], udevd: bool = False, usb: bool = False) -> None:
    """``guest.env`` for /init (outside the chroot; ``usb``: load the USB modules) and ``run.sh``
    (inside): udevd if asked, cwd, a clean environment, argv, stdin from /dev/null (the console
    is not the command's input)."""
    share = env["GUEST_SHARE"]
    (control / "guest.env").write_text(f"GUEST_SHARE={shlex.quote(share)}\nGUEST_REPO={shlex.quote(str(REPO_ROOT))}\n"
                                       + ("GUEST_USB=1\n" if usb else ""))
    if udevd:  # udevadm and libudev users refuse to work in a chroot without it
        env = {**env, "SYSTEMD_IGNORE_CHROOT": "1"}
    assignments = " ".join(shlex.quote(f"{key}={value}") for key, value in env.items())
    argv = shlex.join(str(part) for part in command)
    (control / "run.sh").write_text(
        "# written by tests/guest/machine.py; run by the guest's /init in the host-root chroot\n"
        + (udevd_prelude(control / "udevd.log", control / "timing") if udevd else "")
        + f"cd {shlex.quote(str(cwd))} || exit 126\n"
        f"exec env -i {assignments} {argv} </dev/null\n")


def udevd_prelude(log: Path, timing: Path) -> str:
    """Shell for run.sh: a real systemd-udevd in the chroot, as on a real host, before the command.

    The recipe of shared/docs/real-kernel-devices.md, section 4: ``SYSTEMD_IGNORE_CHROOT=1`` (else
    udevadm answers "Running in chroot, ignoring request"); udevd in the background rather than
    ``--daemon`` only so that its stderr lands in ``udevd.log`` (daemonized it would go to
    /dev/null); ``--resolve-names=never`` (the host's /etc/group lacks udev's groups, nodes stay
    root:root); wait for ``/run/udev/control`` (about 0.5 s: a libudev monitor on the udev group
    and ``auto`` both look for it); then ``udevadm trigger --action=add --type=all`` and
    ``udevadm settle`` (1.3 and 3 s for the ~240 devices of the SR-IOV guest; about 5 s in all,
    stamped in ``timing``), so the udev database holds every device before the command starts,
    as after a real boot. Exits 125 when udevd does not come up."""
    quoted_log, quoted_timing = shlex.quote(str(log)), shlex.quote(str(timing))
    return (
        "export SYSTEMD_IGNORE_CHROOT=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin\n"
        f"[ -x {UDEVD} ] || {{ echo 'no {UDEVD}: apt-get install udev' >&2; exit 125; }}\n"
        f"echo \"udevd-start $(cut -d' ' -f1 /proc/uptime)\" >>{quoted_timing}\n"
        f"SYSTEMD_LOG_TARGET=console {UDEVD} --resolve-names=never >{quoted_log} 2>&1 </dev/null &\n"
        "tries=0\n"
        "until [ -S /run/udev/control ]; do\n"
        "    tries=$((tries + 1))\n"
        "    [ $tries -le 1000 ] || { echo 'systemd-udevd: no /run/udev/control after 10 s' >&2; exit 125; }\n"
        "    sleep 0.01\n"
        "done\n"
        f"echo \"udevd-control $(cut -d' ' -f1 /proc/uptime)\" >>{quoted_timing}\n"
        "udevadm trigger --action=add --type=all || exit 125\n"
        f"echo \"udevd-triggered $(cut -d' ' -f1 /proc/uptime)\" >>{quoted_timing}\n"
        f"udevadm settle -t {UDEV_SETTLE_SECONDS} || {{ echo 'udevadm settle timed out' >&2; exit 125; }}\n"
        f"echo \"udevd-ready $(cut -d' ' -f1 /proc/uptime)\" >>{quoted_timing}\n"
    )


def nvme_pf_properties(max_vfs: int) -> dict[str, int]:
    """QEMU 7.2 nvme SR-IOV properties for a PF offering ``max_vfs`` VFs. QEMU checks:
    sriov_vq_flexible >= 2 * max_vfs (an admin and an I/O queue per VF), sriov_vi_flexible >=
    max_vfs (one interrupt per VF), max_ioqpairs - sriov_vq_flexible >= 2 (the PF keeps an
    admin and an I/O queue), msix_qsize - sriov_vi_flexible >= 1 (the PF keeps a vector)."""
    if not 0 <= max_vfs <= MAX_VFS_PER_PF:
        raise ValueError(f"an NVMe PF offers 0..{MAX_VFS_PER_PF} VFs, not {max_vfs}")
    if max_vfs == 0:
        return {}
    queues = 2 * max_vfs
    return {"sriov_max_vfs": max_vfs, "sriov_vq_flexible": queues, "sriov_vi_flexible": max_vfs,
            "max_ioqpairs": queues + 2, "msix_qsize": max_vfs + 1}


def root_port_args(index: int, *, slow_link: bool) -> list[str]:
    """A pcie-root-port pinned at ``port_address(index)``; ``slow_link``: 2.5GT/s x1, which clears
    the link's DLLLA-reporting capability so a fatal AER recovery's link wait succeeds."""
    link = ",x-speed=2_5,x-width=1" if slow_link else ""
    return ["-device", f"pcie-root-port,id={port_id(index)},bus=pcie.0,addr={index + 1:x}.0,"
                       f"chassis={index + 1},slot={index + 1}{link}"]


def port_args(index: int, port: Port) -> list[str]:
    """The root port and what sits behind it."""
    bus = port_id(index)
    argv = root_port_args(index, slow_link=port.slow_link)
    if isinstance(port, SriovNvme):
        subsystem = f"nvmesubsys{index}"
        properties = {"bus": bus, "serial": f"devplugd{index}", "subsys": subsystem, **nvme_pf_properties(port.vfs)}
        if port.namespace_mib:
            properties = {"id": f"nvme{index}", **properties}
        argv += ["-device", f"nvme-subsys,id={subsystem},nqn=devplugd-subsys{index}",
                 "-device", "nvme," + ",".join(f"{key}={value}" for key, value in properties.items())]
        if port.namespace_mib:
            drive = f"nvmens{index}"
            argv += ["-blockdev", f"driver=null-co,node-name={drive},size={port.namespace_mib * 1024 * 1024},"
                                  "read-zeroes=on",
                     "-device", f"nvme-ns,drive={drive},bus=nvme{index},nsid=1,shared=on"]
    elif isinstance(port, MultifunctionNvme):
        if not 1 <= port.functions <= 8:
            raise ValueError(f"a slot has 1..8 functions, not {port.functions}")
        for function in range(port.functions):
            multifunction = ",multifunction=on" if function == 0 else ""
            argv += ["-device", f"nvme,bus={bus},addr=00.{function}{multifunction},serial=devplugd{index}f{function}"]
    else:
        if not 1 <= port.count <= 31:
            raise ValueError(f"a pcie-pci-bridge has slots 1..31, not {port.count}")
        bridge = f"ppb{index}"
        argv += ["-device", f"pcie-pci-bridge,id={bridge},bus={bus}"]
        for slot in range(1, port.count + 1):
            argv += ["-device", f"nvme,bus={bridge},addr={slot:x},serial=devplugd{index}s{slot}"]
    return argv


def nvme_pf_args(index: int, max_vfs: int) -> list[str]:
    """A root port, a subsystem and an nvme controller on it (``port_args`` for one SriovNvme)."""
    return port_args(index, SriovNvme(max_vfs))


def qemu_command(image: GuestImage, *, pfs: Sequence[int] = (), ports: Sequence[Port] = (), share: Path,
                 console: Path, memory_mb: int = 1024, qmp: Path | None = None, usb: bool = False) -> list[str]:
    """The QEMU argv: TCG on two vCPUs (MTTCG runs them on two host threads), q35 with VT-d,
    the PFs then the ports, with ``usb`` a qemu-xhci controller, the two 9p exports, no NIC,
    display or default devices; ttyS0 into ``console``; with ``qmp``, a QMP server socket there
    (for MonitorRelay)."""
    topology = [*(SriovNvme(count) for count in pfs), *ports]
    if len(topology) > MAX_PORTS:
        raise ValueError(f"at most {MAX_PORTS} root ports, not {len(topology)}")
    argv = [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", str(memory_mb),
        "-machine", "q35,kernel-irqchip=split", "-nodefaults", "-nographic", "-no-reboot",
        "-serial", f"file:{console}", "-monitor", "none",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", KERNEL_CMDLINE,
        "-device", "intel-iommu,intremap=on,caching-mode=on",
    ]
    if qmp is not None:
        argv += ["-qmp", f"unix:{_qemu_escape(qmp)},server=on,wait=off"]
    for index, port in enumerate(topology):
        argv += port_args(index, port)
    if usb:
        slot = int(USB_CONTROLLER_ADDRESS.split(":")[2].split(".")[0], 16)
        argv += ["-device", f"qemu-xhci,id={USB_CONTROLLER_ID},bus=pcie.0,addr={slot:x}.0"]
    argv += [
        "-virtfs", f"local,path={_qemu_escape(share)},mount_tag=host0,security_model=passthrough,id=fs0",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap,id=fs1",
    ]
    return argv


def _qemu_escape(path: Path) -> str:
    """QEMU option values escape a comma by doubling it."""
    return str(path).replace(",", ",,")


def _run_qemu(argv: list[str], control: Path, timeout: float, relay: MonitorRelay | None = None) -> tuple[float, bool]:
    """Start QEMU (and the monitor relay), wait; past ``timeout`` kill that one process and raise
    with the console tail. A guest that wrote its exit status but does not power off within
    POWEROFF_GRACE_SECONDS is killed too (returns hung=True): its result is complete."""
    if shutil.which(argv[0]) is None:
        raise GuestBootFailed(f"{argv[0]} not found: apt-get install qemu-system-x86 (Debian's QEMU 7.2)")
    started = time.monotonic()
    with open(control / "qemu.log", "wb") as qemu_log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT)
    if relay is not None:
        relay.start()
    timed_out = hung = False
    exit_status = control / "exit-status"
    finished_at: float | None = None
    try:
        while process.poll() is None:
            now = time.monotonic()
            if now - started > timeout:
                timed_out = True
                break
            if finished_at is None and exit_status.exists():
                finished_at = now
            if finished_at is not None and now - finished_at > POWEROFF_GRACE_SECONDS:
                hung = True
                break
            try:
                process.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:  # also on Ctrl-C or any error: never leave our QEMU behind
        if process.poll() is None:
            process.kill()
            process.wait()
        if relay is not None:
            relay.stop()
    if timed_out:
        raise GuestTimeout(f"guest still running after {timeout:.0f} s; QEMU (pid {process.pid}) killed\n"
                           f"{_failure_report(control)}")
    if process.returncode != 0 and not hung:
        raise GuestBootFailed(f"QEMU exited {process.returncode}\n{_failure_report(control)}")
    return time.monotonic() - started, hung


def _collect(control: Path, share: Path, wall: float, hung: bool = False) -> GuestResult:
    status = _read(control / "exit-status").strip()
    if not status:
        raise GuestBootFailed(f"the guest stopped without running the command to its end\n{_failure_report(control)}")
    timing = dict(line.split() for line in _read(control / "timing").splitlines() if len(line.split()) == 2)
    start, end = float(timing.get("command-start", 0)), float(timing.get("command-end", 0))
    udevd_seconds = None
    if "udevd-ready" in timing:
        udevd_seconds = float(timing["udevd-ready"]) - float(timing["udevd-start"])
    return GuestResult(exit_code=int(status), console_log=_read(control / "console.log"),
                       output=_read(control / "output.log"), share=share, boot_seconds=start,
                       command_seconds=max(end - start, 0.0), wall_seconds=wall, udevd_seconds=udevd_seconds,
                       poweroff_hung=hung)


def _failure_report(control: Path) -> str:
    names = ("qemu.log", "init-failed", "monitor.log", "udevd.log", "output.log", "console.log")
    parts = [f"--- {name} (tail) ---\n{_tail(_read(control / name))}" for name in names if _read(control / name).strip()]
    return "\n".join(parts) or f"(nothing in {control})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])

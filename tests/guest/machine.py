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

Files QEMU and /init leave in ``share/.guest/``: ``console.log`` (ttyS0), ``qemu.log``
(QEMU's stderr), ``output.log`` (the command's stdout+stderr), ``exit-status``, ``timing``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.guest.image import GuestImage, ensure_image

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

    def describe(self) -> str:
        """The command's output and the console's tail, for assertion messages."""
        return (f"guest command exited {self.exit_code}\n--- command output (tail) ---\n{_tail(self.output)}\n"
                f"--- console (tail) ---\n{_tail(self.console_log)}")


def guest_python(*arguments: str | os.PathLike[str]) -> list[str]:
    """argv for the repo's venv Python in the guest (its interpreter is the host's /usr/bin/python3)."""
    return [str(GUEST_PYTHON), *(str(argument) for argument in arguments)]


def run_in_guest(
    command: Sequence[str | os.PathLike[str]],
    *,
    pfs: Sequence[int],
    share: Path,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO_ROOT,
    memory_mb: int = 1024,
    check: bool = True,
    image: GuestImage | None = None,
) -> GuestResult:
    """Boot a guest with one NVMe PF per entry of ``pfs`` (its ``sriov_totalvfs``), run ``command``
    in the host-root chroot with cwd ``cwd`` and ``DEFAULT_ENV`` + ``GUEST_SHARE`` + ``env``, and
    power off. Raises GuestTimeout (QEMU killed), GuestBootFailed (no exit status) and, with
    ``check``, GuestCommandFailed for a non-zero exit; every message carries the console's tail
    and the command's output."""
    share = share.resolve()
    control = _prepare_control_dir(share)
    _write_run_script(control, command, cwd=cwd, env=_guest_env(share, env))
    image = image or ensure_image()
    argv = qemu_command(image, pfs=pfs, share=share, console=control / "console.log", memory_mb=memory_mb)
    (control / "qemu-command").write_text(shlex.join(argv) + "\n")
    wall = _run_qemu(argv, control, timeout)
    result = _collect(control, share, wall)
    if check and result.exit_code != 0:
        raise GuestCommandFailed(result.describe(), result)
    return result


def _prepare_control_dir(share: Path) -> Path:
    """A fresh ``share/.guest`` (results of an earlier run must not be read as this one's)."""
    control = share / CONTROL_DIR
    control.mkdir(parents=True, exist_ok=True)
    for leftover in ("exit-status", "output.log", "console.log", "qemu.log", "timing", "init-failed"):
        (control / leftover).unlink(missing_ok=True)
    return control


def _guest_env(share: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    return {**DEFAULT_ENV, "GUEST_SHARE": str(share), **(env or {})}


def _write_run_script(control: Path, command: Sequence[str | os.PathLike[str]], *, cwd: Path,
                      env: Mapping[str, str]) -> None:
    """``guest.env`` for /init (outside the chroot) and ``run.sh`` (inside): cwd, a clean
    environment, argv, stdin from /dev/null (the console is not the command's input)."""
    share = env["GUEST_SHARE"]
    (control / "guest.env").write_text(f"GUEST_SHARE={shlex.quote(share)}\nGUEST_REPO={shlex.quote(str(REPO_ROOT))}\n")
    assignments = " ".join(shlex.quote(f"{key}={value}") for key, value in env.items())
    argv = shlex.join(str(part) for part in command)
    (control / "run.sh").write_text(
        "# written by tests/guest/machine.py; run by the guest's /init in the host-root chroot\n"
        f"cd {shlex.quote(str(cwd))} || exit 126\n"
        f"exec env -i {assignments} {argv} </dev/null\n")


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


def nvme_pf_args(index: int, max_vfs: int) -> list[str]:
    """A root port, a subsystem and an nvme controller on it: the PF is the only function on its
    bus, so its VFs (routing ID offset 1, stride 1, with ARI past function 7) all fit."""
    port, subsystem = f"rp{index}", f"nvmesubsys{index}"
    properties = {"bus": port, "serial": f"devplugd{index}", "subsys": subsystem, **nvme_pf_properties(max_vfs)}
    return [
        "-device", f"pcie-root-port,id={port},chassis={index + 1},slot={index + 1}",
        "-device", f"nvme-subsys,id={subsystem},nqn=devplugd-subsys{index}",
        "-device", "nvme," + ",".join(f"{key}={value}" for key, value in properties.items()),
    ]


def qemu_command(image: GuestImage, *, pfs: Sequence[int], share: Path, console: Path,
                 memory_mb: int = 1024) -> list[str]:
    """The QEMU argv: TCG on two vCPUs (MTTCG runs them on two host threads), q35 with VT-d,
    the PFs, the two 9p exports, no NIC, display or default devices; ttyS0 into ``console``."""
    argv = [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", str(memory_mb),
        "-machine", "q35,kernel-irqchip=split", "-nodefaults", "-nographic", "-no-reboot",
        "-serial", f"file:{console}", "-monitor", "none",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", KERNEL_CMDLINE,
        "-device", "intel-iommu,intremap=on,caching-mode=on",
    ]
    for index, max_vfs in enumerate(pfs):
        argv += nvme_pf_args(index, max_vfs)
    argv += [
        "-virtfs", f"local,path={_qemu_escape(share)},mount_tag=host0,security_model=passthrough,id=fs0",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap,id=fs1",
    ]
    return argv


def _qemu_escape(path: Path) -> str:
    """QEMU option values escape a comma by doubling it."""
    return str(path).replace(",", ",,")


def _run_qemu(argv: list[str], control: Path, timeout: float) -> float:
    """Start QEMU, wait; past ``timeout`` kill that one process and raise with the console tail."""
    if shutil.which(argv[0]) is None:
        raise GuestBootFailed(f"{argv[0]} not found: apt-get install qemu-system-x86 (Debian's QEMU 7.2)")
    started = time.monotonic()
    with open(control / "qemu.log", "wb") as qemu_log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT)
    timed_out = False
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on Ctrl-C or any error: never leave our QEMU behind
        if process.poll() is None:
            process.kill()
            process.wait()
    if timed_out:
        raise GuestTimeout(f"guest still running after {timeout:.0f} s; QEMU (pid {process.pid}) killed\n"
                           f"{_failure_report(control)}")
    if process.returncode != 0:
        raise GuestBootFailed(f"QEMU exited {process.returncode}\n{_failure_report(control)}")
    return time.monotonic() - started


def _collect(control: Path, share: Path, wall: float) -> GuestResult:
    status = _read(control / "exit-status").strip()
    if not status:
        raise GuestBootFailed(f"the guest stopped without running the command to its end\n{_failure_report(control)}")
    timing = dict(line.split() for line in _read(control / "timing").splitlines() if line.strip())
    start, end = float(timing.get("command-start", 0)), float(timing.get("command-end", 0))
    return GuestResult(exit_code=int(status), console_log=_read(control / "console.log"),
                       output=_read(control / "output.log"), share=share, boot_seconds=start,
                       command_seconds=max(end - start, 0.0), wall_seconds=wall)


def _failure_report(control: Path) -> str:
    parts = [f"--- {name} (tail) ---\n{_tail(_read(control / name))}"
             for name in ("qemu.log", "init-failed", "output.log", "console.log") if _read(control / name).strip()]
    return "\n".join(parts) or f"(nothing in {control})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])

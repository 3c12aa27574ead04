"""In the guest: an SR-IOV NVMe PF's VFs brought up on the ``nvme`` driver, each with its namespace.

QEMU 7.2's emulated VF controllers start offline: ``nvme`` binds one, finds it not ready and lets
go about 0.5 s later. The PF gives them resources and puts them online with NVMe Virtualization
Management (admin opcode 1Ch), sent here through ``NVME_IOCTL_ADMIN_CMD`` on the PF's
``/dev/nvmeN`` (no nvme-cli). The recipe (shared/docs/real-kernel-devices.md section 5):

1. the primary controller's flexible resources to 0 (action 1, VQ then VI), applied by QEMU at
   the PF's function level reset: sysfs ``reset``, then wait for the controller to be live;
2. ``sriov_drivers_autoprobe`` 0, ``sriov_numvfs`` N;
3. per VF: its secondary controller ID from Identify CNS 15h, VQ and VI assigned (action 8),
   online (action 9);
4. ``sriov_drivers_autoprobe`` back to 1 (with 0 a VF binds to no driver without a
   ``driver_override``, so a driver given back at Unprepare could never bind), each VF written to
   ``drivers_probe``; wait until each has its controller live and its namespace's block device.

    from tests.guest.nvme_virt import enable_vfs_on_nvme
    reload_nvme_without_multipath()      # first: each controller its own /dev/nvmeXn1
    vfs = enable_vfs_on_nvme(pf, 2)      # {'0000:01:00.1': NvmeFunction(controller='nvme4', ...)}

Under native multipath (Debian's default, before the reload) ``enable_vfs_on_nvme(pf, 2,
hidden_paths=True)`` waits instead for each VF's hidden path ``nvme0c4n1`` and the head
``/dev/nvme0n1`` it leads to (``NvmeFunction.path``, ``.block``).

The PF needs a namespace every VF sees: ``SriovNvme(n, namespace_mib=...)`` (tests/guest/machine.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from tests.guest.devices import DRIVERS_PROBE, NVME_DRIVER, PCI_DEVICES, driver_of, set_num_vfs, vfs_of, write
from tests.waiting import wait_until

# <linux/nvme_ioctl.h>: struct nvme_passthru_cmd (72 bytes); NVME_IOCTL_ADMIN_CMD = _IOWR('N', 0x41, it)
PASSTHRU = struct.Struct("=BBHIIIQQIIIIIIIIII")
_IOC_READ_WRITE = 3
NVME_IOCTL_ADMIN_CMD = (_IOC_READ_WRITE << 30) | (PASSTHRU.size << 16) | (ord("N") << 8) | 0x41
ADMIN_IDENTIFY = 0x06
ADMIN_VIRT_MGMT = 0x1C
CNS_SECONDARY_CONTROLLER_LIST = 0x15
IDENTIFY_BYTES = 4096
SECONDARY_ENTRY = struct.Struct("<HHBxxxHHH18x")  # SCID, PCID, SCS, VFN, NVQ, NVI (32 bytes)
# Virtualization Management actions and resource types (NVMe 1.4 section 5.22)
ACTION_PRIMARY_FLEXIBLE = 1
ACTION_SECONDARY_OFFLINE = 7
ACTION_SECONDARY_ASSIGN = 8
ACTION_SECONDARY_ONLINE = 9
RESOURCE_VQ = 0
RESOURCE_VI = 1
VF_QUEUES = 2  # an admin queue and one I/O queue
VF_INTERRUPTS = 1
NVME_CLASS_DIR = Path("/sys/class/nvme")
NVME_SUBSYSTEM_CLASS_DIR = Path("/sys/class/nvme-subsystem")
LIVE_TIMEOUT = 30.0
RESET_SETTLE_SECONDS = 0.5  # QEMU runs the reset's work after the sysfs write returns
BLOCK_TIMEOUT = 30.0
NVME_CORE_PARAMETERS = Path("/sys/module/nvme_core/parameters")
INITRAMFS_MODULES = Path("/proc/1/root/lib/modules")  # tests/guest/image.py puts the .ko files there
SYS_DELETE_MODULE = 176  # x86_64
SYS_FINIT_MODULE = 313
_NAMESPACE = re.compile(r"^nvme[0-9]+n[0-9]+$")  # not a multipath path nvmeXcYnZ
_PATH = re.compile(r"^nvme[0-9]+c[0-9]+n[0-9]+$")  # a multipath path: nvme<subsystem>c<controller>n<namespace>


class NvmeAdminError(OSError):
    """An admin command the controller completed with a non-zero status."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: NVMe status {status:#x}")
        self.status = status


@dataclass(frozen=True)
class SecondaryController:
    """One entry of the Secondary Controller List."""

    scid: int
    primary: int
    online: bool
    vf_number: int  # 1-based: virtfn0 is VF number 1
    queues: int
    interrupts: int


@dataclass(frozen=True)
class NvmeFunction:
    """A function on ``nvme``: its controller (``nvmeN``) and namespace block device (``/dev/nvmeNn1``;
    under native multipath the head's node ``/dev/nvme<S>n1``, and ``path`` the function's hidden
    path to it, ``nvme<S>c<C>n1``)."""

    address: str
    controller: str
    block: str
    path: str = ""


def admin_command(controller: str, opcode: int, *, nsid: int = 0, cdw10: int = 0, cdw11: int = 0,
                  data_len: int = 0, timeout_ms: int = 10000) -> tuple[int, bytes]:
    """Send one admin command to ``/dev/<controller>``; (completion dword 0, data). Raises
    NvmeAdminError for an NVMe status, OSError for a refused ioctl."""
    buffer = ctypes.create_string_buffer(data_len) if data_len else None
    address = ctypes.addressof(buffer) if buffer is not None else 0
    command = bytearray(PASSTHRU.pack(opcode, 0, 0, nsid, 0, 0, 0, address, 0, data_len,
                                      cdw10, cdw11, 0, 0, 0, 0, timeout_ms, 0))
    fd = os.open(f"/dev/{controller}", os.O_RDWR)
    try:
        status = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, command, True)
    finally:
        os.close(fd)
    if status != 0:
        raise NvmeAdminError(f"{controller}: admin opcode {opcode:#x} cdw10 {cdw10:#x} cdw11 {cdw11:#x}", status)
    result = PASSTHRU.unpack(bytes(command))[-1]
    return result, buffer.raw if buffer is not None else b""


def secondary_controllers(controller: str) -> list[SecondaryController]:
    """Identify CNS 15h from controller ID 0: every secondary controller of this primary."""
    _, data = admin_command(controller, ADMIN_IDENTIFY, cdw10=CNS_SECONDARY_CONTROLLER_LIST,
                            data_len=IDENTIFY_BYTES)
    count = data[0]
    entries = []
    for index in range(count):
        scid, pcid, scs, vfn, nvq, nvi = SECONDARY_ENTRY.unpack_from(data, 32 + 32 * index)
        entries.append(SecondaryController(scid, pcid, bool(scs & 1), vfn, nvq, nvi))
    return entries


def virt_mgmt(controller: str, action: int, cntlid: int, resource: int = 0, count: int = 0) -> int:
    """Virtualization Management: CDW10 = action | resource type << 8 | controller ID << 16, CDW11 = count."""
    result, _ = admin_command(controller, ADMIN_VIRT_MGMT, cdw10=action | resource << 8 | cntlid << 16,
                              cdw11=count)
    return result


def controller_of(address: str) -> str | None:
    """The ``nvmeN`` controller of a function bound to ``nvme`` (None while it has none)."""
    directory = PCI_DEVICES / address / "nvme"
    try:
        names = sorted(entry.name for entry in directory.iterdir())
    except FileNotFoundError:
        return None
    return names[0] if names else None


def controller_state(controller: str) -> str:
    try:
        return (NVME_CLASS_DIR / controller / "state").read_text().strip()
    except FileNotFoundError:
        return "gone"


def wait_live(address: str, timeout: float = LIVE_TIMEOUT) -> str:
    """Until the function's controller is live; its name."""
    def live() -> str:
        controller = controller_of(address)
        return controller if controller is not None and controller_state(controller) == "live" else ""
    return wait_until(live, timeout, f"{address}'s nvme controller live", interval=0.02)


def wait_on_nvme(address: str, timeout: float = BLOCK_TIMEOUT, *, hidden_path: bool = False) -> NvmeFunction:
    """Until the function is on nvme, its controller live and its namespace's node there; with
    ``hidden_path`` (native multipath on, a shared namespace) until its hidden path is there and
    the node of the head that path belongs to."""
    def ready() -> NvmeFunction | None:
        if driver_of(address) != NVME_DRIVER:
            return None
        controller = controller_of(address)
        if controller is None or controller_state(controller) != "live":
            return None
        if not hidden_path:
            block = namespace_block(address)
            return NvmeFunction(address, controller, block) if block is not None else None
        path = namespace_path(address)
        head = multipath_head(controller, path) if path is not None else None
        if path is None or head is None or not (Path("/dev") / head).exists():
            return None
        return NvmeFunction(address, controller, f"/dev/{head}", path)
    found: NvmeFunction | None = wait_until(ready, timeout, f"{address} on nvme with its namespace", interval=0.01)
    assert found is not None
    return found


def namespace_block(address: str) -> str | None:
    """``/dev/nvmeXnY`` of the function's first namespace once its node exists, else None. Needs
    the guest booted with ``NO_NVME_MULTIPATH`` when the namespace is shared: under native
    multipath a controller's view of it is a hidden path (``nvmeXcYnZ``) with no node of its own."""
    controller = controller_of(address)
    if controller is None:
        return None
    try:
        names = sorted(entry.name for entry in (NVME_CLASS_DIR / controller).iterdir()
                       if _NAMESPACE.match(entry.name))
    except FileNotFoundError:
        return None
    for name in names:
        node = Path("/dev") / name
        if node.exists():
            return str(node)
    return None


def namespace_path(address: str) -> str | None:
    """The hidden multipath path (``nvme<S>c<C>n<N>``) of the function's first namespace, under
    its controller in sysfs; None without one (multipath off, or a namespace not shared)."""
    controller = controller_of(address)
    if controller is None:
        return None
    try:
        names = sorted(entry.name for entry in (NVME_CLASS_DIR / controller).iterdir() if _PATH.match(entry.name))
    except FileNotFoundError:
        return None
    return names[0] if names else None


def subsystem_of(controller: str) -> Path | None:
    """The ``/sys/class/nvme-subsystem/nvme-subsysN`` holding a link named after ``controller``."""
    try:
        subsystems = sorted(NVME_SUBSYSTEM_CLASS_DIR.iterdir())
    except FileNotFoundError:
        return None
    return next((subsystem for subsystem in subsystems if (subsystem / controller).is_symlink()), None)


def multipath_head(controller: str, path: str) -> str | None:
    """The head (``nvme<S>n<N>``) the controller's hidden ``path`` belongs to, found as the kernel
    relates them rather than by name: the block device in the controller's subsystem whose
    ``nsid`` is the path's. None when there is none."""
    subsystem = subsystem_of(controller)
    try:
        nsid = (NVME_CLASS_DIR / controller / path / "nsid").read_text().strip()
    except FileNotFoundError:
        return None
    if subsystem is None:
        return None
    for entry in sorted(subsystem.iterdir()):
        if entry.is_symlink() or not (entry / "subsystem").is_symlink():
            continue  # the links to its controllers; its attributes
        if os.path.basename(os.readlink(entry / "subsystem")) != "block":
            continue  # the generic char device ngXnY
        try:
            if (entry / "nsid").read_text().strip() == nsid:
                return entry.name
        except FileNotFoundError:
            continue
    return None


def function_level_reset(address: str) -> None:
    """The PF's FLR (sysfs ``reset``); then until its controller is live again."""
    write(PCI_DEVICES / address / "reset", "1")
    time.sleep(RESET_SETTLE_SECONDS)
    wait_live(address)


def primary_flexible_to_zero(pf: str) -> None:
    """Step 1: the PF keeps none of the flexible queues and interrupts (QEMU applies it at FLR)."""
    controller = wait_live(pf)
    cntlid = int((NVME_CLASS_DIR / controller / "cntlid").read_text())
    virt_mgmt(controller, ACTION_PRIMARY_FLEXIBLE, cntlid, RESOURCE_VQ, 0)
    virt_mgmt(controller, ACTION_PRIMARY_FLEXIBLE, cntlid, RESOURCE_VI, 0)
    function_level_reset(pf)


def _syscall(number: int, *arguments: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, *arguments) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"syscall {number}: {os.strerror(error)}")


def multipath() -> bool:
    return (NVME_CORE_PARAMETERS / "multipath").read_text().strip() == "Y"


def reload_nvme_without_multipath(timeout: float = LIVE_TIMEOUT) -> None:
    """nvme and nvme_core unloaded and loaded again with ``multipath=N``, then every NVMe
    function's controller live. Debian's kernel has native NVMe multipath on: a subsystem's shared
    namespace is then one head (``/dev/nvme0n1``) and each controller's view of it a hidden path
    (``nvme0c4n1``, no node), so a VF's namespace would not come and go with its driver. The
    parameter is read-only once loaded, and the initramfs's busybox insmod does not take module
    parameters from the kernel command line: the modules are loaded again from the initramfs
    (``/proc/1/root``: /init's root, outside the chroot). Run before anything uses an NVMe device."""
    if not multipath():
        return
    functions = [path.name for path in PCI_DEVICES.iterdir() if driver_of(path.name) == NVME_DRIVER]
    for module in ("nvme", "nvme_core"):
        _syscall(SYS_DELETE_MODULE, module.encode(), ctypes.c_uint(os.O_NONBLOCK))
    for name, parameters in (("nvme-core.ko", b"multipath=N"), ("nvme.ko", b"")):
        fd = os.open(INITRAMFS_MODULES / name, os.O_RDONLY)
        try:
            _syscall(SYS_FINIT_MODULE, fd, parameters, 0)
        finally:
            os.close(fd)
    for function in functions:  # nvme probes asynchronously
        wait_live(function, timeout)


def enable_vfs_on_nvme(pf: str, count: int, *, timeout: float = BLOCK_TIMEOUT,
                       hidden_paths: bool = False) -> dict[str, NvmeFunction]:
    """Steps 1-4: ``count`` VFs of ``pf`` on ``nvme``, each with its controller live and its
    namespace block device (``hidden_paths``: native multipath on, its hidden path and the head's
    node); by VF address, in ``virtfnN`` order. The PF must be on nvme with no VFs."""
    primary_flexible_to_zero(pf)
    write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "0")
    set_num_vfs(pf, count)
    controller = wait_live(pf)
    by_number = {entry.vf_number: entry for entry in secondary_controllers(controller)}
    vfs = vfs_of(pf)
    for number in range(1, len(vfs) + 1):  # virtfn0 is VF number 1
        entry = by_number[number]
        if entry.online:
            virt_mgmt(controller, ACTION_SECONDARY_OFFLINE, entry.scid)
        virt_mgmt(controller, ACTION_SECONDARY_ASSIGN, entry.scid, RESOURCE_VQ, VF_QUEUES)
        virt_mgmt(controller, ACTION_SECONDARY_ASSIGN, entry.scid, RESOURCE_VI, VF_INTERRUPTS)
        virt_mgmt(controller, ACTION_SECONDARY_ONLINE, entry.scid)
    write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "1")
    for vf in vfs:
        if driver_of(vf) is None:
            write(DRIVERS_PROBE, vf)
    return {vf: wait_on_nvme(vf, timeout, hidden_path=hidden_paths) for vf in vfs}

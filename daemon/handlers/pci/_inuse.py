"""Whether the host still uses a PCI function that a DRA claim wants on vfio-pci (the checks of
``_rebind``): an interface of it carries the host's default route, or a block device of it is
mounted, used as swap or held by another block device (device-mapper, md).

A function's block devices are those the kernel nests below it (an NVMe namespace
``<function>/nvme/nvme1/nvme1n1``, a SCSI disk, their partitions) and, under native NVMe
multipath (``nvme_core.multipath=Y``, the default of Debian, Ubuntu and RHEL kernels), the head
of each namespace it has a path to, with the head's partitions. The head ``nvme<S>n<N>`` is the
block device the host mounts; it sits in its subsystem,
``devices/virtual/nvme-subsystem/nvme-subsys<S>/``, not below any function, which only has the
hidden path ``nvme/nvme<C>/nvme<S>c<C>n<N>`` (a block device without a device number: nothing
opens it). A head is the function's when one of its ``multipath/`` links (Linux 6.15 on) leads
below the function, or when a path below the function bears its name with ``c<C>`` added (how the
kernel names them; older kernels have no links). Unbinding the function takes that path away, the
only one or one of several: either way the namespace is not one to hand to a VM while the host
has it mounted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from daemon.core import AllocationError, link_name, list_dir, read_text

from ._discovery import read_proc_text

NVME_SUBSYSTEMS = "devices/virtual/nvme-subsystem"  # below the sysfs root
_BLOCK_DEPTH = 6  # directories below a function where its block devices sit (SCSI: host/target/lun/block/sdX)
_NVME_PATH = re.compile(r"nvme(\d+)c\d+n(\d+)")  # a multipath path: nvme<subsystem>c<controller>n<namespace>


@dataclass(frozen=True, slots=True)
class BlockDevice:
    """A block device or partition of a function: its name, its sysfs directory, and how it is
    the function's when it is not below it (``NVMe multipath, through its path nvme1c1n1``)."""

    name: str
    directory: str
    through: str = ""


def check_unused(sysfs_root: str, address: str, routes: frozenset[str], mounted: frozenset[str]) -> None:
    """AllocationError when the function carries the default route (an interface in ``routes``)
    or a block device of it is in use (its ``MAJ:MIN`` in ``mounted``, or held)."""
    device_dir = f"{sysfs_root}/bus/pci/devices/{address}"
    for ifname in list_dir(device_dir + "/net"):
        if ifname in routes:
            raise AllocationError(f"{address} carries the host's default route (interface {ifname}): it is never "
                                  "taken from its driver")
    for block in block_devices(sysfs_root, device_dir):
        _check_block_device(address, block, mounted)


def _check_block_device(address: str, block: BlockDevice, mounted: frozenset[str]) -> None:
    numbers = read_text(block.directory + "/dev")
    if numbers is not None and numbers in mounted:
        shown = f"{numbers}; {block.through}" if block.through else numbers
        raise AllocationError(f"{address}: its block device {block.name} ({shown}) is mounted or used as swap")
    holders = list_dir(block.directory + "/holders")
    if holders:
        shown = f" ({block.through})" if block.through else ""
        raise AllocationError(f"{address}: its block device {block.name}{shown} is held by {', '.join(holders)}")


def block_devices(sysfs_root: str, device_dir: str) -> Iterator[BlockDevice]:
    """Every block device and partition of the function at ``device_dir``: those below it, then
    the NVMe multipath heads it has a path to, each with its partitions."""
    below = list(_block_devices_below(device_dir))
    yield from below
    for head, path in _multipath_heads(sysfs_root, device_dir, (block.name for block in below)):
        name = os.path.basename(head)
        yield BlockDevice(name, head, f"NVMe multipath, through its path {path}")
        for partition in _block_devices_below(head):
            yield replace(partition, through=f"on NVMe multipath {name}, through its path {path}")


def _block_devices_below(directory: str) -> Iterator[BlockDevice]:
    """Every block device and partition below ``directory`` (a function's namespaces, disks, a
    disk's partitions; a hidden one without ``dev`` too), not following links (a PF's
    ``virtfnN``, a ``subsystem``, a head's ``multipath/``): the kernel nests them."""
    stack = [(directory, 0)]
    while stack:
        current, depth = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if link_name(entry.path + "/subsystem") == "block":
                yield BlockDevice(entry.name, entry.path)
            if depth < _BLOCK_DEPTH:
                stack.append((entry.path, depth + 1))


def _multipath_heads(sysfs_root: str, device_dir: str, names: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(directory, path name) of each NVMe multipath head with a path below the function, whose
    block devices are ``names``."""
    heads = {f"nvme{found[1]}n{found[2]}": name for name in names if (found := _NVME_PATH.fullmatch(name))}
    if not heads:
        return
    own = os.path.realpath(device_dir) + os.sep
    subsystems = f"{sysfs_root}/{NVME_SUBSYSTEMS}"
    for subsystem in list_dir(subsystems):
        for name in list_dir(f"{subsystems}/{subsystem}"):
            head = f"{subsystems}/{subsystem}/{name}"
            if link_name(head + "/subsystem") != "block":
                continue  # the links to its controllers, its attributes
            path = _path_below(head, own) or heads.get(name)
            if path is not None:
                yield head, path


def _path_below(head: str, own: str) -> str | None:
    """The name of the head's first ``multipath/`` link that leads below ``own``, or ``None``."""
    for name in list_dir(head + "/multipath"):
        if os.path.realpath(f"{head}/multipath/{name}").startswith(own):
            return name
    return None


def mounted_devices(proc_root: str) -> frozenset[str]:
    """``MAJ:MIN`` of every block device the host has mounted (the mount table of PID 1: the
    host's, also from a container given the host's ``/proc``) or uses as swap. Both are read
    whole: a node with many pods has a mount table far longer than one sysfs read."""
    text = read_proc_text(f"{proc_root}/1/mountinfo") or read_proc_text(f"{proc_root}/self/mountinfo")
    numbers = {fields[2] for line in text.splitlines() if len(fields := line.split()) > 2}
    for line in read_proc_text(f"{proc_root}/swaps").splitlines()[1:]:
        if line.split() and (found := _block_numbers(line.split()[0])) is not None:
            numbers.add(found)
    return frozenset(numbers)


def _block_numbers(path: str) -> str | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return f"{os.major(status.st_rdev)}:{os.minor(status.st_rdev)}" if status.st_rdev else None

"""A device's properties as the kernel and udev know them, read from sysfs and udev's database.

The kernel's own properties of a device are in its sysfs ``uevent`` file (``MAJOR``, ``MINOR``,
``DEVNAME``, ``DEVTYPE``, ``DRIVER``, ``PRODUCT``, ...) and its ``subsystem`` link; they are what a
kernel uevent carries. udevd adds its rules' properties (``ID_VENDOR_ID``, ``ID_SERIAL_SHORT``,
``ID_PATH``, ...) and symlinks (``/dev/serial/by-id/...``) and keeps them in its database, one file
per device under ``/run/udev/data``, named as systemd's ``device_get_device_id`` names them:

* ``c<major>:<minor>`` / ``b<major>:<minor>``: a device with a character / block node,
* ``n<ifindex>``: a network interface,
* ``+<subsystem>:<sysname>``: any other device (``+usb:1-2``, ``+usb:1-2:1.0``).

Each line is ``<letter>:<value>``: ``S:`` a symlink relative to /dev, ``E:`` a ``KEY=VALUE``
property, and others (``I:`` init time, ``G:``/``Q:`` tags, ``L:`` link priority, ``V:``
version, ``W:`` watch) this module does not need. libudev hard-codes ``/sys`` and ``/run/udev``,
so it cannot read the trees tests lay out elsewhere; the format is small and stable (systemd
``src/libsystemd/sd-device/device-private.c``), so it is read here, tolerantly: a line that is not
``<letter>:`` is skipped, bytes that are not UTF-8 become U+FFFD, a truncated file gives what it
holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

MAX_ENTRY_BYTES = 256 * 1024  # udev's entries are a few KiB; anything bigger is not one
# Keys only udevd's rules and builtins set; the kernel never sends them.
UDEV_ONLY_KEYS = frozenset({"DEVLINKS", "TAGS", "CURRENT_TAGS", "USEC_INITIALIZED"})
UDEV_ONLY_PREFIXES = ("ID_", "SYSTEMD_", "UDISKS_", "LIBINPUT_", "MTP_", "COLORD_", "SOUND_", "DM_", "LVM_")


def set_by_udev(key: str) -> bool:
    """Whether ``key`` is a property only udev sets (a kernel uevent never carries it)."""
    return key in UDEV_ONLY_KEYS or key.startswith(UDEV_ONLY_PREFIXES)


@dataclass(frozen=True, slots=True)
class UdevEntry:
    """What udev's database says of one device: its properties and symlinks (relative to /dev)."""

    properties: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    links: tuple[str, ...] = ()


NO_ENTRY = UdevEntry()


def parse_udev_entry(data: bytes) -> UdevEntry:
    """The entry's properties, with those libudev makes of its other lines, as udev's events
    carry them: ``DEVLINKS`` (``S:``), ``TAGS`` (``G:``), ``CURRENT_TAGS`` (``Q:``),
    ``USEC_INITIALIZED`` (``I:``)."""
    properties: dict[str, str] = {}
    lines: dict[str, list[str]] = {"S": [], "G": [], "Q": [], "I": []}
    for raw_line in data.split(b"\n"):
        line = raw_line.decode("utf-8", "replace")
        if len(line) < 2 or line[1] != ":":
            continue
        kind, value = line[0], line[2:]
        if kind == "E":
            key, equals, text = value.partition("=")
            if equals and key:
                properties[key] = text
        elif kind in lines and value:
            lines[kind].append(value)
    links = tuple(lines["S"])
    if links:
        properties["DEVLINKS"] = " ".join(sorted("/dev/" + link for link in links))
    for key, kind in (("TAGS", "G"), ("CURRENT_TAGS", "Q")):
        if lines[kind]:
            properties[key] = ":" + ":".join(lines[kind]) + ":"
    if lines["I"]:
        properties["USEC_INITIALIZED"] = lines["I"][-1]
    return UdevEntry(MappingProxyType(properties), links)


def udev_entry_name(properties: Mapping[str, str], sysname: str) -> str | None:
    """The database file name of a device with these kernel properties (``None``: no subsystem)."""
    subsystem = properties.get("SUBSYSTEM")
    major, minor = properties.get("MAJOR"), properties.get("MINOR")
    if major and minor and major.isdigit() and minor.isdigit():
        return f"{'b' if subsystem == 'block' else 'c'}{major}:{minor}"
    ifindex = properties.get("IFINDEX")
    if subsystem == "net" and ifindex and ifindex.isdigit():
        return f"n{ifindex}"
    return f"+{subsystem}:{sysname}" if subsystem else None


def read_udev_entry(data_dir: Path, name: str) -> UdevEntry:
    """The entry ``name`` in udev's database at ``data_dir`` (none there: an empty one)."""
    if "/" in name or name in (".", ".."):
        return NO_ENTRY
    try:
        with open(f"{data_dir}/{name}", "rb") as entry:
            data = entry.read(MAX_ENTRY_BYTES)
    except OSError:
        return NO_ENTRY  # not processed by udev (yet), or gone
    return parse_udev_entry(data)


def parse_uevent_file(data: bytes) -> dict[str, str]:
    """``KEY=VALUE`` lines of a sysfs ``uevent`` file."""
    properties: dict[str, str] = {}
    for raw_line in data.split(b"\n"):
        key, equals, value = raw_line.decode("utf-8", "replace").partition("=")
        if equals and key:
            properties[key] = value
    return properties


def read_uevent_file(directory: str) -> dict[str, str] | None:
    """The ``uevent`` file of the sysfs device ``directory`` (a string: a scan reads thousands
    of these, and pathlib's joins cost more than the read); ``None`` when it is gone."""
    try:
        with open(f"{directory}/uevent", "rb") as uevent:
            return parse_uevent_file(uevent.read(MAX_ENTRY_BYTES))
    except OSError:
        return None


def kernel_properties(sysfs_root: Path, devpath: str) -> dict[str, str]:
    """The kernel's properties of the device at ``devpath`` (``/devices/...``): its ``uevent``
    file, with ``SUBSYSTEM`` from its ``subsystem`` link and ``DEVPATH``; empty when it is gone."""
    directory = f"{sysfs_root}/{devpath.lstrip('/')}"
    properties = read_uevent_file(directory)
    if properties is None:
        return {}
    try:
        properties["SUBSYSTEM"] = os.path.basename(os.readlink(f"{directory}/subsystem"))
    except OSError:
        pass
    properties["DEVPATH"] = devpath
    return properties


def device_properties(sysfs_root: Path, devpath: str, udev_data: Path | None) -> tuple[dict[str, str], UdevEntry]:
    """Kernel properties, then (with ``udev_data``) udev's on top, and udev's entry for its links."""
    properties = kernel_properties(sysfs_root, devpath)
    if udev_data is None or not properties:
        return properties, NO_ENTRY
    name = udev_entry_name(properties, os.path.basename(devpath))
    entry = read_udev_entry(udev_data, name) if name else NO_ENTRY
    return {**properties, **entry.properties}, entry

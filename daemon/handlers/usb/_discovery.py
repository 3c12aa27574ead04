"""USB devices as sysfs shows them, with the device nodes of everything below them.

``/sys/bus/usb/devices`` links every USB device (``1-2``, ``1-2.1`` behind a hub: bus, then the
port path) and every interface (``1-2:1.0``: configuration 1, interface 0) to its directory under
``/sys/devices/.../usbN``. A device's class devices (``ttyUSB0``, ``hidraw0``, ``input/event3``,
``block/sda`` and ``sda1``, ``video4linux/video0``) live below its interfaces, each a directory
with a ``dev`` file and a ``DEVNAME`` in its ``uevent``; the device's own node is
``/dev/bus/usb/BBB/DDD``. A hub's children sit beside its interfaces, not below them, so walking
the interfaces never strays into another device.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from daemon.core import (
    HandlerContext,
    SysfsError,
    link_name,
    list_dir,
    read_hex_id,
    read_int,
    read_text,
    read_uevent_file,
)
from daemon.handlers._devnodes import DeviceNode, relative_devname, stat_node

log = logging.getLogger("devplugd.usb")

USB_DEVICES = Path("bus/usb/devices")
# a USB device's kernel name: bus, then port numbers through the hubs (root hubs are ``usbN``)
DEVICE_NAME = re.compile(r"[0-9]+-[0-9]+(\.[0-9]+)*")
ROOT_HUB = re.compile(r"usb[0-9]+")
STABLE_SERIAL = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# directories below an interface that hold no class device (its links, driver, subsystem, device,
# port, are never followed: only real directories are walked)
SKIPPED_DIRS = frozenset({"power"})


@dataclass(frozen=True, slots=True)
class UsbInterface:
    name: str  # ``1-2:1.0``
    interface_class: str | None  # two hex digits, ``ff``
    driver: str | None


@dataclass(frozen=True, slots=True)
class UsbDevice:
    name: str  # the kernel name, which is the port path: ``1-2.1``
    devpath: str  # below the sysfs root: ``/devices/pci0000:00/0000:00:14.0/usb1/1-2.1``
    vendor: str  # idVendor, four lower-case hex digits
    product: str  # idProduct
    serial: str | None
    serial_problem: str | None  # why the serial cannot name the device (None: it can, or there is none)
    interfaces: tuple[UsbInterface, ...]
    nodes: tuple[DeviceNode, ...]  # its own /dev/bus/usb node first, then its interfaces'
    numa_node: int | None
    settled: bool  # an interface (or the device itself) was bound: it is offered

    @property
    def port(self) -> str:
        return self.name

    @property
    def drivers(self) -> tuple[str, ...]:
        return tuple(interface.driver for interface in self.interfaces if interface.driver)


def device_name_in(devpath: str) -> tuple[str, str] | None:
    """The USB device an event's devpath is at or below, as (kernel name, its devpath)."""
    parts = devpath.split("/")
    for index in range(len(parts) - 1, 0, -1):
        if DEVICE_NAME.fullmatch(parts[index]):
            if not any(ROOT_HUB.fullmatch(part) for part in parts[:index]):
                return None  # an I2C client (``0-0050``) or the like: named alike, not USB
            return parts[index], "/".join(parts[: index + 1])
    return None


def _serial(directory: str) -> tuple[str | None, str | None]:
    try:
        serial = read_text(directory + "/serial")
    except SysfsError:
        return None, "its serial is not ASCII text"
    if serial is None or serial == "":
        return None, None
    if not STABLE_SERIAL.fullmatch(serial):
        return serial, f"its serial {serial[:80]!r} is not 1-64 of A-Z a-z 0-9 . _ : -"
    return serial, None


def _interface(directory: str, name: str) -> UsbInterface:
    try:
        interface_class = read_hex_id(directory + "/bInterfaceClass", 2)
    except SysfsError as error:
        log.warning("USB interface %s: %s", name, error)
        interface_class = None
    return UsbInterface(name, interface_class, link_name(directory + "/driver"))


def _nodes_below(context: HandlerContext, devpath: str, skip: str | None) -> list[DeviceNode]:
    """The nodes of the class devices below ``devpath`` (an interface), leaving out ``skip``
    (a device being removed) and what is below it; depth first, in name order, as ``find``
    would list them. ``scandir`` over string paths: every uevent of a USB device walks this, and
    ``os.walk`` with its joins and ``relpath`` was most of a fold."""
    nodes: list[DeviceNode] = []
    root = os.fspath(context.sysfs_root)
    pending = [devpath]
    while pending:
        current = pending.pop()
        if skip is not None and (current == skip or current.startswith(skip + "/")):
            continue
        try:
            with os.scandir(root + current) as listing:
                entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
        except OSError:
            continue  # gone mid-read: an interface or class device gone with its device
        if any(name == "dev" for name, _ in entries) and (node := _node_of(context, root + current)):
            nodes.append(node)
        pending.extend(sorted((f"{current}/{name}" for name, is_dir in entries
                               if is_dir and name not in SKIPPED_DIRS), reverse=True))
    return nodes


def _node_of(context: HandlerContext, directory: str) -> DeviceNode | None:
    devname = (read_uevent_file(directory) or {}).get("DEVNAME")
    if not devname or (relative := relative_devname(devname)) is None:
        return None
    return stat_node(context.dev_root, relative)


def _numa_node(context: HandlerContext, devpath: str) -> int | None:
    """The NUMA node of the host controller: the nearest ancestor with a ``numa_node``."""
    parent = devpath
    while parent.startswith("/devices/"):
        try:
            numa = read_int(f"{context.sysfs_root}{parent}/numa_node")
        except SysfsError:
            return None
        if numa is not None:
            return numa if numa >= 0 else None
        parent = os.path.dirname(parent)
    return None


def read_usb_device(context: HandlerContext, devpath: str, *, settled: bool | None,
                    skip: str | None = None, earlier: UsbDevice | None = None) -> UsbDevice | None:
    """The USB device at ``devpath``, or ``None`` when it is gone (or half gone: no IDs).
    ``settled`` None: settled when it or an interface has a driver (what a scan concludes).
    ``earlier``: its record before this event, whose host controller's NUMA node still holds.
    String paths throughout: every uevent of the device reads it again."""
    name = os.path.basename(devpath)
    directory = f"{context.sysfs_root}{devpath}"
    try:
        vendor = read_hex_id(directory + "/idVendor", 4)
        product = read_hex_id(directory + "/idProduct", 4)
    except SysfsError as error:
        log.warning("USB device %s left out: %s", name, error)
        return None
    if vendor is None or product is None:
        return None
    serial, serial_problem = _serial(directory)
    interfaces = tuple(
        _interface(f"{directory}/{entry}", entry)
        for entry in list_dir(directory)
        if entry.startswith(name + ":") and (skip is None or skip != f"{devpath}/{entry}")
    )
    own_node = _node_of(context, directory)
    nodes: list[DeviceNode] = [own_node] if own_node is not None else []
    for interface in interfaces:
        nodes.extend(_nodes_below(context, f"{devpath}/{interface.name}", skip))
    if settled is None:
        settled = link_name(directory + "/driver") is not None or any(i.driver for i in interfaces)
    numa_node = earlier.numa_node if earlier is not None else _numa_node(context, devpath)
    return UsbDevice(name, devpath, vendor, product, serial, serial_problem, interfaces, tuple(nodes),
                     numa_node, settled)


def scan_usb(context: HandlerContext) -> Mapping[str, UsbDevice]:
    devices: dict[str, UsbDevice] = {}
    links = context.sysfs_root / USB_DEVICES
    for name in list_dir(links):
        if not DEVICE_NAME.fullmatch(name):
            continue  # a root hub (usbN) or an interface (1-2:1.0)
        try:
            target = os.readlink(links / name)
        except OSError:
            continue
        devpath = os.path.normpath(os.path.join("/" + str(USB_DEVICES), target))
        device = read_usb_device(context, devpath, settled=None)
        if device is not None:
            devices[name] = device
    return MappingProxyType(devices)

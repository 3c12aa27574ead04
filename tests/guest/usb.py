"""USB hotplug in the guest: devices on ``run_in_guest(usb=True)``'s qemu-xhci, through QEMU's monitor.

    from tests.guest.usb import FTDI, KEYBOARD, plug, unplug, usb_sysfs_name, wait_bound

    plug(KEYBOARD)                      # device_add usb-kbd,bus=xhci.0,id=kbd1,serial=KBD0001,port=1
    wait_bound(KEYBOARD, 10)            # /sys/bus/usb/devices/1-1: every interface has its driver
    unplug(KEYBOARD)                    # device_del kbd1 (its chardev or drive goes with it)

The recipe is shared/docs/real-kernel-devices.md, section 3. What it teaches and this follows:

- qemu-xhci has QEMU ports 1..4 only; each is dual-speed: a keyboard or FTDI enumerates on bus 1
  (USB 2, ``1-<port>``), usb-storage on bus 2 (SuperSpeed, ``2-<port>``). With ``port=`` the
  kernel name is the same after a replug; devnum grows on every enumeration.
- usb-serial needs a ``file`` chardev (``null`` is never opened and the device never attaches):
  one per plug, at ``.guest/usb/<qdev id>.out`` in the share, removed again on unplug.
- usb-storage takes a drive made by ``drive_add`` (``if=none``), which QEMU deletes with the
  device: one per plug, on ``.guest/usb-disk.img`` (``write_disk_image``: an MBR with one
  partition, written on the host before boot by ``run_in_guest``).
- QEMU makes a serial up (``<magic>-<xhci BDF>-<port>``) unless ``serial=`` is given; an empty
  ``serial=`` gives a device with no serial string at all (no sysfs ``serial``).
- ``device_add`` -> first uevent 0.30-0.45 s under TCG; the disk's ``sda1`` about 1.4 s;
  ``device_del`` -> the last remove 0.03-0.32 s.

Only the standard library and tests.guest.monitor: this module runs in the guest, and the
host's ``run_in_guest`` imports ``write_disk_image`` from it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from tests.guest.monitor import CONTROL_DIR, MonitorError, Reply, hmp
from tests.waiting import wait_until

USB_BUS = "xhci.0"  # machine.USB_CONTROLLER_ID's bus (not imported: machine is host-side)
USB_DEVICES = Path("/sys/bus/usb/devices")
DISK_IMAGE = "usb-disk.img"  # in the share's .guest/ directory
CHARDEV_DIR = "usb"  # in the share's .guest/ directory: what the guest wrote to each usb-serial
DISK_MIB = 8
PARTITION_START = 2048  # sectors: the first partition at 1 MiB, as fdisk puts it
DISK_SIGNATURE = 0xFEA5F00D  # udev's by-partuuid link: /dev/disk/by-partuuid/fea5f00d-01
SECTOR = 512


@dataclass(frozen=True)
class UsbDevice:
    """One device QEMU can hot-plug on the xhci: its qdev id, QEMU model, port and serial
    (``None``: QEMU invents one; ``""``: none at all)."""

    qdev_id: str
    model: str  # usb-kbd, usb-serial or usb-storage
    port: int  # 1..4
    serial: str | None

    @property
    def bus(self) -> int:
        """The USB bus it enumerates on: storage is SuperSpeed (the xhci's USB 3 root hub)."""
        return 2 if self.model == "usb-storage" else 1


KEYBOARD = UsbDevice("kbd1", "usb-kbd", 1, "KBD0001")  # 0627:0001, usbhid: input/eventN + hidrawN
FTDI = UsbDevice("ftdi1", "usb-serial", 2, "FTDI0042")  # 0403:6001, ftdi_sio: ttyUSBn
DISK = UsbDevice("disk1", "usb-storage", 3, "STOR4242")  # 46f4:0001, usb-storage: sdX, sdX1, bsg
FTDI_NO_SERIAL = UsbDevice("ftdi2", "usb-serial", 4, "")  # 0403:6001 with no serial string


def usb_sysfs_name(device: UsbDevice) -> str:
    """The kernel's name for it: ``1-2`` (bus 1, port 2), ``2-3`` for the disk."""
    return f"{device.bus}-{device.port}"


def share_path(name: str) -> Path:
    return Path(os.environ["GUEST_SHARE"]) / CONTROL_DIR / name


def _checked(command: str) -> Reply:
    """HMP reports a refused device_add/chardev-add/drive_add as text (success prints nothing,
    or ``OK`` for drive_add): anything else is an error."""
    reply = hmp(command)
    if reply.text.strip() not in ("", "OK"):
        raise MonitorError(f"{command!r}: {reply.text.strip()}")
    return reply


def plug(device: UsbDevice) -> Reply:
    """Hot-add ``device`` (its chardev or drive first); returns the device_add's reply, whose
    ``requested_at`` (guest ``time.monotonic()``) is when QEMU was asked."""
    properties = [device.model, f"bus={USB_BUS}", f"id={device.qdev_id}", f"port={device.port}"]
    if device.serial is not None:
        properties.append(f"serial={device.serial}")
    if device.model == "usb-serial":
        output = share_path(CHARDEV_DIR) / f"{device.qdev_id}.out"
        output.parent.mkdir(exist_ok=True)
        _checked(f"chardev-add file,id={device.qdev_id}-chr,path={output}")
        properties.append(f"chardev={device.qdev_id}-chr")
    elif device.model == "usb-storage":
        _checked(f"drive_add 0 if=none,id={device.qdev_id}-drive,format=raw,file={share_path(DISK_IMAGE)}")
        properties.append(f"drive={device.qdev_id}-drive")
    return _checked("device_add " + ",".join(properties))


CHARDEV_RELEASE_TIMEOUT = 10.0


def unplug(device: UsbDevice) -> Reply:
    """``device_del`` (QEMU detaches a USB device at once and deletes its drive); then its chardev,
    which QEMU lets go only once the device object is finalized (deferred to an RCU grace period,
    so on a loaded host ``chardev-remove`` can find it still "busy" for a while: asked again)."""
    reply = _checked(f"device_del {device.qdev_id}")
    if device.model == "usb-serial":
        command = f"chardev-remove {device.qdev_id}-chr"
        answers: list[str] = []

        def removed() -> bool:
            answers.append(hmp(command).text.strip())
            if answers[-1] not in ("", "OK") and "is busy" not in answers[-1]:
                raise MonitorError(f"{command!r}: {answers[-1]}")
            return answers[-1] in ("", "OK")

        try:
            wait_until(removed, CHARDEV_RELEASE_TIMEOUT, interval=0.05)
        except AssertionError:
            raise MonitorError(f"{command!r}: {answers[-1]}") from None
    return reply


def interfaces(name: str) -> list[Path]:
    """The interfaces of USB device ``name`` (``1-2:1.0``...), as sysfs directories."""
    directory = USB_DEVICES / name
    try:
        return sorted(child for child in directory.iterdir() if child.name.startswith(f"{name}:"))
    except FileNotFoundError:
        return []


def is_bound(name: str) -> bool:
    """``name`` is there and it and every interface have a driver (its bind uevents were sent)."""
    found = interfaces(name)
    return bool(found) and (USB_DEVICES / name / "driver").exists() and all((i / "driver").exists() for i in found)


def wait_bound(device: UsbDevice, timeout: float = 15.0) -> None:
    name = usb_sysfs_name(device)
    wait_until(lambda: is_bound(name), timeout, f"{name} ({device.qdev_id}) bound", interval=0.01)


def wait_gone(device: UsbDevice, timeout: float = 15.0) -> None:
    name = usb_sysfs_name(device)
    wait_until(lambda: not (USB_DEVICES / name).exists(), timeout, f"{name} ({device.qdev_id}) removed", interval=0.01)


def _devname(directory: Path) -> str | None:
    if not (directory / "dev").is_file():
        return None
    try:
        lines = (directory / "uevent").read_text().splitlines()
    except OSError:
        return None
    return next((line.split("=", 1)[1] for line in lines if line.startswith("DEVNAME=")), None)


def device_nodes(name: str) -> list[str]:
    """What the spec says a usbDevice's Allocate carries, read from sysfs independently of the
    daemon: the device's own ``/dev/bus/usb/BBB/DDD``, then every node (a sysfs directory with
    ``dev`` and a ``DEVNAME``) below its interfaces, not below child USB devices; sorted."""
    own = _devname(USB_DEVICES / name)
    found = {f"/dev/{own}"} if own else set()
    for interface in interfaces(name):
        for root, directories, _files in os.walk(interface, followlinks=False):
            here = Path(root)
            directories[:] = [d for d in directories
                              if not (here / d).is_symlink() and not (here / d / "bConfigurationValue").exists()]
            devname = _devname(here)
            if devname:
                found.add(f"/dev/{devname}")
    return sorted(found)


def describe(name: str) -> dict[str, object]:
    """sysfs facts of USB device ``name`` (the test's expectations are checked against these)."""
    directory = USB_DEVICES / name

    def read(attribute: str) -> str | None:
        try:
            return (directory / attribute).read_text().strip()
        except OSError:
            return None

    return {"name": name, "vendor": read("idVendor"), "product": read("idProduct"), "serial": read("serial"),
            "devnum": read("devnum"), "busnum": read("busnum"), "nodes": device_nodes(name),
            "drivers": {i.name: (i / "driver").resolve().name if (i / "driver").exists() else None
                        for i in interfaces(name)}}


def write_disk_image(path: Path, size_mib: int = DISK_MIB) -> None:
    """A sparse raw disk of ``size_mib`` MiB with an MBR and one Linux partition (type 0x83)
    from sector 2048 to the end: the kernel's partition scan gives ``sdX1``. Run on the host."""
    sectors = size_mib * 1024 * 1024 // SECTOR
    entry = struct.pack("<B3sB3sII", 0, b"\xfe\xff\xff", 0x83, b"\xfe\xff\xff",
                        PARTITION_START, sectors - PARTITION_START)
    mbr = bytearray(SECTOR)
    struct.pack_into("<I", mbr, 440, DISK_SIGNATURE)
    mbr[446:462] = entry
    mbr[510:512] = b"\x55\xaa"
    with open(path, "wb") as disk:
        disk.write(mbr)
        disk.truncate(sectors * SECTOR)

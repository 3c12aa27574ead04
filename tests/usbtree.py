"""USB devices on a FakeHost as Linux and systemd-udevd lay them out, and the uevents of each
step of their hotplug and removal in the order a real kernel sends them.

Built from the kernel's ABI documentation (``Documentation/ABI/testing/sysfs-bus-usb``,
``sysfs-class-tty``, the driver model's ``uevent`` rules: ``MAJOR``/``MINOR``/``DEVNAME``/
``DEVTYPE``/``DRIVER`` first, then the bus's and the type's properties), systemd's udev database
writer (``device_update_db``: ``S:`` links, ``L:``, ``I:``, ``E:`` rule properties, ``G:``/``Q:``
tags, ``V:1``) and the real shapes in ``shared/docs/real-kernel-devices.md`` §3-4 (QEMU's
qemu-xhci with usb-kbd, usb-serial, usb-storage and usb-hub):

* the xHCI controller ``sys/devices/pci0000:00/<bdf>`` (class ``0x0c0330``, ``numa_node``,
  ``driver -> …/bus/pci/drivers/xhci_hcd``) with root hubs ``usb1`` (USB 2, ``1d6b:0002``) and
  ``usb2`` (USB 3, ``1d6b:0003``), their interface ``1-0:1.0`` (driver ``hub``) and ports;
* a usb_device ``usb<bus>/<bus>-<port>`` (``.<port>`` behind a hub: ``1-2/1-2.1``, the child a
  sibling of the hub's interfaces) with ``idVendor``, ``idProduct``, ``bcdDevice``, ``serial``
  (only when the device has one), ``busnum``, ``devnum``, ``devpath``, ``speed``, ``dev``
  (``189:<(bus-1)*128+devnum-1>``), ``port -> ../<hub interface>/<hub>-port<n>``, ``ep_00``,
  its node ``/dev/bus/usb/BBB/DDD``; interfaces ``<name>:1.<n>`` with ``bInterfaceClass`` and
  endpoints; below them the class devices with ``dev`` files (tty, hidraw, input, scsi disk and
  partition, bsg), each with its ``device`` link back up (a loop for a walker that follows links);
* ``subsystem`` and ``driver`` links, ``sys/bus/<bus>/devices/<name>``,
  ``sys/bus/<bus>/drivers/<driver>/<name>``, ``sys/class/<class>/<name>`` and
  ``sys/dev/{char,block}/M:m``, every one a relative symlink as sysfs shows it;
* udev's side: ``run/udev/data/{c,b}M:m`` and ``+<subsystem>:<sysname>`` files, the ``S:``
  symlinks under the dev root (``serial/by-id/…``, ``disk/by-path/…``) and ``char/M:m``.

A ``Plug`` is a list of ``Step``\\ s: each changes the tree as the kernel (and udevd) would, then
gives the uevent of that moment, as the kernel sends it or as udevd passes it on (the kernel's
properties plus the database's, ``DEVLINKS``, ``TAGS``). ``probe`` steps (a driver's link made
before its probe creates children) send nothing, as in the kernel.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from daemon.core import UEvent
from daemon.sources.uevent_wire import parse_kernel_uevent
from tests.fakesysfs import FakeHost, relative_link, write_file
from tests.uevents import kernel_message

USB_MAJOR = 189
TTY_USB_MAJOR = 188
INPUT_MAJOR = 13
HIDRAW_MAJOR = 244
BSG_MAJOR = 247
SD_MAJOR = 8
CONTROLLER = "0000:00:14.0"
USEC_BASE = 4_000_000


def _prune(directory: Path, stop: Path) -> None:
    """Remove ``directory`` and its parents up to ``stop`` while they are empty."""
    while directory != stop and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent


@dataclass(eq=False)
class Kobj:
    """One sysfs device: where it is, what its ``uevent`` file says, and udev's entry for it."""

    devpath: str  # relative to /sys: /devices/pci0000:00/0000:00:14.0/usb1/1-2
    subsystem: str
    is_class: bool  # ``subsystem`` -> class/<subsystem> (else bus/<subsystem>)
    head: dict[str, str] = field(default_factory=dict)  # DEVTYPE (MAJOR/MINOR/DEVNAME come from node)
    tail: dict[str, str] = field(default_factory=dict)  # the bus's and the type's properties
    attributes: dict[str, str] = field(default_factory=dict)
    node: tuple[str, int, int] | None = None  # DEVNAME, major, minor
    block: bool = False
    driver: str | None = None  # the driver that binds it (at its probe step)
    udev: dict[str, str] = field(default_factory=dict)  # E: lines
    links: list[str] = field(default_factory=list)  # S: lines, relative to /dev
    tags: list[str] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)  # name in its dir -> devpath it points to
    bound: bool = False
    usec: int = 0

    @property
    def name(self) -> str:
        return self.devpath.rsplit("/", 1)[1]

    @property
    def db_name(self) -> str:
        if self.node is not None:
            return f"{'b' if self.block else 'c'}{self.node[1]}:{self.node[2]}"
        return f"+{self.subsystem}:{self.name}"

    def kernel_properties(self) -> dict[str, str]:
        """What the ``uevent`` file says now (in the kernel's order)."""
        properties: dict[str, str] = {}
        if self.node is not None:
            properties.update(MAJOR=str(self.node[1]), MINOR=str(self.node[2]), DEVNAME=self.node[0])
        properties.update(self.head)
        if self.bound and self.driver is not None:
            properties["DRIVER"] = self.driver
        properties.update(self.tail)
        return properties


@dataclass
class Step:
    """One change of the tree and its uevent (none for ``probe``)."""

    action: str  # add, change, bind, unbind, remove, probe
    kobj: Kobj
    extra: dict[str, str] = field(default_factory=dict)  # properties only this event carries
    kernel: dict[str, str] = field(default_factory=dict)  # filled by apply
    udev: dict[str, str] = field(default_factory=dict)

    @property
    def sends(self) -> bool:
        """``probe`` has no uevent; nor has a device with neither bus nor class (a hub's ports)."""
        return self.action != "probe" and bool(self.kobj.subsystem)

    @property
    def devpath(self) -> str:
        return self.kobj.devpath

    def message(self, udev: bool = False) -> bytes:
        """The uevent in the kernel's wire format, as the unix seam takes it; ``udev``: with
        udevd's properties too (``DEVNAME`` stays relative: the seam's format is the kernel's)."""
        properties = dict(self.udev if udev else self.kernel)
        properties.pop("ACTION"), properties.pop("DEVPATH")
        return kernel_message(self.action, self.devpath, **properties)

    def event(self, udev: bool = False) -> UEvent:
        """The UEvent the daemon gets: from the kernel, the parse of the message; from udevd,
        what the ``udev`` source makes of libudev's device (its properties as udev has them,
        ``DEVNAME`` absolute there, relative in ``devname``)."""
        if not udev:
            return parse_kernel_uevent(self.message())
        properties = dict(self.udev)
        devname = properties.get("DEVNAME")
        if devname is not None:
            properties["DEVNAME"] = f"/dev/{devname}"
        return UEvent(self.action, self.devpath, self.kobj.subsystem, devname, MappingProxyType(properties))

    def __repr__(self) -> str:
        return f"{self.action}@{self.devpath}"


@dataclass(frozen=True)
class Interface:
    klass: str  # bInterfaceClass, 2 hex digits
    subclass: str
    protocol: str
    driver: str | None


@dataclass(frozen=True)
class UsbModel:
    """What an emulated USB device presents (descriptors and strings), and what its driver
    makes below its interface (``kind``)."""

    kind: str  # serial, keyboard, storage, hub
    vendor: str
    product: str
    bcd_device: str
    manufacturer: str
    product_name: str
    serial: str | None
    speed: str
    version: str
    device_class: str
    interface: Interface
    superspeed: bool = False
    interface_count: int = 1  # alike interfaces 1.0, 1.1, ... (an FT2232's two UARTs)


def ftdi(serial: str | None = "FTDI0042") -> UsbModel:
    """QEMU's usb-serial: an FTDI FT232 (0403:6001), bound by ftdi_sio, full speed."""
    return UsbModel("serial", "0403", "6001", "0600", "QEMU", "QEMU USB SERIAL", serial, "12", " 1.10", "00",
                    Interface("ff", "ff", "ff", "ftdi_sio"))


def ft2232(serial: str | None = "FT2232A") -> UsbModel:
    """A dual-UART FTDI FT2232H (0403:6010): two interfaces, each with its own ttyUSB."""
    return UsbModel("serial", "0403", "6010", "0700", "FTDI", "Dual RS232-HS", serial, "480", " 2.00", "00",
                    Interface("ff", "ff", "ff", "ftdi_sio"), interface_count=2)


def keyboard(serial: str | None = "KBD0001") -> UsbModel:
    """QEMU's usb-kbd (0627:0001): a boot-protocol HID keyboard bound by usbhid."""
    return UsbModel("keyboard", "0627", "0001", "0000", "QEMU", "QEMU USB Keyboard", serial, "480", " 2.00", "00",
                    Interface("03", "01", "01", "usbhid"))


def storage(serial: str | None = "STOR4242") -> UsbModel:
    """QEMU's usb-storage (46f4:0001): bulk-only mass storage, SuperSpeed on the USB 3 bus."""
    return UsbModel("storage", "46f4", "0001", "0000", "QEMU", "QEMU USB HARDDRIVE", serial, "5000", " 3.00", "00",
                    Interface("08", "06", "50", "usb-storage"), superspeed=True)


def hub(serial: str | None = "314159-0000:00:01.0-2") -> UsbModel:
    """QEMU's usb-hub (0409:55aa, 8 ports, full speed); QEMU invents its serial."""
    return UsbModel("hub", "0409", "55aa", "0101", "QEMU", "QEMU USB Hub", serial, "12", " 1.10", "09",
                    Interface("09", "00", "00", "hub"))


def _encode(text: str) -> str:
    """udev's ``*_ENC`` value: blanks and unsafe bytes as ``\\xNN``."""
    return "".join(c if c.isalnum() or c in "#+-.:=@_" else f"\\x{ord(c):02x}" for c in text)


def _replace_blanks(text: str) -> str:
    return text.strip().replace(" ", "_")


@dataclass
class Plug:
    """One device plugged in: its usb_device, every sysfs device below it, and its steps."""

    model: UsbModel
    name: str  # kernel name: 1-2, 1-2.1, 2-3
    busnum: int
    devnum: int
    usb_device: Kobj
    steps: list[Step]
    kobjs: list[Kobj] = field(default_factory=list)

    @property
    def devpath(self) -> str:
        return self.usb_device.devpath

    @property
    def bus_node(self) -> str:
        return f"/dev/bus/usb/{self.busnum:03d}/{self.devnum:03d}"

    def nodes(self) -> list[str]:
        """Every node of it present now: its own, then those below its interfaces."""
        own = [f"/dev/{k.node[0]}" for k in self.kobjs if k.node is not None and k is not self.usb_device]
        return [self.bus_node, *own]


class UsbTree:
    """USB devices on ``host`` behind one xHCI controller; ``udev``: a udevd keeps its
    database and links (else only the kernel's side is made)."""

    def __init__(self, host: FakeHost, *, controller: str = CONTROLLER, numa_node: int = 0, udev: bool = True) -> None:
        self.host = host
        self.controller = controller
        self.udev_enabled = udev
        self.seqnum = 1000
        self._devnums = {1: 1, 2: 1}
        self._input_no = 2
        self._hid_no = 0
        self._diskseq = 0
        self._usec = USEC_BASE
        self._reserved: set[str] = set()
        self.plugs: dict[str, Plug] = {}
        host.add_pci(controller, vendor="8086", device="a36d", class_code="0c0330", driver="xhci_hcd",
                     numa_node=numa_node, bridge=None)
        pci_dir = host.device_dir(controller)
        write_file(pci_dir / "uevent", f"DRIVER=xhci_hcd\nPCI_CLASS=C0330\nPCI_ID=8086:A36D\nPCI_SUBSYS_ID=8086:7270\n"
                                   f"PCI_SLOT_NAME={controller}\nMODALIAS=pci:v00008086d0000A36Dsv00008086sd00007270"
                                   f"bc0Csc03i30\n")
        relative_link(pci_dir / "subsystem", host.sys / "bus" / "pci")
        for bus in (1, 2):
            for step in self._root_hub(bus):
                self.apply(step)

    @property
    def udev_data(self) -> Path:
        return self.host.root / "run" / "udev" / "data"

    @property
    def pci_devpath(self) -> str:
        return self.host.devpath(self.controller)

    # -- the tree ------------------------------------------------------------------------------
    def _dir(self, kobj: Kobj) -> Path:
        return self.host.sys / kobj.devpath.lstrip("/")

    def apply(self, step: Step) -> Step:
        """Make ``step``'s change; its event's properties are those of that moment."""
        kobj = step.kobj
        getattr(self, f"_{step.action}")(kobj)
        self.seqnum += 1
        step.kernel = {"ACTION": step.action, "DEVPATH": kobj.devpath, "SUBSYSTEM": kobj.subsystem,
                       **kobj.kernel_properties(), **step.extra, "SEQNUM": str(self.seqnum)}
        step.udev = dict(step.kernel)
        step.udev.pop("SEQNUM")
        if self.udev_enabled:
            step.udev.update(kobj.udev)
            if kobj.links:
                step.udev["DEVLINKS"] = " ".join(f"/dev/{link}" for link in kobj.links)
            if kobj.tags:
                step.udev["TAGS"] = step.udev["CURRENT_TAGS"] = "".join(f":{t}" for t in kobj.tags) + ":"
            step.udev["USEC_INITIALIZED"] = str(kobj.usec)
        step.udev["SEQNUM"] = str(self.seqnum)
        return step

    def _write_uevent(self, kobj: Kobj) -> None:
        write_file(self._dir(kobj) / "uevent", "".join(f"{k}={v}\n" for k, v in kobj.kernel_properties().items()))

    def _add(self, kobj: Kobj) -> None:
        directory = self._dir(kobj)
        directory.mkdir(parents=True)
        for name, value in kobj.attributes.items():
            write_file(directory / name, value + "\n")
        self._write_uevent(kobj)
        for name, target in kobj.symlinks.items():
            relative_link(directory / name, self.host.sys / target.lstrip("/"))
        kind = "class" if kobj.is_class else "bus"
        if not kobj.subsystem:
            pass
        elif kobj.is_class:
            relative_link(directory / "subsystem", self.host.sys / kind / kobj.subsystem)
            if kobj.head.get("DEVTYPE") != "partition" and not kobj.devpath.startswith("/devices/virtual/"):
                relative_link(directory / "device", self._parent_device_dir(directory))  # back up: a loop to walkers
            relative_link(self.host.sys / "class" / kobj.subsystem / kobj.name, directory)
            if kobj.subsystem == "block" and kobj.head.get("DEVTYPE") == "disk":
                relative_link(self.host.sys / "block" / kobj.name, directory)
        else:
            relative_link(directory / "subsystem", self.host.sys / kind / kobj.subsystem)
            relative_link(self.host.sys / "bus" / kobj.subsystem / "devices" / kobj.name, directory)
        if kobj.node is not None:
            devname, major, minor = kobj.node
            write_file(directory / "dev", f"{major}:{minor}\n")
            relative_link(self.host.sys / "dev" / ("block" if kobj.block else "char") / f"{major}:{minor}", directory)
            self._mknod(devname, major, minor, kobj.block)
        if self.udev_enabled and kobj.subsystem:
            self._write_db(kobj)

    def _parent_device_dir(self, directory: Path) -> Path:
        """The device a class device hangs off: the nearest parent with a ``uevent`` that is not
        a class's grouping directory (``tty/``, ``block/``, ``input/``)."""
        parent = directory.parent
        while not (parent / "uevent").exists():
            parent = parent.parent
        return parent

    def _mknod(self, devname: str, major: int, minor: int, block: bool) -> None:
        path = self.host.dev / devname
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, (stat.S_IFBLK if block else stat.S_IFCHR) | 0o660, os.makedev(major, minor))

    def _write_db(self, kobj: Kobj) -> None:
        """udevd's database entry and links, as ``device_update_db`` and ``udev-node`` write them:
        a device without a node and with nothing udev added gets no entry."""
        self._usec += 1237
        kobj.usec = self._usec
        if kobj.node is None and not (kobj.udev or kobj.links or kobj.tags):
            return
        lines = [f"S:{link}" for link in kobj.links] + [f"I:{kobj.usec}"]
        lines += [f"E:{key}={value}" for key, value in kobj.udev.items()]
        lines += [f"G:{tag}" for tag in kobj.tags] + [f"Q:{tag}" for tag in kobj.tags] + ["V:1"]
        write_file(self.udev_data / kobj.db_name, "\n".join(lines) + "\n")
        if kobj.node is not None:
            node = self.host.dev / kobj.node[0]
            for link in kobj.links:
                relative_link(self.host.dev / link, node)
            relative_link(self.host.dev / ("block" if kobj.block else "char") / f"{kobj.node[1]}:{kobj.node[2]}", node)

    def _probe(self, kobj: Kobj) -> None:
        assert kobj.driver is not None
        driver_dir = self.host.sys / "bus" / kobj.subsystem / "drivers" / kobj.driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        relative_link(self._dir(kobj) / "driver", driver_dir)
        relative_link(driver_dir / kobj.name, self._dir(kobj))
        kobj.bound = True
        self._write_uevent(kobj)

    def _change(self, kobj: Kobj) -> None:
        """udevd runs its rules again and rewrites the entry before passing the event on."""
        if self.udev_enabled and kobj.subsystem:
            self._write_db(kobj)

    def _bind(self, kobj: Kobj) -> None:
        if not kobj.bound:
            self._probe(kobj)
        self._change(kobj)

    def _unbind(self, kobj: Kobj) -> None:
        driver_link = self._dir(kobj) / "driver"
        if driver_link.is_symlink():
            (driver_link.resolve() / kobj.name).unlink(missing_ok=True)
            driver_link.unlink()
        kobj.bound = False
        self._write_uevent(kobj)

    def _remove(self, kobj: Kobj) -> None:
        directory = self._dir(kobj)
        if not kobj.subsystem:
            pass
        elif kobj.is_class:
            (self.host.sys / "class" / kobj.subsystem / kobj.name).unlink(missing_ok=True)
            (self.host.sys / "block" / kobj.name).unlink(missing_ok=True)
        else:
            (self.host.sys / "bus" / kobj.subsystem / "devices" / kobj.name).unlink(missing_ok=True)
        if kobj.node is not None:
            devname, major, minor = kobj.node
            (self.host.sys / "dev" / ("block" if kobj.block else "char") / f"{major}:{minor}").unlink(missing_ok=True)
            (self.host.dev / devname).unlink(missing_ok=True)
            _prune((self.host.dev / devname).parent, self.host.dev)
        shutil.rmtree(directory)
        _prune(directory.parent, self.host.sys / "devices")
        self._reserved.discard(kobj.name)
        if self.udev_enabled:
            (self.udev_data / kobj.db_name).unlink(missing_ok=True)
            for link in kobj.links:
                (self.host.dev / link).unlink(missing_ok=True)
                _prune((self.host.dev / link).parent, self.host.dev)
            if kobj.node is not None:
                (self.host.dev / ("block" if kobj.block else "char") / f"{kobj.node[1]}:{kobj.node[2]}").unlink(
                    missing_ok=True)

    # -- root hubs -----------------------------------------------------------------------------
    def _root_hub(self, bus: int) -> list[Step]:
        usb3 = bus == 2
        devpath = f"{self.pci_devpath}/usb{bus}"
        device = Kobj(
            devpath, "usb", False, head={"DEVTYPE": "usb_device"},
            tail={"PRODUCT": f"1d6b/{3 if usb3 else 2}/601", "TYPE": "9/0/3" if usb3 else "9/0/1",
                  "BUSNUM": f"{bus:03d}", "DEVNUM": "001"},
            attributes={"idVendor": "1d6b", "idProduct": "0003" if usb3 else "0002", "bcdDevice": "0601",
                        "manufacturer": "Linux 6.1.0-37-amd64 xhci-hcd", "product": "xHCI Host Controller",
                        "serial": self.controller, "busnum": str(bus), "devnum": "1", "devpath": "0",
                        "bDeviceClass": "09", "bDeviceSubClass": "00", "bDeviceProtocol": "03" if usb3 else "01",
                        "bNumInterfaces": " 1", "bConfigurationValue": "1", "maxchild": "4",
                        "speed": "5000" if usb3 else "480", "version": " 3.00" if usb3 else " 2.00",
                        "authorized": "1", "removable": "unknown"},
            node=(f"bus/usb/{bus:03d}/001", USB_MAJOR, (bus - 1) * 128), driver="usb",
            udev={"ID_VENDOR_FROM_DATABASE": "Linux Foundation",
                  "ID_MODEL_FROM_DATABASE": "3.0 root hub" if usb3 else "2.0 root hub",
                  "ID_PATH": f"pci-{self.controller}", "ID_PATH_TAG": "pci-" + self.controller.replace(":", "_")
                  .replace(".", "_")})
        interface = Kobj(
            f"{devpath}/{bus}-0:1.0", "usb", False, head={"DEVTYPE": "usb_interface"},
            tail={"PRODUCT": device.tail["PRODUCT"], "TYPE": device.tail["TYPE"], "INTERFACE": "9/0/0",
                  "MODALIAS": f"usb:v1D6Bp000{3 if usb3 else 2}d0601dc09dsc00dp0{3 if usb3 else 1}"
                              "ic09isc00ip00in00"},
            attributes={"bInterfaceClass": "09", "bInterfaceSubClass": "00", "bInterfaceProtocol": "00",
                        "bInterfaceNumber": "00", "bAlternateSetting": " 0", "bNumEndpoints": "01"},
            driver="hub")
        steps = [Step("add", device), Step("probe", device), Step("add", interface), Step("probe", interface)]
        for port in range(1, 5):
            steps.append(Step("add", self._hub_port(interface.devpath, f"usb{bus}-port{port}")))
        return steps

    @staticmethod
    def _endpoint(parent_devpath: str, address: str) -> Kobj:
        """``ep_XX``: a usb_endpoint device, with neither bus nor class (no uevent, no node)."""
        return Kobj(f"{parent_devpath}/ep_{address}", "", True, head={"DEVTYPE": "usb_endpoint"},
                    attributes={"bEndpointAddress": address, "type": "Bulk" if address != "00" else "Control",
                                "direction": "in" if address.startswith("8") else "out", "interval": "0ms"})

    @staticmethod
    def _hub_port(interface_devpath: str, name: str) -> Kobj:
        # usb_port devices have neither bus nor class: no ``subsystem`` link, and the driver core
        # sends no uevent for them (dev_uevent_filter).
        return Kobj(f"{interface_devpath}/{name}", "", True, head={"DEVTYPE": "usb_port"},
                    attributes={"connect_type": "hotplug", "quirks": "00000000"})

    # -- plugging ------------------------------------------------------------------------------
    def plug(self, model: UsbModel, port: str) -> Plug:
        """The steps that plug ``model`` in at ``port`` (``2``, or ``2.1`` behind a hub at ``2``),
        nothing applied yet: apply them one by one (``apply``) or all at once (``attach``)."""
        bus = 2 if model.superspeed else 1
        name = f"{bus}-{port}"
        parent_name, _, hub_port = name.rpartition(".")
        if parent_name:
            parent = self.plugs[parent_name]
            parent_devpath = parent.devpath
            port_of = f"{parent_devpath}/{parent_name}:1.0/{parent_name}-port{hub_port}"
        else:
            parent_devpath = f"{self.pci_devpath}/usb{bus}"
            port_of = f"{parent_devpath}/{bus}-0:1.0/usb{bus}-port{port}"
        self._devnums[bus] += 1
        devnum = self._devnums[bus]
        plug = Plug(model, name, bus, devnum, None, [])  # type: ignore[arg-type]
        usb_device = self._usb_device(model, name, bus, devnum, f"{parent_devpath}/{name}", port)
        plug.usb_device = usb_device
        plug.steps = [Step("add", usb_device), Step("add", self._endpoint(usb_device.devpath, "00")),
                      Step("probe", usb_device), Step("change", usb_device)]
        for number in range(model.interface_count):
            interface = self._interface(model, usb_device, port, number)
            plug.steps += [Step("add", interface), Step("add", self._endpoint(interface.devpath, f"8{number + 1}")),
                           Step("add", self._endpoint(interface.devpath, f"0{number + 2}")), Step("probe", interface)]
            plug.steps += getattr(self, f"_{model.kind}_children")(model, plug, interface, port)
        # the generic driver's probe returns (its bind) once every interface's driver bound
        last_interface_bind = max(i for i, step in enumerate(plug.steps)
                                  if step.action == "bind" and step.kobj.head.get("DEVTYPE") == "usb_interface")
        plug.steps.insert(last_interface_bind + 1, Step("bind", usb_device))
        usb_device.symlinks["port"] = port_of
        plug.kobjs = list(dict.fromkeys(step.kobj for step in plug.steps))
        self.plugs[name] = plug
        return plug

    def attach(self, model: UsbModel, port: str) -> Plug:
        """Plug ``model`` in at ``port`` with every step applied (as before the daemon starts)."""
        plug = self.plug(model, port)
        for step in plug.steps:
            self.apply(step)
        return plug

    def hotplug(self, model: UsbModel, port: str, send: Callable[[Step], None]) -> Plug:
        plug = self.plug(model, port)
        self.run(plug.steps, send)
        return plug

    def run(self, steps: list[Step], send: Callable[[Step], None]) -> None:
        """Apply each step and hand each that sends a uevent to ``send``, in order."""
        for step in steps:
            self.apply(step)
            if step.sends:
                send(step)

    def unplug(self, name: str) -> list[Step]:
        """The steps that take the device at ``name`` out (its children first, as ``device_del``
        does: each child's remove, each bound device's unbind before its remove), nothing
        applied yet. A hub's devices behind it go first."""
        plug = self.plugs.pop(name)
        steps: list[Step] = []
        for child in [n for n in self.plugs if n.startswith(name + ".")]:
            steps += self.unplug(child)
        present = [k for k in plug.kobjs if self._dir(k).is_dir()]
        for kobj in reversed(present):
            if kobj.driver is not None:
                steps.append(Step("unbind", kobj))
            steps.append(Step("remove", kobj))
        return steps

    def detach(self, name: str) -> None:
        for step in self.unplug(name):
            self.apply(step)

    # -- the devices a model makes -------------------------------------------------------------
    def _id_path(self, port: str, *rest: str) -> str:
        return f"pci-{self.controller}-usb-0:{port}" + "".join(f":{part}" for part in rest)

    def _usb_udev(self, model: UsbModel, port: str) -> dict[str, str]:
        serial = f"{_replace_blanks(model.manufacturer)}_{_replace_blanks(model.product_name)}"
        properties = {
            "ID_VENDOR": _replace_blanks(model.manufacturer), "ID_VENDOR_ENC": _encode(model.manufacturer),
            "ID_VENDOR_ID": model.vendor, "ID_MODEL": _replace_blanks(model.product_name),
            "ID_MODEL_ENC": _encode(model.product_name), "ID_MODEL_ID": model.product,
            "ID_REVISION": model.bcd_device,
            "ID_SERIAL": serial + (f"_{model.serial}" if model.serial else ""),
        }
        if model.serial:
            properties["ID_SERIAL_SHORT"] = model.serial
        interface = model.interface
        properties.update(ID_BUS="usb", ID_USB_INTERFACES=f":{interface.klass}{interface.subclass}"
                                                            f"{interface.protocol}:")
        return properties

    def _usb_device(self, model: UsbModel, name: str, bus: int, devnum: int, devpath: str, port: str) -> Kobj:
        attributes = {
            "idVendor": model.vendor, "idProduct": model.product, "bcdDevice": model.bcd_device,
            "manufacturer": model.manufacturer, "product": model.product_name,
            "busnum": str(bus), "devnum": str(devnum), "devpath": port, "bDeviceClass": model.device_class,
            "bDeviceSubClass": "00", "bDeviceProtocol": "00", "bNumConfigurations": "1", "bNumInterfaces": " 1",
            "bConfigurationValue": "1", "bMaxPower": "100mA", "speed": model.speed, "version": model.version,
            "maxchild": "8" if model.kind == "hub" else "0", "authorized": "1", "removable": "removable",
            "quirks": "0x0", "avoid_reset_quirk": "0", "ltm_capable": "no", "rx_lanes": "1", "tx_lanes": "1",
        }
        if model.serial is not None:
            attributes["serial"] = model.serial
        udev = self._usb_udev(model, port)
        udev.update(ID_VENDOR_FROM_DATABASE=_VENDORS.get(model.vendor, model.manufacturer),
                    ID_PATH=self._id_path(port), ID_PATH_TAG=_tag(self._id_path(port)))
        product = f"{int(model.vendor, 16):x}/{int(model.product, 16):x}/{int(model.bcd_device, 16):x}"
        return Kobj(devpath, "usb", False, head={"DEVTYPE": "usb_device"},
                    tail={"PRODUCT": product, "TYPE": f"{int(model.device_class, 16)}/0/0",
                          "BUSNUM": f"{bus:03d}", "DEVNUM": f"{devnum:03d}"},
                    attributes=attributes, node=(f"bus/usb/{bus:03d}/{devnum:03d}", USB_MAJOR,
                                                 (bus - 1) * 128 + devnum - 1),
                    driver="usb", udev=udev)

    def _interface(self, model: UsbModel, device: Kobj, port: str, number: int) -> Kobj:
        interface = model.interface
        config = f"1.{number}"
        numbers = "/".join(str(int(x, 16)) for x in (interface.klass, interface.subclass, interface.protocol))
        modalias = (f"usb:v{model.vendor.upper()}p{model.product.upper()}d{model.bcd_device.upper()}"
                    f"dc{model.device_class.upper()}dsc00dp00ic{interface.klass.upper()}"
                    f"isc{interface.subclass.upper()}ip{interface.protocol.upper()}in{number:02X}")
        udev = {"ID_VENDOR_FROM_DATABASE": _VENDORS.get(model.vendor, model.manufacturer),
                "ID_PATH": self._id_path(port, config), "ID_PATH_TAG": _tag(self._id_path(port, config))}
        return Kobj(f"{device.devpath}/{device.name}:{config}", "usb", False, head={"DEVTYPE": "usb_interface"},
                    tail={"PRODUCT": device.tail["PRODUCT"], "TYPE": device.tail["TYPE"], "INTERFACE": numbers,
                          "MODALIAS": modalias},
                    attributes={"bInterfaceClass": interface.klass, "bInterfaceSubClass": interface.subclass,
                                "bInterfaceProtocol": interface.protocol, "bInterfaceNumber": f"{number:02d}",
                                "bAlternateSetting": " 0", "bNumEndpoints": "02", "modalias": modalias,
                                "supports_autosuspend": "1", "authorized": "1"},
                    driver=interface.driver, udev=udev)

    def _device_udev(self, model: UsbModel, port: str, interface: Kobj) -> dict[str, str]:
        """What udev's usb_id and path_id give a device below an interface (tty, input, disk)."""
        udev = self._usb_udev(model, port)
        udev.update(ID_USB_INTERFACE_NUM=interface.attributes["bInterfaceNumber"])
        if interface.driver is not None:
            udev["ID_USB_DRIVER"] = interface.driver
        config = interface.name.rsplit(":", 1)[1]
        udev.update(ID_PATH=self._id_path(port, config), ID_PATH_TAG=_tag(self._id_path(port, config)))
        return udev

    def _free(self, prefix: str, taken_in: Path, name: Callable[[int], str] | None = None) -> int:
        """The lowest free index of a kernel name (``ttyUSB<n>``), counting names planned by
        plugs not applied yet; the name is reserved until its device is removed."""
        name = name or (lambda index: f"{prefix}{index}")
        index = 0
        while (taken_in / name(index)).exists() or name(index) in self._reserved:
            index += 1
        self._reserved.add(name(index))
        return index

    def _serial_children(self, model: UsbModel, plug: Plug, interface: Kobj, port: str) -> list[Step]:
        index = self._free("ttyUSB", self.host.sys / "class" / "tty")
        tty_name = f"ttyUSB{index}"
        usb_serial = Kobj(f"{interface.devpath}/{tty_name}", "usb-serial", False, driver="ftdi_sio",
                          attributes={"port_number": "0", "latency_timer": "1"})
        udev = self._device_udev(model, port, interface)
        udev.update(ID_MM_CANDIDATE="1")
        links = [f"serial/by-id/usb-{udev['ID_SERIAL']}-if{udev['ID_USB_INTERFACE_NUM']}-port0",
                 f"serial/by-path/{udev['ID_PATH']}-port0"]
        tty = Kobj(f"{usb_serial.devpath}/tty/{tty_name}", "tty", True, node=(tty_name, TTY_USB_MAJOR, index),
                   udev=udev, links=links, tags=["systemd"])
        return [Step("add", usb_serial), Step("probe", usb_serial), Step("add", tty), Step("bind", usb_serial),
                Step("bind", interface)]

    def _keyboard_children(self, model: UsbModel, plug: Plug, interface: Kobj, port: str) -> list[Step]:
        self._hid_no += 1
        self._input_no += 1
        hid_name = f"0003:{model.vendor.upper()}:{model.product.upper()}.{self._hid_no:04X}"
        phys = f"usb-{self.controller}-{port}/input0"
        hid = Kobj(f"{interface.devpath}/{hid_name}", "hid", False, driver="hid-generic",
                   tail={"HID_ID": f"0003:0000{model.vendor.upper()}:0000{model.product.upper()}",
                         "HID_NAME": f"{model.manufacturer} {model.product_name}", "HID_PHYS": phys,
                         "HID_UNIQ": model.serial or "",
                         "MODALIAS": f"hid:b0003g0001v0000{model.vendor.upper()}p0000{model.product.upper()}"},
                   attributes={"country": "00"})
        wakeup = Kobj(f"{plug.devpath}/wakeup/wakeup{self._input_no + 10}", "wakeup", True,
                      attributes={"name": plug.name, "active_count": "0", "event_count": "0"})
        input_name = f"input{self._input_no}"
        udev = self._device_udev(model, port, interface)
        udev.update(ID_INPUT="1", ID_INPUT_KEY="1", ID_INPUT_KEYBOARD="1")
        input_dev = Kobj(f"{hid.devpath}/input/{input_name}", "input", True,
                         tail={"PRODUCT": f"3/{int(model.vendor, 16):x}/{int(model.product, 16):x}/0",
                               "NAME": f'"{model.manufacturer} {model.product_name}"', "PHYS": f'"{phys}"',
                               "UNIQ": f'"{model.serial or ""}"', "PROP": "0", "EV": "120013",
                               "KEY": "1000000000007 ff800000000007ff febeffdff3cfffff fffffffffffffffe",
                               "MSC": "10", "LED": "1f",
                               "MODALIAS": f"input:b0003v{model.vendor.upper()}p{model.product.upper()}e0000-e0,1,"
                                           "4,11,14,k71,72,73,ram4,l0,1,2,3,4,sfw"},
                         attributes={"name": f"{model.manufacturer} {model.product_name}", "phys": phys,
                                     "uniq": model.serial or ""},
                         udev=dict(udev), tags=["seat"])
        leds = [Kobj(f"{input_dev.devpath}/{input_name}::{led}", "leds", True,
                     attributes={"brightness": "0", "max_brightness": "1"})
                for led in ("numlock", "capslock", "scrolllock", "compose", "kana")]
        event_index = self._free("event", self.host.sys / "class" / "input")
        event_udev = dict(udev)
        event_udev.update(XKBMODEL="pc105", XKBLAYOUT="us", BACKSPACE="guess",
                          LIBINPUT_DEVICE_GROUP=f"3/{int(model.vendor, 16):x}/{int(model.product, 16):x}:"
                                                f"usb-{self.controller}-{port}")
        serial_part = udev["ID_SERIAL"]
        event = Kobj(f"{input_dev.devpath}/event{event_index}", "input", True,
                     node=(f"input/event{event_index}", INPUT_MAJOR, 64 + event_index), udev=event_udev,
                     links=[f"input/by-id/usb-{serial_part}-event-kbd",
                            f"input/by-path/{self._id_path(port, '1.0')}-event-kbd"],
                     tags=["power-switch"])
        hidraw_index = self._free("hidraw", self.host.sys / "class" / "hidraw")
        hidraw = Kobj(f"{hid.devpath}/hidraw/hidraw{hidraw_index}", "hidraw", True,
                      node=(f"hidraw{hidraw_index}", HIDRAW_MAJOR, hidraw_index))
        return [Step("add", hid), Step("probe", hid), Step("add", wakeup), Step("add", input_dev),
                *(Step("add", led) for led in leds), Step("add", event), Step("add", hidraw),
                Step("bind", hid), Step("bind", interface)]

    def _hub_children(self, model: UsbModel, plug: Plug, interface: Kobj, port: str) -> list[Step]:
        ports = [self._hub_port(interface.devpath, f"{plug.name}-port{n}") for n in range(1, 9)]
        return [*(Step("add", p) for p in ports), Step("bind", interface)]

    def _storage_children(self, model: UsbModel, plug: Plug, interface: Kobj, port: str) -> list[Step]:
        host_no = self._free("host", self.host.sys / "class" / "scsi_host")
        host = Kobj(f"{interface.devpath}/host{host_no}", "scsi", False, head={"DEVTYPE": "scsi_host"})
        scsi_host = Kobj(f"{host.devpath}/scsi_host/host{host_no}", "scsi_host", True,
                         attributes={"proc_name": "usb-storage", "unique_id": str(host_no)})
        hctl = f"{host_no}:0:0:0"
        target = Kobj(f"{host.devpath}/target{host_no}:0:0", "scsi", False, head={"DEVTYPE": "scsi_target"})
        sdev = Kobj(f"{target.devpath}/{hctl}", "scsi", False, head={"DEVTYPE": "scsi_device"}, driver="sd",
                    tail={"MODALIAS": "scsi:t-0x00"},
                    attributes={"vendor": "QEMU    ", "model": "QEMU HARDDISK   ", "rev": "2.5+", "type": "0",
                                "state": "running"})
        scsi_device = Kobj(f"{sdev.devpath}/scsi_device/{hctl}", "scsi_device", True)
        bsg = Kobj(f"{sdev.devpath}/bsg/{hctl}", "bsg", True,
                   node=(f"bsg/{hctl}", BSG_MAJOR, host_no))
        scsi_disk = Kobj(f"{sdev.devpath}/scsi_disk/{hctl}", "scsi_disk", True,
                         attributes={"cache_type": "write back", "protection_type": "0"})
        disk_index = self._free("sd", self.host.sys / "class" / "block", lambda index: f"sd{chr(ord('a') + index)}")
        disk = f"sd{chr(ord('a') + disk_index)}"
        self._diskseq += 1
        bdi = Kobj(f"/devices/virtual/bdi/{SD_MAJOR}:{16 * disk_index}", "bdi", True,
                   attributes={"read_ahead_kb": "128"})
        udev = self._device_udev(model, port, interface)
        disk_serial = f"QEMU_QEMU_HARDDISK_{model.serial}-0:0" if model.serial else "QEMU_QEMU_HARDDISK-0:0"
        scsi_path = f"{self._id_path(port, '1.0')}-scsi-0:0:0:0"
        udev.update(ID_VENDOR="QEMU", ID_VENDOR_ENC="QEMU\\x20\\x20\\x20\\x20", ID_MODEL="QEMU_HARDDISK",
                    ID_MODEL_ENC="QEMU\\x20HARDDISK\\x20\\x20\\x20", ID_REVISION="2.5+", ID_SERIAL=disk_serial,
                    ID_TYPE="disk", ID_INSTANCE="0:0", ID_PATH=scsi_path, ID_PATH_TAG=_tag(scsi_path),
                    ID_PART_TABLE_UUID="fea5f00d", ID_PART_TABLE_TYPE="dos")
        disk_links = [f"disk/by-id/usb-{disk_serial}", f"disk/by-path/{scsi_path}",
                      f"disk/by-diskseq/{self._diskseq}"]
        sda = Kobj(f"{sdev.devpath}/block/{disk}", "block", True, head={"DEVTYPE": "disk"},
                   tail={"DISKSEQ": str(self._diskseq)}, block=True,
                   node=(disk, SD_MAJOR, 16 * disk_index), udev=udev, links=disk_links, tags=["systemd"],
                   attributes={"size": "131072", "removable": "1", "ro": "0"})
        part_udev = dict(udev)
        part_udev.update(ID_PART_ENTRY_SCHEME="dos", ID_PART_ENTRY_UUID="fea5f00d-01", ID_PART_ENTRY_TYPE="0x83",
                         ID_PART_ENTRY_NUMBER="1", ID_PART_ENTRY_OFFSET="2048", ID_PART_ENTRY_SIZE="129024")
        sda1 = Kobj(f"{sda.devpath}/{disk}1", "block", True, head={"DEVTYPE": "partition"},
                    tail={"DISKSEQ": str(self._diskseq), "PARTN": "1"}, block=True,
                    node=(f"{disk}1", SD_MAJOR, 16 * disk_index + 1), udev=part_udev,
                    links=[f"{link}-part1" for link in disk_links[:2]] + ["disk/by-partuuid/fea5f00d-01"],
                    tags=["systemd"], attributes={"partition": "1", "start": "2048", "size": "129024"})
        return [Step("add", host), Step("add", scsi_host), Step("bind", interface),
                Step("add", target), Step("add", sdev), Step("add", scsi_device), Step("add", bsg),
                Step("probe", sdev), Step("add", scsi_disk),
                Step("change", sdev, extra={"SDEV_UA": "POWER_ON_RESET_OCCURRED"}),
                Step("add", bdi), Step("add", sda), Step("add", sda1), Step("bind", sdev)]


_VENDORS = {"0403": "Future Technology Devices International, Ltd", "0627": "Adomax Technology Co., Ltd",
            "46f4": "QEMU", "0409": "NEC Corp."}


def _tag(id_path: str) -> str:
    return "".join(c if c.isalnum() or c == "-" else "_" for c in id_path)

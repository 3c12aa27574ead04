"""Pools of whole USB devices (``deviceType: usbDevice``), each with every node below it.

``{"resourceName": "usb_serial", "deviceType": "usbDevice", "selectors": {"vendors": ["0403"]}}``
offers each matching USB device (see ``_selectors``) as one device whose Allocate carries its
``/dev/bus/usb/BBB/DDD`` node and the nodes of its interfaces (tty, hidraw, input events, disks
and partitions, video), as present at that moment, plus ``USBDEVICE_<PREFIX>_<NAME>`` (the IDs)
and ``USBDEVICE_<PREFIX>_<NAME>_INFO`` (JSON: vendor, product, serial, port, nodes per ID).

The device ID is the same across replug and reboot: ``serial-<serial>`` when the device has a
serial that can name it (printable, at most 64 characters, no other device present with the
same one), else ``port-<kernel name>`` (``port-1-2.1``: the physical port path), and the log
says why. Bus and device numbers change on every enumeration and are never used.

Events: every uevent at or below a USB device reads that device again. Its nodes come after the
``usb_device`` add (a disk's partitions more than a second later); the device is offered once an
interface's driver (or the device's own) sent its ``bind``, so a pod is not handed a keyboard
without its input nodes. At start, a device with a driver is taken as settled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from daemon.core import (
    HEALTHY,
    AttributeValue,
    ConfiguredPool,
    ContainerAllocation,
    DeviceChanged,
    DeviceInfo,
    DeviceMap,
    DeviceSpec,
    Event,
    Explanation,
    HandlerContext,
    Offered,
    PoolEntry,
    ResourcePool,
    Resync,
    UEvent,
    device_list_env_name,
)
from daemon.handlers._devnodes import DeviceNode, parse_permissions

from ._discovery import UsbDevice, device_name_in, read_usb_device, scan_usb
from ._explain import explain as explain_usb
from ._explain import why_empty as why_pool_empty
from ._selectors import UsbSelector, parse_selector

if TYPE_CHECKING:
    from daemon.core import Allocator, DeviceDescriber, Explainer, Handler

log = logging.getLogger("devplugd.usb")

ENV_FAMILY = "USBDEVICE"
MAX_ATTRIBUTE_LENGTH = 64  # a DRA string attribute's limit
UsbFacts = Mapping[str, UsbDevice]


@dataclass(frozen=True)
class UsbPoolSpec:
    selectors: tuple[UsbSelector, ...]
    permissions: str


def device_ids(facts: UsbFacts) -> dict[str, str]:
    """Kernel name -> device ID, for every device in ``facts``."""
    serial_count: dict[str, int] = {}
    for device in facts.values():
        if device.serial is not None and device.serial_problem is None:
            serial_count[device.serial] = serial_count.get(device.serial, 0) + 1
    return {
        name: f"serial-{device.serial}"
        if device.serial is not None and device.serial_problem is None and serial_count[device.serial] == 1
        else f"port-{name}"
        for name, device in facts.items()
    }


def _why_port_id(device: UsbDevice, facts: UsbFacts) -> str | None:
    if device.serial_problem is not None:
        return device.serial_problem
    if device.serial is None:
        return "it has no serial (in another port it is another device)"
    twins = sorted(name for name, other in facts.items() if other.serial == device.serial and name != device.name)
    return f"its serial {device.serial!r} is also the serial of {', '.join(twins)}" if twins else None


def _say_identity(device: UsbDevice, facts: UsbFacts) -> None:
    """Once per device seen: a device named by its port (no serial, or one that cannot name it) says why."""
    if (reason := _why_port_id(device, facts)) is not None:
        log.warning("USB device %s (%s:%s) is offered as port-%s, which follows the port, not the device: %s",
                    device.name, device.vendor, device.product, device.name, reason,
                    extra={"USB_DEVICE": device.name})


def _node_specs(device: UsbDevice, permissions: str) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(node.host_path, node.host_path, permissions) for node in device.nodes)


def _info(device: UsbDevice, nodes: Sequence[DeviceNode]) -> dict[str, Any]:
    return {"vendor": device.vendor, "product": device.product, "serial": device.serial,
            "port": device.port, "nodes": [node.host_path for node in nodes]}


class UsbDeviceHandler:
    name: ClassVar[str] = "usb"
    device_types: ClassVar[frozenset[str]] = frozenset({"usbDevice"})
    # a USB device's nodes come with events of their own subsystems (tty, hidraw, input, block, ...)
    subsystems: ClassVar[frozenset[str]] = frozenset()
    wants_links: ClassVar[bool] = False

    def __init__(self, context: HandlerContext) -> None:
        self._context = context

    def parse_pool(self, entry: PoolEntry) -> UsbPoolSpec:
        return UsbPoolSpec(tuple(parse_selector(selector) for selector in entry.selectors), parse_permissions(entry))

    def scan(self) -> UsbFacts:
        facts = scan_usb(self._context)
        for device in facts.values():
            _say_identity(device, facts)
        return facts

    def fold(self, facts: UsbFacts, event: Event) -> UsbFacts:
        """Read the USB device an event is at or below again (``Resync``: all of them)."""
        if isinstance(event, Resync):
            return self.scan()
        if isinstance(event, DeviceChanged):  # found changed at Allocate: read it as a kernel change says
            event = event.as_uevent()
        if not isinstance(event, UEvent) or (found := device_name_in(event.devpath)) is None:
            return facts
        name, devpath = found
        known = facts.get(name)
        device = None
        if not (event.action == "remove" and event.devpath == devpath):
            device = read_usb_device(self._context, devpath, settled=self._settled(known, event, devpath),
                                     skip=event.devpath if event.action == "remove" else None, earlier=known)
        if device == known:
            return facts
        updated = dict(facts)
        if device is None:
            updated.pop(name, None)
        else:
            updated[name] = device
            if known is None:
                _say_identity(device, updated)
        return MappingProxyType(updated)

    @staticmethod
    def _settled(known: UsbDevice | None, event: UEvent, devpath: str) -> bool:
        if event.action == "add" and event.devpath == devpath:
            return False  # enumerated just now: its interfaces are still to come
        parent, _, last = event.devpath.rpartition("/")
        if event.action == "bind" and (event.devpath == devpath or (parent == devpath and ":" in last)):
            return True  # the device's, or one of its interfaces', driver is bound
        return known.settled if known is not None else False

    def build(self, facts: UsbFacts, pools: Sequence[ConfiguredPool[UsbPoolSpec]]) -> dict[str, DeviceMap]:
        ids = device_ids(facts)
        taken: set[str] = set()
        result: dict[str, DeviceMap] = {}
        for pool in pools:
            spec: UsbPoolSpec = pool.spec
            devices: dict[str, DeviceInfo] = {}
            for name, device in sorted(facts.items()):
                if not device.settled or name in taken or not any(s.matches(device) for s in spec.selectors):
                    continue
                taken.add(name)
                numa = device.numa_node if device.numa_node is not None and not pool.entry.exclude_topology else None
                devices[ids[name]] = DeviceInfo(
                    health=HEALTHY,
                    numa_nodes=(numa,) if numa is not None else (),
                    specs=_node_specs(device, spec.permissions),
                    details=device,
                )
            result[pool.resource] = devices
        return result

    # Explainer: why a USB device is or is not in a pool (devplugd explain).
    def explain(self, facts: UsbFacts, pools: Sequence[ConfiguredPool[UsbPoolSpec]], device: str,
                offered: Offered) -> Explanation | None:
        return explain_usb(facts, pools, device, device_ids(facts), offered)

    def why_empty(self, facts: UsbFacts, pools: Sequence[ConfiguredPool[UsbPoolSpec]], resource: str) -> str:
        return why_pool_empty(facts, pools, resource)

    # Allocator: the nodes present now, and the USBDEVICE_* variables.
    def allocate(self, pool: ResourcePool, device_ids: Sequence[str]) -> ContainerAllocation:
        spec: UsbPoolSpec = pool.pool_config.spec
        allocation = ContainerAllocation()
        seen: set[str] = set()
        info: dict[str, Any] = {}
        for device_id in device_ids:
            known: UsbDevice = pool.devices[device_id].details
            device = read_usb_device(self._context, known.devpath, settled=known.settled, earlier=known) or known
            if device.nodes != known.nodes:
                allocation.reread.add(device_id)
                self._context.host_changes.device_changed(self.name, known.devpath, "usb",
                                                         "its device nodes changed since it was read")
            for node_spec in _node_specs(device, spec.permissions):
                if node_spec.host_path not in seen:
                    seen.add(node_spec.host_path)
                    allocation.specs.append(node_spec)
            info[device_id] = _info(device, device.nodes)
        prefix, _, name = pool.resource.partition("/")
        key = device_list_env_name(ENV_FAMILY, prefix, name)
        allocation.envs[key] = ",".join(device_ids)
        allocation.envs[f"{key}_INFO"] = json.dumps(info, separators=(",", ":"))
        return allocation

    # DeviceDescriber: what a ResourceSlice says of a USB device.
    def dra_attributes(self, pool: ResourcePool, device_id: str) -> Mapping[str, AttributeValue]:
        device: UsbDevice = pool.devices[device_id].details
        attributes: dict[str, AttributeValue] = {"vendor": device.vendor, "product": device.product,
                                                 "port": device.port}
        if device.serial is not None and len(device.serial) <= MAX_ATTRIBUTE_LENGTH:
            attributes["serial"] = device.serial
        return attributes


if TYPE_CHECKING:
    # mypy checks here that UsbDeviceHandler keeps the handler contract and the hooks it opts into.
    _handler: type[Handler[UsbFacts, UsbPoolSpec]] = UsbDeviceHandler
    _allocator: type[Allocator] = UsbDeviceHandler
    _describer: type[DeviceDescriber] = UsbDeviceHandler
    _explainer: type[Explainer] = UsbDeviceHandler

"""usbDevice pools on a fake host: a UsbDeviceHandler driven like the daemon drives it
(configure, scan, fold each uevent, build, Allocate), over a tree from tests/usbtree.py."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from daemon.core import (
    ConfiguredPool,
    ContainerAllocation,
    DeviceInfo,
    HandlerContext,
    ResourcePool,
)
from daemon.handlers.usb import UsbDeviceHandler
from tests.fakesysfs import FakeHost
from tests.handlerpools import allocate_as_daemon, build_by_name, configure_pools, pool_of
from tests.usbtree import Step

PREFIX = "intel.com"


class UsbPools:
    """A UsbDeviceHandler on ``host``; ``udev_data``: udev's database (None: kernel properties
    only, as with ``--uevent-source kernel``)."""

    def __init__(self, host: FakeHost, udev_data: Path | None) -> None:
        self.host = host
        self.handler = UsbDeviceHandler(HandlerContext(host.sys, host.dev, host.proc, host.root / "devinfo",
                                                       udev_data=udev_data))

    def configure(self, *entries: dict[str, Any]) -> list[ConfiguredPool[Any]]:
        return configure_pools(self.handler, entries, PREFIX, "usbDevice")

    def build(self, facts: Any, *entries: dict[str, Any]) -> dict[str, dict[str, DeviceInfo]]:
        """The devices of each pool (by resource name without the prefix) from ``facts``."""
        return build_by_name(self.handler, facts, self.configure(*entries))

    def scan_build(self, *entries: dict[str, Any]) -> dict[str, dict[str, DeviceInfo]]:
        return self.build(self.handler.scan(), *entries)

    def ids(self, *entries: dict[str, Any]) -> dict[str, set[str]]:
        return {name: set(devices) for name, devices in self.scan_build(*entries).items()}

    def fold(self, facts: Any, steps: Iterable[Step], *, udev: bool = False) -> Any:
        """``facts`` with the uevent of each step that sends one folded in (the steps already applied)."""
        for step in steps:
            if step.sends:
                facts = self.handler.fold(facts, step.event(udev))
        return facts

    def pool(self, entry: dict[str, Any], facts: Any = None) -> ResourcePool:
        (configured,) = self.configure(entry)
        return pool_of(self.handler, configured, facts)

    def allocate(self, pool: ResourcePool, device_ids: list[str]) -> ContainerAllocation:
        return allocate_as_daemon(self.handler, pool, device_ids)


def node_paths(info: DeviceInfo) -> list[str]:
    return [spec.host_path for spec in info.specs]

"""Real device nodes under a fake dev root (mknod), and a devNode handler over them."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

from daemon.core import HandlerContext
from daemon.handlers.devnode import DevNodeHandler
from tests.fakesysfs import FakeHost
from tests.handlerpools import configure_pools


def mknod(root: Path, relative: str, major: int, minor: int, *, block: bool = False) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, (stat.S_IFBLK if block else stat.S_IFCHR) | 0o660, os.makedev(major, minor))
    return path


class DevNodes:
    """A DevNodeHandler on ``host``; with ``udev_data``, reading udev's database there (as with
    the ``udev`` or ``unix:`` uevent source)."""

    def __init__(self, host: FakeHost, udev_data: Path | None = None) -> None:
        self.host = host
        self.root = host.dev
        context = HandlerContext(host.sys, host.dev, host.proc, host.root / "devinfo")
        if udev_data is not None:
            context = dataclasses.replace(context, udev_data=udev_data)
        self.handler = DevNodeHandler(context)

    def configure(self, *entries: dict[str, Any]) -> list[Any]:
        return configure_pools(self.handler, entries, "devices.kubevirt.io", "devNode")

    def build(self, *entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
        configured = self.configure(*entries)
        built = self.handler.build(self.handler.scan(), configured)
        return {pool.resource.split("/")[1]: dict(built[pool.resource]) for pool in configured}

    def ids(self, *entries: dict[str, Any]) -> dict[str, set[str]]:
        return {name: set(devices) for name, devices in self.build(*entries).items()}

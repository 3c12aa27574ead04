"""Event records: what sources put on the bus and the kernel loop routes.

Every record is a small frozen dataclass. Sources create them; nobody mutates them. The kernel
loop (``daemon/kernel.py``) decides who hears each one: device events go to the handlers that
declared interest, kubelet events go to the plugin servers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resync:
    """Rebuild facts from a full scan.

    ``handler`` names one handler, or is ``None`` for all of them. The daemon's first scan is a
    ``Resync(None, "start")`` sent over the bus like any other event; a source that may have lost
    events sends one for the handlers it feeds, so a lost event never leaves a wrong list behind.
    """

    handler: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class KubeletSocketCreated:
    """``kubelet.sock`` appeared in the device-plugin directory: a kubelet (re)started."""

    path: str


@dataclass(frozen=True, slots=True)
class PluginSocketRemoved:
    """A socket file in a directory we serve in was removed (the kubelet cleans sockets)."""

    path: str


Event = Resync | KubeletSocketCreated | PluginSocketRemoved

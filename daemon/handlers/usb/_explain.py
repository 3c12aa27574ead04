"""Why a USB device is, or is not, in a usbDevice pool (``devplugd explain``), with the build's
rules: a device is offered once a driver is bound to it or to one of its interfaces, by the first
pool (in file order) one of whose selectors matches it.

A device is named by its USB ID (``vendor:product``, e.g. ``0403:6001``: the first such device by
port), its port (``1-2.1``) or its device ID (``serial-FT123``, ``port-1-2.1``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from daemon.core import (
    LEFT_OUT,
    TOOK,
    ConfiguredPool,
    Explanation,
    Offered,
    PoolVerdict,
    first_pool_wins,
    refused_by_selectors,
)

from ._discovery import UsbDevice

if TYPE_CHECKING:
    from . import UsbPoolSpec

UsbFacts = Mapping[str, UsbDevice]


def find_usb(facts: UsbFacts, ids: Mapping[str, str], name: str) -> UsbDevice | None:
    wanted = name.strip()
    if wanted in facts:
        return facts[wanted]
    by_id = [port for port, device_id in ids.items() if device_id == wanted]
    if by_id:
        return facts[by_id[0]]
    vendor, colon, product = wanted.lower().partition(":")
    if colon:
        return next((d for _, d in sorted(facts.items()) if (d.vendor, d.product) == (vendor, product)), None)
    return None


def describe(device: UsbDevice) -> str:
    parts = [f"USB device {device.vendor}:{device.product}", f"port {device.port}"]
    parts.append(f"serial {device.serial!r}" if device.serial else "no serial")
    parts.append(f"drivers {', '.join(device.drivers)}" if device.drivers else "no driver bound")
    if device.nodes:
        parts.append("nodes " + ", ".join(node.host_path for node in device.nodes))
    return ", ".join(parts)


def explain(facts: UsbFacts, pools: Sequence[ConfiguredPool[UsbPoolSpec]], name: str, ids: Mapping[str, str],
            offered: Offered) -> Explanation | None:
    device = find_usb(facts, ids, name)
    if device is None:
        return None
    device_id = ids[device.name]

    def refusal(pool: ConfiguredPool[UsbPoolSpec]) -> PoolVerdict | None:
        return refused_by_selectors(pool.resource, [selector.mismatch(device) for selector in pool.spec.selectors])

    def placed(pool: ConfiguredPool[UsbPoolSpec]) -> PoolVerdict:
        info = offered.get(pool.resource, {}).get(device_id)
        if not device.settled:
            return PoolVerdict(pool.resource, LEFT_OUT, "its selectors take it, but no driver is bound to it or its "
                               "interfaces yet (it is offered once one is)")
        if info is None:
            return PoolVerdict(pool.resource, LEFT_OUT, "its selectors take it, but the pool does not list it yet")
        return PoolVerdict(pool.resource, TOOK, "its selectors take it", device_id, info.health)

    return Explanation("usb", device.port, describe(device), first_pool_wins(pools, refusal, placed))


def why_empty(facts: UsbFacts, pools: Sequence[ConfiguredPool[UsbPoolSpec]], resource: str) -> str:
    pool = next(p for p in pools if p.resource == resource)
    matching = [d for d in facts.values() if any(s.matches(d) for s in pool.spec.selectors)]
    if not matching:
        return f"no USB device plugged in matches its selectors ({len(facts)} USB devices seen)"
    return f"{len(matching)} USB devices match its selectors, but an earlier pool took them or no driver is bound " \
        f"yet (`devplugd explain {matching[0].port}` says which)"

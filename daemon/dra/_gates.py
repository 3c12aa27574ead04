"""Fields of our slices that a feature gate keeps, on a server where the gate is off.

The API server takes the write and drops the fields without a word (upstream's
``dropDisabledFields``): ``dropped_gates`` compares what we sent with what it answered.
``Fallbacks`` remembers, per pool, which gates were found off, and makes the pool's devices what
they must be without them: without taints an Unhealthy device would be schedulable, so it is
left out; without consumable capacity a shared device would be one claim's, so each share is a
device of its own. Until devplugd restarts: a server is not upgraded under a running driver often,
and a gate that flips back and forth would rewrite the pool each time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("devplugd.dra")

TAINTS_GATE, SHARING_GATE = "DRADeviceTaints", "DRAConsumableCapacity"
_INSTEAD = {TAINTS_GATE: "unhealthy devices are left out of its ResourceSlices",
            SHARING_GATE: "each share of a shared device is published as a device of its own"}

JsonObject = dict[str, Any]


def dropped_gates(sent: Sequence[Mapping[str, Any]], answered: Sequence[Mapping[str, Any]]) -> set[str]:
    """The feature gates whose fields our write had and the server's answer lacks."""
    kept = {device.get("name"): device for device in answered}
    gates: set[str] = set()
    for device in sent:
        if device.get("taints") or device.get("allowMultipleAllocations"):
            there = kept.get(device["name"]) or {}
            if device.get("taints") and not there.get("taints"):
                gates.add(TAINTS_GATE)
            if device.get("allowMultipleAllocations") and not there.get("allowMultipleAllocations"):
                gates.add(SHARING_GATE)
    return gates


class Fallbacks:
    def __init__(self) -> None:
        self._off: dict[str, set[str]] = {TAINTS_GATE: set(), SHARING_GATE: set()}  # gate -> pools

    def devices(self, pool: str, devices: list[JsonObject], unshared: list[JsonObject] | None) -> list[JsonObject]:
        """What ``pool`` publishes on this server: ``devices``, or ``unshared`` (its shares as
        devices) where sharing is off, without tainted devices where taints are off."""
        if unshared is not None and pool in self._off[SHARING_GATE]:
            devices = unshared
        if pool in self._off[TAINTS_GATE]:
            devices = [device for device in devices if "taints" not in device]
        return devices

    def dropped(self, pool: str, gates: set[str]) -> bool:
        """The server dropped the fields of ``gates`` from ``pool``'s write: whether the pool
        must be written again without them (one error line per pool and gate)."""
        fallen = False
        for gate in sorted(gates):
            if pool not in self._off[gate]:
                self._off[gate].add(pool)
                fallen = True
                log.error("DRA: the API server dropped fields of pool %s that its feature gate %s keeps (it is off: "
                          "Kubernetes 1.35 or older by default); %s instead until devplugd restarts", pool, gate,
                          _INSTEAD[gate], extra={"EVENT": "dra", "DRA_POOL": pool})
        return fallen

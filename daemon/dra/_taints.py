"""Device taints on their way to the API server: when each was added, and how many there are
by cause.

``slice_devices`` says which taint a device carries; the publisher puts them on the server with
``TaintTimes``, which gives each taint its ``timeAdded``: the one the same taint (key, value,
effect) has on the server or had in our last write, else now in whole seconds (the API stores
seconds; a finer time would be a change at every write). A taint published again keeps its time,
so a republish is no change and the tolerations' ``tolerationSeconds`` do not start again (the
Go helper's ``copyTaintTimeAdded``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Gauge

JsonObject = dict[str, Any]
TaintId = tuple[str, str, str]  # key, value, effect


def _taint_id(taint: Mapping[str, Any]) -> TaintId:
    return str(taint.get("key", "")), str(taint.get("value", "")), str(taint.get("effect", ""))


def whole_seconds(now: float) -> str:
    """``now`` (seconds since the epoch) as the API's time, RFC 3339 in whole seconds, UTC."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))


def with_times(entry: Mapping[str, Any], prior: Mapping[str, Any] | None, now: str) -> JsonObject:
    """``entry`` with a ``timeAdded`` on each taint: the prior entry's for the same taint, else ``now``."""
    times = {_taint_id(t): t["timeAdded"] for t in (prior or {}).get("taints") or [] if t.get("timeAdded")}
    return {**entry, "taints": [{**taint, "timeAdded": times.get(_taint_id(taint), now)}
                                for taint in entry["taints"]]}


def cause_of(taint: Mapping[str, Any]) -> str:
    """The cause a taint names: its key's name part (``devplugd.io/carrier-lost`` -> ``carrier-lost``)."""
    return str(taint.get("key", "")).rpartition("/")[2]


class TaintTimes:
    """Per pool, each tainted device's entry as wanted (from ``slice_devices``) and as sent."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._sent: dict[str, dict[str, tuple[Mapping[str, Any], JsonObject]]] = {}
        self._stamped: set[str] = set()  # pools stamped before: what the server has came from us

    def stamp(self, pool: str, devices: list[JsonObject],
              on_server: Callable[[], Mapping[str, Mapping[str, Any]]]) -> tuple[list[JsonObject], Counter[str]]:
        """``devices`` with their taints' times, and the count of tainted devices by cause.
        ``on_server`` gives the pool's devices on the server by name; it is asked only for a
        taint of a pool this publisher has not stamped before (after a restart: the last run's
        times); later, a taint it did not send is new."""
        known = self._sent.get(pool)
        first = pool not in self._stamped
        self._stamped.add(pool)
        if known is None and not any("taints" in device for device in devices):
            return devices, Counter()
        known = known or {}
        sent: dict[str, tuple[Mapping[str, Any], JsonObject]] = {}
        causes: Counter[str] = Counter()
        stamped = devices
        server: Mapping[str, Mapping[str, Any]] | None = None
        now = ""
        for index, device in enumerate(devices):
            if "taints" not in device:
                continue
            name = device["name"]
            before = known.get(name)
            if before is not None and before[0] is device:
                entry = before[1]
            else:
                if before is None and server is None and first:
                    server = on_server()
                prior = before[1] if before is not None else (server or {}).get(name)
                now = now or whole_seconds(self._clock())
                entry = with_times(device, prior, now)
            if stamped is devices:
                stamped = list(devices)
            stamped[index] = entry
            sent[name] = (device, entry)
            causes.update(cause_of(taint) for taint in entry["taints"])
        if sent:
            self._sent[pool] = sent
        else:
            self._sent.pop(pool, None)
        return stamped, causes

    def forget(self, pool: str) -> None:
        self._sent.pop(pool, None)
        self._stamped.discard(pool)


class TaintCounts:
    """The taint gauge (``devplugd_dra_device_taints``): devices published with a taint, by pool
    and cause; a cause no device has any more leaves the gauge."""

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._causes: dict[str, set[str]] = {}  # resource -> the causes the gauge has

    def count(self, resource: str, causes: Mapping[str, int]) -> None:
        for cause, count in causes.items():
            self._gauge.labels(resource, cause).set(count)
        for cause in self._causes.get(resource, set()) - causes.keys():
            self._gauge.remove(resource, cause)
        if causes:
            self._causes[resource] = set(causes)
        else:
            self._causes.pop(resource, None)

    def keep(self, resources: set[str]) -> None:
        """Only these pools are published: the others leave the gauge."""
        for resource in self._causes.keys() - resources:
            self.count(resource, {})

"""DRA claims as the kubelet names them (``ClaimRef``) and as the API server allocated them
(``driver_results`` reads and checks ``status.allocation``); how this node prepared them is
``_prepared.py``'s.

A result of a prioritized list (KEP-4816, ``firstAvailable``) names its request
``<main>/<subrequest>``; the pod spec and the kubelet know only ``<main>`` (``base_request``), and
a config applies to a result when it names no request, its main request or its subrequest
(``config_applies``: upstream's ``resourceclaim.BaseRequestRef`` and ``ConfigForResult``). The one
config of ours a result may carry is a ``VfioConfig`` (``_vfioconfig.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ._devices import SHARES
from ._vfioconfig import VfioConfig, parse_vfio_config

# -- a claim as the kubelet names it and as the API server allocated it --------------------------


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    uid: str
    name: str

    @property
    def label(self) -> str:
        return f"claim {self.namespace}/{self.name}"


class ClaimNotFound(Exception):
    """The API server has no such claim (404)."""


class ClaimRefused(Exception):
    """A claim that cannot be prepared; the message (the claim's error) says which and why."""


@dataclass(frozen=True)
class AllocationResult:
    """One ``status.allocation.devices.results[]`` entry of our driver. ``request`` as the
    allocation names it (``<main>/<subrequest>`` for a prioritized list); ``share_id`` is the
    result's ``shareID`` (one share of a device allocated with consumable capacity), or ``None``."""

    request: str
    pool: str
    device: str
    admin_access: bool
    share_id: str | None = None
    shares: int = 1  # of a shared device: the shares it consumed (consumedCapacity's ``shares``)
    vfio: VfioConfig | None = None  # the VfioConfig that applies to it: the device goes to vfio-pci

    @property
    def main_request(self) -> str:
        return base_request(self.request)


# a result's request: a request's name, or a request's and one of its subrequests' (KEP-4816)
_REQUEST = re.compile(r"[^/]+(?:/[^/]+)?")


def base_request(request: str) -> str:
    """The request a pod's containers name (``nic`` of ``nic/fast``), as upstream's
    ``resourceclaim.BaseRequestRef``."""
    return request.split("/", 1)[0]


def config_applies(config_requests: Sequence[str], request: str) -> bool:
    """Whether a config naming ``config_requests`` applies to a result of ``request``: it names
    none (it is for every request), the result's request, or its main request (upstream's
    ``resourceclaim.ConfigForResult``)."""
    return not config_requests or request in config_requests or base_request(request) in config_requests


def driver_results(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[AllocationResult]:
    """The allocation results of ``driver`` in ``claim`` as the API server returns it, checked:
    the UID the kubelet named, allocated, well formed; an opaque config for ``driver`` that
    applies to one of them must be a ``VfioConfig`` (``_vfioconfig.py``), which that result
    carries (a config naming only a subrequest the allocation did not choose applies to
    nothing; of two that apply, the later: the class's come before the claim's); results of
    other drivers are left out. ClaimRefused says what is wrong."""
    label = ref.label

    def malformed(what: str) -> ClaimRefused:
        return ClaimRefused(f"{label}: malformed claim from the API server: {what}")

    metadata = _object(claim.get("metadata") if isinstance(claim, Mapping) else None, "metadata", malformed)
    uid = metadata.get("uid")
    if not isinstance(uid, str):
        raise malformed("metadata.uid is not a string")
    if uid != ref.uid:
        raise ClaimRefused(f"{label} got replaced: the API server has UID {uid}, the kubelet asked for {ref.uid}")
    status = claim.get("status")
    if status is not None and not isinstance(status, Mapping):
        raise malformed("status is not an object")
    allocation = status.get("allocation") if status is not None else None
    if allocation is None:
        raise ClaimRefused(f"{label} not allocated")
    allocation = _object(allocation, "status.allocation", malformed)
    devices = _object(allocation.get("devices") or {}, "status.allocation.devices", malformed)
    results = []
    for index, item in enumerate(_list(devices.get("results"), "status.allocation.devices.results", malformed)):
        where = f"status.allocation.devices.results[{index}]"
        item = _object(item, where, malformed)
        if not isinstance(item.get("driver"), str):
            raise malformed(f"{where}.driver is not a string")
        if item["driver"] != driver:
            continue
        for key in ("request", "pool", "device"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise malformed(f"{where}.{key} is missing or not a non-empty string")
        if not _REQUEST.fullmatch(item["request"]):
            raise malformed(f"{where}.request {item['request']!r} is neither <request> nor <request>/<subrequest>")
        admin_access = item.get("adminAccess")
        if admin_access is not None and not isinstance(admin_access, bool):
            raise malformed(f"{where}.adminAccess is not true or false")
        share_id = item.get("shareID")
        if share_id is not None and (not isinstance(share_id, str) or not share_id):
            raise malformed(f"{where}.shareID is not a non-empty string")
        results.append(AllocationResult(item["request"], item["pool"], item["device"], bool(admin_access),
                                        share_id, _consumed_shares(item, driver, where, malformed)))
    for index, entry in enumerate(_list(devices.get("config"), "status.allocation.devices.config", malformed)):
        where = f"status.allocation.devices.config[{index}]"
        entry = _object(entry, where, malformed)
        if entry.get("opaque") is None:
            continue
        opaque = _object(entry["opaque"], f"{where}.opaque", malformed)
        if not isinstance(opaque.get("driver"), str):
            raise malformed(f"{where}.opaque.driver is not a string")
        if opaque["driver"] != driver:
            continue
        requests = _list(entry.get("requests"), f"{where}.requests", malformed)
        if not all(isinstance(request, str) for request in requests):
            raise malformed(f"{where}.requests is not a list of strings")
        applies = [index for index, result in enumerate(results) if config_applies(requests, result.request)]
        if not applies:
            continue
        try:
            vfio = parse_vfio_config(opaque.get("parameters"), f"{where}.opaque.parameters")
        except ValueError as error:
            shown = ", ".join(f"{results[i].device} of pool {results[i].pool}" for i in applies)
            raise ClaimRefused(f"{label}: {error} (source {entry.get('source')}; for {shown})") from error
        for index in applies:  # a later config overrides an earlier one: the class's come first
            results[index] = replace(results[index], vfio=vfio)
    return results


def _consumed_shares(item: Mapping[str, Any], driver: str, where: str,
                     malformed: Callable[[str], ClaimRefused]) -> int:
    """The shares of a shared device a result consumed: its ``consumedCapacity`` of ``shares``
    (the capacity our slices publish; 1 when it says none)."""
    consumed = _object(item.get("consumedCapacity") or {}, f"{where}.consumedCapacity", malformed)
    value = consumed.get(SHARES, consumed.get(f"{driver}/{SHARES}", "1"))
    text = str(value)
    if not re.fullmatch(r"[0-9]{1,9}", text) or int(text) < 1:  # not '²' (a digit to isdigit), not 10^4300
        raise malformed(f"{where}.consumedCapacity shares {value!r} is not a whole number of shares")
    return int(text)


def _object(value: Any, where: str, malformed: Callable[[str], ClaimRefused]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise malformed(f"{where} is not an object")
    return value


def _list(value: Any, where: str, malformed: Callable[[str], ClaimRefused]) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise malformed(f"{where} is not a list")
    return value

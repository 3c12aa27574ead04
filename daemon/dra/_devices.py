"""A DRA pool's ``devices[]`` entries, built from the tree alone.

``slice_devices`` turns one pool into the entries its ResourceSlices publish (``_slices.py`` cuts
them into slices): the devices the availability rule offers, Unhealthy ones with a taint naming
why, a device's shares as one shared device, each with its attributes.

What an entry may hold is checked here against the API server's own limits (``validation.go``),
so one bad attribute never costs a whole slice: an attribute the server would refuse is left
out and logged (logger ``devplugd.dra``) with the reason, the device is still published.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping, MutableSet, Sequence
from typing import Any

from daemon.core import AttributeValue, DeviceDescriber, DeviceInfo, Fault, ResourcePool
from daemon.core._config import OMIT_UNHEALTHY
from daemon.core._handler import Hooks
from daemon.core._names import dns_subdomain_problem, label_value_problem
from daemon.core._tree import UNNAMED_FAULT, VANISHED_FAULT
from daemon.holdings import SLICE_ASKS, UNHEALTHY, VANISHED, holder_of, refusal
from daemon.holdings._rule import rule_context

from ._names import device_name

log = logging.getLogger("devplugd.dra")

MAX_ATTRIBUTES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_STRING_LENGTH = 64  # DeviceAttributeMaxValueLength, in bytes (Go's len)
MAX_ID_LENGTH = 32  # DeviceMaxIDLength: the name part of a QualifiedName
MAX_DOMAIN_LENGTH = 63  # DeviceMaxDomainLength: its domain
STANDARD_NUMA_NODE = "resource.kubernetes.io/numaNode"  # KEP-6072: an int, left out when sysfs says -1
SHARES = "shares"  # the capacity of a shared device: how many claims may hold it at once
INT64 = range(-(2**63), 2**63)

_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=256)  # the same dozen names on every device of every pool
def qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not a device attribute name (a QualifiedName): a C identifier of at most
    32 characters, optionally after a ``<DNS subdomain of at most 63>/`` domain; ``None`` if it is."""
    domain, slash, identifier = name.rpartition("/")
    if slash:
        if "/" in domain:
            return "has more than one '/'"
        if problem := dns_subdomain_problem(domain, MAX_DOMAIN_LENGTH):
            return f"domain {domain!r} {problem}"
    if not _C_IDENTIFIER.fullmatch(identifier):
        return f"{identifier!r} is not a C identifier (letters, digits, '_', not starting with a digit)"
    if len(identifier) > MAX_ID_LENGTH:
        return f"{identifier!r} is longer than {MAX_ID_LENGTH} characters"
    return None


def string_problem(value: str) -> str | None:
    """Why ``value`` cannot be a string attribute: longer than 64 bytes."""
    if len(value.encode()) > MAX_STRING_LENGTH:
        return f"the value is longer than {MAX_STRING_LENGTH} bytes ({value[:80]!r})"
    return None


def attribute_value(value: object) -> tuple[dict[str, AttributeValue] | None, str | None]:
    """``{"bool"|"int"|"string": value}`` for a Python value, or ``(None, why not)``."""
    if isinstance(value, bool):  # before int: a bool is an int to Python, not to the API
        return {"bool": value}, None
    if isinstance(value, int):
        if value not in INT64:
            return None, f"the value {value} does not fit in int64"
        return {"int": value}, None
    if isinstance(value, str):
        if problem := string_problem(value):
            return None, problem
        return {"string": value}, None
    return None, f"a {type(value).__name__} is not an int, bool or string"


class _Problems:
    """Logs each problem once: per call, or across calls when the caller keeps ``seen``."""

    def __init__(self, resource: str, seen: MutableSet[str] | None) -> None:
        self._resource = resource
        self._seen: MutableSet[str] = set() if seen is None else seen

    def report(self, device_id: str, message: str) -> None:
        key = f"{self._resource}\0{device_id}\0{message}"
        if key in self._seen:
            return
        self._seen.add(key)
        log.warning("%s: %s", self._resource, message, extra={"RESOURCE": self._resource, "DEVICE_ID": device_id})

    def drop(self, device_id: str, key: object, reason: str) -> None:
        self.report(device_id, f"device {device_id}: attribute {key!r} left out of its ResourceSlice: {reason}")


# a device as slice_devices last made it: its record, its taint (fault, effect), its entry (None: left out)
Remembered = tuple[DeviceInfo, tuple[Fault, str] | None, dict[str, Any] | None]


class Memo:
    """What ``slice_devices`` made of one pool last time: per device, its record, its taint
    (the fault and the effect) and its entry (``None``: left out), and what the availability
    rule read of the pool besides the records (``context``). While the context is the same, a
    device whose record is the same object is what it was: neither the rule nor the describer
    is asked again (a change to one VF of 4096 costs one entry, not 4096). ``output`` is the
    last list made and ``position`` where each device's entry is in it: a change that only
    replaces entries (a taint, an attribute) patches a copy of it."""

    __slots__ = ("context", "entries", "output", "position")

    def __init__(self) -> None:
        self.context: object = None
        self.entries: dict[str, Remembered] = {}
        self.output: list[dict[str, Any]] = []
        self.position: dict[str, int] = {}


# a pool's shared devices: the shared device's ID -> its shares' IDs (``pool_shares``)
SharesOf = Callable[[ResourcePool], Mapping[str, Sequence[str]]]


def pool_shares(hooks_of: Mapping[str, Hooks], pool: ResourcePool) -> Mapping[str, Sequence[str]]:
    """``pool``'s shared devices (its handler's ``DeviceSharer``): each shared device's ID -> its
    shares' IDs; none for a handler that shares nothing."""
    hooks = hooks_of.get(pool.handler)
    return hooks.sharer.shares(pool) if hooks is not None and hooks.sharer is not None else {}


def unhealthy_taint_effect(pool: ResourcePool) -> str | None:
    """The effect of the taint ``pool``'s Unhealthy devices are published with (its
    ``unhealthyTaint``); ``None``: they are left out (``omit``)."""
    effect = pool.pool_config.entry.unhealthy_taint
    return None if effect == OMIT_UNHEALTHY else effect


def slice_devices(
    pool: ResourcePool,
    driver: str,
    describer: DeviceDescriber | None,
    *,
    taint_effect: str | None = None,
    shares: Mapping[str, Sequence[str]] | None = None,
    seen: MutableSet[str] | None = None,
    memo: Memo | None = None,
) -> list[dict[str, Any]]:
    """The ``devices[]`` entries ``pool`` publishes, in the order ListAndWatch lists them (by
    device ID): every device the one availability rule offers to the slices
    (``daemon.holdings.refusal``: Healthy, not vanished, held by no other road: a host lease, a
    pod through the device-plugin API, a lost book), as ``{"name": device_name(id),
    "attributes": {...}}``. Devices prepared for claims stay: the scheduler allocated them from
    these slices and counts them allocated through their claims; taking them out would only
    rewrite the pool at every pod start.

    With ``taint_effect`` (``NoSchedule``, ``NoExecute`` or ``None``), an Unhealthy or vanished
    device that nothing else holds is published too, with one taint (``device_taint``) naming
    why; without it (the pool says ``omit``, or the API server drops taints) it is left out.

    ``shares`` (the handler's ``DeviceSharer``: a shared device's ID -> its shares' IDs) makes
    the shares one device, named after the shared ID, with ``allowMultipleAllocations`` and a
    capacity ``shares`` of as many as the rule offers (a claim takes one by default), where the
    first share would have been listed; left out when the rule offers none.

    Attributes: ``id`` (the device-plugin ID), ``resourceName`` (the pool's resource),
    ``numaNode`` and the standard ``resource.kubernetes.io/numaNode`` (KEP-6072, the name other
    drivers' devices carry too, so one claim can ``matchAttribute`` across drivers) when the
    device has exactly one NUMA node, then the describer's. An attribute
    the API server would refuse (a bad name, a string over 64 bytes, a value that is not an
    int, bool or string, more than 32 in all) or that repeats one already set (``foo`` and
    ``<driver>/foo`` are one name) is left out; a describer that raises contributes nothing; a
    device whose name an earlier device of the pool has is left out. Each is logged with its
    reason, once per call or, when the caller passes the same ``seen`` set every time, once in all.

    ``memo`` (the caller's, for one pool and its config; see ``Memo``) is left holding the
    devices of this call only.

    A pool whose resource name is over 64 bytes publishes no devices: ``resourceName`` is what
    its DeviceClass selects on, and a device of our driver without it would make every class's
    selector fail on it (a CEL error, not a mismatch).
    """
    problems = _Problems(pool.resource, seen)
    if problem := string_problem(pool.resource):
        problems.report("", f"no devices published: the resource name cannot be an attribute: {problem}")
        return []
    context = (rule_context(pool, SLICE_ASKS), taint_effect)
    same_context = memo is not None and memo.context == context
    if memo is not None and same_context and not shares and (
            patched := _patched(pool, memo, taint_effect, driver, describer, problems)) is not None:
        return patched
    devices: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # device name -> the device ID that has it
    position: dict[str, int] = {}
    known = memo.entries if memo is not None else {}
    remembered: dict[str, Remembered] = {}
    share_of = {share: shared for shared, ids in (shares or {}).items() for share in ids}
    shared_at: dict[str, int] = {}  # a shared device -> where in ``devices`` it goes
    for device_id, info in sorted(pool.devices.items()):
        if (shared := share_of.get(device_id)) is not None:
            shared_at.setdefault(shared, len(devices))
            continue
        cached = known.get(device_id)
        entry: dict[str, Any] | None
        if same_context and cached is not None and cached[0] is info:
            remembered[device_id] = cached
            entry = cached[2]
            if entry is None:
                continue
            name = entry["name"]
        else:
            made = remembered[device_id] = _made(pool, device_id, info, cached, taint_effect, driver, describer,
                                                 problems)
            entry = made[2]
            if entry is None:
                continue
            name = entry["name"]
        if name in names:
            problems.report(device_id, f"device {device_id} left out of its ResourceSlice: its name {name!r} "
                                       f"is the name of device {names[name]} already")
            continue
        names[name] = device_id
        position[device_id] = len(devices)
        devices.append(entry)
    for shared, index in sorted(shared_at.items(), key=lambda item: -item[1]):  # from the end: indexes hold
        entry = _shared_entry(pool, shared, (shares or {})[shared], taint_effect, driver, describer, problems)
        if entry is None:
            continue
        if (name := entry["name"]) in names:
            problems.report(shared, f"device {shared} left out of its ResourceSlice: its name {name!r} "
                                    f"is the name of device {names[name]} already")
            continue
        devices.insert(index, entry)
    if memo is not None:
        memo.context, memo.entries = context, remembered
        memo.output, memo.position = (devices, position) if not shared_at else ([], {})
    return devices


LEFT_OUT = "left out"  # _published: the device is not in the slices


def _published(pool: ResourcePool, device_id: str, info: DeviceInfo,
               taint_effect: str | None) -> tuple[Fault, str] | str | None:
    """Whether the rule puts a device in the slices: ``None`` (as it is), its taint (Unhealthy or
    vanished, nothing else holding it, and the pool taints), or ``LEFT_OUT``."""
    if (refused := refusal(pool, device_id, SLICE_ASKS)) is None:
        return None
    if (taint_effect is None or refused.reason not in (UNHEALTHY, VANISHED)
            or holder_of(pool, device_id, SLICE_ASKS) is not None):
        return LEFT_OUT
    return device_fault(pool, device_id, info), taint_effect


def _made(pool: ResourcePool, device_id: str, info: DeviceInfo, cached: Remembered | None, taint_effect: str | None,
          driver: str, describer: DeviceDescriber | None, problems: _Problems) -> Remembered:
    """One device asked of the rule and, when it is published, its entry (the last one when its
    record and taint are the same)."""
    taint = _published(pool, device_id, info, taint_effect)
    if isinstance(taint, str):
        return info, None, None
    if cached is not None and cached[0] is info and cached[1] == taint and cached[2] is not None:
        return info, taint, cached[2]
    return info, taint, _entry(pool, device_id, info, taint, driver, describer, problems)


def _patched(pool: ResourcePool, memo: Memo, taint_effect: str | None, driver: str,
             describer: DeviceDescriber | None, problems: _Problems) -> list[dict[str, Any]] | None:
    """The last list with the entries of the devices whose record changed made again, when the
    pool has the same devices and each is published (or left out) as before; ``None``: the full
    walk is needed."""
    known = memo.entries
    if pool.devices.keys() != known.keys():
        return None
    changed = [(device_id, info) for device_id, info in pool.devices.items() if known[device_id][0] is not info]
    if not changed:
        return memo.output
    devices = list(memo.output)
    remembered = dict(known)
    for device_id, info in changed:
        made = _made(pool, device_id, info, known[device_id], taint_effect, driver, describer, problems)
        where = memo.position.get(device_id)
        if (made[2] is None) != (where is None):
            return None  # joins or leaves the list (or was left out for its name): walk
        if where is not None and made[2] is not None:
            devices[where] = made[2]
        remembered[device_id] = made
    memo.entries, memo.output = remembered, devices
    return devices


def _shared_entry(pool: ResourcePool, shared: str, share_ids: Sequence[str], taint_effect: str | None, driver: str,
                  describer: DeviceDescriber | None, problems: _Problems) -> dict[str, Any] | None:
    """The one entry of a shared device: its first share's, named and identified as the shared
    device, with a capacity of the shares the rule offers (and those it would taint); ``None``
    when it offers none."""
    offered: list[str] = []
    taint: tuple[Fault, str] | None = None
    for share in share_ids:
        published = _published(pool, share, pool.devices[share], taint_effect)
        if not isinstance(published, str):
            offered.append(share)
            taint = taint or published
    if not offered:
        return None
    entry = _entry(pool, offered[0], pool.devices[offered[0]], taint, driver, describer, problems)
    entry["name"] = device_name(shared)
    entry["attributes"]["id"] = {"string": shared}
    if len(entry["attributes"]) >= MAX_ATTRIBUTES:  # attributes and capacities: 32 in all
        dropped = list(entry["attributes"])[-1]
        problems.drop(shared, dropped, f"a shared device has at most {MAX_ATTRIBUTES - 1} attributes")
        del entry["attributes"][dropped]
    entry["allowMultipleAllocations"] = True
    # a claim that asks for no capacity takes one share; more in steps of one, where one step
    # fits (the API refuses a range whose min + step is over the capacity: one share left)
    steps = {"step": "1"} if len(offered) > 1 else {}
    policy = {"default": "1", "validRange": {"min": "1", **steps}}
    entry["capacity"] = {SHARES: {"value": str(len(offered)), "requestPolicy": policy}}
    return entry


def _entry(pool: ResourcePool, device_id: str, info: DeviceInfo, taint: tuple[Fault, str] | None, driver: str,
           describer: DeviceDescriber | None, problems: _Problems) -> dict[str, Any]:
    """One device's ``devices[]`` entry: its name, its attributes, its taint."""
    own_prefix = f"{driver}/"
    numa_nodes = info.numa_nodes
    attributes: dict[str, dict[str, AttributeValue]] = {}
    core: dict[str, AttributeValue] = {"id": device_id, "resourceName": pool.resource}
    if len(numa_nodes) == 1:
        core["numaNode"] = core[STANDARD_NUMA_NODE] = numa_nodes[0]
    for key, value in core.items():
        _add(attributes, key, key, value, problems, device_id)
    for described, described_value in _described(pool, device_id, describer, problems):
        if not isinstance(described, str):
            problems.drop(device_id, described, "its name is not a string")
            continue
        short = described[len(own_prefix):] if described.startswith(own_prefix) else described
        if short in attributes:
            problems.drop(device_id, described, f"{short!r} is set already")
        elif len(attributes) >= MAX_ATTRIBUTES:
            problems.drop(device_id, described, f"a device has at most {MAX_ATTRIBUTES} attributes")
        else:
            _add(attributes, short, described, described_value, problems, device_id)
    entry: dict[str, Any] = {"name": device_name(device_id), "attributes": attributes}
    if taint is not None:
        entry["taints"] = [device_taint(driver, *taint)]
    return entry


def device_fault(pool: ResourcePool, device_id: str, info: DeviceInfo) -> Fault:
    """Why a device refused as Unhealthy or vanished is: vanished first (its last record may
    say another fault), then its handler's word, else a fault with no name."""
    if device_id in pool.vanished:
        return Fault(VANISHED_FAULT, "", "it is gone from the host")
    return info.fault or Fault(UNNAMED_FAULT, "", f"it is {info.health}")


def device_taint(driver: str, fault: Fault, effect: str) -> dict[str, str]:
    """The taint of a device with ``fault``: key ``<driver>/<cause>``, the fault's detail as the
    value when it is a valid label value (else none), ``effect``; no ``timeAdded`` (the
    publisher keeps the one on the server, ``_taints.py``)."""
    taint = {"key": f"{driver}/{fault.cause}", "effect": effect}
    if fault.detail and label_value_problem(fault.detail) is None:
        taint["value"] = fault.detail
    return taint


def _described(
    pool: ResourcePool, device_id: str, describer: DeviceDescriber | None, problems: _Problems
) -> list[tuple[object, object]]:
    """The describer's attributes of one device (names and values as it gave them, checked by
    the caller); none when it fails."""
    if describer is None:
        return []
    try:
        return list(describer.dra_attributes(pool, device_id).items())
    except Exception as error:
        problems.report(device_id, f"device {device_id}: its handler's attributes left out of its ResourceSlice: "
                                   f"the handler failed: {type(error).__name__}: {error}")
        return []


def _add(
    attributes: dict[str, dict[str, AttributeValue]],
    short: str,
    key: str,
    value: object,
    problems: _Problems,
    device_id: str,
) -> None:
    """Add ``value`` as ``short`` (``key`` without our own domain) unless the server would refuse it."""
    if problem := qualified_name_problem(key):
        problems.drop(device_id, key, f"not a valid attribute name: {problem}")
        return
    typed, problem = attribute_value(value)
    if typed is None:
        problems.drop(device_id, key, problem or "not a valid value")
        return
    attributes[short] = typed

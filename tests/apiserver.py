"""A kube-apiserver stand-in for what a node-local DRA driver uses, over real HTTP/JSON.

No kube-apiserver can run here, so the daemon is driven through the real ``kubernetes`` client
against this: a real HTTP/1.1 server on 127.0.0.1 that answers the real paths with the real
bodies (``docs/dra-api.md`` section 9), its own accept loop and one thread per connection.
Tests stay plain synchronous code (or trio code through ``wait_until_async``); every piece of
state sits behind one lock whose condition is notified on every change and every request.

* ``GET /api/v1/nodes/{name}`` (``add_node``) and ``GET``/``PUT .../status`` of
  ``resource.k8s.io/v1`` ResourceClaims (``put_claim``), which the test plays the scheduler for.
* ResourceSlices (cluster-scoped): get, list (``fieldSelector`` on ``metadata.name``,
  ``spec.driver``, ``spec.nodeName``), watch (bookmarks on ``bookmark()``), create
  (``generateName``), update (PUT) and delete (preconditions), the kubelet's wipe (``wipe``), with
  upstream's validation (``pkg/apis/resource/validation``) answering 422 ``Invalid`` with
  ``details.causes``.
* One global resourceVersion counter as etcd's revision; every write bumps it. Watches get
  events after their resourceVersion from a bounded history (410 ``Expired`` before it), in
  order, filtered by their field selector, newline-delimited JSON in chunked transfer encoding.
* Unknown fields are dropped with a ``Warning`` header, and the fields behind a feature gate
  that is off (device taints, consumable capacity) are dropped silently, as upstream's strategy does.
* Faults (``fail_next``), a server that goes away (``down``/``up``), a bearer token (401).

This is what the daemon's client (``daemon/dra/_kube.py``) calls, and what the next DRA work needs
(taints and shared devices in slices, per-slice updates, claim status); nothing else is modelled
(PATCH, label selectors, paging, deletecollection over HTTP, dryRun, discovery, RBAC, TLS,
protobuf, server-side apply, finalizers, managedFields, watches of claims or nodes, other API
versions, the scheduler): a request for it is answered as a server without it would, or its
options are ignored.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import random
import re
import selectors
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import trio

from tests.waiting import wait_until

T = TypeVar("T")

GROUP = "resource.k8s.io"
API_VERSION = f"{GROUP}/v1"
SLICES_PATH = f"/apis/{API_VERSION}/resourceslices"
HISTORY = 1000  # events a watch can resume from; compact() drops them all
CLAIM_DEVICE_CLASS = "devplugd.example.com"  # of every request of a claim put_claim makes
WATCH_TIMEOUT = 1800.0  # a watch without timeoutSeconds ends after this (the server's own limit)
# Gates whose fields the daemon sends or will (strategy.go dropDisabledFields): device taints and
# consumable capacity, alpha and off by default in 1.34 and 1.35.
FEATURE_GATES = frozenset({"DRADeviceTaints", "DRAConsumableCapacity"})

_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery utilrand: no vowels
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool


class Request(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    status: int


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- Status ------------------------------------------------------------------------------------
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
            409: "Conflict", 410: "Expired", 422: "Invalid", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


class ApiError(Exception):
    """A failure answered as a ``Status`` (``k8s.io/apimachinery/pkg/api/errors``)."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict[str, Any] | None = None,
                 headers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                       "message": message, "reason": reason or _REASONS.get(code, "Unknown")}
        if details is not None:
            self.status["details"] = details
        self.status["code"] = code
        self.headers = list(headers)


@dataclass(frozen=True)
class _Resource:
    """A qualified resource, for upstream's error messages."""

    plural: str
    kind: str
    group: str = GROUP

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def details(self, name: str) -> dict[str, Any]:
        return {"name": name, **({"group": self.group} if self.group else {}), "kind": self.plural}

    def not_found(self, name: str) -> ApiError:
        return ApiError(404, f'{self} "{name}" not found', details=self.details(name))

    def conflict(self, name: str, why: str) -> ApiError:
        return ApiError(409, f'Operation cannot be fulfilled on {self} "{name}": {why}', details=self.details(name))

    def invalid(self, name: str, errors: Sequence[FieldError]) -> ApiError:
        messages = list(dict.fromkeys(str(error) for error in errors))  # ToAggregate drops repeats
        summary = messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"
        causes = [{"reason": error.reason, "message": error.body(), "field": error.field} for error in errors]
        group = f".{self.group}" if self.group else ""
        return ApiError(422, f'{self.kind}{group} "{name}" is invalid: {summary}',
                        details={"name": name, **({"group": self.group} if self.group else {}), "kind": self.kind,
                                 "causes": causes})


SLICES = _Resource("resourceslices", "ResourceSlice")
CLAIMS = _Resource("resourceclaims", "ResourceClaim")
NODES = _Resource("nodes", "Node", group="")
_MODIFIED = "the object has been modified; please apply your changes to the latest version and try again"


# -- field errors (k8s.io/apimachinery/pkg/util/validation/field) ------------------------------
_OMIT = object()
_CAUSES = {"Not found": "FieldValueNotFound", "Required value": "FieldValueRequired",
           "Duplicate value": "FieldValueDuplicate", "Invalid value": "FieldValueInvalid",
           "Unsupported value": "FieldValueNotSupported", "Forbidden": "FieldValueForbidden",
           "Too long": "FieldValueTooLong", "Too many": "FieldValueTooMany", "Internal error": "InternalError"}


@dataclass(frozen=True)
class FieldError:
    type: str  # upstream's ErrorType text: "Invalid value", "Required value", "Too many", ...
    field: str
    value: Any = _OMIT
    detail: str = ""

    @property
    def reason(self) -> str:
        return _CAUSES[self.type]

    def body(self) -> str:
        """ErrorBody(): the type, the bad value as Go prints it (where it does), the detail."""
        if self.type in ("Required value", "Forbidden", "Too long", "Internal error") or self.value is _OMIT:
            text = self.type
        else:
            text = f"{self.type}: {_go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def _go_value(value: Any) -> str:
    if value is None:
        return '"null"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"))  # Go prints structs with %#v; JSON is close enough


def _invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("Invalid value", path, value, detail)


def _required(path: str, detail: str = "") -> FieldError:
    return FieldError("Required value", path, detail=detail)


def _too_long(path: str, limit: int) -> FieldError:
    return FieldError("Too long", path, detail=f"may not be more than {limit} bytes")


def _too_many(path: str, count: int, limit: int) -> FieldError:
    return FieldError("Too many", path, count, f"must have at most {limit} item{'s' if limit != 1 else ''}")


def _not_supported(path: str, value: str, supported: Iterable[str]) -> FieldError:
    return FieldError("Unsupported value", path, value,
                      "supported values: " + ", ".join(json.dumps(v) for v in supported))


def _each(path: str, value: Any, messages: Iterable[str]) -> list[FieldError]:
    return [_invalid(path, value, message) for message in messages]


# -- name rules (k8s.io/apimachinery/pkg/util/validation) --------------------------------------
_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN_FMT = _LABEL_FMT + "(\\." + _LABEL_FMT + ")*"
_C_IDENTIFIER_FMT = "[A-Za-z_][A-Za-z0-9_]*"
_QUALIFIED_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE_FMT = "(" + _QUALIFIED_FMT + ")?"
_LABEL_RE, _SUBDOMAIN_RE, _C_IDENTIFIER_RE, _QUALIFIED_RE, _LABEL_VALUE_RE = (
    re.compile(f"(?:{fmt})\\Z", re.ASCII)
    for fmt in (_LABEL_FMT, _SUBDOMAIN_FMT, _C_IDENTIFIER_FMT, _QUALIFIED_FMT, _LABEL_VALUE_FMT))
_SEMVER_RE = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?\Z", re.ASCII)
_QUANTITY_RE = re.compile(r"([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)\Z", re.ASCII)


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    return f"{message} (e.g. " + " or ".join(f"'{e}', " for e in examples) + f"regex used for validation is '{fmt}')"


def _nbytes(text: str) -> int:
    """Go's len(): bytes, not characters."""
    return len(text) if text.isascii() else len(text.encode())


def _dns_label(value: str) -> list[str]:
    problems = ["must be no more than 63 characters"] if _nbytes(value) > 63 else []
    if not _LABEL_RE.match(value):
        problems.append("must not contain dots" if _SUBDOMAIN_RE.match(value) else _regex_error(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
            "start and end with an alphanumeric character", _LABEL_FMT, "my-name", "123-abc"))
    return problems


def _dns_subdomain(value: str) -> list[str]:
    problems = ["must be no more than 253 characters"] if _nbytes(value) > 253 else []
    if not _SUBDOMAIN_RE.match(value):
        problems.append(_regex_error(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
            "must start and end with an alphanumeric character", _SUBDOMAIN_FMT, "example.com"))
    return problems


def _qualified_name(value: str) -> list[str]:
    """IsQualifiedName: label and annotation keys."""
    name_rule = _regex_error("must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                             "with an alphanumeric character", _QUALIFIED_FMT, "MyName", "my.name", "123-abc")
    parts = value.split("/")
    if len(parts) > 2:
        return [f"a qualified name {name_rule} with an optional DNS subdomain prefix and '/' (e.g. "
                "'example.com/MyName')"]
    problems: list[str] = []
    if len(parts) == 2:
        if not parts[0]:
            problems.append("prefix part must be non-empty")
        else:
            problems += [f"prefix part {problem}" for problem in _dns_subdomain(parts[0])]
    name = parts[-1]
    if not name:
        problems.append("name part must be non-empty")
    elif _nbytes(name) > 63:
        problems.append("name part must be no more than 63 characters")
    if not _QUALIFIED_RE.match(name):
        problems.append(f"name part {name_rule}")
    return problems


def _label_value(value: str) -> list[str]:
    problems = ["must be no more than 63 characters"] if _nbytes(value) > 63 else []
    if not _LABEL_VALUE_RE.match(value):
        problems.append(_regex_error(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
            "must start and end with an alphanumeric character", _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return problems


# -- ResourceClaim status.devices validation (validateResourceClaimStatusUpdate) ---------------
CLAIM_DEVICE_CONDITIONS_MAX = 8  # AllocatedDeviceStatusMaxConditions
CLAIM_DEVICE_DATA_MAX = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
NETWORK_INTERFACE_NAME_MAX = 256  # NetworkDeviceDataInterfaceNameMaxLength
NETWORK_HARDWARE_ADDRESS_MAX = 128  # NetworkDeviceDataHardwareAddressMaxLength
NETWORK_IPS_MAX = 16  # NetworkDeviceDataMaxIPs
_CIDR_EXAMPLE = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)"


def _device_id(entry: Mapping[str, Any]) -> str:
    """structured.SharedDeviceID as Go prints it: driver/pool/device, and /shareID for a share."""
    base = f"{entry.get('driver')}/{entry.get('pool')}/{entry.get('device')}"
    return f"{base}/{entry['shareID']}" if entry.get("shareID") else base


def _is_cidr(value: Any) -> bool:
    """netutils.ParseCIDRSloppy: an address and a prefix length (host bits may be set)."""
    if not isinstance(value, str) or "/" not in value:
        return False
    try:
        ipaddress.ip_interface(value)
    except ValueError:
        return False
    return True


def _validate_network_data(data: Any, path: str) -> list[FieldError]:
    if data is None:
        return []
    if not isinstance(data, Mapping):
        return [_invalid(path, data, "must be an object")]
    errors: list[FieldError] = []
    for key, limit in (("interfaceName", NETWORK_INTERFACE_NAME_MAX), ("hardwareAddress", NETWORK_HARDWARE_ADDRESS_MAX)):
        value = data.get(key, "")
        if not isinstance(value, str):
            errors.append(_invalid(f"{path}.{key}", value, "must be a string"))
        elif _nbytes(value) > limit:
            errors.append(_too_long(f"{path}.{key}", limit))
    ips = data.get("ips") or []
    if not isinstance(ips, list):
        return errors + [_invalid(f"{path}.ips", ips, "must be a list")]
    if len(ips) > NETWORK_IPS_MAX:
        return errors + [_too_many(f"{path}.ips", len(ips), NETWORK_IPS_MAX)]
    seen: set[str] = set()
    for index, ip in enumerate(ips):
        if not _is_cidr(ip):
            errors.append(_invalid(f"{path}.ips[{index}]", ip, _CIDR_EXAMPLE))
        elif ip in seen:
            errors.append(FieldError("Duplicate value", f"{path}.ips[{index}]", ip))
        seen.add(str(ip))
    return errors


def validate_claim_devices(devices: Sequence[Mapping[str, Any]], allocation: Mapping[str, Any] | None
                           ) -> list[FieldError]:
    """``status.devices``: each names an allocated device of the claim (and its share), once;
    its driver, pool and device names valid; at most 8 conditions, data of at most 10 KiB, and
    ``networkData`` with an interfaceName of at most 256 bytes, a hardwareAddress of at most 128
    and at most 16 distinct CIDRs as ips."""
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    allocated = {_device_id(result) for result in results}
    errors: list[FieldError] = []
    seen: set[str] = set()
    for index, entry in enumerate(devices):
        path = f"status.devices[{index}]"
        errors += _validate_driver_name(str(entry.get("driver") or ""), f"{path}.driver")
        errors += _validate_pool_name(str(entry.get("pool") or ""), f"{path}.pool")
        device = str(entry.get("device") or "")
        errors += [_required(f"{path}.device")] if not device else _each(f"{path}.device", device, _dns_label(device))
        key = _device_id(entry)
        if key not in allocated:
            errors.append(_invalid(path, key, "must be an allocated device in the claim"))
        if key in seen:
            errors.append(FieldError("Duplicate value", f"{path}.deviceID", key))
        seen.add(key)
        conditions = entry.get("conditions") or []
        if isinstance(conditions, list) and len(conditions) > CLAIM_DEVICE_CONDITIONS_MAX:
            errors.append(_too_many(f"{path}.conditions", len(conditions), CLAIM_DEVICE_CONDITIONS_MAX))
        if entry.get("data") is not None and len(_dumps(entry["data"])) > CLAIM_DEVICE_DATA_MAX:
            errors.append(_too_long(f"{path}.data", CLAIM_DEVICE_DATA_MAX))
        errors += _validate_network_data(entry.get("networkData"), f"{path}.networkData")
    return errors


# -- ResourceSlice validation (pkg/apis/resource/validation/validation.go) ---------------------
def _validate_driver_name(name: str, path: str) -> list[FieldError]:
    """ValidateCSIDriverName: required, at most 63 bytes, a DNS subdomain once lower-cased."""
    errors = [_required(path)] if not name else []
    if _nbytes(name) > 63:
        errors.append(_too_long(path, 63))
    return errors + _each(path, name, _dns_subdomain(name.lower()))


def _validate_pool_name(name: str, path: str) -> list[FieldError]:
    if not name:
        return [_required(path)]
    errors = [_too_long(path, 253)] if _nbytes(name) > 253 else []
    for part in name.split("/"):
        errors += _each(path, part, _dns_subdomain(part))
    return errors


def _validate_c_identifier(name: str, path: str) -> list[FieldError]:
    errors = [_too_long(path, 32)] if _nbytes(name) > 32 else []
    if not _C_IDENTIFIER_RE.match(name):
        errors.append(_invalid(path, name, _regex_error(
            "a valid C identifier must start with alphabetic character or '_', followed by a string of "
            "alphanumeric characters or '_'", _C_IDENTIFIER_FMT, "my_name", "MY_NAME", "MyName")))
    return errors


def _validate_qualified_name(name: str, path: str) -> list[FieldError]:
    """An attribute or capacity name: a C identifier, optionally prefixed by ``<domain>/``."""
    parts = name.split("/")
    if len(parts) == 1:
        return _validate_c_identifier(name, path)
    if len(parts) > 2:
        return [_invalid(path, name, "must not contain more than one slash")]
    domain, identifier = parts
    errors = _validate_driver_name(domain, path) if domain else [_invalid(path, "", "the domain must not be empty")]
    errors += (_validate_c_identifier(identifier, path) if identifier
               else [_invalid(path, "", "the name must not be empty")])
    return errors


def _map_key_path(path: str, key: str, limit: int = 97) -> str:
    """truncateIfTooLong: long keys are shortened in the middle in error paths."""
    limit = max(limit, 16)
    if len(key) > limit:
        remaining = limit - 3
        key = key[:(remaining + 1) // 2] + "..." + key[len(key) - remaining // 2:]
    return f"{path}[{key}]"


def _validate_attribute(attribute: Mapping[str, Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if "string" in attribute and _nbytes(attribute["string"]) > 64:
        errors.append(_too_long(f"{path}.string", 64))
    if "version" in attribute:
        version = attribute["version"]
        if not _SEMVER_RE.match(version):
            errors.append(_invalid(f"{path}.version", version, "must be a string compatible with semver.org spec 2.0.0"))
        if _nbytes(version) > 64:
            errors.append(_too_long(f"{path}.version", 64))
    values = sum(key in attribute for key in ("bool", "int", "string", "version"))
    if values != 1:
        errors.append(_invalid(path, "" if values == 0 else dict(attribute), "exactly one value must be specified"))
    return errors


def _validate_taint(taint: Mapping[str, Any], path: str) -> list[FieldError]:
    key = taint.get("key", "")
    errors = _each(f"{path}.key", key, _qualified_name(key))
    if taint.get("value"):
        errors += _each(f"{path}.value", taint["value"], _label_value(taint["value"]))
    effect = taint.get("effect", "")
    if not effect:
        errors.append(_required(f"{path}.effect"))
    elif effect not in ("NoExecute", "NoSchedule", "None"):
        errors.append(_not_supported(f"{path}.effect", effect, ("NoExecute", "NoSchedule", "None")))
    return errors


def _validate_named_set(items: Sequence[Mapping[str, Any]], key: str, limit: int, path: str,
                        validate: Callable[[Mapping[str, Any], str], list[FieldError]]) -> list[FieldError]:
    """validateSet: too many items short-circuits; then each item; then duplicates by ``key``."""
    if len(items) > limit:
        return [_too_many(path, len(items), limit)]
    errors: list[FieldError] = []
    for index, item in enumerate(items):
        errors += validate(item, f"{path}[{index}]")
    seen: set[str] = set()
    for index, item in enumerate(items):
        name = item.get(key, "")
        if name in seen:
            errors.append(FieldError("Duplicate value", f"{path}[{index}]", name))
        seen.add(name)
    return errors


def _validate_device(device: Mapping[str, Any], path: str) -> list[FieldError]:
    name = device.get("name", "")
    errors = _each(f"{path}.name", name, _dns_label(name))
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > 32:
        errors.append(_invalid(path, len(attributes) + len(capacity),
                               "the total number of attributes and capacities must not exceed 32"))
    for key, attribute in attributes.items():
        errors += _validate_qualified_name(key, f"{path}.attributes")
        errors += _validate_attribute(attribute, _map_key_path(f"{path}.attributes", key))
    for key, value in capacity.items():
        errors += _validate_qualified_name(key, f"{path}.capacity")
        if "requestPolicy" in value and not device.get("allowMultipleAllocations"):
            errors.append(FieldError("Forbidden", f"{_map_key_path(f'{path}.capacity', key)}.requestPolicy",
                                     detail="allowMultipleAllocations must be true"))
        elif "requestPolicy" in value:
            errors += _validate_request_policy(value.get("value"), value["requestPolicy"],
                                               f"{_map_key_path(f'{path}.capacity', key)}.requestPolicy")
    taints = device.get("taints") or []
    if len(taints) > 16:
        errors.append(_too_many(f"{path}.taints", len(taints), 16))
    else:
        for index, taint in enumerate(taints):
            errors += _validate_taint(taint, f"{path}.taints[{index}]")
    return errors


def _whole(quantity: Any) -> int | None:
    """A quantity written as a whole number ("4"), else ``None``: the stand-in checks the
    numbers of a request policy only in whole numbers, which is all devplugd publishes."""
    return int(quantity) if isinstance(quantity, str) and quantity.isdigit() else None


def _validate_request_policy(capacity_value: Any, policy: Mapping[str, Any], path: str) -> list[FieldError]:
    """validateRequestPolicy (``validation.go``): one of validValues and validRange, each value
    within the capacity, the default one of them; a range's ``min + step`` within the capacity."""
    valid_values, valid_range = policy.get("validValues"), policy.get("validRange")
    if valid_values is not None and valid_range is not None:
        return [FieldError("Forbidden", path, detail='exactly one policy can be specified, cannot specify '
                                                     '"validValues" and "validRange" at the same time')]
    capacity, default = _whole(capacity_value), _whole(policy.get("default"))
    errors: list[FieldError] = []
    if valid_values is not None:
        values = [_whole(v) for v in valid_values]
        for index, value in enumerate(values):
            if value is not None and capacity is not None and value > capacity:
                errors.append(_invalid(f"{path}.validValues[{index}]", valid_values[index],
                                       f"option is larger than capacity value: {capacity_value}"))
        if default is not None and default not in values:
            errors.append(_invalid(f"{path}.validValues", policy.get("default"),
                                   "default value is not valid according to the requestPolicy"))
    elif valid_range is not None:
        where = f"{path}.validRange"
        low, high, step = (_whole(valid_range.get(k)) for k in ("min", "max", "step"))
        if valid_range.get("min") is None:
            return [_required(f"{where}.min", "required when validRange is defined")]
        if low is None or capacity is None:
            return errors
        if low > capacity:
            errors.append(_invalid(f"{where}.min", valid_range["min"], f"min is larger than capacity value: {capacity}"))
        if default is not None and default < low:
            errors.append(_invalid(f"{where}.min", policy["default"], f"default is less than min: {low}"))
        if high is not None and high > capacity:
            errors.append(_invalid(f"{where}.max", valid_range["max"], f"max is larger than capacity value: {capacity}"))
        if step is not None and low + step > capacity:
            errors.append(_invalid(f"{where}.step", valid_range["step"],
                                   f"one step {low + step} is larger than capacity value: {capacity}"))
        if step and default is not None and (default - low) % step:
            errors.append(_invalid(f"{where}.step", policy["default"],
                                   f"value is not a multiple of a given step ({step}) from ({low})"))
    return errors


def _validate_object_meta(meta: Mapping[str, Any]) -> list[FieldError]:
    """ValidateObjectMeta for a cluster-scoped object named by a DNS subdomain."""
    errors: list[FieldError] = []
    generate_name = meta.get("generateName", "")
    if generate_name:
        masked = generate_name[:-2] + "a" if len(generate_name) > 1 and generate_name.endswith("-") else generate_name
        errors += _each("metadata.generateName", generate_name, _dns_subdomain(masked))
    name = meta.get("name", "")
    if not name:
        errors.append(_required("metadata.name", "name or generateName is required"))
    else:
        errors += _each("metadata.name", name, _dns_subdomain(name))
    for key, value in (meta.get("labels") or {}).items():
        errors += _each("metadata.labels", key, _qualified_name(key))
        errors += _each("metadata.labels", value, _label_value(value))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += _each("metadata.annotations", key, _qualified_name(key.lower()))
    if sum(len(k) + len(v) for k, v in annotations.items()) > 262144:
        errors.append(_too_long("metadata.annotations", 262144))
    controller = ""
    for reference in meta.get("ownerReferences") or []:
        path = "metadata.ownerReferences"  # upstream does not index these paths
        api_version = reference.get("apiVersion", "")
        if not api_version or api_version.count("/") > 1 or api_version.endswith("/"):
            errors.append(_invalid(f"{path}.apiVersion", api_version, "version must not be empty"))
        for key in ("kind", "name", "uid"):
            if not reference.get(key):
                errors.append(_invalid(f"{path}.{key}", reference.get(key, ""), f"{key} must not be empty"))
        if reference.get("controller"):
            current = f"{reference.get('kind', '')}/{reference.get('name', '')}"
            if controller:
                errors.append(_invalid(path, list(meta["ownerReferences"]), "Only one reference can have Controller "
                                       f'set to true. Found "true" in references for {controller} and {current}'))
            else:
                controller = current
    return errors


def validate_resource_slice(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[FieldError]:
    """ValidateResourceSlice, or ValidateResourceSliceUpdate with ``old``, on the decoded object."""
    errors = _validate_object_meta(obj.get("metadata", {}))
    spec = obj.get("spec", {})
    pool = spec.get("pool", {})
    errors += _validate_driver_name(spec.get("driver", ""), "spec.driver")
    errors += _validate_pool_name(pool.get("name", ""), "spec.pool.name")
    if pool.get("resourceSliceCount", 0) <= 0:
        errors.append(_invalid("spec.pool.resourceSliceCount", pool.get("resourceSliceCount", 0),
                               "must be greater than zero"))
    if pool.get("generation", 0) < 0:
        errors.append(_invalid("spec.pool.generation", pool["generation"], "must be greater than or equal to zero"))
    if old is not None:
        old_spec = old["spec"]
        for path, new_value, old_value in (
                ("spec.pool.name", pool.get("name", ""), old_spec["pool"].get("name", "")),
                ("spec.driver", spec.get("driver", ""), old_spec.get("driver", "")),
                ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName"))):
            if new_value != old_value:
                errors.append(_invalid(path, new_value, "field is immutable"))
    placement: list[str] = []
    if "nodeName" in spec:
        if spec["nodeName"]:
            placement.append("`nodeName`")
            errors += _each("spec.nodeName", spec["nodeName"], _dns_subdomain(spec["nodeName"]))
        else:
            errors.append(_invalid("spec.nodeName", "", "must be either unset or set to a non-empty string"))
    if "nodeSelector" in spec:
        placement.append("`nodeSelector`")
        terms = (spec["nodeSelector"] or {}).get("nodeSelectorTerms") or []
        if len(terms) != 1:
            errors.append(_invalid("spec.nodeSelector.nodeSelectorTerms", terms,
                                   "must have exactly one node selector term"))
    if "allNodes" in spec:
        if spec["allNodes"]:
            placement.append("`allNodes`")
        else:
            errors.append(_invalid("spec.allNodes", False, "must be either unset or set to true"))
    rule = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
    if not placement:
        errors.append(_required("spec", rule))
    elif len(placement) > 1:
        errors.append(_invalid("spec", "{" + ", ".join(placement) + "}", f"{rule}, but multiple fields are set"))
    devices = spec.get("devices") or []
    tainted = any(device.get("taints") for device in devices)  # a slice with a taint holds at most 64
    errors += _validate_named_set(devices, "name", 64 if tainted else 128, "spec.devices", _validate_device)
    return errors


def _drop_disabled_fields(spec: dict[str, Any], old_spec: Mapping[str, Any] | None, gates: frozenset[str]) -> None:
    """dropDisabledFields: a gate that is off drops its fields, unless the stored object uses them."""
    devices = spec.get("devices") or []
    old_devices = (old_spec or {}).get("devices") or []
    if "DRADeviceTaints" not in gates and not any(device.get("taints") for device in old_devices):
        for device in devices:
            device.pop("taints", None)
    if ("DRAConsumableCapacity" not in gates and not any("allowMultipleAllocations" in d for d in old_devices)
            and not any("requestPolicy" in c for d in old_devices for c in (d.get("capacity") or {}).values())):
        for device in devices:
            device.pop("allowMultipleAllocations", None)
            for value in (device.get("capacity") or {}).values():
                value.pop("requestPolicy", None)


# -- decoding: the v1 schema's fields and types; anything else is an unknown field -------------
class _MapOf(NamedTuple):
    value: Any


class _ListOf(NamedTuple):
    item: Any


_ANY, _QUANTITY = "any", "quantity"
_OBJECT_META = {"name": str, "generateName": str, "namespace": str, "selfLink": str, "uid": str,
                "resourceVersion": str, "generation": int, "creationTimestamp": str, "deletionTimestamp": str,
                "deletionGracePeriodSeconds": int, "labels": _MapOf(str), "annotations": _MapOf(str),
                "ownerReferences": _ListOf({"apiVersion": str, "kind": str, "name": str, "uid": str,
                                            "controller": bool, "blockOwnerDeletion": bool}),
                "finalizers": _ListOf(str), "managedFields": _ANY}
# The fields of partitionable devices and binding conditions are left out: unknown fields here.
_DEVICE = {"name": str, "attributes": _MapOf({"int": int, "bool": bool, "string": str, "version": str}),
           "capacity": _MapOf({"value": _QUANTITY, "requestPolicy": _ANY}),
           "taints": _ListOf({"key": str, "value": str, "effect": str, "timeAdded": str}),
           "allowMultipleAllocations": bool}
_RESOURCE_SLICE = {
    "apiVersion": str, "kind": str, "metadata": _OBJECT_META,
    "spec": {"driver": str, "pool": {"name": str, "generation": int, "resourceSliceCount": int},
             "nodeName": str, "nodeSelector": _ANY, "allNodes": bool, "devices": _ListOf(_DEVICE)}}
_JSON_TYPES = {str: "string", int: "int64", bool: "bool", dict: "object", list: "array"}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "value")


def _decode(value: Any, schema: Any, path: str, unknown: list[str]) -> Any:
    """A copy of ``value`` holding only the schema's fields (nulls dropped), or ValueError."""
    def mismatch(want: str) -> ValueError:
        return ValueError(f"json: cannot unmarshal {_json_type(value)} into Go struct field {path} of type {want}")

    if schema is _ANY:
        return value
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise mismatch("struct")
        decoded = {}
        for key, item in value.items():
            child = f"{path}.{key}" if path else key
            if key not in schema:
                unknown.append(child)
            elif item is not None:
                decoded[key] = _decode(item, schema[key], child, unknown)
        return decoded
    if isinstance(schema, _MapOf):
        if not isinstance(value, dict):
            raise mismatch("map")
        return {key: _decode(item, schema.value, f"{path}[{key}]", unknown) for key, item in value.items()
                if item is not None}
    if isinstance(schema, _ListOf):
        if not isinstance(value, list):
            raise mismatch("slice")
        return [_decode(item, schema.item, f"{path}[{index}]", unknown) for index, item in enumerate(value)]
    if schema is _QUANTITY:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not _QUANTITY_RE.match(value):
            raise ValueError("quantities must match the regular expression "
                             "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
        return value
    if not isinstance(value, schema) or (schema is int and isinstance(value, bool)):
        raise mismatch(_JSON_TYPES[schema])
    return value


# -- selectors ---------------------------------------------------------------------------------
_Predicate = Callable[[Mapping[str, Any]], bool]
_SLICE_FIELDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "metadata.name": lambda obj: obj["metadata"]["name"],
    "spec.nodeName": lambda obj: obj["spec"].get("nodeName") or "",
    "spec.driver": lambda obj: obj["spec"].get("driver", ""),
}


def _split_unescaped(text: str, separator: str) -> list[str]:
    parts, current, escaped = [], "", False
    for char in text:
        if escaped:
            current, escaped = current + "\\" + char, False
        elif char == "\\":
            escaped = True
        elif char == separator:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current + ("\\" if escaped else "")]


def _field_selector(text: str) -> _Predicate:
    """fields.ParseSelector (``a=b``, ``a==b``, ``a!=b``, comma-separated), for ResourceSlice's fields."""
    requirements: list[tuple[Callable[[Mapping[str, Any]], str], bool, str]] = []
    for term in _split_unescaped(text, ",") if text else []:
        if not term:
            continue
        match = re.match(r"((?:[^\\!=]|\\.)*)(!=|==|=)(.*)\Z", term)
        if match is None:
            raise ApiError(400, f"invalid selector: '{text}'; can't understand '{term}'")
        key, operator, value = match.groups()
        if key not in _SLICE_FIELDS:
            raise ApiError(400, f"field label not supported: {key}")
        value = re.sub(r"\\(.)", r"\1", value)
        requirements.append((_SLICE_FIELDS[key], operator == "!=", value))
    return lambda obj: all((get(obj) == value) != negated for get, negated, value in requirements)


def _selector(query: Mapping[str, str]) -> _Predicate:
    return _field_selector(query.get("fieldSelector", ""))


# -- stored objects and watches ----------------------------------------------------------------
class _Stored:
    """One object: ``obj`` without kind/apiVersion (never mutated once stored), its JSON as a list
    item (``item``, as upstream serializes list items) and as a whole object (``full``)."""

    __slots__ = ("obj", "item", "full")

    def __init__(self, obj: dict[str, Any], kind: str, api_version: str) -> None:
        self.obj = obj
        self.item = _dumps(obj)
        self.full = b'{"kind":"%s","apiVersion":"%s",' % (kind.encode(), api_version.encode()) + self.item[1:]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def rv(self) -> str:
        return str(self.obj["metadata"]["resourceVersion"])

    def copy(self) -> dict[str, Any]:
        """A deep copy of the whole object, as a client would read it."""
        result: dict[str, Any] = json.loads(self.full)
        return result

    def copy_obj(self) -> dict[str, Any]:
        """A deep copy of ``obj`` (no kind/apiVersion), to build the next state from."""
        result: dict[str, Any] = json.loads(self.item)
        return result


def _slice(obj: dict[str, Any]) -> _Stored:
    return _Stored(obj, "ResourceSlice", API_VERSION)


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    stored: _Stored


def _event_line(kind: str, raw_object: bytes) -> bytes:
    return b'{"type":"%s","object":%s}\n' % (kind.encode(), raw_object)


def _bookmark_line(rv: int) -> bytes:
    return _event_line("BOOKMARK", _dumps({"kind": "ResourceSlice", "apiVersion": API_VERSION,
                                           "metadata": {"resourceVersion": str(rv)},
                                           "spec": {"driver": "", "pool": {"name": "", "generation": 0,
                                                                           "resourceSliceCount": 0}}}))


@dataclass(eq=False)
class _Watcher:
    matches: _Predicate
    bookmarks: bool
    lines: list[bytes] = field(default_factory=list)
    ended: bool = False  # end the stream cleanly (terminal chunk) once the lines are sent
    aborted: bool = False  # drop the connection

    def offer(self, event: _Event) -> None:
        """The fields a watch selects by (name, driver, node) never change: an event is the
        watch's whole or not at all."""
        if self.matches(event.stored.obj):
            self.lines.append(_event_line(event.type, event.stored.full))


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int | None
    remaining: int
    delay: float
    message: str | None


_FAULT_MESSAGES = {
    409: _MODIFIED, 410: "too old resource version", 429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected by the test",
    503: "the server is currently unable to handle the request",
    504: "Timeout: request did not complete within the allotted timeout",
}


@dataclass
class _Response:
    code: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, error: ApiError) -> _Response:
        return cls(error.code, _dumps(error.status), error.headers)


# -- the server ----------------------------------------------------------------------------------
class ApiServer:
    """The stand-in. ``start()`` (or ``with``) listens on 127.0.0.1 (``port`` 0: any free port)."""

    def __init__(self, token: str | None = None, *, port: int = 0, feature_gates: Iterable[str] = ()) -> None:
        self.token = token
        self.feature_gates = frozenset(feature_gates)
        if unknown_gates := self.feature_gates - FEATURE_GATES:
            raise ValueError(f"feature gates not modelled: {sorted(unknown_gates)}")
        self.port = port
        self._cond = threading.Condition(threading.RLock())
        self._random = random.Random()
        self._rv = 100  # a real cluster's resourceVersion is never 0, which means "any" to list and watch
        self._floor = self._rv  # watches from a resourceVersion below this are Expired
        self._history: deque[_Event] = deque(maxlen=HISTORY)
        self._slices: dict[str, _Stored] = {}
        self._claims: dict[tuple[str, str], _Stored] = {}
        self._nodes: dict[str, _Stored] = {}
        self._watchers: set[_Watcher] = set()
        self._faults: list[_Fault] = []
        self._requests: list[Request] = []
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._listener: _Listener | None = None
        self._closed = threading.Event()
        self.internal_errors: list[str] = []  # the stand-in's own bugs, answered as 500s

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> ApiServer:
        self.up()
        return self

    def close(self) -> None:
        self._closed.set()
        self.down()
        with self._cond:
            threads = list(self._connections.values())
        deadline = time.monotonic() + 5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        """Stop listening (connects are refused) and drop every connection, watches included."""
        with self._cond:
            listener, self._listener = self._listener, None
        if listener is None:
            return
        listener.close()
        with self._cond:
            for watcher in self._watchers:
                watcher.aborted = True
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._cond.notify_all()

    def up(self) -> None:
        """Listen again, on the same port."""
        with self._cond:
            if self._listener is None:
                self._closed.clear()
                self._listener = _Listener(self, self.port)
                self.port = self._listener.port

    def kubeconfig(self, path: Path | str) -> Path:
        """Write a kubeconfig for this server (and ``token``) that ``load_kube_config`` reads."""
        path = Path(path)
        user = f"\n    token: {json.dumps(self.token)}" if self.token is not None else " {}"
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: standin
  cluster:
    server: {json.dumps(self.url)}
contexts:
- name: standin
  context:
    cluster: standin
    user: standin
current-context: standin
preferences: {{}}
users:
- name: standin
  user:{user}
""")
        return path

    # -- test-side state -----------------------------------------------------------------------
    def add_node(self, name: str, uid: str | None = None) -> str:
        uid = uid or str(uuid.uuid4())
        with self._cond:
            meta = {"name": name, "uid": uid, "resourceVersion": self._bump(), "creationTimestamp": _now()}
            self._nodes[name] = _Stored({"metadata": meta, "spec": {}, "status": {}}, "Node", "v1")
            self._cond.notify_all()
        return uid

    def delete_node(self, name: str) -> None:
        with self._cond:
            del self._nodes[name]
            self._bump()
            self._cond.notify_all()

    def put_claim(self, namespace: str, name: str, uid: str | None = None,
                  results: Sequence[Mapping[str, Any]] | None = None,
                  config: Sequence[Mapping[str, Any]] | None = None,
                  annotations: Mapping[str, str] | None = None) -> str:
        """Create or replace a claim as the scheduler leaves it. ``results`` are
        ``{request, driver, pool, device[, adminAccess, ...]}`` (a request ``<main>/<subrequest>``
        of a prioritized list counts for its main request); None means not allocated (no
        ``status.allocation``). ``config`` entries are ``{source?, requests?, opaque: {driver,
        parameters}}`` (source defaults to FromClaim). ``uid`` defaults to a new one: a replaced claim.
        ``annotations``: the claim's (a claim made from a template has
        ``resource.kubernetes.io/pod-claim-name``)."""
        uid = uid or str(uuid.uuid4())
        counts: dict[str, int] = {}
        for result in results or []:
            request = str(result["request"]).split("/")[0]
            counts[request] = counts.get(request, 0) + 1
        requests = [{"name": request, "exactly": {"deviceClassName": CLAIM_DEVICE_CLASS, "allocationMode": "ExactCount",
                                                  "count": count}} for request, count in counts.items()]
        status: dict[str, Any] = {}
        if results is not None:
            devices: dict[str, Any] = {"results": [dict(result) for result in results]}
            if config:
                devices["config"] = [{"source": "FromClaim", **entry} for entry in config]
            status["allocation"] = {"devices": devices, "allocationTimestamp": _now()}
        with self._cond:
            meta = {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": self._bump(),
                    "generation": 1, "creationTimestamp": _now()}
            if annotations:
                meta["annotations"] = dict(annotations)
            self._claims[namespace, name] = _Stored(
                {"metadata": meta, "spec": {"devices": {"requests": requests}}, "status": status},
                "ResourceClaim", API_VERSION)
            self._cond.notify_all()
        return uid

    def delete_claim(self, namespace: str, name: str) -> None:
        with self._cond:
            del self._claims[namespace, name]
            self._bump()
            self._cond.notify_all()

    def claim(self, namespace: str, name: str) -> dict[str, Any]:
        with self._cond:
            return self._claims[namespace, name].copy()

    def slices(self, driver: str | None = None, node: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored slices (sorted by name), optionally of one driver and/or node."""
        with self._cond:
            return [stored.copy() for _, stored in sorted(self._slices.items())
                    if (driver is None or stored.obj["spec"].get("driver") == driver)
                    and (node is None or stored.obj["spec"].get("nodeName") == node)]

    def create_slice(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a slice as another client would (validated; ApiError on failure)."""
        stored, _ = self._create_slice(json.loads(_dumps(obj)), {})
        return stored.copy()

    def delete_slice(self, name: str) -> None:
        self._delete_slice(name, b"")

    def wipe(self, node: str, driver: str | None = None) -> int:
        """Delete the node's slices (of one driver), as the kubelet does; the count deleted."""
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver is not None else "")
        return len(self._delete_collection({"fieldSelector": selector}))

    def compact(self) -> None:
        """Drop the watch history (and list continue tokens): older resourceVersions are Expired."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv

    def close_watches(self) -> None:
        """End every open watch cleanly, as the server may at any time."""
        with self._cond:
            for watcher in self._watchers:
                watcher.ended = True
            self._cond.notify_all()

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to every watch that allows them."""
        with self._cond:
            for watcher in self._watchers:
                if watcher.bookmarks:
                    watcher.lines.append(_bookmark_line(self._rv))
            self._cond.notify_all()

    def fail_next(self, method: str, path_regex: str, status: int | None, count: int = 1, delay: float = 0.0,
                  message: str | None = None) -> None:
        """Answer the next ``count`` requests whose path (no query) matches ``path_regex``
        (re.search) with a Status of ``status``, after sleeping ``delay`` seconds; with ``status``
        None, sleep and then serve normally. ``method`` is an HTTP method, ``*``, or a
        Kubernetes verb in lower case (get, list, watch, create, update, delete)."""
        with self._cond:
            self._faults.append(_Fault(method, re.compile(path_regex), status, count, delay, message))

    @property
    def requests(self) -> list[Request]:
        with self._cond:
            return list(self._requests)

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    @property
    def watch_count(self) -> int:
        """How many watches are open now."""
        with self._cond:
            return len(self._watchers)

    def wait_until(self, predicate: Callable[[], T], timeout: float = 10.0,
                   what: str | Callable[[], str] = "") -> T:
        """:func:`tests.waiting.wait_until` on the condition every change and request notifies,
        its failure naming the slices and the last requests. The predicate runs under the lock
        (which is reentrant: it may call ``slices()``, ``requests``, ...)."""
        def failure() -> str:
            names = {name: stored.rv for name, stored in sorted(self._slices.items())}
            return (f"apiserver stand-in: {what() if callable(what) else what}; slices={names}; "
                    f"last requests={self._requests[-5:]}")

        with self._cond:
            return wait_until(predicate, timeout, failure, condition=self._cond)

    async def wait_until_async(self, predicate: Callable[[], T], timeout: float = 10.0,
                               what: str | Callable[[], str] = "") -> T:
        """``wait_until`` from trio code, in a worker thread."""
        return await trio.to_thread.run_sync(functools.partial(self.wait_until, predicate, timeout, what),
                                             abandon_on_cancel=True)

    # -- store ---------------------------------------------------------------------------------
    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _commit(self, kind: str, obj: dict[str, Any], previous: _Stored | None) -> _Stored:
        """Write one slice change (under the lock): a new resourceVersion, the event, the fan-out.
        ``previous`` is the state it replaces (None: a create), for a subclass that stamps writes
        (benchmarks.dra_common)."""
        obj["metadata"]["resourceVersion"] = self._bump()
        stored = _slice(obj)
        if kind == "DELETED":
            del self._slices[stored.name]
        else:
            self._slices[stored.name] = stored
        event = _Event(self._rv, kind, stored)
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        self._history.append(event)
        for watcher in self._watchers:
            watcher.offer(event)
        self._cond.notify_all()
        return stored

    def _decode_slice(self, body: Any, query: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
        unknown: list[str] = []
        try:
            obj: dict[str, Any] = _decode(body, _RESOURCE_SLICE, "", unknown)
        except ValueError as error:
            raise ApiError(400, f'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: {error}') \
                from None
        for key, want in (("kind", "ResourceSlice"), ("apiVersion", API_VERSION)):
            if obj.pop(key, want) != want:
                raise ApiError(400, f"the {key} in the data ({body[key]}) does not match the expected {key} ({want})")
        obj.setdefault("metadata", {})
        obj.setdefault("spec", {})
        return obj, [f'unknown field "{u}"' for u in unknown]

    def _create_slice(self, body: Any, query: Mapping[str, str]) -> tuple[_Stored, list[str]]:
        obj, warnings = self._decode_slice(body, query)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        for key in ("namespace", "selfLink", "managedFields", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        _drop_disabled_fields(obj["spec"], None, self.feature_gates)
        with self._cond:
            if not meta.get("name") and meta.get("generateName"):
                for _ in range(8):  # upstream retries a generated name that is taken
                    meta["name"] = meta["generateName"][:58] + "".join(
                        self._random.choice(_NAME_SUFFIX_ALPHABET) for _ in range(5))
                    if meta["name"] not in self._slices:
                        break
            meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
            name = meta.get("name", "")
            if errors := validate_resource_slice(obj):
                raise SLICES.invalid(name, errors)
            if name in self._slices:
                raise ApiError(409, f'{SLICES} "{name}" already exists', "AlreadyExists", SLICES.details(name))
            return self._commit("ADDED", _ordered_meta(obj), None), warnings

    def _update_slice(self, name: str, body: Any, query: Mapping[str, str]) -> tuple[_Stored, list[str]]:
        obj, warnings = self._decode_slice(body, query)
        meta = obj["metadata"]
        if meta.get("name", "") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name', '')}) does not match the name on the URL "
                                f"({name})")
        with self._cond:
            old = self._slices.get(name)
            if old is None:
                raise SLICES.not_found(name)
            old_meta = old.obj["metadata"]
            # AllowUnconditionalUpdate is true for ResourceSlices: no resourceVersion, no check.
            if meta.get("resourceVersion") and meta["resourceVersion"] != old.rv:
                raise SLICES.conflict(name, _MODIFIED)
            if meta.get("uid") and meta["uid"] != old_meta["uid"]:
                raise SLICES.conflict(name, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                                            f"meta: {old_meta['uid']}")
            for key in ("namespace", "selfLink", "managedFields"):
                meta.pop(key, None)
            _drop_disabled_fields(obj["spec"], old.obj["spec"], self.feature_gates)
            generation = old_meta["generation"] + (obj["spec"] != old.obj["spec"])
            meta.update(uid=old_meta["uid"], resourceVersion=old.rv, generation=generation,
                        creationTimestamp=old_meta["creationTimestamp"])
            if errors := validate_resource_slice(obj, old.obj):
                raise SLICES.invalid(name, errors)
            obj = _ordered_meta(obj)
            if obj == old.obj:
                return old, warnings  # a no-op update writes nothing
            return self._commit("MODIFIED", obj, old), warnings

    def _delete_slice(self, name: str, body: bytes) -> _Stored:
        options = _json_body(body) if body else {}
        preconditions = (options.get("preconditions") or {}) if isinstance(options, dict) else {}
        with self._cond:
            old = self._slices.get(name)
            if old is None:
                raise SLICES.not_found(name)
            for key, label, current in (("uid", "UID", old.obj["metadata"]["uid"]),
                                        ("resourceVersion", "ResourceVersion", old.rv)):
                wanted = preconditions.get(key)
                if wanted is not None and wanted != current:
                    raise SLICES.conflict(name, f"Precondition failed: {label} in precondition: {wanted}, {label} "
                                                f"in object meta: {current}")
            return self._commit("DELETED", old.copy_obj(), old)

    def _delete_collection(self, query: Mapping[str, str]) -> list[_Stored]:
        matches = _selector(query)
        with self._cond:
            doomed = [stored for _, stored in sorted(self._slices.items()) if matches(stored.obj)]
            return [self._commit("DELETED", stored.copy_obj(), stored) for stored in doomed]

    def _list(self, query: Mapping[str, str]) -> bytes:
        matches = _selector(query)
        with self._cond:
            items = [stored.item for _, stored in sorted(self._slices.items()) if matches(stored.obj)]
            metadata = _dumps({"resourceVersion": str(self._rv)})
        return (b'{"kind":"ResourceSliceList","apiVersion":"%s","metadata":%s,"items":[%s]}'
                % (API_VERSION.encode(), metadata, b",".join(items)))

    def write_claim_status(self, namespace: str, name: str, devices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Set the claim's ``status.devices`` as another driver would (validated; ApiError on
        failure): the claim as stored now."""
        with self._cond:
            rv = self._claims[namespace, name].rv
        body = {"metadata": {"resourceVersion": rv}, "status": {"devices": json.loads(_dumps(list(devices)))}}
        return self._update_claim_status(namespace, name, body).copy()

    def _update_claim_status(self, namespace: str, name: str, body: Any) -> _Stored:
        """PUT .../status: only ``status.devices`` is taken, validated as upstream's
        ``validateResourceClaimStatusUpdate`` does (``validate_claim_devices``); a stale
        resourceVersion is a 409; a write that changes nothing keeps the resourceVersion."""
        if not isinstance(body, dict):
            raise ApiError(400, "ResourceClaim in version \"v1\" cannot be handled as a ResourceClaim")
        meta = body.get("metadata") or {}
        status = body.get("status") or {}
        devices = status.get("devices") if isinstance(status, dict) else None
        if devices is not None and not (isinstance(devices, list) and all(isinstance(d, dict) for d in devices)):
            raise ApiError(400, "ResourceClaim in version \"v1\" cannot be handled as a ResourceClaim: "
                                "status.devices: expected a list of objects")
        with self._cond:
            old = self._claims.get((namespace, name))
            if old is None:
                raise CLAIMS.not_found(name)
            if meta.get("resourceVersion") and meta["resourceVersion"] != old.rv:
                raise CLAIMS.conflict(name, _MODIFIED)
            errors = validate_claim_devices(devices or [], old.obj["status"].get("allocation"))
            if errors:
                raise CLAIMS.invalid(name, errors)
            if (devices or None) == old.obj["status"].get("devices"):
                return old  # no change: no new resourceVersion
            obj = old.copy_obj()
            if devices:
                obj["status"]["devices"] = devices
            else:
                obj["status"].pop("devices", None)
            obj["metadata"]["resourceVersion"] = self._bump()
            stored = _Stored(obj, "ResourceClaim", API_VERSION)
            self._claims[namespace, name] = stored
            self._cond.notify_all()
            return stored

    # -- HTTP ----------------------------------------------------------------------------------
    def _accepted(self, connection: socket.socket) -> None:
        thread = threading.Thread(target=self._serve_connection, args=(connection,), daemon=True,
                                  name=f"apiserver-standin-{self.port}-connection")
        with self._cond:
            self._connections[connection] = thread
        thread.start()

    def _serve_connection(self, connection: socket.socket) -> None:
        try:
            _Handler(connection, ("127.0.0.1", 0), self)  # type: ignore[arg-type]
        except OSError:
            pass
        finally:
            with self._cond:
                self._connections.pop(connection, None)
            with contextlib.suppress(OSError):
                connection.close()

    def _log(self, method: str, path: str, query: dict[str, str], status: int) -> None:
        with self._cond:
            self._requests.append(Request(method, path, query, status))
            self._cond.notify_all()

    def _handle(self, handler: _Handler, method: str) -> None:
        url = urlsplit(handler.path)
        path = url.path
        query = {key: values[0] for key, values in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        parts = [unquote(part) for part in path.strip("/").split("/")]
        collection = path.rstrip("/") == SLICES_PATH
        verb = _verb(method, collection, query)
        try:
            self._inject_fault(method, verb, path)
            self._authenticate(handler.headers.get("Authorization"))
            if verb == "watch" and collection:
                self._watch(handler, path, query)
                return
            response = self._route(method, parts, query, body)
        except ApiError as error:
            response = _Response.of(error)
        except Exception as error:  # noqa: BLE001 -- a bug here must not kill the connection's thread
            with self._cond:
                self.internal_errors.append(f"{method} {handler.path}: {error!r}")
            response = _Response.of(ApiError(500, f"Internal error occurred: stand-in bug: {error!r}"))
        self._log(method, path, query, response.code)
        handler.reply(response)

    def _inject_fault(self, method: str, verb: str, path: str) -> None:
        with self._cond:
            fault = next((f for f in self._faults if f.method in ("*", method, verb) and f.path.search(path)), None)
            if fault is None:
                return
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._faults.remove(fault)
        if fault.delay:
            self._closed.wait(fault.delay)
        if fault.status is None:
            return
        item = re.fullmatch(f"{SLICES_PATH}/([^/]+)", path)
        if fault.status == 409 and item and not fault.message:
            raise SLICES.conflict(unquote(item.group(1)), _MODIFIED)
        headers = [("Retry-After", "1")] if fault.status == 429 else []
        details = {"retryAfterSeconds": 1} if fault.status == 429 else None
        raise ApiError(fault.status, fault.message or _FAULT_MESSAGES.get(fault.status, "injected by the test"),
                       details=details, headers=headers)

    def _authenticate(self, authorization: str | None) -> None:
        if self.token is not None and authorization != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized")

    def _route(self, method: str, parts: list[str], query: dict[str, str], body: bytes) -> _Response:
        if len(parts) == 4 and parts[:3] == ["api", "v1", "nodes"]:
            return self._node(method, parts[3])
        if parts[:3] == ["apis", GROUP, "v1"]:
            rest = parts[3:]
            if rest == ["resourceslices"]:
                return self._slices_collection(method, query, body)
            if len(rest) == 2 and rest[0] == "resourceslices":
                return self._slice_item(method, rest[1], query, body)
            if len(rest) in (4, 5) and rest[0] == "namespaces" and rest[2] == "resourceclaims" and rest[4:] in (
                    [], ["status"]):
                return self._claim(method, rest[1], rest[3], bool(rest[4:]), body)
        raise ApiError(404, "the server could not find the requested resource", details={})

    def _node(self, method: str, name: str) -> _Response:
        if method != "GET":
            raise _not_allowed()
        with self._cond:
            stored = self._nodes.get(name)
            if stored is None:
                raise NODES.not_found(name)
            return _Response(200, stored.full)

    def _claim(self, method: str, namespace: str, name: str, status: bool, body: bytes) -> _Response:
        if status and method == "PUT":
            return _Response(200, self._update_claim_status(namespace, name, _json_body(body)).full)
        if status or method != "GET":
            raise _not_allowed()
        with self._cond:
            stored = self._claims.get((namespace, name))
            if stored is None:
                raise CLAIMS.not_found(name)
            return _Response(200, stored.full)

    def _slices_collection(self, method: str, query: dict[str, str], body: bytes) -> _Response:
        if method == "GET":
            return _Response(200, self._list(query))
        if method == "POST":
            stored, warnings = self._create_slice(_json_body(body), query)
            return _Response(201, stored.full, _warning_headers(warnings))
        raise _not_allowed()

    def _slice_item(self, method: str, name: str, query: dict[str, str], body: bytes) -> _Response:
        if method == "GET":
            with self._cond:
                stored = self._slices.get(name)
                if stored is None:
                    raise SLICES.not_found(name)
                return _Response(200, stored.full)
        if method == "PUT":
            stored, warnings = self._update_slice(name, _json_body(body), query)
            return _Response(200, stored.full, _warning_headers(warnings))
        if method == "DELETE":
            return _Response(200, self._delete_slice(name, body).full)  # ReturnDeletedObject: true
        raise _not_allowed()

    def _watch(self, handler: _Handler, path: str, query: dict[str, str]) -> None:
        """Stream events as upstream's watch cache does, until timeoutSeconds, close_watches(),
        down() or the client going away."""
        matches = _selector(query)
        bookmarks = query.get("allowWatchBookmarks", "") in _TRUE
        rv_text = query.get("resourceVersion", "")
        try:
            timeout = float(query.get("timeoutSeconds") or 0) or WATCH_TIMEOUT
        except ValueError:
            raise ApiError(400, f"invalid timeoutSeconds: {query['timeoutSeconds']}") from None
        watcher = _Watcher(matches, bookmarks)
        with self._cond:
            if rv_text in ("", "0"):  # the current state first, as ADDED events
                for _, stored in sorted(self._slices.items()):
                    if matches(stored.obj):
                        watcher.lines.append(_event_line("ADDED", stored.full))
            else:
                try:
                    since = int(rv_text)
                except ValueError:
                    raise ApiError(400, f"invalid resource version: {rv_text}") from None
                if since < self._floor:
                    expired = ApiError(410, f"too old resource version: {since} ({self._floor})", "Expired")
                    watcher.lines.append(_event_line("ERROR", _dumps(expired.status)))
                    watcher.ended = True
                else:
                    for event in self._history:
                        if event.rv > since:
                            watcher.offer(event)
            if self._listener is None:
                watcher.aborted = True  # down() came between reading the request and now
            elif not watcher.ended:
                self._watchers.add(watcher)
            self._requests.append(Request("GET", path, query, 200))
            self._cond.notify_all()
        threading.Thread(target=self._notice_hangup, args=(handler.connection, watcher), daemon=True,
                         name=f"apiserver-standin-{self.port}-hangup").start()
        try:
            handler.start_chunked()
            self._stream(handler, watcher, time.monotonic() + timeout)
        except OSError:
            handler.close_connection = True
        finally:
            with self._cond:
                self._watchers.discard(watcher)
                self._cond.notify_all()

    def _notice_hangup(self, connection: socket.socket, watcher: _Watcher) -> None:
        """End the watch as soon as the client closes the connection (a client sends nothing
        during a watch), so that ``watch_count`` counts only watches someone is reading."""
        try:
            hung_up = not connection.recv(1, socket.MSG_PEEK)
        except OSError:
            hung_up = True
        if hung_up:
            with self._cond:
                watcher.aborted = True
                self._cond.notify_all()

    def _stream(self, handler: _Handler, watcher: _Watcher, deadline: float) -> None:
        while True:
            with self._cond:
                while not (watcher.lines or watcher.ended or watcher.aborted):
                    if (remaining := deadline - time.monotonic()) <= 0:
                        watcher.ended = True
                    else:
                        self._cond.wait(remaining)
                lines, watcher.lines = watcher.lines, []
                ended, aborted = watcher.ended, watcher.aborted
            if aborted:
                handler.close_connection = True
                return
            for line in lines:
                handler.write_chunk(line)
            if ended:
                handler.write_chunk(b"")
                return


def _ordered_meta(obj: dict[str, Any]) -> dict[str, Any]:
    """metadata's fields in upstream's order (name, generateName, uid, resourceVersion, ...)."""
    order = ("name", "generateName", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
             "labels", "annotations", "ownerReferences", "finalizers")
    meta = obj["metadata"]
    obj["metadata"] = {key: meta[key] for key in order if key in meta} | meta
    return {"metadata": obj["metadata"], "spec": obj["spec"]}


def _verb(method: str, collection: bool, query: Mapping[str, str]) -> str:
    if method == "GET":
        return ("watch" if query.get("watch", "") in _TRUE else "list") if collection else "get"
    return {"POST": "create", "PUT": "update"}.get(method, method.lower())


def _not_allowed() -> ApiError:
    return ApiError(405, "the server does not allow this method on the requested resource")


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError as error:
        raise ApiError(400, f"couldn't get version/kind; json parse error: {error}") from None


def _warning_headers(warnings: Sequence[str]) -> list[tuple[str, str]]:
    return [("Warning", f"299 - {json.dumps(warning)}") for warning in warnings]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "devplugd-apiserver-standin"
    disable_nagle_algorithm = True
    server: ApiServer  # type: ignore[assignment]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server._handle(self, "GET")

    def do_POST(self) -> None:
        self.server._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server._handle(self, "PUT")

    def do_DELETE(self) -> None:
        self.server._handle(self, "DELETE")

    def reply(self, response: _Response) -> None:
        try:
            self.send_response(response.code)
            if not any(key == "Content-Type" for key, _ in response.headers):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(response.body)))
            for key, value in response.headers:
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(response.body)
        except OSError:
            self.close_connection = True

    def start_chunked(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        """One chunk (the terminal one for empty ``data``), flushed at once, as upstream flushes
        after every event."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


class _Listener:
    """The listening socket and its accept loop, woken through a socket pair to stop."""

    def __init__(self, api: ApiServer, port: int) -> None:
        self._api = api
        self.socket = socket.create_server(("127.0.0.1", port), backlog=128)
        self.port: int = self.socket.getsockname()[1]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name=f"apiserver-standin-{self.port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_reader:
                        return
                    try:
                        connection, _ = self.socket.accept()
                    except OSError:
                        continue
                    self._api._accepted(connection)

    def close(self) -> None:
        self._wake_writer.send(b"\0")
        self._thread.join(5)
        for sock in (self.socket, self._wake_reader, self._wake_writer):
            sock.close()

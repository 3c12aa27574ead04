"""The pool config file: the SR-IOV network device plugin's format, read exactly as it reads it.

``{"resourceList": [ {resourceName, resourcePrefix, deviceType, excludeTopology,
additionalInfo, selectors, ...}, ... ]}`` with Go's case-insensitive keys and ignored unknown
keys. This module parses the fields every pool has; the handler that serves a pool's
``deviceType`` parses the rest (its selectors). Errors name the JSON path and the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from ._jsonpath import ConfigError, ConfigObject, describe, expect_type, parse_json
from ._names import dra_pool_part, extended_resource_name_problem, resource_name_problem

log = logging.getLogger("devplugd.config")

DEFAULT_DEVICE_TYPE = "netDevice"
DEVICE_PLUGIN_API = "devicePlugin"
DRA_API = "dra"
ALLOCATION_APIS = (DEVICE_PLUGIN_API, DRA_API)
# unhealthyTaint: what a DRA pool's Unhealthy device is in its ResourceSlice: published with a
# taint of one of the API's effects, or left out (OMIT_UNHEALTHY)
NO_SCHEDULE, NO_EXECUTE, INFORM_ONLY = "NoSchedule", "NoExecute", "None"
OMIT_UNHEALTHY = "omit"
UNHEALTHY_TAINTS = (NO_SCHEDULE, NO_EXECUTE, INFORM_ONLY, OMIT_UNHEALTHY)


@dataclass(frozen=True)
class PoolEntry:
    """The fields common to every pool, as written in the file."""

    index: int
    json_path: str
    resource_name: str
    resource_prefix: str
    device_type: str
    exclude_topology: bool
    additional_info: Mapping[str, Mapping[str, str]] | None
    selectors: tuple[ConfigObject, ...]
    raw: ConfigObject
    # which road its devices take: the kubelet's device-plugin API, or DRA ResourceSlices
    allocation_api: str = DEVICE_PLUGIN_API
    # through DRA: the effect of an Unhealthy device's taint, or OMIT_UNHEALTHY
    unhealthy_taint: str = NO_SCHEDULE

    @cached_property
    def resource(self) -> str:
        """``<prefix>/<name>``: one string per pool, however many devices name it."""
        return f"{self.resource_prefix}/{self.resource_name}"


SpecT = TypeVar("SpecT")


@dataclass(frozen=True)
class ConfiguredPool(Generic[SpecT]):
    """A pool entry together with the handler that serves it and that handler's parsed spec."""

    entry: PoolEntry
    handler: str
    spec: SpecT

    @property
    def resource(self) -> str:
        return self.entry.resource


@dataclass(frozen=True)
class DaemonConfig:
    """A validated config file: its pools in file order and the warnings parsing it gave."""

    source: str
    pools: tuple[ConfiguredPool[Any], ...]
    warnings: tuple[str, ...]

    def pools_of(self, handler: str) -> tuple[ConfiguredPool[Any], ...]:
        return tuple(pool for pool in self.pools if pool.handler == handler)

    @property
    def dra_pools(self) -> tuple[ConfiguredPool[Any], ...]:
        return tuple(pool for pool in self.pools if pool.entry.allocation_api == DRA_API)


class ConfigFileError(Exception):
    """The config file cannot be used. ``str(error)`` names the file, the JSON path and why."""

    def __init__(self, source: str, error: ConfigError | str) -> None:
        detail = str(error)
        super().__init__(f"config {source}: {detail}")
        self.source = source
        self.json_path = error.json_path if isinstance(error, ConfigError) else "$"


PoolParser = Callable[[PoolEntry], object]
# deviceType -> (handler name, parser of that handler)
ParserTable = Mapping[str, tuple[str, PoolParser]]


def load_config(path: Path, default_prefix: str, parsers: ParserTable) -> DaemonConfig:
    """Read and validate the config file at ``path``; raise ConfigFileError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigFileError(str(path), f"cannot read: {error}") from error
    return parse_config(text, str(path), default_prefix, parsers)


def parse_config(text: str, source: str, default_prefix: str, parsers: ParserTable) -> DaemonConfig:
    """Validate a config document; raise ConfigFileError naming the first problem."""
    try:
        document = parse_json(text)
    except ValueError as error:
        raise ConfigFileError(source, f"$: not valid JSON: {error}") from error
    warnings: list[str] = []
    try:
        root = ConfigObject(expect_type(document, dict, "$"), "$")
        if not root.has("resourceList"):
            raise ConfigError("$.resourceList", "is required")
        pools: list[ConfiguredPool[Any]] = []
        resources: dict[str, str] = {}
        dra_pool_names: dict[str, str] = {}  # pool name part -> JSON path of the pool that has it
        for index, item in enumerate(root.get("resourceList", list, [])):
            json_path = f"$.resourceList[{index}]"
            entry = _parse_entry(index, item, json_path, default_prefix, warnings)
            if entry is None:
                continue
            if entry.device_type not in parsers:
                known = ", ".join(sorted(parsers))
                raise ConfigError(
                    f"{json_path}.deviceType",
                    f"unknown deviceType {entry.device_type!r} (known: {known})",
                )
            handler_name, parse_pool = parsers[entry.device_type]
            if entry.resource in resources:
                raise ConfigError(
                    f"{json_path}.resourceName",
                    f"duplicate resource {entry.resource!r} (also at {resources[entry.resource]})",
                )
            resources[entry.resource] = json_path
            if entry.allocation_api == DRA_API:
                _check_dra_pool_name(entry, dra_pool_names)
            pools.append(
                ConfiguredPool(entry=entry, handler=handler_name, spec=_parse_pool(handler_name, parse_pool, entry))
            )
    except ConfigError as error:
        raise ConfigFileError(source, error) from error
    return DaemonConfig(source=source, pools=tuple(pools), warnings=tuple(warnings))


def _check_dra_pool_name(entry: PoolEntry, seen: dict[str, str]) -> None:
    """A DRA pool's ResourceSlice pool name (``<node>/<resource made valid>``) must not be the
    same as another DRA pool's (``intel.com/a_b`` and ``intel.com/a-b`` would be one)."""
    where = entry.raw.path_of("allocationApi")
    part = dra_pool_part(entry.resource)
    if part in seen:
        raise ConfigError(where, f"resource {entry.resource!r} would publish the ResourceSlice pool <node>/{part}, "
                                 f"as the pool at {seen[part]} does")
    seen[part] = entry.json_path


def _parse_pool(handler_name: str, parse_pool: PoolParser, entry: PoolEntry) -> object:
    """The handler's spec for ``entry``. A handler that fails with anything but ConfigError has a
    bug, not the file: it still refuses this config (naming the pool and the handler), never the
    daemon."""
    try:
        return parse_pool(entry)
    except ConfigError:
        raise
    except Exception as error:
        log.exception("handler %s failed to parse the pool at %s", handler_name, entry.json_path)
        raise ConfigError(entry.json_path, f"handler {handler_name} failed to parse this pool: "
                                           f"{type(error).__name__}: {error}") from error


def _parse_entry(
    index: int, item: Any, json_path: str, default_prefix: str, warnings: list[str]
) -> PoolEntry | None:
    pool = ConfigObject(expect_type(item, dict, json_path), json_path)
    resource_name = pool.require("resourceName", str)
    if problem := resource_name_problem(resource_name):
        raise ConfigError(pool.path_of("resourceName"), problem)
    resource_prefix = pool.get("resourcePrefix", str, "") or default_prefix
    resource = f"{resource_prefix}/{resource_name}"
    if problem := extended_resource_name_problem(resource):
        where = "resourcePrefix" if pool.has("resourcePrefix") else "resourceName"
        raise ConfigError(pool.path_of(where), f"resource name {resource!r} is invalid: {problem}")
    device_type = pool.get("deviceType", str, "") or DEFAULT_DEVICE_TYPE
    exclude_topology = pool.get("excludeTopology", bool, False)
    additional_info = _parse_additional_info(pool)
    allocation_api = pool.get("allocationApi", str, "") or DEVICE_PLUGIN_API
    if allocation_api not in ALLOCATION_APIS:
        raise ConfigError(pool.path_of("allocationApi"),
                          f"must be {' or '.join(repr(a) for a in ALLOCATION_APIS)}, not {allocation_api!r}")
    unhealthy_taint = pool.get("unhealthyTaint", str, NO_SCHEDULE)
    if unhealthy_taint not in UNHEALTHY_TAINTS:
        raise ConfigError(pool.path_of("unhealthyTaint"),
                          f"must be {', '.join(repr(t) for t in UNHEALTHY_TAINTS)}, not {unhealthy_taint!r}")

    if not pool.has("selectors") or pool.raw("selectors") is None:
        raise ConfigError(pool.path_of("selectors"), "is required (an object or a list of objects)")
    raw_selectors = pool.raw("selectors")
    selectors_path = pool.path_of("selectors")
    selectors: tuple[ConfigObject, ...]
    if isinstance(raw_selectors, dict):
        selectors = (ConfigObject(raw_selectors, selectors_path),)
    elif isinstance(raw_selectors, list) and raw_selectors and all(isinstance(s, dict) for s in raw_selectors):
        selectors = tuple(
            ConfigObject(selector, f"{selectors_path}[{position}]")
            for position, selector in enumerate(raw_selectors)
        )
    else:
        # The SR-IOV plugin logs and skips such a pool rather than failing the file.
        reason = "is an empty list" if raw_selectors == [] else (
            f"must be an object or a list of objects, not {describe(raw_selectors)}"
        )
        warnings.append(f"{selectors_path}: {reason}; pool {resource!r} is skipped")
        return None
    return PoolEntry(
        index=index,
        json_path=json_path,
        resource_name=resource_name,
        resource_prefix=resource_prefix,
        device_type=device_type,
        exclude_topology=exclude_topology,
        additional_info=additional_info,
        selectors=selectors,
        raw=pool,
        allocation_api=allocation_api,
        unhealthy_taint=unhealthy_taint,
    )


def _parse_additional_info(pool: ConfigObject) -> Mapping[str, Mapping[str, str]] | None:
    """``additionalInfo``; ``None`` when absent or null (an empty object is kept: upstream then
    still adds an empty ``extra`` provider to ``_INFO``)."""
    info = pool.object("additionalInfo")
    if info is None:
        return None
    parsed: dict[str, Mapping[str, str]] = {}
    for device_key, values, values_path in info.map_items():  # a Go map: keys are case-sensitive
        if values is None:
            continue
        values = expect_type(values, dict, values_path)
        parsed[device_key] = MappingProxyType(
            {key: expect_type(value, str, f"{values_path}.{key}") for key, value in values.items()}
        )
    return MappingProxyType(parsed)

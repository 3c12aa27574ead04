"""devNode selectors: ``paths`` (globs of /dev paths) and ``udev`` (subsystems and properties).

One selector object may hold either or both; a node must match every part it holds::

    {"paths": ["/dev/ttyUSB*"],
     "udev": {"subsystems": ["tty"],
              "properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "FT*"},
              "parentProperties": {"DRIVER": "ftdi_sio"}}}

``properties`` match the node's own device, every key (glob values, case-sensitive as udev's
rules are); ``parentProperties`` match its ancestors, every key on some ancestor (each key may
be met by a different one; the node's own device is not its ancestor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from daemon.core import ConfigError, ConfigObject, Mismatch, set_by_udev, wanted
from daemon.handlers._devnodes import DEV_PREFIX

UDEV_KEYS = ("subsystems", "properties", "parentProperties")
Globs = tuple[tuple[str, str], ...]  # (property key, glob of its value)


@dataclass(frozen=True, slots=True)
class UdevSelector:
    subsystems: tuple[str, ...]
    properties: Globs
    parent_properties: Globs

    def udev_only_keys(self) -> list[str]:
        """The keys only udev sets (they never match kernel properties alone)."""
        return sorted({key for key, _ in (*self.properties, *self.parent_properties) if set_by_udev(key)})

    def matches(self, own: Mapping[str, str], ancestors: Sequence[Mapping[str, str]]) -> bool:
        return self.mismatch(own, ancestors) is None

    def mismatch(self, own: Mapping[str, str], ancestors: Sequence[Mapping[str, str]]) -> Mismatch | None:
        """What refuses a node with these properties (``None``: it matches): the key, what it
        wants, what the node has."""
        if self.subsystems and not any(fnmatchcase(own.get("SUBSYSTEM", ""), s) for s in self.subsystems):
            return Mismatch("udev.subsystems", wanted(self.subsystems), own.get("SUBSYSTEM") or "no SUBSYSTEM")
        for key, glob in self.properties:
            if not (key in own and fnmatchcase(own[key], glob)):
                return Mismatch(f"udev.properties.{key}", repr(glob), repr(own[key]) if key in own else "none")
        for key, glob in self.parent_properties:
            if not any(key in properties and fnmatchcase(properties[key], glob) for properties in ancestors):
                seen = sorted({p[key] for p in ancestors if key in p})
                return Mismatch(f"udev.parentProperties.{key}", repr(glob),
                                f"{', '.join(map(repr, seen))} on its ancestors" if seen else "none on its ancestors")
        return None


@dataclass(frozen=True, slots=True)
class NodeSelector:
    patterns: tuple[tuple[str, ...], ...] | None  # each /dev glob split into components; None: any path
    udev: UdevSelector | None  # None: any properties

    def path_mismatch(self, relative_path: str) -> Mismatch | None:
        """``paths`` refusing the node at ``relative_path`` (below /dev), or ``None``."""
        if self.patterns is None or any(path_matches(parts, relative_path) for parts in self.patterns):
            return None
        return Mismatch("paths", wanted(DEV_PREFIX + "/".join(parts) for parts in self.patterns),
                        DEV_PREFIX + relative_path)


def path_matches(parts: tuple[str, ...], relative_path: str) -> bool:
    path_parts = relative_path.split("/")
    return len(path_parts) == len(parts) and all(map(fnmatchcase, path_parts, parts))


def parse_glob(pattern: str, json_path: str) -> tuple[str, ...]:
    if not pattern.startswith(DEV_PREFIX) or pattern.rstrip("/") == "/dev":
        raise ConfigError(json_path, f"{pattern!r} must be an absolute path under /dev/")
    parts = tuple(part for part in pattern[len(DEV_PREFIX):].split("/") if part)
    if any(part in (".", "..") for part in parts):
        raise ConfigError(json_path, f"{pattern!r} must not contain '.' or '..'")
    return parts


def _globs(raw: ConfigObject | None) -> Globs:
    if raw is None:
        return ()
    globs: list[tuple[str, str]] = []
    for key, value, json_path in raw.map_items():
        if not key or "=" in key or any(c.isspace() for c in key):
            raise ConfigError(json_path, f"{key!r} is not a udev property name")
        if not isinstance(value, str):
            raise ConfigError(json_path, f"must be a string (a glob of the value), not {type(value).__name__}")
        globs.append((key, value))
    return tuple(globs)


def parse_udev(raw: Any, json_path: str) -> UdevSelector:
    if not isinstance(raw, dict):
        raise ConfigError(json_path, "must be an object with subsystems, properties and/or parentProperties")
    udev = ConfigObject(raw, json_path)
    unknown = sorted(key for key in udev.keys() if key.casefold() not in {k.casefold() for k in UDEV_KEYS})
    if unknown:
        raise ConfigError(udev.path_of(unknown[0]), f"is not a udev selector key (one of {', '.join(UDEV_KEYS)})")
    selector = UdevSelector(
        subsystems=udev.string_list("subsystems"),
        properties=_globs(udev.object("properties")),
        parent_properties=_globs(udev.object("parentProperties")),
    )
    if not (selector.subsystems or selector.properties or selector.parent_properties):
        raise ConfigError(json_path, "selects nothing: give subsystems, properties or parentProperties")
    return selector


def parse_selector(selector: ConfigObject) -> NodeSelector:
    paths = selector.string_list("paths")
    raw_udev = selector.raw("udev")
    if not paths and raw_udev is None:
        raise ConfigError(selector.path_of("paths"),
                          "is required unless udev is given: a list of /dev globs")
    patterns = tuple(
        parse_glob(path, f"{selector.path_of('paths')}[{index}]") for index, path in enumerate(paths)
    ) or None
    udev = parse_udev(raw_udev, selector.path_of("udev")) if raw_udev is not None else None
    return NodeSelector(patterns, udev)

"""Reading untrusted JSON with errors that name the JSON path and the reason.

``ConfigObject`` gives Go ``encoding/json`` semantics, which existing SR-IOV configs depend on:
keys match case-insensitively (an exact-case key wins over a folded one) and unknown keys are
ignored. Every accessor checks the type and raises ``ConfigError`` naming e.g.
``$.resourceList[2].selectors.vendors[0]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, cast

T = TypeVar("T")

_TYPE_NAMES: dict[type, str] = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    list: "a list",
    dict: "an object",
}


class ConfigError(ValueError):
    """A config value is wrong. ``str(error)`` is ``<json path>: <reason>``."""

    def __init__(self, json_path: str, reason: str) -> None:
        super().__init__(f"{json_path}: {reason}")
        self.json_path = json_path
        self.reason = reason


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` for text someone else wrote, where every way it can be bad is a ValueError:
    not JSON, not UTF-8 (UnicodeDecodeError), or nested deeper than the parser recurses (CPython
    raises RecursionError, which would otherwise escape every ``except ValueError``)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def describe(value: Any) -> str:
    """A short, readable rendering of a bad value for error messages."""
    if value is None:
        return "null"
    for kind, name in _TYPE_NAMES.items():
        if type(value) is kind:
            shown = repr(value) if kind is not dict and kind is not list else name
            return shown if len(shown) <= 60 else shown[:57] + "..."
    return type(value).__name__


def expect_type(value: Any, kind: type[T], json_path: str) -> T:
    """Return ``value`` if it has exactly JSON type ``kind`` (bool is not an int), else raise."""
    if kind is int:
        ok = type(value) is int
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(json_path, f"must be {_TYPE_NAMES.get(kind, kind.__name__)}, not {describe(value)}")
    return cast(T, value)  # checked just above


class ConfigObject:
    """A JSON object read with case-insensitive keys, remembering where it sits in the file."""

    __slots__ = ("json_path", "_raw", "_folded")

    def __init__(self, raw: Mapping[str, Any], json_path: str) -> None:
        self.json_path = json_path
        self._raw = raw
        self._folded: dict[str, str] = {}
        for key in raw:
            # Go decodes every key in file order into the field it matches case-insensitively,
            # so when a key appears twice in different cases the last one wins.
            self._folded[key.casefold()] = key

    def _key(self, key: str) -> str | None:
        return self._folded.get(key.casefold())

    def path_of(self, key: str) -> str:
        return f"{self.json_path}.{key}"

    def has(self, key: str) -> bool:
        return self._key(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value under ``key`` as it is in the file (``default`` when absent)."""
        actual = self._key(key)
        return default if actual is None else self._raw[actual]

    def get(self, key: str, kind: type[T], default: T) -> T:
        """The value under ``key`` checked to be of ``kind``; ``default`` when absent or null."""
        value = self.raw(key)
        if value is None:
            return default
        return expect_type(value, kind, self.path_of(key))

    def require(self, key: str, kind: type[T]) -> T:
        value = self.raw(key)
        if value is None:
            raise ConfigError(self.path_of(key), "is required")
        return expect_type(value, kind, self.path_of(key))

    def string_list(self, key: str) -> tuple[str, ...]:
        """A list of strings under ``key`` (empty when absent or null)."""
        items = self.get(key, list, [])
        return tuple(
            expect_type(item, str, f"{self.path_of(key)}[{index}]") for index, item in enumerate(items)
        )

    def object(self, key: str) -> ConfigObject | None:
        value = self.raw(key)
        if value is None:
            return None
        return ConfigObject(expect_type(value, dict, self.path_of(key)), self.path_of(key))

    def objects(self, key: str) -> Iterator[ConfigObject]:
        """Each element of the list under ``key``, which must be an object."""
        for index, item in enumerate(self.get(key, list, [])):
            item_path = f"{self.path_of(key)}[{index}]"
            yield ConfigObject(expect_type(item, dict, item_path), item_path)

    def keys(self) -> Iterator[str]:
        return iter(self._raw)

    def map_items(self) -> Iterator[tuple[str, Any, str]]:
        """``(key, value, json path)`` with keys exactly as written: for JSON objects that are Go
        maps (case-sensitive keys), not structs."""
        for key, value in self._raw.items():
            yield key, value, self.path_of(key)

"""DRA CEL selectors evaluated with a real CEL engine (cel-python)."""

from __future__ import annotations

from typing import Any

import celpy


def cel_device(driver: str, attributes: dict[str, dict[str, Any]]) -> Any:
    """``device`` as a DRA CEL selector sees it: ``driver``, and ``attributes`` by domain, the
    unprefixed ones under the driver's own."""
    by_domain: dict[str, dict[str, Any]] = {}
    for name, typed in attributes.items():
        domain, _, identifier = name.rpartition("/")
        ((_, value),) = typed.items()
        by_domain.setdefault(domain or driver, {})[identifier] = value
    return celpy.json_to_cel({"driver": driver, "attributes": by_domain})

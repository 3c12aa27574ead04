"""The durable books (leases, DRA claims) as a test reads and plants them: two slots written in
turn (``daemon.holdings._slots``), the newest valid one the book."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.holdings._slots import TwinSlots


def book_document(path: Path) -> dict[str, Any]:
    """The document the book ``path`` holds now: its newest valid slot (AssertionError: none)."""
    found = TwinSlots(path).read()
    assert found.document is not None, f"no valid slot of {path}: {found.problems}"
    return found.document


def plant_book(path: Path, content: str | bytes) -> None:
    """``content`` as the whole book ``path``: in slot a, slot b removed (as an older devplugd,
    or an operator, leaves it)."""
    slots = TwinSlots(path)
    slots.paths[1].unlink(missing_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)

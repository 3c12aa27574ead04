"""A book's file as two slots written in turn, in place: one durable write per change.

Why not a temporary file renamed over the old one: on ext4 that is a new inode, a rename, the
old inode's blocks freed (a discard with ``-o discard``) and two journal commits (the file's
fsync, the directory's), about 1.1 ms a write on the disks measured (``benchmarks/
checkpoint_load.py``), on the way of every DRA Prepare, Unprepare and lease. Overwriting blocks a
file already has and ``fdatasync`` is one data write and a cache flush, about 0.4 ms.

An overwrite in place can be torn by a crash, so there are two files, ``<name>`` (slot a, the
name a book always had: a book written by an older devplugd is slot a at sequence 0) and
``<stem>.b<suffix>`` (slot b). Each write goes to the slot that does not hold the newest
document, so a torn write never touches the last one written. Each slot is a JSON object (still
readable with ``jq``)::

    {"sha256":"<hex>","sequence":7,"version":1,"leases":[...]}        <spaces>

``sequence`` counts the writes; ``sha256`` is the digest of the text after it (``{`` and the
rest, the trailing spaces aside). A slot is padded with spaces to the size the file has (a
shorter document does not shrink it: no metadata change) or, when longer, to a multiple of
``BLOCK`` (grown now and then, not at every write). Reading takes the valid slot with the highest
sequence; a slot whose digest does not match, or that is not JSON, is one a crash tore (or
someone edited): it is reported, and the other is used. A document without ``sha256`` is taken as
it is (written by an older devplugd, or by hand).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.core._jsonpath import parse_json
from daemon.files import write_all

BLOCK = 4096
_DIGEST_PREFIX = re.compile(rb'\{"sha256":"([0-9a-f]{64})",')


@dataclass
class SlotsRead:
    """What the two slots hold: ``document`` the newest valid one (``None``: none is), from
    ``path``; ``problems`` each slot file there that could not be taken, and why (``is corrupt
    (...)``, ``cannot be read (...)``);
    ``unreadable`` whether one of those could not even be read (an I/O error, not a torn
    write)."""

    document: dict[str, Any] | None = None
    path: Path | None = None
    problems: list[tuple[Path, str]] = field(default_factory=list)
    unreadable: bool = False


class TwinSlots:
    """The slots of the book file ``path`` (see the module docstring). ``read`` once, then
    ``write`` (from one thread at a time: the book's write lock)."""

    def __init__(self, path: Path, *, sort_keys: bool = False) -> None:
        self.paths = (path, path.with_name(f"{path.stem}.b{path.suffix}"))
        self._sort_keys = sort_keys
        self._sequence = 0  # of the newest document written or read
        self._next = 0  # the slot the next write goes to

    def existing(self) -> list[Path]:
        return [path for path in self.paths if os.path.lexists(path)]

    def read(self) -> SlotsRead:
        """The newest valid document; the next write goes to the other slot."""
        found = SlotsRead()
        newest = -1
        for index, path in enumerate(self.paths):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as error:
                found.problems.append((path, f"cannot be read ({error.strerror or error})"))
                found.unreadable = True
                continue
            try:
                document, sequence = _valid(data)
            except ValueError as error:
                found.problems.append((path, f"is corrupt ({error})"))
                continue
            if sequence > newest:
                newest, found.document, found.path = sequence, document, path
                self._sequence, self._next = sequence, 1 - index
        return found

    def forget(self) -> None:
        """The slots were moved aside: the next write starts a fresh slot a."""
        self._sequence, self._next = 0, 0

    def write(self, document: Mapping[str, Any]) -> None:
        """(worker thread) ``document`` with the next sequence, durably, over the older slot.
        OSError: not written (the slot may be torn; the next write tries it again)."""
        sequence = self._sequence + 1
        body = json.dumps({"sequence": sequence, **document}, separators=(",", ":"),
                          sort_keys=self._sort_keys).encode()
        data = b'{"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]
        path = self.paths[self._next]
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(descriptor).st_size
            padded = max(size, -(-len(data) // BLOCK) * BLOCK)
            write_all(descriptor, data.ljust(padded))  # from offset 0: a fresh descriptor
            os.fdatasync(descriptor)
        finally:
            os.close(descriptor)
        if size == 0:  # a new file (or one a crash left empty): its directory entry, durably
            directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self._sequence, self._next = sequence, 1 - self._next


def _valid(data: bytes) -> tuple[dict[str, Any], int]:
    """A slot's document and sequence; ValueError says why it is not one."""
    text = data.rstrip(b" \n")
    matched = _DIGEST_PREFIX.match(text)
    if matched is not None and hashlib.sha256(b"{" + text[matched.end():]).hexdigest() != matched[1].decode():
        raise ValueError("its sha256 does not match its content: a write was cut short")
    document = parse_json(text.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    sequence = document.get("sequence", 0)
    if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 0:
        raise ValueError(f"sequence {sequence!r} is not a count")
    return document, sequence

"""A book's file as two slots written in turn, in place: one durable write per change.

Why not a temporary file renamed over the old one: on ext4 that is a new inode, a rename, the
old inode's blocks freed (a discard with ``-o discard``) and two journal commits (the file's
fsync, the directory's), about 1.1 ms a write on the disk measured (``benchmarks/dra_prepare.py``
prints both), on the way of every DRA Prepare, Unprepare and lease. Overwriting blocks a file
already has and ``fdatasync`` is one data write and a cache flush, about 0.4-0.6 ms.

An overwrite in place can be torn by a crash, so there are two files, ``<name>`` (slot a, the
name a book always had) and ``<stem>.b<suffix>`` (slot b). Each write goes to the slot that
does not hold the newest document, so a torn write never touches the last one written. A slot
not there yet is made whole, as before (a temporary file renamed into place, fsyncs): a crash
then leaves it whole or absent. Each slot is a JSON object (still readable with ``jq``)::

    {"sha256":"<hex>","sequence":7,"version":1,"leases":[...]}        <spaces>

``sequence`` counts the writes (from 1); ``sha256`` is the digest of the text from the ``{``
after the ``"sha256":"<hex>",`` prefix, as ``{`` + the rest, the trailing spaces aside. A slot is
padded with spaces to the size the file has (a shorter document does not shrink it: no metadata
change) or, when longer, to a multiple of ``BLOCK`` (grown now and then, not at every write).
Reading takes the valid slot with the highest sequence; a slot whose digest does not match, or
that is not JSON, is one a crash tore (or someone edited): it is reported, and the other is
used. A document without the digest prefix (a book of an earlier devplugd, or one written by
hand) is taken as it is, at sequence 0 whatever it says: a torn overwrite of it cannot pass for
a newer write. A slot that cannot be read at all is reported apart (``unreadable``): its reader
cannot tell whether it was the newer.
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
from daemon.files import sync_directory, write_all, write_atomically

BLOCK = 4096
_DIGEST_PREFIX = re.compile(rb'\{"sha256":"([0-9a-f]{64})",')


@dataclass
class SlotsRead:
    """What the two slots hold: ``document`` the newest valid one (``None``: none is), from
    ``path``; ``problems`` each slot file there that could not be taken, and why (``is corrupt
    (...)``, ``cannot be read (...)``); ``unreadable`` whether one of those could not even be
    read (an I/O error, not a torn write)."""

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
        """(worker thread) ``document`` with the next sequence, durably, over the older slot (a
        slot not there yet is made whole: a temporary file renamed into place). OSError: not
        known to be written: the slot may be torn, or may hold it whole if only the flush
        failed (a start before the next write then reads it); the next write goes to it again."""
        sequence = self._sequence + 1
        body = json.dumps({"sequence": sequence, **document}, separators=(",", ":"),
                          sort_keys=self._sort_keys).encode()
        data = b'{"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]
        blocks = -(-len(data) // BLOCK) * BLOCK
        path = self.paths[self._next]
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # twice in a book's life: made whole or not at all, with its directory entry
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data.ljust(blocks))
        else:
            try:
                padded = max(os.fstat(descriptor).st_size, blocks)
                write_all(descriptor, data.ljust(padded))  # from offset 0: a fresh descriptor
                os.fdatasync(descriptor)
            finally:
                os.close(descriptor)
        self._sequence, self._next = sequence, 1 - self._next

    def settle(self, document: Mapping[str, Any]) -> None:
        """(worker thread, nothing else writing) Leave the book in slot a alone: ``document``
        (the newest, as last written) over it if slot b holds the newer, then slot b removed, so
        an earlier devplugd started next (a rollback) reads the book whole from the one file it
        knows."""
        if not os.path.lexists(self.paths[1]):
            return
        if self._next == 0:  # the newest is in slot b
            self.write(document)
        os.unlink(self.paths[1])
        sync_directory(self.paths[1].parent)
        self._next = 1


def _valid(data: bytes) -> tuple[dict[str, Any], int]:
    """A slot's document and sequence; ValueError says why it is not one."""
    text = data.rstrip(b" \n")
    matched = _DIGEST_PREFIX.match(text)
    if matched is not None and hashlib.sha256(b"{" + text[matched.end():]).hexdigest() != matched[1].decode():
        raise ValueError("its sha256 does not match its content: a write was cut short")
    document = parse_json(text.decode("utf-8"))  # UnicodeDecodeError is a ValueError
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if matched is None:  # an earlier devplugd's (or a hand's): whatever ``sequence`` it may say, the oldest
        return document, 0
    sequence = document.get("sequence")
    if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1:
        raise ValueError(f"sequence {sequence!r} is not a count")
    return document, sequence

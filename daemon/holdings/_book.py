"""A durable book: who holds what, in one JSON file (two slots written in turn, ``_slots``),
with one policy for every book (the host leases, the prepared DRA claims).

Writes: the whole book, durably (in place over the older slot, then ``fdatasync``), in a worker
thread, one write at a time, before anyone hears of the change: a ``kill -9`` or a power loss at
any moment leaves the newest write whole in one slot (a torn one is told by its digest and
passed over). What the book reports meanwhile errs on the side of "held": a record being added holds its
devices from the moment it is reserved (so no other road can get them), and a record being
removed holds them until the file no longer has it (so a crash cannot leave a device with two
holders).

Who is told of a change (``on_change``: a new tree is due) is told at once, or, while
``defer_changes`` runs (the DRA driver runs it for the claim book), that long after it, one call
for the changes meanwhile: a claim's reservation and its write then set off one tree build after
the kubelet's answer is out, not two while it is being made and sent. What the book holds
(``holders``, ``records``) changes at once either way: every road asks it, not the tree.

A book that cannot be read (no slot is valid, or one cannot be read at all) is never taken as
empty or older: that could hand a device to a second holder while the first still has it. Its
files are moved aside (kept for the operator; not one that cannot be read), logged once with
their path and the reason, and the book is *lost* (``lost``): nobody can tell which devices it
held, so they are all held by it (see ``daemon.holdings``) until the operator clears it
(``clear_lost``, ``devplugd clear-lost``) or its owner finds out on its own. Nothing the file
holds, text or bytes, escapes as an exception. A lost book writes a fresh file, never over one
it could not move aside.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import trio

from ._holder import DeviceKey, Holder, LostBook
from ._slots import TwinSlots

log = logging.getLogger("devplugd.holdings")

FORMAT_VERSION = 1

T = TypeVar("T")


class DurableBook(Generic[T]):
    """Records by key in ``path`` (and its slot b), under ``list_key`` (``{"version": 1,
    "<list_key>": [...]}``, with ``sha256`` and ``sequence``: see ``_slots``).
    ``book`` names it in messages (``lease``, ``claim``). ``from_json`` raises ValueError (or
    KeyError, TypeError) for an entry it cannot take; ``held_by`` says which devices a record
    holds, and as whom; ``sort_keys`` sorts the file's keys."""

    def __init__(self, path: Path, book: str, list_key: str, key: Callable[[T], str],
                 to_json: Callable[[T], Mapping[str, Any]], from_json: Callable[[Any], T],
                 held_by: Callable[[T], Iterable[tuple[DeviceKey, Holder]]], *,
                 sort_keys: bool = False, on_change: Callable[[], None] = lambda: None) -> None:
        self._path = path
        self._book = book
        self._list_key = list_key
        self._key = key
        self._to_json = to_json
        self._from_json = from_json
        self._held_by = held_by
        self._slots = TwinSlots(path, sort_keys=sort_keys)
        self.on_change = on_change  # who holds what changed (a reservation, a write, the lost state)
        self._on_disk: dict[str, T] = {}
        self._pending: dict[str, T] = {}  # reserved or being written, not on disk yet
        self._write_lock = trio.Lock()
        self._changes = 0  # any change to what the book holds: reservations, writes, the lost state
        self._holders: tuple[int, Mapping[DeviceKey, Holder]] | None = None  # (at _changes, holders)
        self._lost: LostBook | None = None
        self._sealed = ""  # why nothing is written any more (``seal``)
        self._notify_delay: float | None = None  # while defer_changes runs
        self._notify_due = False
        self._notify_wakeup = trio.Event()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def records(self) -> Mapping[str, T]:
        """In force: those on disk (removals in flight included) and those being added."""
        return MappingProxyType({**self._on_disk, **self._pending})

    def holders(self) -> Mapping[DeviceKey, Holder]:
        """(resource, device ID) -> the holder, for the records in force; worked out once per
        change of the book (every road asks it for every device it looks at)."""
        if self._holders is None or self._holders[0] != self._changes:
            self._holders = (self._changes, MappingProxyType(
                {key: holder for record in self.records.values() for key, holder in self._held_by(record)}))
        return self._holders[1]

    @property
    def on_disk(self) -> Mapping[str, T]:
        return MappingProxyType(self._on_disk)

    @property
    def lost(self) -> str | None:
        """Why the records of before this start are unknown, or ``None``."""
        return str(self._lost) if self._lost is not None else None

    @property
    def lost_book(self) -> LostBook | None:
        return self._lost

    # -- reading ---------------------------------------------------------------------------------
    def load(self) -> None:
        """Read the file (its two slots, see ``_slots``; none there: an empty book). A book that
        cannot be read or parsed is moved aside, logged, and lost; this never raises."""
        found = self._slots.read()
        if found.problems and (found.document is None or found.unreadable):
            # nothing to read, or a slot that may be the newer one cannot be: never an older book
            self._set_lost(" and ".join(why if path == self._path else f"its slot {path} {why}"
                                        for path, why in found.problems), move=not found.unreadable)
            return
        if found.document is None:
            return
        for path, why in found.problems:  # the other slot: a write a crash cut short
            log.warning("the %s book %s: its slot %s %s; read the newest valid write instead, %s (sequence %s)",
                        self._book, self._path, path, why, found.path, found.document.get("sequence", 0),
                        extra={"EVENT": f"{self._book}-book"})
        try:
            records = self._parse(found.document)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            self._set_lost(f"is corrupt ({found.path}: {type(error).__name__}: {error})", move=True)
            return
        self._on_disk = records
        log.info("loaded %d %ss from %s", len(records), self._book, found.path)

    def _parse(self, document: dict[str, Any]) -> dict[str, T]:
        if not isinstance(document.get(self._list_key), list):
            raise ValueError(f"no {self._list_key!r} list")
        if document.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {document.get('version')!r}, expected {FORMAT_VERSION}")
        records = [self._from_json(item) for item in document[self._list_key]]
        return {self._key(record): record for record in records}

    def _set_lost(self, reason: str, *, move: bool) -> None:
        aside: Path | None = None
        if move:
            stamp = int(time.time())
            moved: list[Path] = []
            try:
                for slot in self._slots.existing():
                    candidate = slot.with_name(f"{slot.name}.corrupt-{stamp}")
                    os.replace(slot, candidate)
                    moved.append(candidate)
                self._slots.forget()
                aside = moved[0] if moved else None
            except OSError as error:  # what is left is never written over (``_write``)
                kept = f"; {', '.join(map(str, moved))} moved aside" if moved else ""
                reason = f"{reason} and could not be moved aside ({error}{kept})"
        self._lost = LostBook(self._book, self._path, reason, aside, time.time())
        log.error("%s: which devices its %ss held is unknown, so every device one could hold stays held until "
                  "`devplugd clear-lost %ss` (the file is kept for you)", self._lost, self._book, self._book,
                  extra={"EVENT": f"lost-{self._book}-book"})

    def clear_lost(self, who: str) -> bool:
        """The lost book's devices are known free (``who`` says so): hold them no longer.
        Whether it was lost."""
        if self._lost is None:
            return False
        log.warning("%s: cleared by %s; its devices are offered again", self._lost, who,
                    extra={"EVENT": f"lost-{self._book}-book"})
        self._lost = None
        self._changed()
        return True

    def _changed(self) -> None:
        self._changes += 1
        if self._notify_delay is None:
            self.on_change()
        elif not self._notify_due:
            self._notify_due = True
            self._notify_wakeup.set()

    def notify(self) -> None:
        """Tell ``on_change`` (at once, or deferred as any change): who holds what changed."""
        self._changed()

    async def defer_changes(self, delay: float, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled, ``on_change`` is called ``delay`` seconds after a change, once for
        the changes meanwhile (a change due when it ends is told then)."""
        self._notify_delay = delay
        task_status.started()
        try:
            while True:
                await self._notify_wakeup.wait()
                self._notify_wakeup = trio.Event()
                await trio.sleep(delay)
                self._notify_due = False
                self.on_change()
        finally:
            self._notify_delay = None
            if self._notify_due:
                self._notify_due = False
                self.on_change()

    # -- changing --------------------------------------------------------------------------------
    def reserve(self, record: T) -> None:
        """Hold ``record``'s devices at once (call it in the same step that chose them)."""
        self._pending[self._key(record)] = record
        self._changed()

    def unreserve(self, key: str) -> None:
        """What was reserved and will not be added (its preparation failed) holds nothing."""
        if self._pending.pop(key, None) is not None:
            self._changed()

    async def add(self, record: T) -> None:
        """Write ``record`` (reserved or not) to the file; on failure (OSError) it holds nothing."""
        key = self._key(record)
        if self._pending.get(key) is not record:
            self.reserve(record)
        await self._add(key, lambda: record)

    async def add_made(self, key: str, make: Callable[[], T]) -> T:
        """Write the record ``make`` returns under ``key`` (reserved before: it holds the
        devices meanwhile), and return it. ``make`` runs in the worker thread that writes the
        file, just before the write, so what it does (a claim's allocation and CDI spec) costs no
        trip of its own to a thread and is done before the record is on disk. On failure (what
        ``make`` raises, OSError from the write) the key holds nothing."""
        return await self._add(key, make)

    async def _add(self, key: str, make: Callable[[], T]) -> T:
        reserved = self._pending.get(key)
        try:
            async with self._write_lock:
                records = await trio.to_thread.run_sync(self._make_and_write, dict(self._on_disk), key, make)
                self._on_disk = records
        except BaseException:
            self._pending.pop(key, None)
            self._changed()
            raise
        self._pending.pop(key, None)
        record = records[key]
        if reserved is None or list(self._held_by(reserved)) != list(self._held_by(record)):
            self._changed()
        else:
            self._changes += 1  # the same holders, now on disk
        return record

    def _make_and_write(self, records: dict[str, T], key: str, make: Callable[[], T]) -> dict[str, T]:
        """(worker thread)"""
        records[key] = make()
        self._write(records)
        return records

    async def remove(self, key: str, before: Callable[[], None] | None = None) -> T | None:
        """Take the record out of the file (``None``: it was not in it). OSError: not written,
        it still holds its devices. ``before`` runs first, in the worker thread that writes the
        file (what it raises: nothing written)."""
        async with self._write_lock:
            if key not in self._on_disk:
                if before is not None:
                    await trio.to_thread.run_sync(before)
                return None
            updated = dict(self._on_disk)
            removed = updated.pop(key)
            await trio.to_thread.run_sync(self._write, updated, before)
            self._on_disk = updated
        self._changed()
        return removed

    async def settle(self) -> None:
        """At the end (nothing writes any more): the book left in its first file alone, for an
        earlier devplugd that knows only it (``TwinSlots.settle``). A lost book is left as it is;
        a failure is logged (the next start reads both slots)."""
        async with self._write_lock:
            if self._lost is not None:
                return
            try:
                await trio.to_thread.run_sync(self._slots.settle, self._document(self._on_disk))
            except OSError as error:
                log.warning("the %s book %s: could not leave it in that one file (%s); an earlier devplugd (one "
                            "that writes one file) would read it one write behind", self._book, self._path, error,
                            extra={"EVENT": f"{self._book}-book"})

    def seal(self, reason: str) -> None:
        """Nothing is written from now on (an instance handing over: the next one's file once
        the lock goes); a write that comes later fails with OSError naming ``reason``, so what
        asked for it is refused and holds nothing."""
        self._sealed = reason

    def _document(self, records: Mapping[str, T]) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, self._list_key: [self._to_json(r) for r in records.values()]}

    def _write(self, records: Mapping[str, T], before: Callable[[], None] | None = None) -> None:
        """(worker thread) ``before`` first, once the book may be written: a write refused
        (sealed, or a lost book's file still there) has done nothing, ``before``'s work neither
        (an Unprepare's spec removal and driver rebinds on a host another instance now owns)."""
        if self._sealed:
            raise OSError(f"not writing {self._path}: {self._sealed}")
        if self._lost is not None and self._lost.moved_to is None and self._slots.existing():
            # the unreadable file is still there: writing over it would lose what it holds
            raise OSError(f"not overwriting {self._path}: {self._lost}")
        if before is not None:
            before()
        self._slots.write(self._document(records))  # it makes the directory with a slot's first write

"""A durable book's two slots (``daemon/holdings/_slots.py``) on a real state directory: writes
go in turn, each read takes the newest valid slot, a torn write is passed over, and a book of an
earlier devplugd is read and written on."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import daemon.files
from daemon.dra._prepared import CLAIMS_FILE
from daemon.holdings._slots import BLOCK, TwinSlots
from tests.books import book_document
from tests.test_dra_claims import UID_A, UID_B, claim, loaded


def document(*names: str) -> dict[str, Any]:
    return {"version": 1, "claims": list(names)}


def test_writes_go_to_the_two_slots_in_turn_and_a_read_takes_the_newest(tmp_path: Path) -> None:
    slots = TwinSlots(tmp_path / "book.json")
    assert slots.paths == (tmp_path / "book.json", tmp_path / "book.b.json")
    for count, names in enumerate((["a"], ["a", "b"], ["b"]), start=1):
        slots.write(document(*names))
        found = TwinSlots(tmp_path / "book.json").read()
        assert found.document is not None and found.problems == []
        assert (found.document["claims"], found.document["sequence"]) == (names, count)
        assert found.path == slots.paths[(count - 1) % 2]
    # the slot not written last still holds the write before
    assert json.loads(slots.paths[1].read_text())["claims"] == ["a", "b"]


def test_a_slot_is_json_padded_in_place_and_never_shrinks(tmp_path: Path) -> None:
    slots = TwinSlots(tmp_path / "book.json")
    slots.write(document("x" * 5000))
    slots.write(document())
    slots.write(document())  # slot a again, with much less to say
    text = slots.paths[0].read_text()
    assert len(text) == 2 * BLOCK and text.endswith(" ")
    assert json.loads(text)["claims"] == []  # still what jq reads


def torn(new: bytes, old: bytes, at: int) -> bytes:
    """What a crash leaves of ``new`` written over ``old``: its first ``at`` bytes, then old's."""
    return new[:at] + old[at:]


@pytest.mark.parametrize("at", [512, 4096])
def test_a_write_a_crash_tore_is_passed_over_for_the_last_whole_one(tmp_path: Path, at: int) -> None:
    slots = TwinSlots(tmp_path / "book.json")
    slots.write(document("first" + "x" * 6000))  # slot a, sequence 1
    slots.write(document("second" + "x" * 6000))  # slot b, sequence 2: answered
    old = slots.paths[0].read_bytes()
    slots.write(document("third" + "y" * 6000))  # slot a, sequence 3: the crash comes mid-write
    slots.paths[0].write_bytes(torn(slots.paths[0].read_bytes(), old, at))
    found = TwinSlots(tmp_path / "book.json").read()
    assert found.document is not None and found.document["claims"][0].startswith("second")
    assert found.problems == [(slots.paths[0], "is corrupt (its sha256 does not match its content: "
                                               "a write was cut short)")]


async def test_the_book_loads_the_last_whole_write_and_says_which_slot_it_passed_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    book = loaded(tmp_path)
    await book.add(claim(UID_A, "a"))  # slot a
    await book.add(claim(UID_B, "b"))  # slot b
    slot_a = tmp_path / CLAIMS_FILE
    slot_a.write_bytes(slot_a.read_bytes()[:100])  # the next write, to slot a, cut short
    caplog.set_level(logging.WARNING, "devplugd.holdings")
    again = loaded(tmp_path)
    assert (set(again.claims), again.lost) == ({UID_A, UID_B}, None)
    assert f"the claim book {slot_a}: its slot {slot_a} is corrupt" in caplog.text
    await again.remove(UID_A)  # written over the torn slot, not over the last whole write
    assert [c["uid"] for c in json.loads(slot_a.read_text())["claims"]] == [UID_B]
    assert set(loaded(tmp_path).claims) == {UID_B}


async def test_a_book_of_an_earlier_devplugd_is_read_and_the_next_write_goes_beside_it(tmp_path: Path) -> None:
    earlier = {"version": 1, "claims": [claim(UID_A, "a").to_json()]}
    (tmp_path / CLAIMS_FILE).write_text(json.dumps(earlier, indent=2))  # no sha256, no sequence
    book = loaded(tmp_path)
    assert set(book.claims) == {UID_A}
    await book.add(claim(UID_B, "b"))
    assert json.loads((tmp_path / CLAIMS_FILE).read_text()) == earlier  # kept until it is the older slot
    assert book_document(tmp_path / CLAIMS_FILE)["sequence"] == 1
    assert set(loaded(tmp_path).claims) == {UID_A, UID_B}


async def test_every_slot_corrupt_is_a_lost_book_with_both_moved_aside(tmp_path: Path) -> None:
    book = loaded(tmp_path)
    await book.add(claim(UID_A, "a"))
    await book.add(claim(UID_B, "b"))
    for path in TwinSlots(tmp_path / CLAIMS_FILE).paths:
        path.write_text("{ torn")
    lost = loaded(tmp_path)
    assert lost.lost is not None and lost.lost.startswith(
        f"the claim book {tmp_path / CLAIMS_FILE} is corrupt (") and f"and its slot {tmp_path / 'dra-claims.b.json'}" \
        " is corrupt (" in lost.lost
    assert sorted(p.name.split(".corrupt-")[0] for p in tmp_path.glob("*.corrupt-*")) == [
        "dra-claims.b.json", "dra-claims.json"]
    await lost.add(claim(UID_A, "a"))  # a fresh book, in slot a
    assert book_document(tmp_path / CLAIMS_FILE)["sequence"] == 1


async def test_a_whole_newest_slot_the_book_cannot_take_is_lost_not_an_older_one(tmp_path: Path) -> None:
    """A digest that matches is a write that finished: what it says wrong is not a crash's doing,
    so the slot before it (older) is not quietly taken instead."""
    slots = TwinSlots(tmp_path / CLAIMS_FILE)
    slots.write({"version": 1, "claims": [claim(UID_A, "a").to_json()]})
    slots.write({"version": 2, "claims": []})
    book = loaded(tmp_path)
    assert book.lost is not None and "format version 2, expected 1" in book.lost


async def test_a_write_that_fails_leaves_the_last_one_and_is_tried_again_on_the_same_slot(tmp_path: Path) -> None:
    book = loaded(tmp_path)
    await book.add(claim(UID_A, "a"))  # slot a
    blocker = tmp_path / "dra-claims.b.json"
    blocker.mkdir()  # slot b cannot be opened for writing
    with pytest.raises(OSError):
        await book.add(claim(UID_B, "b"))
    assert book.prepared(UID_B) is None and book.holders().keys() == {("intel.com/sriov_net", "0000:3b:02.0")}
    blocker.rmdir()
    assert set(loaded(tmp_path).claims) == {UID_A}
    await book.add(claim(UID_B, "b"))
    assert book_document(tmp_path / CLAIMS_FILE)["sequence"] == 2
    assert set(loaded(tmp_path).claims) == {UID_A, UID_B}


async def test_a_slot_that_cannot_be_read_loses_the_book_rather_than_take_the_other(tmp_path: Path) -> None:
    """An I/O error says nothing of which slot is newer: the other may be one write behind."""
    book = loaded(tmp_path)
    await book.add(claim(UID_A, "a"))  # slot a
    await book.add(claim(UID_B, "b"))  # slot b: the newest
    slot_b = tmp_path / "dra-claims.b.json"
    slot_b.unlink()
    slot_b.mkdir()  # read() fails with EISDIR, as a disk's EIO would
    lost = loaded(tmp_path)
    assert lost.lost == f"the claim book {tmp_path / CLAIMS_FILE} its slot {slot_b} cannot be read (Is a directory)"
    assert (tmp_path / CLAIMS_FILE).exists() and not list(tmp_path.glob("*.corrupt-*"))  # nothing moved


def test_a_book_of_an_earlier_devplugd_is_the_oldest_whatever_sequence_it_says(tmp_path: Path) -> None:
    """Without the digest nothing tells a torn overwrite of it from a whole one, so a
    ``sequence`` in it (torn in from the new write's text) never makes it newer."""
    slots = TwinSlots(tmp_path / "book.json")
    (tmp_path / "book.json").write_text(json.dumps({"version": 1, "claims": ["old"], "sequence": 99}))
    slots.read()
    slots.write(document("new"))  # slot b, sequence 1
    found = TwinSlots(tmp_path / "book.json").read()
    assert found.document is not None and (found.path, found.document["claims"]) == (slots.paths[1], ["new"])


def test_a_slot_is_made_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first write of a slot cut short (a full disk) leaves no slot, so the book reads as
    it was (here: empty), not as a lost book of a torn file, and no temporary file either."""
    def cut_short(descriptor: int, data: bytes) -> None:
        os.write(descriptor, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(daemon.files, "write_all", cut_short)
    with pytest.raises(OSError):
        TwinSlots(tmp_path / "book.json").write(document("first"))
    monkeypatch.undo()
    assert TwinSlots(tmp_path / "book.json").existing() == []
    assert list(tmp_path.iterdir()) == []  # a restart's pid would leave one more each time
    found = TwinSlots(tmp_path / "book.json").read()
    assert (found.document, found.problems) == (None, [])


@pytest.mark.parametrize("writes", [2, 3])
def test_settling_leaves_the_newest_in_slot_a_alone(tmp_path: Path, writes: int) -> None:
    slots = TwinSlots(tmp_path / "book.json")
    for count in range(writes):
        slots.write(document(f"write {count}"))
    slots.settle(document(f"write {writes - 1}"))
    assert slots.existing() == [tmp_path / "book.json"]
    assert json.loads((tmp_path / "book.json").read_text())["claims"] == [f"write {writes - 1}"]
    slots.write(document("after"))  # the next start's first write: slot b again
    assert TwinSlots(tmp_path / "book.json").read().path == tmp_path / "book.b.json"


async def test_a_sealed_book_writes_nothing_and_what_asked_holds_nothing(tmp_path: Path) -> None:
    """An instance that handed over seals its books before the lock goes: a Prepare still in
    flight past the drain may not write the file the next instance now owns."""
    book = loaded(tmp_path)
    await book.add(claim(UID_A, "a"))
    written = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    book.book.seal("this devplugd has handed over to pod-2")
    with pytest.raises(OSError, match="handed over to pod-2"):
        await book.add(claim(UID_B, "b"))
    with pytest.raises(OSError, match="handed over to pod-2"):
        await book.remove(UID_A)
    undone: list[str] = []  # an Unprepare's work before the write: its spec, its drivers given back
    with pytest.raises(OSError, match="handed over to pod-2"):
        await book.remove(UID_A, before=lambda: undone.append("spec removed, functions given back"))
    assert undone == []  # the host is the next instance's now: nothing of the claim is undone
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == written
    assert set(book.claims) == {UID_A} and UID_B not in {h.detail for h in book.holders().values()}

"""The book of prepared DRA claims (ClaimBook) and its checkpoint file, on a real state directory."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from daemon.dra._prepared import CLAIMS_FILE, ClaimBook, PreparedClaim, PreparedDevice
from daemon.holdings import CLAIM, Holder
from daemon.holdings._slots import TwinSlots
from tests.books import book_document

UID_A = "4a1f0c2e-0000-4000-8000-00000000000a"
UID_B = "4a1f0c2e-0000-4000-8000-00000000000b"


def device(device_id: str = "0000:3b:02.0", *, admin: bool = False, resource: str = "intel.com/sriov_net",
           claim_uid: str = UID_A) -> PreparedDevice:
    name = device_id.replace(":", "-").replace(".", "-")
    return PreparedDevice(resource, device_id, "node1/intel.com/sriov-net", name, ("nic",), admin,
                          f"devplugd.io/claim={claim_uid}-{name}")


def claim(uid: str = UID_A, name: str = "a", *devices: PreparedDevice) -> PreparedClaim:
    spec = {"cdiVersion": "0.3.0", "kind": "devplugd.io/claim",
            "devices": [{"name": f"{uid}-{d.device_name}", "containerEdits": {"env": ["A=1"]}} for d in devices]}
    return PreparedClaim(uid, "default", name, devices or (device(claim_uid=uid),), spec)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def loaded(state_dir: Path) -> ClaimBook:
    book = ClaimBook(state_dir)
    book.load()
    return book


def test_claim_survives_its_json_round_trip() -> None:
    original = claim(UID_A, "a", device("0000:3b:02.0"), device("0000:3b:02.1", admin=True))
    assert PreparedClaim.from_json(json.loads(json.dumps(original.to_json()))) == original


async def test_added_claim_is_in_the_file_and_in_a_new_book(state_dir: Path) -> None:
    book = loaded(state_dir)
    await book.add(claim())
    document = book_document(state_dir / CLAIMS_FILE)
    assert document["version"] == 1
    assert [entry["uid"] for entry in document["claims"]] == [UID_A]
    assert loaded(state_dir).prepared(UID_A) == claim()


async def test_removed_claim_leaves_the_file(state_dir: Path) -> None:
    book = loaded(state_dir)
    await book.add(claim(UID_A, "a"))
    await book.add(claim(UID_B, "b", device("0000:3b:02.1", claim_uid=UID_B)))
    assert await book.remove(UID_A) == claim(UID_A, "a")
    assert list(loaded(state_dir).claims) == [UID_B]


async def test_removing_an_unknown_claim_changes_nothing(state_dir: Path) -> None:
    book = loaded(state_dir)
    assert await book.remove(UID_A) is None
    assert not (state_dir / CLAIMS_FILE).exists()


async def test_holders_are_the_exclusive_allocations(state_dir: Path) -> None:
    book = loaded(state_dir)
    await book.add(claim(UID_A, "a", device("0000:3b:02.0"), device("0000:3b:02.1", admin=True)))
    assert book.holders() == {("intel.com/sriov_net", "0000:3b:02.0"): Holder(CLAIM, "default/a", UID_A)}


async def test_claim_holds_its_devices_from_the_moment_it_is_added(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_may_finish = threading.Event()

    write = TwinSlots.write

    def held_write(slots: TwinSlots, document: Mapping[str, Any]) -> None:
        write_may_finish.wait(10)  # the disk is slow: the add waits on its write in a worker thread
        write(slots, document)

    monkeypatch.setattr(TwinSlots, "write", held_write)
    book = loaded(state_dir)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(book.add, claim())
        await trio.testing.wait_all_tasks_blocked()
        assert book.holders() == {("intel.com/sriov_net", "0000:3b:02.0"): Holder(CLAIM, "default/a", UID_A)}
        assert book.prepared(UID_A) is None  # not in the file yet
        write_may_finish.set()
    assert book.prepared(UID_A) == claim()


async def test_claim_whose_write_fails_holds_nothing(state_dir: Path) -> None:
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    state_dir.write_text("")  # a file where the directory should be
    book = loaded(state_dir)
    with pytest.raises(OSError):
        await book.add(claim())
    assert book.holders() == {}
    assert book.prepared(UID_A) is None and not (state_dir / CLAIMS_FILE).exists()


def test_missing_file_is_no_claims(state_dir: Path) -> None:
    book = loaded(state_dir)
    assert (dict(book.claims), book.lost) == ({}, None)


@pytest.mark.parametrize(
    "content",
    [
        "{ torn",
        "[]",
        '{"version": 1}',
        '{"version": 2, "claims": []}',
        '{"version": 1, "claims": [7]}',
        '{"version": 1, "claims": [{"uid": "x", "namespace": "n", "name": "c", "devices": [{"resource": 1}]}]}',
        '{"version": 1, "claims": [{"uid": "x", "namespace": "n", "name": "c", "devices": [], "cdi_spec": []}]}',
        b"\xff\xfe not text",
    ],
)
def test_corrupt_file_is_moved_aside_and_the_book_is_lost(state_dir: Path, content: str | bytes) -> None:
    state_dir.mkdir(parents=True)
    path = state_dir / CLAIMS_FILE
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    book = loaded(state_dir)
    assert dict(book.claims) == {}
    (aside,) = [p for p in state_dir.iterdir() if p.name.startswith(f"{CLAIMS_FILE}.corrupt-")]
    assert aside.read_bytes() == (content if isinstance(content, bytes) else content.encode())
    assert book.lost is not None and book.lost.endswith(f"moved aside to {aside}")
    assert not path.exists()


async def test_lost_book_writes_a_fresh_file(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    (state_dir / CLAIMS_FILE).write_text("{ torn")
    book = loaded(state_dir)
    await book.add(claim())
    assert list(loaded(state_dir).claims) == [UID_A]


async def test_lost_book_never_writes_over_a_file_it_could_not_move_aside(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    (state_dir / CLAIMS_FILE).write_text("{ torn")
    now = int(time.time())
    for second in range(now - 1, now + 30):  # every name it could be moved aside to is taken by a non-empty directory
        (state_dir / f"{CLAIMS_FILE}.corrupt-{second}" / "taken").mkdir(parents=True)
    book = loaded(state_dir)
    assert book.lost is not None and "could not be moved aside" in book.lost
    with pytest.raises(OSError, match="not overwriting"):
        await book.add(claim())
    assert (state_dir / CLAIMS_FILE).read_text() == "{ torn"
    assert book.holders() == {}


async def test_add_made_writes_what_make_returns_in_the_writing_thread(state_dir: Path) -> None:
    book = loaded(state_dir)
    reserved = claim()
    book.reserve(PreparedClaim(reserved.uid, reserved.namespace, reserved.name, reserved.devices))
    made_in: list[str] = []

    def make() -> PreparedClaim:
        made_in.append(threading.current_thread().name)
        assert not (state_dir / CLAIMS_FILE).exists()  # made before the write
        return reserved

    assert await book.add_made(UID_A, make) == reserved
    assert made_in and made_in[0] != threading.main_thread().name
    assert loaded(state_dir).prepared(UID_A) == reserved


async def test_add_made_that_fails_holds_nothing_and_writes_nothing(state_dir: Path) -> None:
    book = loaded(state_dir)
    book.reserve(claim())

    def make() -> PreparedClaim:
        raise RuntimeError("the allocation failed")

    with pytest.raises(RuntimeError):
        await book.add_made(UID_A, make)
    assert book.holders() == {} and book.prepared(UID_A) is None and not (state_dir / CLAIMS_FILE).exists()


async def test_deferred_changes_are_told_once_after_the_delay_but_held_at_once(state_dir: Path) -> None:
    book = loaded(state_dir)
    told: list[float] = []
    book.book.on_change = lambda: told.append(trio.current_time())
    async with trio.open_nursery() as nursery:
        await nursery.start(book.book.defer_changes, 0.5)
        started = trio.current_time()
        book.reserve(claim())
        assert book.holders() == {("intel.com/sriov_net", "0000:3b:02.0"): Holder(CLAIM, "default/a", UID_A)}
        await book.add(claim())
        book.book.notify()
        assert told == []
        await trio.sleep(0.7)
        assert len(told) == 1 and told[0] - started >= 0.5
        book.book.notify()
        nursery.cancel_scope.cancel()
    assert len(told) == 2  # the change due when it ended is told then
    book.book.notify()
    assert len(told) == 3  # and at once without it

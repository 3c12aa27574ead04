"""PCIe error recovery as health: folding ERROR_EVENT uevents into the PCI facts (from the event
alone, never from sysfs), the health they give, the loop's hints, and the ListAndWatch mailbox
that must not hide an Unhealthy list behind a Healthy one."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import trio

from daemon.core import (
    HEALTH_LOST,
    HEALTH_RESTORED,
    HEALTHY,
    PCIE_ERROR,
    UNHEALTHY,
    DeviceInfo,
    Event,
    Fault,
    PoolEntry,
    Resync,
    UEvent,
)
from daemon.core._config import parse_config
from daemon.core._notifier import Notifier, TreeStream
from daemon.core._tree import DeviceTree
from daemon.deviceplugin._servicer import listing_scope
from daemon.handlers.pci import _folding
from daemon.loop import EventLoop
from tests.counting import holdings_for
from tests.fakesysfs import FakeHost
from tests.pci import Pci
from tests.trees import pool, tree
from tests.waiting import wait_until_async

PF = "0000:3b:00.0"
VFS = ["0000:3b:02.0", "0000:3b:02.1"]
OTHER = "0000:5e:00.0"
CONFIG = [
    {"resourceName": "pf", "deviceType": "accelerator", "selectors": {"drivers": ["qat"]}},
    {"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}},
    {"resourceName": "nic", "selectors": {"drivers": ["i40e"]}},
]


@pytest.fixture
def world(host: FakeHost, pci: Pci) -> Pci:
    host.add_pf(PF, netdev=None, class_code="120000", driver="qat")
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[40, 41])
    host.add_pci(OTHER, bridge="0000:00:03.0")
    return pci


def error_event(host: FakeHost, address: str, value: str, online: str = "0") -> UEvent:
    return UEvent("change", host.devpath(address), "pci",
                  properties={"ERROR_EVENT": value, "DEVICE_ONLINE": online, "PCI_SLOT_NAME": address})


def pci_event(host: FakeHost, action: str, address: str, **properties: str) -> UEvent:
    return UEvent(action, host.devpath(address), "pci", properties=properties)


def healths(pci: Pci, facts: Any) -> dict[str, str]:
    return {address: info.health for address, info in records(pci, facts).items()}


def records(pci: Pci, facts: Any) -> dict[str, DeviceInfo]:
    built = pci.handler.build(facts, pci.configure(*CONFIG))
    return {address: info for devices in built.values() for address, info in devices.items()}


@pytest.fixture
def no_sysfs_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("an ERROR_EVENT fold read sysfs")
    monkeypatch.setattr(_folding, "read_devices", forbidden)
    monkeypatch.setattr(_folding, "read_rdma_char_devices", forbidden)
    monkeypatch.setattr(_folding, "list_dir", forbidden)


def test_recovery_folds_from_the_event_alone_with_the_device_dirs_gone(world, host, no_sysfs_reads):
    facts = world.handler.scan()
    events = {a: (error_event(host, a, "BEGIN_RECOVERY"), error_event(host, a, "SUCCESSFUL_RECOVERY", "1"))
              for a in (PF, *VFS)}
    shutil.rmtree(host.sys / "devices")  # any read now would find the devices gone
    for begin, _ in events.values():
        facts = world.handler.fold(facts, begin)
    assert dict(facts.recovery) == {PF: "recovering", VFS[0]: "recovering", VFS[1]: "recovering"}
    assert set(facts.devices) == {PF, *VFS, OTHER}
    for _, successful in events.values():
        facts = world.handler.fold(facts, successful)
    assert dict(facts.recovery) == {}
    failed = world.handler.fold(facts, error_event(host, VFS[0], "FAILED_RECOVERY"))
    assert dict(failed.recovery) == {VFS[0]: "failed"}


def test_a_device_in_recovery_is_unhealthy_and_healthy_again_after_success(world, host):
    facts = world.handler.scan()
    world.handler.build(facts, world.configure(*CONFIG))  # the builder then patches incrementally
    assert set(healths(world, facts).values()) == {HEALTHY}
    for address in (PF, *VFS):
        facts = world.handler.fold(facts, error_event(host, address, "BEGIN_RECOVERY"))
    assert healths(world, facts) == {PF: UNHEALTHY, VFS[0]: UNHEALTHY, VFS[1]: UNHEALTHY, OTHER: HEALTHY}
    assert records(world, facts)[VFS[0]].fault == Fault(PCIE_ERROR, "recovering", "it is in PCIe error recovery")
    for address in (PF, *VFS):
        facts = world.handler.fold(facts, error_event(host, address, "SUCCESSFUL_RECOVERY", "1"))
    assert set(healths(world, facts).values()) == {HEALTHY}


def test_failed_recovery_stays_unhealthy_until_a_bind_and_a_remove_takes_it_away(world, host):
    facts = world.handler.scan()
    world.handler.build(facts, world.configure(*CONFIG))
    facts = world.handler.fold(facts, error_event(host, VFS[0], "FAILED_RECOVERY"))
    facts = world.handler.fold(facts, error_event(host, VFS[1], "FAILED_RECOVERY"))
    facts = world.handler.fold(facts, pci_event(host, "change", OTHER))  # unrelated
    facts = world.handler.fold(facts, pci_event(host, "unbind", VFS[0]))  # an unbind is no re-probe
    facts = world.handler.fold(facts, Resync("pci", "test"))  # recovery states survive a rescan
    assert healths(world, facts)[VFS[0]] == UNHEALTHY
    assert records(world, facts)[VFS[0]].fault == Fault(PCIE_ERROR, "failed", "its PCIe error recovery failed")
    assert dict(facts.recovery) == {VFS[0]: "failed", VFS[1]: "failed"}
    facts = world.handler.fold(facts, pci_event(host, "bind", VFS[0], DRIVER="vfio-pci"))
    assert healths(world, facts)[VFS[0]] == HEALTHY and dict(facts.recovery) == {VFS[1]: "failed"}
    (host.device_dir(PF) / "virtfn1").unlink()
    devpath = host.devpath(VFS[1])
    host.remove_pci(VFS[1])
    facts = world.handler.fold(facts, UEvent("remove", devpath, "pci"))
    assert VFS[1] not in facts.devices and dict(facts.recovery) == {}


def test_a_recovery_state_of_a_device_gone_at_a_rescan_is_dropped(world, host):
    facts = world.handler.fold(world.handler.scan(), error_event(host, OTHER, "FAILED_RECOVERY"))
    host.remove_pci(OTHER)
    facts = world.handler.fold(facts, Resync("pci", "test"))
    assert OTHER not in facts.devices and dict(facts.recovery) == {}


def test_an_unknown_error_event_is_one_warning_naming_it_and_changes_nothing(world, host, caplog, no_sysfs_reads):
    facts = world.handler.scan()
    with caplog.at_level(logging.DEBUG, "devplugd.pci"):
        folded = world.handler.fold(facts, error_event(host, PF, "PARTIAL_RECOVERY"))
    assert folded is facts
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "'PARTIAL_RECOVERY'" in warnings[0].getMessage()
    assert warnings[0].PCI_ADDR == PF  # type: ignore[attr-defined]
    assert world.handler.health_step(error_event(host, PF, "PARTIAL_RECOVERY")) is None


def test_each_transition_is_logged_with_the_device_and_the_event(world, host, caplog):
    facts = world.handler.scan()
    with caplog.at_level(logging.INFO, "devplugd.pci"):
        for value in ("BEGIN_RECOVERY", "BEGIN_RECOVERY", "SUCCESSFUL_RECOVERY", "FAILED_RECOVERY"):
            facts = world.handler.fold(facts, error_event(host, VFS[0], value))
        facts = world.handler.fold(facts, pci_event(host, "bind", VFS[0], DRIVER="vfio-pci"))
    logged = [(r.PCI_ADDR, r.EVENT) for r in caplog.records if hasattr(r, "EVENT")]  # type: ignore[attr-defined]
    # the repeated BEGIN is no transition; the bind after the failure is one
    assert logged == [(VFS[0], "BEGIN_RECOVERY"), (VFS[0], "SUCCESSFUL_RECOVERY"), (VFS[0], "FAILED_RECOVERY"),
                      (VFS[0], "bind")]


def test_the_loop_hints(world, host):
    handler = world.handler
    facts = handler.scan()
    assert handler.health_step(error_event(host, PF, "BEGIN_RECOVERY")) == HEALTH_LOST
    assert handler.health_step(error_event(host, PF, "FAILED_RECOVERY")) == HEALTH_LOST
    assert handler.health_step(error_event(host, PF, "SUCCESSFUL_RECOVERY")) == HEALTH_RESTORED
    assert handler.health_step(pci_event(host, "bind", PF)) == HEALTH_RESTORED
    assert handler.health_step(pci_event(host, "add", PF)) is None
    assert not any(handler.fold_may_block(facts, pci_event(host, "change", a)) for a in (PF, *VFS, OTHER))
    facts = handler.fold(facts, error_event(host, PF, "BEGIN_RECOVERY"))
    # a uevent of the PF, or of a VF (whose fold reads its PF), may wait for the PF's device lock
    assert all(handler.fold_may_block(facts, pci_event(host, "change", a)) for a in (PF, *VFS))
    assert not handler.fold_may_block(facts, pci_event(host, "change", OTHER))
    assert not handler.fold_may_block(facts, error_event(host, VFS[0], "BEGIN_RECOVERY"))  # never reads


# -- the event loop: batches split at a health recovery, blocking folds off its thread -----------


class RecoveringHandler:
    """Facts: the set of unhealthy devices among d0..d2; ``lose dN`` / ``restore dN`` uevents."""

    name: ClassVar[str] = "recovering"
    device_types: ClassVar[frozenset[str]] = frozenset({"counted"})
    subsystems: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.fold_threads: dict[str, str] = {}

    def parse_pool(self, entry: PoolEntry) -> None:
        return None

    def scan(self) -> frozenset[str]:
        return frozenset()

    def fold(self, facts: frozenset[str], event: Event) -> frozenset[str]:
        if not isinstance(event, UEvent):
            return facts
        self.fold_threads[event.devpath] = threading.current_thread().name
        return facts | {event.devpath} if event.action == "lose" else facts - {event.devpath}

    def fold_may_block(self, facts: frozenset[str], event: Event) -> bool:
        return isinstance(event, UEvent) and event.devpath in facts

    def health_step(self, event: Event) -> str | None:
        if isinstance(event, UEvent):
            return HEALTH_LOST if event.action == "lose" else HEALTH_RESTORED
        return None

    def build(self, facts: frozenset[str], pools: Sequence[Any]) -> dict[str, Any]:
        devices = {f"d{n}": DeviceInfo(health=UNHEALTHY if f"d{n}" in facts else HEALTHY) for n in range(3)}
        return {pool.resource: devices for pool in pools}


class Trees:
    def __init__(self) -> None:
        self.trees: list[DeviceTree] = []

    def offer(self, tree: DeviceTree) -> None:
        self.trees.append(tree)


def recording_loop(handler: RecoveringHandler) -> tuple[EventLoop, Trees]:
    """An event loop serving pool ``things`` of ``handler``, and every tree it publishes."""
    config = parse_config('{"resourceList": [{"resourceName": "things", "deviceType": "counted", "selectors": {}}]}',
                          "test", "example.com", {"counted": ("recovering", handler.parse_pool)})
    notifier = Notifier()
    trees = Trees()
    notifier.subscribe(trees)
    return EventLoop({"recovering": handler}, config, notifier, lambda: config, holdings_for(None)), trees


async def test_the_loop_publishes_the_unhealthy_tree_before_folding_the_recovery():
    handler = RecoveringHandler()
    loop, trees = recording_loop(handler)
    send, receive = trio.open_memory_channel[Event](16)
    send.send_nowait(Resync(None, "start"))
    for action in ("lose", "restore"):  # as the kernel sends them: BEGIN on every function, then SUCCESSFUL
        for device in ("d0", "d1", "d2"):
            send.send_nowait(UEvent(action, device, "x"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop.run, receive)
        await wait_until_async(lambda: trees.trees and trees.trees[-1].version >= 2, 5, "the second tree")
        nursery.cancel_scope.cancel()
    listings = [[health for _, health, _ in tree.pools["example.com/things"].listing] for tree in trees.trees]
    # the first scan and the BEGINs are one batch, the SUCCESSFULs the next: two trees, not one nor six
    assert listings == [[UNHEALTHY] * 3, [HEALTHY] * 3]
    main = threading.current_thread().name
    # the restoring folds concern devices in recovery: off the loop's thread
    assert handler.fold_threads["d0"] != main


class BlockedReadHandler(RecoveringHandler):
    """``slow dN`` uevents read a device under a fatal reset: their fold blocks until ``reads``
    is set (the kernel holds the device's locks for seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = threading.Event()
        self.read_done = threading.Event()

    def fold(self, facts: frozenset[str], event: Event) -> frozenset[str]:
        if isinstance(event, UEvent) and event.action == "slow":
            self.reads.wait(10)
            self.read_done.set()
            return facts
        return super().fold(facts, event)

    def fold_may_block(self, facts: frozenset[str], event: Event) -> bool:
        return isinstance(event, UEvent) and event.action == "slow"

    def health_step(self, event: Event) -> str | None:
        return HEALTH_LOST if isinstance(event, UEvent) and event.action == "lose" else None


async def test_a_health_loss_is_published_before_a_fold_that_may_block():
    """A fatal error's BEGIN_RECOVERY (folded from the event alone), then a uevent whose fold reads
    the device under reset: the Unhealthy tree goes out while that read still waits."""
    handler = BlockedReadHandler()
    loop, trees = recording_loop(handler)
    send, receive = trio.open_memory_channel[Event](16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop.run, receive)
        await send.send(Resync(None, "start"))
        await wait_until_async(lambda: trees.trees, 5, "the first tree")
        send.send_nowait(UEvent("lose", "d0", "x"))
        send.send_nowait(UEvent("slow", "d1", "x"))  # waiting on the bus in the same batch
        await wait_until_async(lambda: trees.trees[-1].pools["example.com/things"].devices["d0"].health == UNHEALTHY,
                               5, "d0 Unhealthy")
        assert not handler.read_done.is_set()  # published while the blocked read still waits
        handler.reads.set()
        await wait_until_async(handler.read_done.is_set, 5, "the blocked read done")
        nursery.cancel_scope.cancel()


# -- the ListAndWatch mailbox ------------------------------------------------------------------


def _tree(healths: dict[str, str]) -> DeviceTree:
    return tree(pool("example.com/things", list(healths), handler="t",
                     unhealthy=[device_id for device_id, health in healths.items() if health == UNHEALTHY]))


def _stream(first: dict[str, str]) -> TreeStream:
    return TreeStream(listing_scope("example.com/things", "t"), _tree(first))


def _listing(tree: Any) -> Any:
    pool = tree.pools.get("example.com/things") if tree is not None else None
    return pool.listing if pool is not None else None


# A plain list the stream would hold this long (quiet since its last send, and at most): an
# hour, so that whatever comes without waiting it out came because it may go at once.
HOLD = {"quiet": 3600.0, "max_delay": 3600.0}


async def _held(stream: TreeStream, last_sent: float) -> asyncio.Task[DeviceTree | None]:
    """``stream.next`` in a task of its own, once it has run until it waits: still running, it holds
    what it has; done, it did not."""
    task = asyncio.create_task(stream.next(last_sent=last_sent, **HOLD))
    await asyncio.sleep(0)  # the task's first step: it takes the tree or waits, with no other await before
    return task


def test_an_unhealthy_list_is_sent_at_once_and_not_hidden_by_a_healthy_one():
    async def run() -> tuple[Any, bool, Any]:
        stream = _stream({"a": HEALTHY, "b": HEALTHY})
        last_sent = time.monotonic()  # the stream has just sent: a plain change would be held
        stream.offer(_tree({"a": HEALTHY, "b": HEALTHY, "c": HEALTHY}))  # plain: conflated away
        stream.offer(_tree({"a": UNHEALTHY, "b": HEALTHY, "c": HEALTHY}))
        stream.offer(_tree({"a": UNHEALTHY, "b": UNHEALTHY, "c": HEALTHY}))  # includes the first urgent one's: replaces it
        stream.offer(_tree({"a": HEALTHY, "b": HEALTHY, "c": HEALTHY}))
        async with asyncio.timeout(10):  # not held for the hour, although the stream had just sent
            first = await stream.next(last_sent=last_sent, **HOLD)
        held = await _held(stream, time.monotonic())  # then the healthy list is coalesced as usual
        was_held = not held.done()
        held.cancel()
        return _listing(first), was_held, _listing(await stream.next())  # what was held, taken now

    first, was_held, second = asyncio.run(run())
    assert [h for _, h, _ in first] == [UNHEALTHY, UNHEALTHY, HEALTHY]
    assert was_held
    assert [h for _, h, _ in second] == [HEALTHY] * 3


def test_an_urgent_list_interrupts_a_held_one():
    async def run() -> tuple[bool, Any]:
        stream = _stream({"a": HEALTHY})
        stream.offer(_tree({"a": HEALTHY, "b": HEALTHY}))
        held = await _held(stream, time.monotonic())
        was_held = not held.done()
        stream.offer(_tree({"a": UNHEALTHY, "b": HEALTHY}))
        async with asyncio.timeout(10):  # not the hour
            return was_held, _listing(await held)

    was_held, listing = asyncio.run(run())
    assert was_held and listing == (("a", UNHEALTHY, ()), ("b", HEALTHY, ()))

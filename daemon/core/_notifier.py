"""The notifier: the one road from the event loop to everything that reads the tree.

The loop ``publish``es each new DeviceTree here and nowhere else. Every consumer (the
device-plugin endpoints and their ListAndWatch streams, the DRA driver and its health streams,
host Watch streams, the CDI writer, the node labels, the metrics, the systemd STATUS line) is a
``Subscriber``: its ``offer(tree)`` is called with each new tree, in subscription order, and
must return at once (keep the tree and wake its own task). So a slow consumer is conflated to
the newest tree and never delays another, and what changed since the tree it last handled is
``tree.diff(last)``, the same diff for all. A subscriber that raises is logged and keeps its
place: the others still hear of the tree.

``TreeMailbox`` is every subscriber's mailbox: trees wait in order, and the newest replaces a
waiting one (a slow reader is conflated to the newest tree, never a backlog), except a tree in
which a device of the reader's scope became Unhealthy. Such a tree is *urgent*: nothing replaces
it but a newer urgent tree whose Unhealthy devices include all of its own, so no Unhealthy state
is ever hidden from the reader: a PCIe recovery that ends 0.3 ms after it began reaches a
ListAndWatch stream, a DRA health stream and a host Watch stream alike as two trees, the
Unhealthy one first. A reader that follows only the newest state (a file writer) gives no scope:
nothing is urgent for it. Each waiting tree carries when the oldest event it answers reached the
event loop (a tree that replaces others takes the oldest of theirs), for the reaction times.

``TreeStream`` is the mailbox of a gRPC stream (ListAndWatch, DRA health, host Watch: asyncio
tasks on the loop's one thread) with the waiting they need: the next tree, at most after a
timeout, and for ListAndWatch the coalescing of bursts (see ``next``). A stream opens it with
``Notifier.stream``, subscribed for as long as the stream runs; ``devices_scope`` is the scope
of a stream that follows devices across pools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from ._tree import HEALTHY, DeviceTree, ResourcePool

log = logging.getLogger("devplugd.notifier")


class Subscriber(Protocol):
    def offer(self, tree: DeviceTree) -> None:
        """A new tree is current. Return at once: keep it, wake your own task."""
        ...


class Notifier:
    """The current tree, and who hears of the next one."""

    def __init__(self) -> None:
        self._tree = DeviceTree.empty()
        self._subscribers: list[Subscriber] = []

    @property
    def tree(self) -> DeviceTree:
        return self._tree

    def subscribe(self, subscriber: Subscriber) -> DeviceTree:
        """Offer every tree from now on to ``subscriber``; return the current one."""
        self._subscribers.append(subscriber)
        return self._tree

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    @contextmanager
    def stream(self, scope: Scope | None, first: DeviceTree) -> Iterator[TreeStream]:
        """A gRPC stream's ``TreeStream``, subscribed while the block runs: it hears of every
        tree after ``first`` (the one the stream starts from)."""
        stream = TreeStream(scope, first)
        self.subscribe(stream)
        try:
            yield stream
        finally:
            self.unsubscribe(stream)

    def publish(self, tree: DeviceTree) -> None:
        """Make ``tree`` current and offer it to every subscriber."""
        self._tree = tree
        for subscriber in tuple(self._subscribers):
            try:
                subscriber.offer(tree)
            except Exception:
                log.exception("a consumer of the device tree failed on version %d (%r); the others go on",
                              tree.version, subscriber, extra={"EVENT": f"tree:{tree.version}"})


# Trees a mailbox holds at most: only urgent ones pile up (each kept until taken); a reader this
# far behind is not reading.
MAX_PENDING = 64


@dataclass(frozen=True)
class Scope:
    """What a stream follows: ``concerns(old, new)`` whether ``new`` may change anything it
    says since ``old`` (else the tree is not even queued: a stream of one resource is not woken
    for another's changes); ``unhealthy(tree)`` its devices that are Unhealthy in ``tree`` (keys
    of the reader's choosing) and ``has(tree, key)`` whether ``tree`` has that one. A tree is
    urgent when a device the previous tree had Healthy is Unhealthy in it (a device that comes
    Unhealthy is news, not a lost health)."""

    concerns: Callable[[DeviceTree, DeviceTree], bool]
    unhealthy: Callable[[DeviceTree], frozenset[Hashable]]
    has: Callable[[DeviceTree, Hashable], bool]


def devices_scope(concerns: Callable[[DeviceTree, DeviceTree], bool],
                  follows: Callable[[ResourcePool], bool] = lambda pool: True) -> Scope:
    """A Scope over every device, keyed ``(resource, device ID)``, of the pools ``follows``."""
    def unhealthy(tree: DeviceTree) -> frozenset[Hashable]:
        return frozenset((resource, device_id) for resource, pool in tree.pools.items()
                         if follows(pool) and pool.healthy_count != len(pool.devices)
                         for device_id, info in pool.devices.items() if info.health != HEALTHY)

    def has(tree: DeviceTree, key: Hashable) -> bool:
        assert isinstance(key, tuple)
        resource, device_id = key
        pool = tree.pools.get(resource)
        return pool is not None and follows(pool) and device_id in pool.devices

    return Scope(concerns, unhealthy, has)


class MailboxClosed(Exception):
    """The stream was closed: the reader ends."""


class TreeMailbox:
    def __init__(self, wake: Callable[[], None], scope: Scope | None = None,
                 last: DeviceTree | None = None) -> None:
        self._wake = wake
        self._scope = scope
        self._last = last
        self._last_unhealthy = scope.unhealthy(last) if scope is not None and last is not None else frozenset()
        # (tree, its Unhealthy devices if urgent, arrival of the oldest event it answers)
        self._pending: list[tuple[DeviceTree, frozenset[Hashable] | None, float | None]] = []
        self.offered_at = 0.0  # monotonic time of the last offer

    def __bool__(self) -> bool:
        return bool(self._pending)

    @property
    def urgent_first(self) -> bool:
        """Whether the next tree to take is urgent (it is never held back)."""
        return bool(self._pending) and self._pending[0][1] is not None

    def offer(self, tree: DeviceTree) -> None:
        scope = self._scope
        if scope is not None and self._last is not None and not scope.concerns(self._last, tree):
            self._last = tree  # nothing of ours changed: not queued, nobody woken
            return
        self.offered_at = time.monotonic()
        arrival = tree.arrival
        urgent: frozenset[Hashable] | None = None
        if scope is not None:
            unhealthy = scope.unhealthy(tree)
            last = self._last
            if last is not None and any(scope.has(last, key) for key in unhealthy - self._last_unhealthy):
                urgent = unhealthy
            self._last, self._last_unhealthy = tree, unhealthy
        pending = self._pending
        while pending:
            kept = pending[-1][1]
            if kept is not None and (urgent is None or not kept <= urgent):
                break
            # conflated: a plain tree, or an urgent one whose Unhealthy devices are still so
            replaced = pending.pop()[2]
            if replaced is not None and (arrival is None or replaced < arrival):
                arrival = replaced
        pending.append((tree, urgent, arrival))
        if len(pending) > MAX_PENDING:
            del pending[:-MAX_PENDING]
        self._wake()

    def take(self) -> tuple[DeviceTree, float | None] | None:
        """The oldest waiting tree and when its oldest event arrived, or ``None``."""
        if not self._pending:
            return None
        tree, _, arrival = self._pending.pop(0)
        return tree, arrival


class TreeStream:
    """A stream's mailbox (a notifier subscriber) and its waiting, on the asyncio loop."""

    def __init__(self, scope: Scope | None, first: DeviceTree) -> None:
        self._wakeup = asyncio.Event()
        self._mailbox = TreeMailbox(self._wakeup.set, scope, first)
        self._closed = False
        self.taken_arrival: float | None = None  # of the tree ``next`` returned last

    def offer(self, tree: DeviceTree) -> None:
        self._mailbox.offer(tree)

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def _wait(self, timeout: float | None) -> None:
        self._wakeup.clear()
        if timeout is None:
            await self._wakeup.wait()
            return
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    async def next(self, timeout: float | None = None, *, last_sent: float | None = None,
                   quiet: float = 0.0, max_delay: float = 0.0) -> DeviceTree | None:
        """The next tree (``None`` once ``timeout`` passed without one); raises MailboxClosed.

        With ``last_sent`` (monotonic seconds) a tree that is not urgent is coalesced: it goes at
        once if the stream has been quiet for ``quiet`` since it last sent, else once no tree has
        come for ``quiet`` (the burst is over), but never later than ``max_delay`` after it came,
        or as soon as an urgent tree arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        mailbox = self._mailbox
        while not mailbox:
            if self._closed:
                raise MailboxClosed
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await self._wait(None if deadline is None else deadline - time.monotonic())
        if self._closed:
            raise MailboxClosed
        first_pending = time.monotonic()
        if last_sent is not None and not mailbox.urgent_first and first_pending - last_sent < quiet:
            while not mailbox.urgent_first:
                held_until = min(mailbox.offered_at + quiet, first_pending + max_delay)
                remaining = held_until - time.monotonic()
                if remaining <= 0:
                    break
                await self._wait(remaining)
                if self._closed:
                    raise MailboxClosed
        taken = mailbox.take()
        assert taken is not None
        tree, self.taken_arrival = taken
        return tree

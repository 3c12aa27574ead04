"""The notifier: the one road from the event loop to everything that reads the tree.

The loop ``publish``es each new DeviceTree here and nowhere else. Every consumer — the
device-plugin endpoints, host Watch streams, the CDI writer, the systemd STATUS line — is a
``Subscriber``: its ``offer(tree)`` is called with each new tree, in subscription order, and
must return at once (keep the newest tree and wake its own task; ``LatestValue`` is the one-slot
mailbox for that). So a slow consumer is conflated to the newest tree and never delays another,
and what changed since the tree it last handled is ``tree.diff(last)``, the same diff for all.
A subscriber that raises is logged and keeps its place: the others still hear of the tree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ._tree import DeviceTree

log = logging.getLogger("devplugd.notifier")

T = TypeVar("T")


class Subscriber(Protocol):
    def offer(self, tree: DeviceTree) -> None:
        """A new tree is current. Return at once: keep it, wake your own task."""
        ...


class LatestValue(Generic[T]):
    """A one-slot mailbox: ``put`` replaces whatever was not taken yet.

    ``on_put`` is how the reader gets woken (an asyncio or trio event's ``set``); the reader then
    calls ``take``. Reading the newest value only is the conflation the notifier relies on.
    """

    __slots__ = ("_value", "_full", "_on_put")

    def __init__(self, on_put: Callable[[], None]) -> None:
        self._value: T | None = None
        self._full = False
        self._on_put = on_put

    def put(self, value: T) -> None:
        self._value = value
        self._full = True
        self._on_put()

    def take(self) -> tuple[bool, T | None]:
        """``(True, value)`` if a value was waiting (and clear the slot), else ``(False, None)``."""
        if not self._full:
            return False, None
        value, self._value, self._full = self._value, None, False
        return True, value


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

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, tree: DeviceTree) -> None:
        """Make ``tree`` current and offer it to every subscriber."""
        self._tree = tree
        for subscriber in tuple(self._subscribers):
            try:
                subscriber.offer(tree)
            except Exception:
                log.exception("a consumer of the device tree failed on version %d (%r); the others go on",
                              tree.version, subscriber, extra={"EVENT": f"tree:{tree.version}"})

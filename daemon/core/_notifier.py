"""The notifier: holds the current DeviceTree and wakes only the subscribers whose resource changed.

A subscriber is anything with ``offer(pool)``. It is called with the resource's new pool (or
``None`` when the resource went away) each time that resource's kubelet-visible list changed.
Subscribers keep only the latest offer (see ``LatestValue``), so a slow reader is conflated to
the newest snapshot and never builds a backlog.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ._tree import DeviceTree, ResourcePool

T = TypeVar("T")


class Subscriber(Protocol):
    def offer(self, pool: ResourcePool | None) -> None: ...


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
    """The current tree, and who wants to hear about which resource."""

    def __init__(self) -> None:
        self._tree = DeviceTree.empty()
        self._subscribers: dict[str, set[Subscriber]] = {}
        self._tree_subscribers: list[Callable[[DeviceTree], None]] = []

    def subscribe_trees(self, offer: Callable[[DeviceTree], None]) -> None:
        """Offer every new tree to ``offer`` (host watch streams: they diff trees themselves)."""
        self._tree_subscribers.append(offer)

    def unsubscribe_trees(self, offer: Callable[[DeviceTree], None]) -> None:
        if offer in self._tree_subscribers:
            self._tree_subscribers.remove(offer)

    @property
    def tree(self) -> DeviceTree:
        return self._tree

    def subscribe(self, resource: str, subscriber: Subscriber) -> ResourcePool | None:
        """Start offering ``resource``'s changes to ``subscriber``; return its current pool."""
        self._subscribers.setdefault(resource, set()).add(subscriber)
        return self._tree.pools.get(resource)

    def unsubscribe(self, resource: str, subscriber: Subscriber) -> None:
        subscribers = self._subscribers.get(resource)
        if subscribers is not None:
            subscribers.discard(subscriber)
            if not subscribers:
                del self._subscribers[resource]

    def subscriber_count(self, resource: str) -> int:
        return len(self._subscribers.get(resource, ()))

    def publish(self, tree: DeviceTree) -> frozenset[str]:
        """Make ``tree`` current; offer it to subscribers of changed resources; return those."""
        previous, self._tree = self._tree, tree
        changed = tree.changed_listings(previous)
        for resource in changed:
            pool = tree.pools.get(resource)
            for subscriber in tuple(self._subscribers.get(resource, ())):
                subscriber.offer(pool)
        for offer in tuple(self._tree_subscribers):
            offer(tree)
        return changed

"""The notifier: the one road from the event loop to everything that reads the tree.

The loop ``publish``es each new DeviceTree here and nowhere else. Every consumer (the
device-plugin endpoints and their ListAndWatch streams, the DRA driver and its health streams,
host Watch streams, the CDI writer, the node labels, the metrics, the systemd STATUS line) is a
``Subscriber``: its ``offer(tree)`` is called with each new tree, in subscription order, and
must return at once (keep the tree and wake its own task: ``TreeMailbox`` in ``_mailbox.py`` is
the mailbox for that). So a slow consumer is conflated to the newest tree and never delays
another, and what changed since the tree it last handled is ``tree.diff(last)``, the same diff
for all.
A subscriber that raises is logged and keeps its place: the others still hear of the tree.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ._tree import DeviceTree

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

    def publish(self, tree: DeviceTree) -> None:
        """Make ``tree`` current and offer it to every subscriber."""
        self._tree = tree
        for subscriber in tuple(self._subscribers):
            try:
                subscriber.offer(tree)
            except Exception:
                log.exception("a consumer of the device tree failed on version %d (%r); the others go on",
                              tree.version, subscriber, extra={"EVENT": f"tree:{tree.version}"})

"""A notifier subscriber that writes what the newest tree says, at its own pace.

The CDI specs and the NFD node labels are files that follow the tree. Both must never delay a
ListAndWatch message, and a burst of trees should be written once. ``TreeFollower.offer`` (the
notifier's call) only stores the tree and wakes ``run``. ``run`` is a task of its own: it waits
``settle`` seconds, then hands the newest tree to ``write`` in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from daemon.core._notifier import TreeMailbox
from daemon.core._tree import DeviceTree


class TreeFollower:
    def __init__(self, write: Callable[[DeviceTree], None], settle: float) -> None:
        self._write = write
        self._settle = settle
        self._wakeup = trio.Event()
        self._mailbox = TreeMailbox(lambda: self._wakeup.set())  # no scope: only the newest tree matters

    def offer(self, tree: DeviceTree) -> None:
        self._mailbox.offer(tree)

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            await trio.sleep(self._settle)  # let the ListAndWatch streams go first; a burst is one write
            self._wakeup = trio.Event()
            if (taken := self._mailbox.take()) is not None:
                await trio.to_thread.run_sync(self._write, taken[0])

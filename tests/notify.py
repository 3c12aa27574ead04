"""A stand-in for systemd's NOTIFY_SOCKET: a datagram socket whose messages a test reads."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tests.waiting import wait_until

T = TypeVar("T")


class NotifySocket:
    """Reads every datagram at once in a thread, as systemd does: a unix datagram socket holds
    only ``net.unix.max_dgram_qlen`` (10) unread messages before the sender blocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.messages: list[tuple[float, str]] = []
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self.socket.recv(4096)
            except OSError:
                return
            with self._condition:
                self.messages.append((time.monotonic(), data.decode()))
                self._condition.notify_all()

    def close(self) -> None:
        self.socket.shutdown(socket.SHUT_RDWR)
        self.socket.close()

    def read_until(self, predicate: Callable[[str], bool], timeout: float = 10.0) -> str:
        """The first message so far that satisfies ``predicate``, waiting for it."""
        return self.wait_for(lambda texts: next((text for text in texts if predicate(text)), None), timeout,
                             "a matching notification")

    def wait_for(self, holds: Callable[[list[str]], T], timeout: float = 10.0, what: str = "") -> T:
        """``holds(messages)`` (the texts so far, in order) once it is true, woken by each new one."""
        with self._condition:
            return wait_until(lambda: holds([text for _, text in self.messages]), timeout,
                              lambda: f"{what}; got {self.messages}", condition=self._condition)

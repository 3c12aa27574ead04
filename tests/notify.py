"""A stand-in for systemd's NOTIFY_SOCKET: a datagram socket whose messages a test reads."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


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

    def read_until(self, predicate, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        with self._condition:
            while True:
                for _, message in self.messages:
                    if predicate(message):
                        return message
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no matching notification; got {self.messages}")
                self._condition.wait(remaining)

    def drain(self, seconds: float) -> list[str]:
        """Everything that arrives in the next ``seconds``."""
        with self._condition:
            start = len(self.messages)
        time.sleep(seconds)
        with self._condition:
            return [message for _, message in self.messages[start:]]

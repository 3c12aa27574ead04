"""What every uevent source shares: the drain loop (``pump``) that sleeps until its socket is
readable and sends what it reads, the overflow rule, and the log lines for what it skips."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from daemon.core import Event, Resync, UEvent

log = logging.getLogger("devplugd.sources")

RECEIVE_BUFFER_BYTES = 16 * 1024 * 1024
DRAIN_BATCH = 256  # datagrams read between two trips through trio's scheduler
OVERFLOW_REASON = "uevent overflow"

SendChannel = trio.MemorySendChannel[Event]


class Overflow(Exception):
    """The kernel dropped messages for this socket (``ENOBUFS``)."""


async def pump(
    fd: object,
    receive: Callable[[], UEvent | None],
    name: str,
    subsystems: frozenset[str],
    send: SendChannel,
) -> None:
    """Forever: sleep until ``fd`` is readable, then send what ``receive`` returns until it is drained.

    ``receive`` returns the next event, ``None`` when nothing is queued, or raises ``Overflow``.
    Reading in batches keeps a storm of filtered-out messages from starving the other tasks.
    """
    overflowed = False
    while True:
        await trio.lowlevel.wait_readable(fd)  # type: ignore[arg-type]
        for _ in range(DRAIN_BATCH):
            try:
                event = receive()
            except Overflow:
                overflowed = True
                continue
            if event is None:
                if overflowed:
                    log_overflow(name)
                    await send.send(Resync(None, OVERFLOW_REASON))
                    overflowed = False
                break
            if wanted(event, subsystems):
                await send.send(event)


def wanted(event: UEvent, subsystems: frozenset[str]) -> bool:
    return not subsystems or event.subsystem in subsystems


def log_skipped(name: str, reason: str) -> None:
    log.warning("uevent source %s: skipped a malformed message: %s", name, reason, extra={"EVENT": "uevent-malformed"})


def log_overflow(name: str) -> None:
    log.warning(
        "uevent source %s: the kernel dropped uevents (receive buffer full); rescanning",
        name,
        extra={"EVENT": "uevent-overflow"},
    )


def subsystem_text(subsystems: frozenset[str]) -> str:
    return ", ".join(sorted(subsystems)) if subsystems else "all"



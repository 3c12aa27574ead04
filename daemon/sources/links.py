"""rtnetlink link source: network interfaces appearing, going away, losing and regaining carrier.

Handlers that hand out network devices need to know when one is deleted, renamed, or loses its
carrier (admin up, ``IFF_LOWER_UP`` gone). The kernel says so on rtnetlink's ``RTMGRP_LINK``
group; this source turns that into bus events:

* at start, and whenever the socket lost messages, a full dump (``RTM_GETLINK`` with
  ``NLM_F_DUMP``) becomes one ``LinkSnapshot`` of every interface of the network namespace;
* after that, ``RTM_NEWLINK`` / ``RTM_DELLINK`` become ``LinkChanged(ifname, state)`` (``state``
  is ``None`` for a deletion), sent only when the state of that name really changed: one carrier
  flip makes the kernel send several ``RTM_NEWLINK`` for the same state. A rename (same ifindex,
  new name) is the old name deleted followed by the new name's state.

The task sleeps in ``trio.lowlevel.wait_readable`` on the non-blocking socket and wakes only when
the kernel sent something; it then drains the socket until it would block. No thread, no timer.

The socket and the framing of its messages are in ``_rtnetlink.py`` (why not pyroute2 is said
there): a link message is decoded down to its ifindex, its flags and ``IFLA_IFNAME``, the rest of
its attribute chain is not looked at, so a dump of a host with thousands of VF netdevs costs
milliseconds of the daemon's only thread.

When the receive buffer overflowed, ``recv`` fails once with ``ENOBUFS``: messages were lost, so
the source logs a warning and dumps again (after the dump in progress, if any, has ended), then
sends a fresh ``LinkSnapshot``. A message that cannot be understood costs one log line and is
skipped. Only ``AF_UNSPEC`` link messages are about interfaces: the bridge's ``AF_BRIDGE``
``RTM_NEWLINK``/``RTM_DELLINK`` (a port joining or leaving a bridge) are ignored.

Net devices are per network namespace: the source sees the namespace it was started in.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import trio

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from daemon.sources._netlink import raise_receive_buffer
from daemon.sources._rtnetlink import (
    AF_UNSPEC,
    IFF_LOWER_UP,
    IFF_UP,
    NLM_F_DUMP_INTR,
    NLMSG_DONE,
    NLMSG_ERROR,
    RTM_DELLINK,
    RTM_NEWLINK,
    Malformed,
    Message,
    dump_request,
    open_socket,
    parse_datagram,
)

log = logging.getLogger("devplugd.links")

SendChannel = trio.MemorySendChannel[Event]

RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
# A dump datagram is at most 32 KiB (the kernel caps its dump buffers there); notifications are
# smaller. A bigger buffer costs nothing and no datagram is ever truncated.
MAX_DATAGRAM_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Link:
    """One decoded link message (``state`` is ``None`` for ``RTM_DELLINK``)."""

    ifindex: int
    ifname: str | None
    state: LinkState | None


class _LinkTable:
    """What was last said about each interface, by name and by ifindex."""

    def __init__(self) -> None:
        self._states: dict[str, LinkState] = {}
        self._names: dict[int, str] = {}

    def snapshot(self) -> LinkSnapshot:
        return LinkSnapshot(links=MappingProxyType(dict(self._states)))

    def apply(self, link: _Link) -> list[LinkChanged]:
        """Record ``link`` and return what changed (a rename gives the old name's deletion first)."""
        if link.state is None:
            return self._delete(link.ifindex)
        assert link.ifname is not None
        changes: list[LinkChanged] = []
        old_name = self._names.get(link.ifindex)
        if old_name is not None and old_name != link.ifname:
            changes += self._delete(link.ifindex)
        previous = self._states.get(link.ifname)
        if previous is not None and previous.ifindex != link.ifindex:
            # The name moved to another device while we were not told: forget the old one.
            self._names.pop(previous.ifindex, None)
        self._names[link.ifindex] = link.ifname
        if previous != link.state:
            self._states[link.ifname] = link.state
            changes.append(LinkChanged(link.ifname, link.state))
        return changes

    def _delete(self, ifindex: int) -> list[LinkChanged]:
        name = self._names.pop(ifindex, None)
        if name is None or self._states.pop(name, None) is None:
            return []
        return [LinkChanged(name, None)]


@dataclass
class _Tracker:
    """The source's state machine: the current table, and the dump being received, if any.

    While a dump runs, every link message (dump answer or notification, in arrival order, which is
    the kernel's order) goes to a fresh table; ``NLMSG_DONE`` makes it current and yields the
    snapshot, unless messages were lost or the dump was interrupted meanwhile: then dump again.
    """

    table: _LinkTable = field(default_factory=_LinkTable)
    dump: _LinkTable | None = None
    dump_seq: int = 0
    dump_again: bool = False

    def start_dump(self) -> int:
        """Begin a new dump; returns the sequence number to send it with."""
        self.dump = _LinkTable()
        self.dump_seq += 1
        self.dump_again = False
        return self.dump_seq

    def lost_messages(self) -> bool:
        """The socket overflowed; returns whether to send a dump request now."""
        if self.dump is not None:
            self.dump_again = True
            return False
        return True

    def link(self, link: _Link) -> list[LinkChanged]:
        """Apply a link message; the changes to send (none while a dump runs)."""
        if self.dump is not None:
            self.dump.apply(link)
            return []
        return self.table.apply(link)

    def dump_done(self, seq: int, interrupted: bool) -> LinkSnapshot | None:
        """The end of dump ``seq``: the snapshot, or ``None`` when it must be done again."""
        if self.dump is None or seq != self.dump_seq:
            return None
        if interrupted or self.dump_again:
            return None
        self.table, self.dump = self.dump, None
        return self.table.snapshot()


class LinkSource:
    """The rtnetlink source: one task that sends ``LinkSnapshot`` and ``LinkChanged`` records.

    ``receive_buffer`` is the socket's receive buffer (``SO_RCVBUFFORCE`` when allowed, else
    ``SO_RCVBUF`` capped by ``net.core.rmem_max``); tests make it tiny to provoke ``ENOBUFS``.
    """

    def __init__(self, receive_buffer: int = RECEIVE_BUFFER_BYTES) -> None:
        self._receive_buffer = receive_buffer

    async def run(self, send: SendChannel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send the first snapshot, then changes, until cancelled.

        ``await nursery.start(source.run, send)`` returns once the socket listens and the first
        dump was requested: no change after that point can be missed.
        """
        netlink = _Netlink(self._receive_buffer)
        try:
            tracker = _Tracker()
            netlink.request_dump(tracker.start_dump())
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(netlink.fileno())
                for event in _drain(netlink, tracker):
                    await send.send(event)
        finally:
            netlink.close()


class _Netlink:
    """The rtnetlink socket on ``RTMGRP_LINK``, non-blocking, with a receive buffer for bursts."""

    def __init__(self, receive_buffer: int) -> None:
        self._socket = open_socket()
        try:
            raise_receive_buffer(self._socket, receive_buffer)
        except BaseException:
            self._socket.close()
            raise

    def fileno(self) -> int:
        return self._socket.fileno()

    def close(self) -> None:
        self._socket.close()

    def request_dump(self, seq: int) -> None:
        self._socket.send(dump_request(seq))

    def receive(self) -> tuple[bytes, int] | None:
        """One datagram and its sender's port (0: the kernel), or ``None`` when none is waiting.

        Raises ``OSError(ENOBUFS)`` once after the kernel dropped messages for us.
        """
        try:
            data, (sender, _groups) = self._socket.recvfrom(MAX_DATAGRAM_BYTES)
        except BlockingIOError:
            return None
        return data, sender


def _drain(netlink: _Netlink, tracker: _Tracker) -> list[Event]:
    """Read until the socket would block; return the events, in order."""
    events: list[Event] = []
    while True:
        try:
            received = netlink.receive()
        except OSError as exc:
            if exc.errno != errno.ENOBUFS:
                raise
            log.warning(
                "rtnetlink dropped link messages (receive buffer full); dumping the links again",
                extra={"EVENT": "link-overflow"},
            )
            if tracker.lost_messages():
                netlink.request_dump(tracker.start_dump())
            continue
        if received is None:
            return events
        data, sender = received
        if sender != 0:
            _log_skipped(f"datagram from port {sender}, not from the kernel")
            continue
        for message in parse_datagram(data):
            if isinstance(message, Malformed):
                _log_skipped(message.reason)
            else:
                events += _handle(netlink, tracker, message)


def _handle(netlink: _Netlink, tracker: _Tracker, message: Message) -> Sequence[Event]:
    if message.type == NLMSG_ERROR:
        return _handle_error(tracker, message)
    if message.type == NLMSG_DONE:
        return _handle_done(netlink, tracker, message)
    if message.type not in (RTM_NEWLINK, RTM_DELLINK):
        _log_skipped(f"unexpected message type {message.type}")
        return []
    if message.family != AF_UNSPEC:
        return []  # AF_BRIDGE port notifications: not about the interface itself
    link = _decode_link(message)
    if link is None:
        return []
    events = tracker.link(link)
    for event in events:
        log.debug("%s: %s", event.ifname, event.state or "deleted", extra={"NETDEV": event.ifname})
    return events


def _handle_error(tracker: _Tracker, message: Message) -> list[Event]:
    answers_dump = tracker.dump is not None and message.sequence == tracker.dump_seq
    if answers_dump and message.error:
        # The kernel refused our dump: without it there is no state to report.
        raise OSError(message.error, f"rtnetlink link dump failed: {errno.errorcode.get(message.error, '?')} "
                                     f"({message.error})")
    _log_skipped(f"an error (errno {message.error}) for a request we did not make (sequence {message.sequence})")
    return []


def _handle_done(netlink: _Netlink, tracker: _Tracker, message: Message) -> list[Event]:
    interrupted = bool(message.flags & NLM_F_DUMP_INTR)
    snapshot = tracker.dump_done(message.sequence, interrupted)
    if snapshot is not None:
        log.info("link dump: %d interfaces", len(snapshot.links), extra={"EVENT": "link-snapshot"})
        return [snapshot]
    if tracker.dump is not None and message.sequence == tracker.dump_seq:
        reason = "it was interrupted by changes" if interrupted else "messages were lost meanwhile"
        log.info("link dump incomplete (%s); dumping again", reason, extra={"EVENT": "link-redump"})
        netlink.request_dump(tracker.start_dump())
    return []


def _decode_link(message: Message) -> _Link | None:
    ifindex, ifname = message.ifindex, message.ifname
    if ifindex <= 0:
        _log_skipped(f"link message with ifindex {ifindex}", ifname)
        return None
    if message.type == RTM_DELLINK:
        return _Link(ifindex, ifname, None)
    if not ifname:
        _log_skipped(f"RTM_NEWLINK for ifindex {ifindex} without IFLA_IFNAME")
        return None
    flags = message.ifflags
    return _Link(ifindex, ifname, LinkState(ifindex, bool(flags & IFF_UP), bool(flags & IFF_LOWER_UP)))


def _log_skipped(reason: str, ifname: str | None = None) -> None:
    extra = {"EVENT": "link-malformed"} | ({"NETDEV": ifname} if ifname else {})
    log.warning("rtnetlink: skipped a message: %s", reason, extra=extra)

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

Why pyroute2 is used the way it is: pyroute2 0.9.7's ``IPRSocket`` is a synchronous wrapper around
a plain ``socket.socket`` (its ``socket`` attribute), kept out of asyncio; its ``get()`` is one
``recv`` followed by a full parse of every attribute of every message (~240 µs per ``RTM_NEWLINK``
of a veth here: 40-odd attribute objects built per message). ``IPRSocket`` itself has no
``setblocking`` (it forwards only some socket methods: ``AttributeError``), so the non-blocking
mode is set on that underlying socket; a socket left blocking waits in ``get()`` for as long as
no link changes. We keep its socket (creation, bind, ``put`` of the dump request, close) and its
marshal, but register for ``RTM_NEWLINK``/``RTM_DELLINK`` a subclass of its ``ifinfmsg`` that
decodes the netlink header and the ``ifinfomsg`` fields with pyroute2's own code and picks
``IFLA_IFNAME`` out of the attribute chain without decoding the rest (~21 µs per message,
measured on a 101-link dump). A dump of a host with thousands of VF netdevs then costs tens of
milliseconds of the daemon's only thread, not a second.

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
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import trio
from pyroute2 import IPRSocket
from pyroute2.netlink import (
    NLA_F_NESTED,
    NLA_F_NET_BYTEORDER,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
)
from pyroute2.netlink.marshal import Marshal
from pyroute2.netlink.rtnl import RTM_DELLINK, RTM_GETLINK, RTM_NEWLINK, RTMGRP_LINK
from pyroute2.netlink.rtnl.ifinfmsg import IFF_LOWER_UP, IFF_UP, ifinfmsg

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from daemon.sources._netlink import raise_receive_buffer

log = logging.getLogger("devplugd.links")

SendChannel = trio.MemorySendChannel[Event]

AF_UNSPEC = 0
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
# A dump datagram is at most 32 KiB (the kernel caps its dump buffers there); notifications are
# smaller. A bigger buffer costs nothing and no datagram is ever truncated.
MAX_DATAGRAM_BYTES = 64 * 1024
NLA_TYPE_MASK = ~(NLA_F_NESTED | NLA_F_NET_BYTEORDER) & 0xFFFF
IFLA_IFNAME = [name for name, _ in ifinfmsg.nla_map].index("IFLA_IFNAME")
_NLA_HEADER = struct.Struct("=HH")


# pyroute2 has no types (none on PyPI either), so ifinfmsg is Any to mypy and subclassing it
# is disallow_subclassing_any's [misc] error; nothing short of writing pyroute2 stubs avoids it.
class _LinkHeaderMsg(ifinfmsg):  # type: ignore[misc]
    """An ``ifinfmsg`` that decodes its header, its fields and ``IFLA_IFNAME``, nothing else.

    pyroute2 calls ``decode_nlas`` from ``decode`` once the fixed part is read; instead of
    building an object for each of the ~40 attributes, walk the chain and keep only the name,
    so ``msg.get_attr("IFLA_IFNAME")`` works as usual. A broken chain leaves the name missing
    (the caller logs and skips the message): this never raises, so pyroute2 logs nothing.
    """

    def decode_nlas(self, offset: int) -> None:
        data = self.data
        end = min(self.offset + self.length, len(data))
        while offset + 4 <= end:
            length, nla_type = _NLA_HEADER.unpack_from(data, offset)
            if length < 4 or offset + length > end:
                return
            if nla_type & NLA_TYPE_MASK == IFLA_IFNAME:
                raw = data[offset + 4 : offset + length].split(b"\0", 1)[0]
                try:
                    self["attrs"].append(("IFLA_IFNAME", raw.decode()))
                except UnicodeDecodeError:
                    pass
                return
            offset += (length + 3) & ~3


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
    """pyroute2's ``IPRSocket`` on ``RTMGRP_LINK``, non-blocking, with the cheap link decoder.

    ``IPRSocket`` keeps the socket out of asyncio: its ``socket`` is a plain ``socket.socket``
    that we read ourselves (``get()`` would be the same ``recv`` plus a full parse).
    """

    def __init__(self, receive_buffer: int) -> None:
        self._iprsocket = IPRSocket(rcvbuf=receive_buffer)
        try:
            self._iprsocket.bind(groups=RTMGRP_LINK)
            self._socket: socket.socket = self._iprsocket.socket
            self._socket.setblocking(False)
            raise_receive_buffer(self._socket, receive_buffer)
            _link_policy_only(self._iprsocket.marshal)
        except BaseException:
            self._iprsocket.close()
            raise

    def fileno(self) -> int:
        return self._socket.fileno()

    def close(self) -> None:
        self._iprsocket.close()

    def request_dump(self, seq: int) -> None:
        self._iprsocket.put(ifinfmsg(), msg_type=RTM_GETLINK, msg_flags=NLM_F_REQUEST | NLM_F_DUMP, msg_seq=seq)

    def receive(self) -> tuple[bytes, int] | None:
        """One datagram and its sender's port (0: the kernel), or ``None`` when none is waiting.

        Raises ``OSError(ENOBUFS)`` once after the kernel dropped messages for us.
        """
        try:
            data, (sender, _groups) = self._socket.recvfrom(MAX_DATAGRAM_BYTES)
        except BlockingIOError:
            return None
        return data, sender

    def parse(self, data: bytes) -> Iterator[Any]:
        return _parse_datagram(self._iprsocket.marshal, data)


def _parse_datagram(marshal: Marshal, data: bytes) -> Iterator[Any]:
    """pyroute2's marshal over one datagram; what it cannot frame costs one log line.

    The marshal turns a message whose attributes do not decode into one with
    ``header["error"]`` set, raises ``struct.error`` for a fixed part cut short, and silently
    stops at a message longer than the datagram: the bytes it did not account for tell.
    """
    framed = 0
    try:
        for msg in marshal.parse(data):
            framed += msg["header"].get("length") or 0
            yield msg
    except struct.error as exc:
        _log_skipped(f"undecodable message in a {len(data)}-byte datagram ({exc}); skipped the rest of it")
        return
    if framed < len(data):
        _log_skipped(f"{len(data) - framed} bytes at the end of a datagram do not frame a message")


def _link_policy_only(marshal: Marshal) -> None:
    """Decode link messages with ``_LinkHeaderMsg``, any other type as a bare netlink header.

    Only link messages are expected on ``RTMGRP_LINK``; anything else is reported and skipped,
    and the request echoed in an ``NLMSG_ERROR`` is not decoded beyond its header.
    """
    marshal.msg_map.clear()
    marshal.msg_map.update({RTM_NEWLINK: _LinkHeaderMsg, RTM_DELLINK: _LinkHeaderMsg})


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
        for msg in netlink.parse(data):
            events += _handle(netlink, tracker, msg)


def _handle(netlink: _Netlink, tracker: _Tracker, msg: Any) -> Sequence[Event]:
    header = msg["header"]
    kind = header.get("type")
    if header.get("error") is not None:
        return _handle_error(tracker, msg)
    if kind == NLMSG_DONE:
        return _handle_done(netlink, tracker, header)
    if kind not in (RTM_NEWLINK, RTM_DELLINK):
        _log_skipped(f"unexpected message type {kind}")
        return []
    if msg["family"] != AF_UNSPEC:
        return []  # AF_BRIDGE port notifications: not about the interface itself
    link = _decode_link(msg, kind)
    if link is None:
        return []
    events = tracker.link(link)
    for event in events:
        log.debug("%s: %s", event.ifname, event.state or "deleted", extra={"NETDEV": event.ifname})
    return events


def _handle_error(tracker: _Tracker, msg: Any) -> list[Event]:
    header = msg["header"]
    error = header["error"]
    answers_dump = tracker.dump is not None and header.get("sequence_number") == tracker.dump_seq
    if header.get("type") == NLMSG_ERROR and answers_dump:
        # The kernel refused our dump: without it there is no state to report.
        raise OSError(getattr(error, "code", errno.EIO), f"rtnetlink link dump failed: {error}")
    _log_skipped(f"undecodable message ({error})")
    return []


def _handle_done(netlink: _Netlink, tracker: _Tracker, header: dict[str, Any]) -> list[Event]:
    interrupted = bool(header.get("flags", 0) & NLM_F_DUMP_INTR)
    seq = header.get("sequence_number", -1)
    snapshot = tracker.dump_done(seq, interrupted)
    if snapshot is not None:
        log.info("link dump: %d interfaces", len(snapshot.links), extra={"EVENT": "link-snapshot"})
        return [snapshot]
    if tracker.dump is not None and seq == tracker.dump_seq:
        reason = "it was interrupted by changes" if interrupted else "messages were lost meanwhile"
        log.info("link dump incomplete (%s); dumping again", reason, extra={"EVENT": "link-redump"})
        netlink.request_dump(tracker.start_dump())
    return []


def _decode_link(msg: Any, kind: int) -> _Link | None:
    ifindex = msg["index"]
    ifname = msg.get_attr("IFLA_IFNAME")
    if ifindex <= 0:
        _log_skipped(f"link message with ifindex {ifindex}", ifname)
        return None
    if kind == RTM_DELLINK:
        return _Link(ifindex, ifname, None)
    if not ifname:
        _log_skipped(f"RTM_NEWLINK for ifindex {ifindex} without IFLA_IFNAME")
        return None
    flags = msg["flags"]
    return _Link(ifindex, ifname, LinkState(ifindex, bool(flags & IFF_UP), bool(flags & IFF_LOWER_UP)))


def _log_skipped(reason: str, ifname: str | None = None) -> None:
    extra = {"EVENT": "link-malformed"} | ({"NETDEV": ifname} if ifname else {})
    log.warning("rtnetlink: skipped a message: %s", reason, extra=extra)

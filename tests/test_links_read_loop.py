"""The link source's read loop and link table on crafted datagrams (no socket), for what the
kernel will not send on demand: malformed messages, a refused dump, an interrupted one."""

from __future__ import annotations

import errno
import logging
import struct

import pytest

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from daemon.sources.links import _drain, _Link, _LinkTable, _Tracker

# netlink / rtnetlink numbers for crafting datagrams
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR = 16, 17, 20
NLM_F_MULTI, NLM_F_DUMP_INTR = 0x2, 0x10
IFF_UP, IFF_LOWER_UP = 0x1, 0x10000
AF_BRIDGE = 7


IFLA_IFNAME, IFLA_MTU = 3, 4


def attribute(kind: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), kind) + value + b"\0" * (-len(value) % 4)


def newlink(
    index: int, name: str | None, flags: int = 0, *, kind: int = RTM_NEWLINK, seq: int = 0, msg_flags: int = 0,
    family: int = 0,
) -> bytes:
    """A link message as the kernel frames it: nlmsghdr, ifinfomsg, IFLA_MTU, then IFLA_IFNAME."""
    attributes = attribute(IFLA_MTU, struct.pack("=I", 1500))
    if name is not None:
        attributes += attribute(IFLA_IFNAME, name.encode() + b"\0")
    body = struct.pack("=BxHiII", family, 1, index, flags, 0) + attributes
    return struct.pack("=IHHII", 16 + len(body), kind, msg_flags, seq, 0) + body


def done(seq: int, msg_flags: int = NLM_F_MULTI) -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_DONE, msg_flags, seq, 0, 0)


def error(seq: int, code: int) -> bytes:
    """NLMSG_ERROR for a link dump request: the error code, then the request it answers."""
    request = struct.pack("=IHHIIBxHiII", 32, 18, 0x301, seq, 0, 0, 0, 0, 0, 0)
    return struct.pack("=IHHIIi", 20 + len(request), NLMSG_ERROR, 0, seq, 0, -code) + request


class FakeNetlink:
    """Stands in for ``_Netlink``: hands out queued datagrams (or raises queued errors)."""

    def __init__(self) -> None:
        self.queue: list[tuple[bytes, int] | OSError] = []
        self.dumps: list[int] = []

    def put(self, data: bytes, sender: int = 0) -> None:
        self.queue.append((data, sender))

    def receive(self) -> tuple[bytes, int] | None:
        if not self.queue:
            return None
        item = self.queue.pop(0)
        if isinstance(item, OSError):
            raise item
        return item

    def request_dump(self, seq: int) -> None:
        self.dumps.append(seq)


def started(netlink: FakeNetlink) -> _Tracker:
    tracker = _Tracker()
    netlink.request_dump(tracker.start_dump())
    return tracker


def drain(netlink: FakeNetlink, tracker: _Tracker) -> list[Event]:
    return _drain(netlink, tracker)  # type: ignore[arg-type]


def test_malformed_messages_cost_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(newlink(1, "lo", IFF_UP | IFF_LOWER_UP, seq=1, msg_flags=NLM_F_MULTI) + done(1))
    assert drain(netlink, tracker) == [LinkSnapshot({"lo": LinkState(1, True, True)})]

    good = newlink(7, "dpa", IFF_UP)
    bad = [
        newlink(7, "dpa", IFF_UP)[:28],  # cut inside the ifinfomsg
        newlink(8, None, IFF_UP),  # no IFLA_IFNAME
        newlink(0, "dpz", IFF_UP),  # no ifindex
        struct.pack("=IHHII", 16, RTM_NEWADDR, 0, 0, 0),  # not a link message
        error(99, errno.EINVAL),  # an error nobody asked for
        newlink(9, "dpx", IFF_UP)[:-3] + b"\xff\xff\xff",  # last attribute's length runs off the end
    ]
    caplog.set_level(logging.WARNING, logger="devplugd.links")
    for datagram in bad:
        netlink.put(datagram)
    netlink.put(good, sender=4242)  # not from the kernel
    netlink.put(good)
    assert drain(netlink, tracker) == [LinkChanged("dpa", LinkState(7, True, False))]
    skipped = [record for record in caplog.records if record.name == "devplugd.links"]
    assert len(skipped) == len(bad) + 1, [record.getMessage() for record in skipped]
    assert all("skipped" in record.getMessage() for record in skipped)


def test_overflow_during_a_dump_dumps_again_after_it() -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(newlink(1, "lo", 0, seq=1, msg_flags=NLM_F_MULTI))
    netlink.queue.append(OSError(errno.ENOBUFS, "No buffer space available"))
    netlink.put(newlink(2, "dpa", IFF_UP, seq=1, msg_flags=NLM_F_MULTI) + done(1))
    assert drain(netlink, tracker) == []
    assert netlink.dumps == [1, 2]  # the second one only once the first had ended

    netlink.put(newlink(2, "dpa", IFF_UP, seq=0))  # a notification in the middle of the dump
    netlink.put(newlink(1, "lo", 0, seq=2, msg_flags=NLM_F_MULTI))
    netlink.put(newlink(2, "dpa", IFF_UP | IFF_LOWER_UP, seq=2, msg_flags=NLM_F_MULTI) + done(2))
    assert drain(netlink, tracker) == [
        LinkSnapshot({"lo": LinkState(1, False, False), "dpa": LinkState(2, True, True)})
    ]


def test_overflow_after_the_dump_dumps_at_once() -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(done(1))
    netlink.queue.append(OSError(errno.ENOBUFS, "No buffer space available"))
    assert drain(netlink, tracker) == [LinkSnapshot({})]
    assert netlink.dumps == [1, 2]


def test_interrupted_dump_is_done_again() -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(newlink(1, "lo", 0, seq=1, msg_flags=NLM_F_MULTI) + done(1, NLM_F_MULTI | NLM_F_DUMP_INTR))
    assert drain(netlink, tracker) == []
    assert netlink.dumps == [1, 2]


def test_refused_dump_is_an_error() -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(error(1, errno.EPERM))
    with pytest.raises(OSError, match="link dump failed"):
        drain(netlink, tracker)


def test_bridge_family_messages_are_ignored() -> None:
    netlink = FakeNetlink()
    tracker = started(netlink)
    netlink.put(newlink(2, "dpa", IFF_UP, seq=1, msg_flags=NLM_F_MULTI) + done(1))
    drain(netlink, tracker)
    netlink.put(newlink(2, "dpa", IFF_UP, kind=RTM_DELLINK, family=AF_BRIDGE))
    assert drain(netlink, tracker) == []


def test_table_sends_only_changes() -> None:
    table = _LinkTable()
    up = LinkState(3, True, True)
    assert table.apply(_Link(3, "dpa", up)) == [LinkChanged("dpa", up)]
    assert table.apply(_Link(3, "dpa", up)) == []
    assert table.apply(_Link(3, "dpb", up)) == [LinkChanged("dpa", None), LinkChanged("dpb", up)]
    assert table.apply(_Link(9, None, None)) == []  # never heard of it
    # The name now on another device (we missed the deletion): its new state, and the old
    # ifindex forgotten so a late RTM_DELLINK for it does not delete the new device.
    other = LinkState(4, True, False)
    assert table.apply(_Link(4, "dpb", other)) == [LinkChanged("dpb", other)]
    assert table.apply(_Link(3, "dpb", None)) == []
    assert table.apply(_Link(4, "dpb", None)) == [LinkChanged("dpb", None)]
    assert table.snapshot() == LinkSnapshot({})

"""rtnetlink on the wire, for the link source: the socket, the dump request, and the framing of
link messages down to the four fields we use (ifindex, IFF_UP, IFF_LOWER_UP, IFLA_IFNAME).

Why not pyroute2, the library for rtnetlink: its package import loads some 190 modules (IPRoute,
NDB, IPDB, ...) for 10 MiB of resident memory, 15 % of the whole daemon with 4096 VFs, and its
``IPRSocket`` cannot be imported without it; we used its socket and its marshal only to frame
``nlmsghdr`` and ``ifinfomsg``, fixed kernel ABI (``linux/netlink.h``, ``linux/rtnetlink.h``),
and already decoded the attribute chain ourselves. The tests decode real kernel dumps with both
this module and pyroute2's full decoder (a test dependency) and compare them.

Every message of a datagram is framed; one that does not frame or decode becomes a ``Malformed``
naming the reason, so the caller logs it and goes on with the next.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_ROUTE = 0
RTMGRP_LINK = 1
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_DUMP_INTR, NLM_F_DUMP = 0x1, 0x2, 0x10, 0x300
IFF_UP, IFF_LOWER_UP = 0x1, 0x10000
IFLA_IFNAME = 3
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
AF_UNSPEC = 0

NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence number, port
IFINFOMSG = struct.Struct("=BxHiII")  # family, (pad), device type, ifindex, flags, change mask
NLMSGERR = struct.Struct("=i")  # -errno, followed by the request it answers
RTATTR = struct.Struct("=HH")  # length, type


@dataclass(frozen=True, slots=True)
class Message:
    """One framed netlink message: the header fields, and what a link message carries."""

    type: int
    flags: int
    sequence: int
    family: int = AF_UNSPEC
    ifindex: int = 0
    ifflags: int = 0
    ifname: str | None = None
    error: int = 0  # NLMSG_ERROR: the errno (positive); 0 for an acknowledgement


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message that could not be framed or decoded (the rest of its datagram is dropped when
    its length cannot be trusted)."""

    reason: str


def open_socket() -> socket.socket:
    """A non-blocking rtnetlink socket on the link multicast group."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                         NETLINK_ROUTE)
    try:
        sock.bind((0, RTMGRP_LINK))
    except BaseException:
        sock.close()
        raise
    return sock


def dump_request(sequence: int) -> bytes:
    """``RTM_GETLINK`` with ``NLM_F_DUMP``: every interface of the network namespace."""
    body = IFINFOMSG.pack(AF_UNSPEC, 0, 0, 0, 0)
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, sequence, 0) + body


def parse_datagram(data: bytes) -> Iterator[Message | Malformed]:
    """The messages of one datagram, in order."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < NLMSGHDR.size:
            yield Malformed(f"{len(data) - offset} bytes at the end of a datagram do not frame a message")
            return
        length, kind, flags, sequence, _port = NLMSGHDR.unpack_from(data, offset)
        if length < NLMSGHDR.size or offset + length > len(data):
            yield Malformed(f"a message of {length} bytes does not fit the {len(data) - offset} bytes left "
                            f"of its {len(data)}-byte datagram; skipped the rest of it")
            return
        yield _decode(data, offset, length, kind, flags, sequence)
        offset += (length + 3) & ~3


def _decode(data: bytes, offset: int, length: int, kind: int, flags: int, sequence: int) -> Message | Malformed:
    body = offset + NLMSGHDR.size
    end = offset + length
    if kind == NLMSG_ERROR:
        if end - body < NLMSGERR.size:
            return Malformed(f"NLMSG_ERROR of {length} bytes has no error code")
        (code,) = NLMSGERR.unpack_from(data, body)
        return Message(kind, flags, sequence, error=-code)
    if kind not in (RTM_NEWLINK, RTM_DELLINK):
        return Message(kind, flags, sequence)
    if end - body < IFINFOMSG.size:
        return Malformed(f"link message of {length} bytes is cut inside its ifinfomsg")
    family, _type, ifindex, ifflags, _change = IFINFOMSG.unpack_from(data, body)
    ifname = None
    attribute = body + IFINFOMSG.size
    while attribute + RTATTR.size <= end:
        size, attribute_type = RTATTR.unpack_from(data, attribute)
        if size < RTATTR.size or attribute + size > end:
            return Malformed(f"link message for ifindex {ifindex}: an attribute of {size} bytes runs off its end")
        if attribute_type & NLA_TYPE_MASK == IFLA_IFNAME:
            raw = data[attribute + RTATTR.size : attribute + size].split(b"\0", 1)[0]
            try:
                ifname = raw.decode()
            except UnicodeDecodeError:
                return Malformed(f"link message for ifindex {ifindex}: IFLA_IFNAME is not text")
            break
        attribute += (size + 3) & ~3
    return Message(kind, flags, sequence, family=family, ifindex=ifindex, ifflags=ifflags, ifname=ifname)

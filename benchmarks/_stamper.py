"""Listens to the uevent netlink group and rtnetlink's link group of the namespace it runs in and
prints one line per record, stamped with ``time.monotonic()`` as soon as ``select`` returns:

    <stamp> link <ifindex> <admin_up 0|1> <lower_up 0|1>      (RTM_NEWLINK)
    <stamp> dellink <ifindex>                                  (RTM_DELLINK)
    <stamp> uevent <ACTION> <SUBSYSTEM> <DEVNAME or ->

Prints ``ready`` once both sockets listen; exits at EOF on stdin. Used by
``benchmarks._events.KernelEventStamper`` (run under ``ip netns exec``).
"""

from __future__ import annotations

import select
import socket
import struct
import sys
import time

NETLINK_KOBJECT_UEVENT = 15
RTMGRP_LINK = 0x1
RTM_NEWLINK, RTM_DELLINK = 16, 17
IFF_UP, IFF_LOWER_UP = 0x1, 0x10000
NLMSGHDR = struct.Struct("=IHHII")
IFINFOMSG = struct.Struct("=BxHiII")


def main() -> int:
    uevents = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT)
    links = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
    uevents.bind((0, 1))
    links.bind((0, RTMGRP_LINK))
    for sock in (uevents, links):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([uevents, links, stdin], [], [])
        stamp = time.monotonic()
        lines = []
        if uevents in readable:
            data = uevents.recv(65536)
            properties = dict(f.decode(errors="replace").split("=", 1) for f in data.split(b"\0")[1:] if b"=" in f)
            lines.append(f"{stamp!r} uevent {properties.get('ACTION', '-')} {properties.get('SUBSYSTEM', '-')} "
                         f"{properties.get('DEVNAME', '-') or '-'}\n")
        if links in readable:
            data = links.recv(65536)
            offset = 0
            while offset + NLMSGHDR.size <= len(data):
                length, kind, _flags, _seq, _pid = NLMSGHDR.unpack_from(data, offset)
                if length < NLMSGHDR.size:
                    break
                if kind == RTM_NEWLINK:
                    family, _type, index, flags, _change = IFINFOMSG.unpack_from(data, offset + NLMSGHDR.size)
                    if family == 0:
                        lines.append(f"{stamp!r} link {index} {int(bool(flags & IFF_UP))} "
                                     f"{int(bool(flags & IFF_LOWER_UP))}\n")
                elif kind == RTM_DELLINK:
                    family, _type, index, _flags, _change = IFINFOMSG.unpack_from(data, offset + NLMSGHDR.size)
                    if family == 0:
                        lines.append(f"{stamp!r} dellink {index}\n")
                offset += (length + 3) & ~3
        if lines:
            out.write("".join(lines))
            out.flush()
        if stdin in readable and not sys.stdin.buffer.read1(4096):
            return 0


if __name__ == "__main__":
    sys.exit(main())

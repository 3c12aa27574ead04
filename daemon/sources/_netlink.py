"""What the netlink sources (uevents, rtnetlink) share: a receive buffer big enough for bursts."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("devplugd.sources")

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def raise_receive_buffer(sock: socket.socket, size: int) -> int:
    """Ask for a ``size``-byte receive buffer: past ``net.core.rmem_max`` with ``CAP_NET_ADMIN``
    (``SO_RCVBUFFORCE``), else ``SO_RCVBUF``, which the kernel silently caps at ``rmem_max``.
    Returns what the kernel granted (it doubles the figure for its bookkeeping)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    granted: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    log.debug("receive buffer: asked %d, kernel granted %d", size, granted)
    return granted

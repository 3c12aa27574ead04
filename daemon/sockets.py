"""Unix-socket plumbing shared by every gRPC server of the daemon and the uevent seam.

* ``SUN_PATH_MAX``: the longest path a unix socket can be bound at (the uevent seam's datagram
  socket); ``GRPC_PATH_MAX``: the longest grpc's unix listener binds, the one limit of every
  socket devplugd serves gRPC on (device-plugin, DRA, host API), and ``socket_path_problem``;
* ``start_unix_server``: start a grpc.aio server listening on one unix socket, or raise;
* ``refuse``: end a call with a status and a message (what every servicer's refusals go through);
* ``remove_socket_file`` / ``remove_stale_sockets``: remove sockets we (or an earlier run of us)
  left behind, and never anything that is not a socket.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc

SUN_PATH_MAX = 107  # sun_path is 108 bytes, the terminating NUL included
# grpcio (core 1.85) refuses a unix path longer than this: a 105-character path binds, 106 fails
# ("Path name should not have more than 107 characters": it counts its own terminator and more)
GRPC_PATH_MAX = 105
SOCKET_PREFIX = "devplugd-"

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def socket_path_problem(path: Path | str) -> str | None:
    """Why gRPC cannot serve on ``path`` (longer than ``GRPC_PATH_MAX`` bytes), or ``None``."""
    length = len(os.fsencode(path))
    if length > GRPC_PATH_MAX:
        return f"{path} is {length} bytes long, and gRPC serves unix socket paths of at most {GRPC_PATH_MAX}"
    return None


async def start_unix_server(server: grpc.aio.Server, socket_path: str) -> grpc.aio.Server:
    """Start ``server`` (its servicers added) listening on the unix socket ``socket_path``
    (an asyncio coroutine: call it through ``aio_as_trio``). Raises OSError when it cannot listen."""
    if problem := socket_path_problem(socket_path):
        raise OSError(problem)
    try:
        port = server.add_insecure_port(f"unix://{socket_path}")
    except RuntimeError as error:  # grpc's "Failed to bind to address"
        raise OSError(f"cannot listen on {socket_path}: {error}") from error
    if port == 0:
        raise OSError(f"cannot listen on {socket_path}")
    await server.start()
    return server


async def refuse(
    context: grpc.aio.ServicerContext[_Request, _Response], code: grpc.StatusCode, message: str
) -> NoReturn:
    """End the call with ``code`` and ``message`` (``abort`` raises; this says so to type checkers)."""
    await context.abort(code, message)
    raise AssertionError("abort raises")


def remove_socket_file(path: Path) -> None:
    """Remove ``path`` if it is a socket (a stale one of ours); leave anything else alone."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except OSError:
        pass


def remove_stale_sockets(directory: Path) -> list[str]:
    """Remove the sockets an earlier devplugd left in ``directory`` (``devplugd-*`` sockets only);
    return their names."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        path = directory / name
        try:
            if name.startswith(SOCKET_PREFIX) and stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
                removed.append(name)
        except OSError:
            continue
    return removed

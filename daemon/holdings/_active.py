"""One writer of the state directory at a time: the active instance.

Two devplugd can run on one node at once: the old and the new pod of a DaemonSet rolling update
(``maxSurge: 1``) mount the same state directory (the lease and claim books), control socket,
CDI and device-info directories. Only one of them may grant devices and write the books, or a
device could be given twice and a book written over with an older copy of itself. So:

* ``StateLock``: an exclusive ``flock`` on ``<state-dir>/active.lock``, held by the active
  instance for as long as it is active. The kernel drops it when its holder dies, however it
  dies (SIGKILL, OOM), so a new instance never waits on a dead one. The file says who holds it
  (pid, pod UID, since when) for the log of whoever waits.
* ``Handover``: the active instance's ``<state-dir>/handover.sock``, a plain unix stream socket
  (one JSON line each way). A new pod of a rolling update asks the active one to hand over; that
  one stops granting (``WriteGate``), lets the calls in flight finish, stops everything that
  writes (its device-plugin endpoints, the control socket, the slices, the files), releases the
  lock and answers. The new one waits for the lock itself, not for the answer: the lock is the
  only truth, the socket only a nudge.
* ``WriteGate``: every call that may write a book or grant a device (a DRA prepare or unprepare,
  a host lease granted or released, a lost book cleared) goes through it. Once a handover closes
  it, later calls are refused with a retryable reason, and the handover waits for the calls
  inside to end.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("devplugd.holdings")

LOCK_NAME = "active.lock"
HANDOVER_NAME = "handover.sock"
REQUEST_READ_TIMEOUT = 5.0
LOCKLESS_POLL = 0.5  # a lockless old instance is looked for this often (it tells nobody when it stops)
MAX_LINE = 4096


class WritesClosed(Exception):
    """This instance has handed the state over (or is handing it over): ask the active one."""


class WriteGate:
    """Every call that may write a book or grant a device enters the gate (``inside``); ``close``
    refuses the later ones and waits for those inside to end. Calls on either side of trio-asyncio
    use it: it only counts, on the one thread both run on."""

    def __init__(self) -> None:
        self.closed: str | None = None  # why later calls are refused
        self._inside = 0
        self._empty = trio.Event()
        self._empty.set()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Around one call that may write; raises WritesClosed once the gate is closed."""
        if self.closed is not None:
            raise WritesClosed(self.closed)
        self._inside += 1
        if self._inside == 1:
            self._empty = trio.Event()
        try:
            yield
        finally:
            self._inside -= 1
            if self._inside == 0:
                self._empty.set()

    async def close(self, reason: str, timeout: float) -> bool:
        """Refuse later calls with ``reason``; wait (at most ``timeout``) for the calls inside to
        end. Whether they all did."""
        self.closed = reason
        with trio.move_on_after(timeout):
            await self._empty.wait()
        return self._inside == 0


class StateLock:
    """The exclusive flock on ``<state_dir>/active.lock``, taken by the active instance."""

    def __init__(self, state_dir: Path, who: str) -> None:
        self.path = state_dir / LOCK_NAME
        self.who = who
        self._descriptor: int | None = None
        self.held = False

    def _open(self) -> int:
        if self._descriptor is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._descriptor

    def try_take(self) -> bool:
        """Take the lock if nobody holds it; whether we hold it now. A state directory that cannot
        be locked (a filesystem without flock) is logged and taken as ours, as before there was
        a lock: nothing then keeps a second instance off it."""
        try:
            descriptor = self._open()
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            log.warning("cannot lock %s (%s): nothing keeps a second devplugd off %s", self.path,
                        error.strerror or error, self.path.parent)
            self.held = True
            return True
        with contextlib.suppress(OSError):
            self._say_who()
        self.held = True
        return True

    async def take(self) -> None:
        """Wait until the lock is ours (in a worker thread, given up if cancelled)."""
        descriptor = self._open()
        await trio.to_thread.run_sync(fcntl.flock, descriptor, fcntl.LOCK_EX, abandon_on_cancel=True)
        with contextlib.suppress(OSError):
            self._say_who()
        self.held = True

    def _say_who(self) -> None:
        assert self._descriptor is not None
        self.held = True
        os.ftruncate(self._descriptor, 0)
        os.pwrite(self._descriptor, f"{self.who}, since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(), 0)

    def holder(self) -> str:
        """Who holds it, as the holder wrote it (for a log line)."""
        try:
            return self.path.read_text(errors="replace").strip() or "an instance that has not said who it is"
        except OSError:
            return "unknown"

    def release(self) -> None:
        """Let the next instance have it (closing the file drops the lock)."""
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
        self.held = False


def instance_name(pod_uid: str | None) -> str:
    return f"devplugd pid {os.getpid()}" + (f" in pod {pod_uid}" if pod_uid else "")


_HOLDER = re.compile(r"devplugd pid (?P<pid>\d+)(?: in pod (?P<pod>[^,\s]+))?, since ")


def not_active_here(state_dir: Path, pod_uid: str | None) -> str | None:
    """Why the devplugd of pod ``pod_uid`` (``None``: of no pod) is not the active instance of
    ``state_dir``, or ``None``: it is. A pod's readiness (``devplugd active``): the new pod of a
    rolling update is Ready once it has taken the state over, so the old one is stopped only
    then. Read from what the holder wrote in the lock file, and whether that process still runs
    here (a probe runs in the daemon's container, in its PID namespace)."""
    path = state_dir / LOCK_NAME
    try:
        said = path.read_text(errors="replace")
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    holder = _HOLDER.match(said)
    if holder is None:
        return f"{path} names no holder ({said.strip()[:80]!r})"
    if holder["pod"] != pod_uid:
        return f"{said.strip()} is active, not this pod's devplugd"
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return f"{said.strip()}: that process is gone"
    except PermissionError:
        pass  # it runs, as another user
    return None


class Handover:
    """The active instance's end of ``<state_dir>/handover.sock``: ``serve`` accepts the first
    request (``requested`` is set, ``requester`` says who) and answers it once ``done``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / HANDOVER_NAME
        self.requested = trio.Event()
        self.requester = ""
        self.done = trio.Event()
        self.answer: dict[str, Any] = {}

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until a handover is done (or cancelled); the socket file goes with it. A
        directory that cannot hold a socket (a filesystem without them) is logged: a new pod then
        waits for the lock until this instance stops, which is safe, only slower."""
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            try:
                with contextlib.suppress(FileNotFoundError):  # a dead instance's: we hold the lock
                    if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                        self.path.unlink()
                await listener.bind(os.fspath(self.path))
                os.chmod(self.path, 0o600)
                identity = os.lstat(self.path).st_ino
                listener.listen(4)
            except OSError as error:
                log.error("cannot listen for handovers on %s: %s; a new pod of a rolling update will wait until "
                          "this instance stops", self.path, error.strerror or error)
                task_status.started()
                return
            task_status.started()
            accepting = trio.CancelScope()
            try:
                async with trio.open_nursery() as nursery:  # ends once every answer is sent
                    nursery.start_soon(self._accept, trio.SocketListener(listener), nursery, accepting)
                    await self.done.wait()
                    accepting.cancel()
            finally:
                with contextlib.suppress(OSError):
                    if os.lstat(self.path).st_ino == identity:
                        self.path.unlink()

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._answer, stream)

    async def _answer(self, stream: trio.SocketStream) -> None:
        async with stream:
            request: dict[str, Any] = {}
            with trio.move_on_after(REQUEST_READ_TIMEOUT):
                request = _parse(await _read_line(stream))
            if not request.get("handover"):
                return
            if self.requested.is_set():
                await _send(stream, {"handed_over": False, "error": f"already handing over to {self.requester}"})
                return
            self.requester = str(request.get("who") or "an instance that did not say who it is")
            self.requested.set()
            await self.done.wait()
            await _send(stream, self.answer)


async def request_handover(state_dir: Path, who: str) -> dict[str, Any] | None:
    """Ask the active instance to hand over, and wait for its answer; None when nobody listens
    (no active instance, or one from before handovers)."""
    try:
        stream = await trio.open_unix_socket(os.fspath(state_dir / HANDOVER_NAME))
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise
    async with stream:
        await _send(stream, {"handover": True, "who": who})
        return _parse(await _read_line(stream))


def serves(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (a stream socket)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(os.fspath(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


async def _read_line(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\n" not in data and len(data) < MAX_LINE:
        chunk = await stream.receive_some(MAX_LINE)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\n")[0]


def _parse(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line.decode("utf-8", errors="replace"))
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


async def _send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError), trio.move_on_after(2.0):
        await stream.send_all(json.dumps(message).encode() + b"\n")


async def become_active(lock: StateLock, control_socket: Path, ask: bool) -> bool:
    """Take ``lock``, the state directory's: at once when nobody holds it; else (a rolling
    update, or a second devplugd started by hand) wait for it, having asked the active instance
    to hand over when ``ask`` (a pod UID: the new pod of a rolling update); without ``ask``, wait
    until the holder stops. Then, should a devplugd that takes no lock (one from before rolling
    updates: the old pod of the first such update) still answer on ``control_socket``, wait until
    it stops too. False when SIGTERM or SIGINT came first."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope)
            if not lock.try_take():
                holder = lock.holder()
                if ask:
                    log.info("%s is active on %s: asking it to hand over", holder, lock.path.parent)
                    nursery.start_soon(_ask_for_handover, lock.path.parent, lock.who)
                else:
                    log.warning("%s is active on %s: waiting until it stops (no pod UID: not a rolling "
                                "update, so it is not asked to hand over)", holder, lock.path.parent)
                await lock.take()
                log.info("took the state directory %s over from %s", lock.path.parent, holder)
            if serves(control_socket):
                log.warning("a devplugd that takes no lock on %s answers on %s (one from before rolling "
                            "updates): waiting until it stops", lock.path.parent, control_socket)
                while serves(control_socket):
                    await trio.sleep(LOCKLESS_POLL)
            nursery.cancel_scope.cancel()
    return lock.held


async def _stop_on_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        if signum != signal.SIGHUP:  # nothing to reload yet
            log.info("received %s while waiting to become active", signal.Signals(signum).name)
            scope.cancel()
            return


async def _ask_for_handover(state_dir: Path, who: str) -> None:
    try:
        answer = await request_handover(state_dir, who)
    except OSError as error:
        log.warning("cannot ask the active instance to hand over (%s): waiting for it to stop", error)
        return
    if answer is None:
        log.warning("the active instance does not listen on %s: waiting for it to stop", state_dir / HANDOVER_NAME)
    elif not answer.get("handed_over"):
        log.warning("the active instance did not hand over (%s): waiting for it to stop", answer.get("error"))
    else:
        log.info("the active instance handed over: %s", answer.get("message", ""))

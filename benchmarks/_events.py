"""Shared pieces of the event benchmarks: the uevent seam, network namespaces, a raw rtnetlink
socket, and waiting for one ListAndWatch message by its content.

Nothing here asserts a timing. The clock everywhere is ``time.monotonic()`` of this process; the
kubelet stand-in stamps each ListAndWatch message with it on arrival (``received_at``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from benchmarks._common import Daemon, DaemonFailure, percentile, wait_kubelet
from tests.kubelet import FakeKubelet

Message = dict[str, tuple[str, tuple[int, ...]]]


# -- the unix uevent seam ---------------------------------------------------------------------
def uevent_payload(action: str, devpath: str, subsystem: str, **properties: str) -> bytes:
    """One uevent in the kernel's wire format: ``ACTION@DEVPATH\\0KEY=VALUE\\0...``."""
    fields = {"ACTION": action, "DEVPATH": devpath, "SUBSYSTEM": subsystem, **properties}
    return f"{action}@{devpath}\0".encode() + b"".join(f"{k}={v}\0".encode() for k, v in fields.items())


class Seam:
    """Sends uevents to the daemon's ``--uevent-source unix:PATH`` socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def argument(self) -> str:
        return f"unix:{self.path}"

    def wait_ready(self, daemon: Daemon, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.path.exists():
            daemon.check_alive()
            if time.monotonic() > deadline:
                raise DaemonFailure(f"the daemon never bound its uevent socket {self.path}", daemon.log)
            time.sleep(0.01)

    def send_payload(self, payload: bytes) -> float:
        """Send one datagram; returns the monotonic time just before ``sendto``."""
        started = time.monotonic()
        self.socket.sendto(payload, str(self.path))
        return started

    def send(self, action: str, devpath: str, subsystem: str, **properties: str) -> float:
        return self.send_payload(uevent_payload(action, devpath, subsystem, **properties))

    def close(self) -> None:
        self.socket.close()


# -- network namespaces -----------------------------------------------------------------------
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def ip(*arguments: str) -> None:
    """``ip ARGS`` (iproute2), raising with its stderr on failure."""
    result = subprocess.run(["ip", *arguments], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(arguments)}: {result.stderr.strip()}")


class Netns:
    """A fresh named network namespace (``ip netns add``), deleted by ``delete`` (idempotent).

    Everything created inside it (veths, macvtaps) goes with it. The machine's own interfaces
    are never touched: every ``ip`` command here runs with ``-n NAME``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.created = False

    def create(self) -> Netns:
        ip("netns", "add", self.name)
        self.created = True
        return self

    def ip(self, *arguments: str) -> None:
        ip("-n", self.name, *arguments)

    def delete(self) -> None:
        if self.created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
            self.created = False

    def exec_prefix(self) -> list[str]:
        """``ip netns exec NAME``: iproute2 enters the namespace and execs the command (same pid)."""
        return ["ip", "netns", "exec", self.name]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This thread inside the namespace for the block (sockets made there stay there)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                number = ctypes.get_errno()
                raise OSError(number, f"setns into {self.name}: {os.strerror(number)}")
            try:
                yield
            finally:
                if _libc.setns(own, CLONE_NEWNET) != 0:
                    number = ctypes.get_errno()
                    raise OSError(number, f"setns back to our own namespace: {os.strerror(number)}")
        finally:
            os.close(own)
            os.close(target)


def unique_netns_name(tag: str) -> str:
    return f"dpb{tag}{os.getpid()}"


# -- a raw rtnetlink socket -------------------------------------------------------------------
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
IFF_UP = 0x1
IFLA_IFNAME, IFLA_LINK, IFLA_LINKINFO = 3, 5, 18
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
IFLA_MACVLAN_MODE, MACVLAN_MODE_BRIDGE = 1, 4
_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")


def _nla(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _ifinfomsg(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return _IFINFOMSG.pack(0, 0, index, flags, change)


class Rtnl:
    """A NETLINK_ROUTE socket opened inside a namespace, for link changes with a low, steady cost:
    one ``send`` of a hand-built request, then reading the kernel's ack (no process started, no
    library between us and the kernel). ``request`` returns the monotonic time just before the
    ``send`` and just after the ack arrived (the kernel acks once the change is done)."""

    def __init__(self, netns: Netns) -> None:
        with netns.entered():
            self.socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self.socket.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.socket.close()

    def request(self, msg_type: int, flags: int, body: bytes) -> tuple[float, float, list[bytes]]:
        self.seq += 1
        seq = self.seq
        message = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags | NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body
        replies: list[bytes] = []
        started = time.monotonic()
        self.socket.send(message)
        while True:
            data = self.socket.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _flags, reply_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    break
                if reply_seq == seq:
                    if kind == NLMSG_ERROR:
                        (error,) = struct.unpack_from("=i", data, offset + _NLMSGHDR.size)
                        if error:
                            raise OSError(-error, f"rtnetlink request type {msg_type}: {os.strerror(-error)}")
                        return started, time.monotonic(), replies
                    replies.append(data[offset : offset + length])
                offset += (length + 3) & ~3

    def set_up(self, index: int, up: bool) -> tuple[float, float]:
        started, acked, _ = self.request(RTM_NEWLINK, 0, _ifinfomsg(index, IFF_UP if up else 0, IFF_UP))
        return started, acked

    def add_macvtap(self, name: str, lower_index: int) -> tuple[float, float]:
        linkinfo = _nla(IFLA_INFO_KIND, b"macvtap\0") + _nla(
            IFLA_INFO_DATA, _nla(IFLA_MACVLAN_MODE, struct.pack("=I", MACVLAN_MODE_BRIDGE)))
        body = (_ifinfomsg() + _nla(IFLA_IFNAME, name.encode() + b"\0")
                + _nla(IFLA_LINK, struct.pack("=I", lower_index)) + _nla(IFLA_LINKINFO, linkinfo))
        started, acked, _ = self.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)
        return started, acked

    def delete(self, name: str) -> tuple[float, float]:
        started, acked, _ = self.request(RTM_DELLINK, 0, _ifinfomsg() + _nla(IFLA_IFNAME, name.encode() + b"\0"))
        return started, acked

    def index_of(self, name: str) -> int:
        _, _, replies = self.request(RTM_GETLINK, 0, _ifinfomsg() + _nla(IFLA_IFNAME, name.encode() + b"\0"))
        for reply in replies:
            _length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(reply, 0)
            if kind == RTM_NEWLINK:
                return _IFINFOMSG.unpack_from(reply, _NLMSGHDR.size)[2]
        raise OSError(errno.ENODEV, f"no link named {name}")


# -- waiting for one message ------------------------------------------------------------------
def wait_message(kubelet: FakeKubelet, daemon: Daemon, resource: str, start: int, predicate: Callable[[Message], bool],
                 timeout: float, what: str) -> int:
    """The index of the first ListAndWatch message of ``resource`` at or after ``start`` for which
    ``predicate`` holds, waiting for it (with the daemon watched for crashes)."""
    found: list[int] = []

    def check(k: FakeKubelet) -> bool:
        messages = k.state(resource).messages
        for index in range(start, len(messages)):
            if predicate(messages[index]):
                found.append(index)
                return True
        return False

    wait_kubelet(kubelet, daemon, check, timeout, what)
    return found[-1]


# -- statistics -------------------------------------------------------------------------------
def latency_row(label: str, values: Sequence[float], *, width: int = 34) -> str:
    if not values:
        return f"  {label:<{width}} (no samples)"
    return (f"  {label:<{width}} n={len(values):<4} p50 {percentile(values, 50) * 1000:6.2f} ms   "
            f"p90 {percentile(values, 90) * 1000:6.2f} ms   p99 {percentile(values, 99) * 1000:6.2f} ms   "
            f"max {max(values) * 1000:6.2f} ms   min {min(values) * 1000:6.2f} ms")


# -- timestamps of the kernel's own events ------------------------------------------------------
class KernelEventStamper:
    """Stamps of the kernel's own events, taken by a separate process (``benchmarks._stamper``,
    run with ``ip netns exec`` in the namespace) that listens to what the daemon listens to: the
    uevent netlink group and rtnetlink's link group. It stamps each datagram with
    ``time.monotonic()`` (the same clock in every process) as soon as ``select`` returns, and
    prints one line per record; a thread here only collects the lines, so stamps never wait for
    this process's GIL.

    Records: ``("link", ifindex, admin_up, lower_up)``, ``("dellink", ifindex)`` and
    ``("uevent", action, subsystem, devname)``.
    """

    def __init__(self, netns: Netns | None, python: str) -> None:
        """``netns`` ``None``: this process's own namespace."""
        import threading

        self.records: list[tuple[float, tuple[object, ...]]] = []
        self._lock = threading.Lock()
        prefix = netns.exec_prefix() if netns is not None else []
        self._process = subprocess.Popen([*prefix, python, "-m", "benchmarks._stamper"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         cwd=Path(__file__).resolve().parent.parent)
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the kernel event stamper did not start (said {ready!r})")
        self._thread = threading.Thread(target=self._collect, name="kernel-event-stamps", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            stamp, kind, *rest = line.split()
            record: tuple[object, ...]
            if kind == "link":
                record = ("link", int(rest[0]), rest[1] == "1", rest[2] == "1")
            elif kind == "dellink":
                record = ("dellink", int(rest[0]))
            else:
                record = ("uevent", *(None if value == "-" else value for value in rest))
            with self._lock:
                self.records.append((float(stamp), record))

    def first(self, since: float, key: tuple[object, ...], wait: float = 0.5) -> float | None:
        """The stamp of the first record equal to ``key`` at or after ``since`` (waiting up to
        ``wait`` seconds for it to arrive), or ``None``."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                for stamp, record in self.records:
                    if stamp >= since and record == key:
                        return stamp
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)

    def between(self, start: float, end: float) -> list[tuple[float, tuple[object, ...]]]:
        with self._lock:
            return [r for r in self.records if start <= r[0] <= end]

    def forget_before(self, stamp: float) -> None:
        with self._lock:
            self.records = [r for r in self.records if r[0] >= stamp]

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            with contextlib.suppress(OSError):
                self._process.stdin.close()  # EOF on its stdin: it exits
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


# -- CPU time with nanosecond resolution --------------------------------------------------------
def thread_cpu_ns(pid: int) -> dict[tuple[int, str], int]:
    """On-CPU nanoseconds of each live thread, by (tid, name): ``/proc/<pid>/task/*/schedstat``
    (utime+stime in ``stat`` only has clock-tick resolution)."""
    result = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                ns = int(schedstat.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        result[(int(tid), name)] = ns
    return result


def threads_cpu_ns(pid: int) -> int:
    """Sum of the on-CPU time of the process's live threads, nanoseconds."""
    return sum(thread_cpu_ns(pid).values())


def cpu_by_thread_name(before: dict[tuple[int, str], int], after: dict[tuple[int, str], int],
                       main_tid: int) -> dict[str, int]:
    """Nanoseconds used between two ``thread_cpu_ns`` readings, summed by thread name (the main
    thread is called ``main``); threads that exited in between are missing."""
    used: dict[str, int] = {}
    for key, ns in after.items():
        name = "main" if key[0] == main_tid else key[1]
        used[name] = used.get(name, 0) + ns - before.get(key, 0)
    return used


def revision_line() -> str:
    """The commit the daemon code comes from (and whether the tree has local changes to it)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "daemon"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "daemon code: revision unknown (no git)"
    return f"daemon code: commit {commit}" + (" with local changes under daemon/" if dirty else "")


def clean_up(*steps: Callable[[], object]) -> None:
    """Run every step even when one fails (a daemon not killed, a namespace not deleted would
    outlive the benchmark); then raise the first failure."""
    failures: list[BaseException] = []
    for step in steps:
        try:
            step()
        except BaseException as failure:  # noqa: BLE001 - the rest must still run
            failures.append(failure)
    if failures:
        raise failures[0]

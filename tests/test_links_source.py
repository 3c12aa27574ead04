"""The rtnetlink link source against real veth pairs in a throw-away network namespace.

rtnetlink is per network namespace, so the source runs in a driver process started with
``ip netns exec`` inside a namespace made for the test (``dpt-<random>``), while the test, in the
root namespace, changes links there with ``ip -n``. The driver is this module run as a program:
it runs ``LinkSource`` under trio and prints each event as a JSON line (see ``_driver_main``).
Nothing here touches the machine's own interfaces; the namespace is deleted afterwards.

The last tests feed crafted datagrams to the source's read loop (no socket) for what the kernel
will not send on demand: malformed messages, a refused dump, an interrupted one.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from daemon.sources.links import (
    RECEIVE_BUFFER_BYTES,
    LinkSource,
    _drain,
    _Link,
    _link_policy_only,
    _LinkHeaderMsg,
    _LinkTable,
    _parse_datagram,
    _Tracker,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_TASK = "links"
TIMEOUT = 10.0

# netlink / rtnetlink numbers for crafting datagrams
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR = 16, 17, 20
NLM_F_MULTI, NLM_F_DUMP_INTR = 0x2, 0x10
IFF_UP, IFF_LOWER_UP = 0x1, 0x10000
AF_BRIDGE = 7


# --------------------------------------------------------------------------------------------
# The driver: runs in the test namespace, prints events as JSON lines on stdout.
#
#   {"snapshot": {name: [ifindex, admin_up, lower_up]}, "steps": N}
#   {"changed": name, "state": [ifindex, admin_up, lower_up] | null, "steps": N}
#
# and, after the first snapshot, depending on its environment:
#
#   DPT_IDLE=seconds  {"idle_steps": N}   how often the source's task ran while nothing happened
#   DPT_STALL=1       {"stalled": true}   then stop taking events until a line arrives on stdin
#   DPT_ONESHOT=1     {"fds_left_open": N} cancel the source, count the descriptors it left open
#   DPT_RCVBUF=bytes  the source's receive buffer
#
# "steps" counts how many times trio ran the source's task so far (a trio Instrument): a task
# that sleeps in wait_readable is never stepped until its socket has data.


class _StepCounter(trio.abc.Instrument):
    def __init__(self, task_name: str) -> None:
        self.task_name = task_name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == self.task_name:
            self.steps += 1


def _encode_state(state: LinkState | None) -> list[Any] | None:
    return None if state is None else [state.ifindex, state.admin_up, state.lower_up]


def _print_json(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _print_event(event: Event, steps: int) -> None:
    if isinstance(event, LinkSnapshot):
        _print_json({"snapshot": {name: _encode_state(state) for name, state in event.links.items()}, "steps": steps})
    elif isinstance(event, LinkChanged):
        _print_json({"changed": event.ifname, "state": _encode_state(event.state), "steps": steps})


async def _after_first_snapshot(counter: _StepCounter, options: dict[str, str]) -> None:
    if "DPT_IDLE" in options:
        await trio.testing.wait_all_tasks_blocked()  # the source is back in wait_readable
        before = counter.steps
        await trio.sleep(float(options["DPT_IDLE"]))
        _print_json({"idle_steps": counter.steps - before})
    if "DPT_STALL" in options:
        _print_json({"stalled": True})
        await trio.lowlevel.wait_readable(sys.stdin.fileno())
        sys.stdin.readline()


async def _drive(source: LinkSource, counter: _StepCounter, options: dict[str, str]) -> None:
    fds_before = set(os.listdir("/proc/self/fd"))
    send, receive = trio.open_memory_channel[Event](0)
    async with trio.open_nursery() as nursery:
        await nursery.start(source.run, send, name=SOURCE_TASK)
        first = True
        async for event in receive:
            _print_event(event, counter.steps)
            if first:
                await _after_first_snapshot(counter, options)
                if "DPT_ONESHOT" in options:
                    nursery.cancel_scope.cancel()
                    break
            first = False
    _print_json({"fds_left_open": len(set(os.listdir("/proc/self/fd")) - fds_before)})


def _driver_main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    options = {key: value for key, value in os.environ.items() if key.startswith("DPT_")}
    source = LinkSource(receive_buffer=int(options.get("DPT_RCVBUF", RECEIVE_BUFFER_BYTES)))
    counter = _StepCounter(SOURCE_TASK)
    trio.run(_drive, source, counter, options, instruments=[counter])


# --------------------------------------------------------------------------------------------
# Test side


def _decode_state(encoded: list[Any] | None) -> LinkState | None:
    return None if encoded is None else LinkState(*encoded)


def _to_event(record: dict[str, Any]) -> Event | None:
    if "snapshot" in record:
        return LinkSnapshot({name: LinkState(*state) for name, state in record["snapshot"].items()})
    if "changed" in record:
        return LinkChanged(record["changed"], _decode_state(record["state"]))
    return None


class LineReader:
    """Lines from a process's stdout, as they come."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def line(self) -> bytes | None:
        """The next line, or ``None`` at the end of the output."""
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    async def lines_until(self, marker: bytes) -> list[bytes]:
        """Lines up to and including the first that contains ``marker``."""
        lines: list[bytes] = []
        while not lines or marker not in lines[-1]:
            line = await self.line()
            if line is None:
                raise AssertionError(f"output ended before {marker!r}: {lines}")
            lines.append(line)
        return lines


class Driver:
    """The driver process, read line by line."""

    def __init__(self, process: trio.Process, stderr_path: Path) -> None:
        assert process.stdout is not None
        self.process = process
        self.stderr_path = stderr_path
        self.records: list[dict[str, Any]] = []
        self._lines = LineReader(process.stdout)

    @property
    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def next_record(self) -> dict[str, Any]:
        line = await self._lines.line()
        if line is None:
            raise AssertionError(f"driver exited ({self.process.poll()}):\n{self.log}")
        record = json.loads(line)
        self.records.append(record)
        return record

    async def wait_record(self, key: str) -> dict[str, Any]:
        with trio.fail_after(TIMEOUT):
            while key not in (record := await self.next_record()):
                pass
            return record

    async def events_until(self, done: Callable[[Event], bool]) -> list[Event]:
        """Events up to and including the first for which ``done`` is true."""
        events: list[Event] = []
        with trio.fail_after(TIMEOUT):
            while True:
                event = _to_event(await self.next_record())
                if event is not None:
                    events.append(event)
                    if done(event):
                        return events

    async def events_until_each(self, *done: Callable[[Event], bool]) -> list[Event]:
        """Events until each of ``done`` was true for at least one of them."""
        waiting = list(done)
        events: list[Event] = []
        while waiting:
            events += await self.events_until(lambda event: any(test(event) for test in waiting))
            waiting = [test for test in waiting if not any(test(event) for event in events)]
        return events

    async def resume(self) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(b"go\n")


async def ip(netns: str, *arguments: str) -> str:
    """``ip -n NETNS ARGUMENTS``: only ever inside the test's namespace."""
    result = await trio.run_process(["ip", "-n", netns, *arguments], capture_stdout=True, capture_stderr=True)
    return result.stdout.decode()


async def ifindex(netns: str, name: str) -> int:
    return int(json.loads(await ip(netns, "-j", "link", "show", "dev", name))[0]["ifindex"])


async def add_veth(netns: str, name: str, peer: str) -> None:
    await ip(netns, "link", "add", name, "type", "veth", "peer", "name", peer)


def changed(name: str) -> Callable[[Event], bool]:
    return lambda event: isinstance(event, LinkChanged) and event.ifname == name


def deleted(name: str) -> Callable[[Event], bool]:
    return lambda event: isinstance(event, LinkChanged) and event.ifname == name and event.state is None


def is_snapshot(event: Event) -> bool:
    return isinstance(event, LinkSnapshot)


def changes_for(events: list[Event], name: str) -> list[LinkState | None]:
    return [event.state for event in events if isinstance(event, LinkChanged) and event.ifname == name]


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace ``dpt-<random>``, deleted (with its veths) afterwards."""
    name = f"dpt-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
async def start_driver(netns: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Driver]]]:
    """Start the driver in ``netns``; keyword arguments become its DPT_* environment."""
    processes: list[trio.Process] = []

    async def start(**options: str) -> Driver:
        stderr_path = tmp_path / f"driver-{len(processes)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{f"DPT_{key.upper()}": value for key, value in options.items()}}
        command = [
            "ip", "netns", "exec", netns,
            sys.executable, "-W", "always::ResourceWarning", "-m", "tests.test_links_source",
        ]
        with open(stderr_path, "wb") as stderr:
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO_ROOT, env=env
            )
        processes.append(process)
        return Driver(process, stderr_path)

    yield start
    for process in processes:
        process.kill()
        await process.wait()


async def test_snapshot_then_carrier_rename_and_delete(
    netns: str, start_driver: Callable[..., Awaitable[Driver]]
) -> None:
    await add_veth(netns, "dpq", "dpr")
    await ip(netns, "link", "set", "dpq", "up")  # its peer is down: no carrier
    driver = await start_driver()

    [snapshot] = await driver.events_until(is_snapshot)
    assert isinstance(snapshot, LinkSnapshot)
    assert set(snapshot.links) == {"lo", "dpq", "dpr"}
    assert snapshot.links["lo"] == LinkState(await ifindex(netns, "lo"), admin_up=False, lower_up=False)
    assert snapshot.links["dpq"] == LinkState(await ifindex(netns, "dpq"), admin_up=True, lower_up=False)
    assert snapshot.links["dpq"].carrier_lost
    assert not snapshot.links["dpr"].admin_up

    await add_veth(netns, "dpa", "dpb")
    events = await driver.events_until_each(changed("dpa"), changed("dpb"))
    a, b = await ifindex(netns, "dpa"), await ifindex(netns, "dpb")
    assert changes_for(events, "dpa") == [LinkState(a, False, False)]
    assert changes_for(events, "dpb") == [LinkState(b, False, False)]

    await ip(netns, "link", "set", "dpa", "up")
    events = await driver.events_until(changed("dpa"))
    assert changes_for(events, "dpa") == [LinkState(a, admin_up=True, lower_up=False)]
    assert events[-1].state is not None and events[-1].state.carrier_lost  # type: ignore[union-attr]

    await ip(netns, "link", "set", "dpb", "up")
    events = await driver.events_until_each(changed("dpa"), changed("dpb"))
    assert changes_for(events, "dpa") == [LinkState(a, admin_up=True, lower_up=True)]
    assert changes_for(events, "dpb") == [LinkState(b, admin_up=True, lower_up=True)]

    r = snapshot.links["dpr"].ifindex
    await ip(netns, "link", "set", "dpr", "name", "dps")  # renamed while down: older kernels refuse it up
    events = await driver.events_until(changed("dps"))
    assert events == [LinkChanged("dpr", None), LinkChanged("dps", LinkState(r, False, False))]

    await ip(netns, "link", "del", "dpa")  # takes its peer dpb along
    events = await driver.events_until_each(deleted("dpa"), deleted("dpb"))
    assert changes_for(events, "dpa")[-1] is None
    assert changes_for(events, "dpb")[-1] is None
    assert "skipped" not in driver.log


async def test_newlinks_that_change_nothing_send_nothing(
    netns: str, start_driver: Callable[..., Awaitable[Driver]]
) -> None:
    await add_veth(netns, "dpa", "dpb")
    await ip(netns, "link", "set", "dpa", "up")
    driver = await start_driver()
    await driver.events_until(is_snapshot)
    monitor = await trio.lowlevel.open_process(["ip", "-n", netns, "-o", "monitor", "link"], stdout=subprocess.PIPE)
    try:
        assert monitor.stdout is not None
        kernel = LineReader(monitor.stdout)
        await _until_monitor_listens(kernel, netns)
        # Each of these makes the kernel send RTM_NEWLINK for dpa with unchanged flags.
        await ip(netns, "link", "set", "dpa", "mtu", "1400")
        await ip(netns, "link", "set", "dpa", "txqueuelen", "500")
        # The carrier flip: several RTM_NEWLINK for dpa and dpb, one change each.
        await ip(netns, "link", "set", "dpb", "up")
        await add_veth(netns, "dpy", "dpz")  # the end marker
        events = await driver.events_until(changed("dpy"))
        with trio.fail_after(TIMEOUT):
            monitor_lines = await kernel.lines_until(b" dpy@")
    finally:
        monitor.kill()
        await monitor.wait()

    a, b = await ifindex(netns, "dpa"), await ifindex(netns, "dpb")
    assert changes_for(events, "dpa") == [LinkState(a, True, True)]
    assert changes_for(events, "dpb") == [LinkState(b, True, True)]
    kernel_messages = [line for line in monitor_lines if b" dpa@" in line or b" dpb@" in line]
    assert len(kernel_messages) >= 4, monitor_lines  # what the kernel said; we sent two changes
    assert "skipped" not in driver.log


async def _until_monitor_listens(kernel: LineReader, netns: str) -> None:
    """Change dpa's MTU until ``ip monitor`` reports it: from then on it hears every message."""
    for attempt in range(50):
        marker = f"mtu {1300 + attempt} ".encode()
        await ip(netns, "link", "set", "dpa", "mtu", str(1300 + attempt))
        with trio.move_on_after(0.2):
            await kernel.lines_until(marker)
            return
    raise AssertionError("ip monitor reported nothing")


async def test_idle_source_never_wakes(netns: str, start_driver: Callable[..., Awaitable[Driver]]) -> None:
    driver = await start_driver(idle="1.0")
    await driver.events_until(is_snapshot)
    idle = await driver.wait_record("idle_steps")
    assert idle["idle_steps"] == 0
    # The counter does count: a change steps the task again.
    steps_before = driver.records[0]["steps"]
    await add_veth(netns, "dpa", "dpb")
    await driver.events_until(changed("dpa"))
    assert driver.records[-1]["steps"] > steps_before


async def test_cancelled_source_closes_its_socket(
    netns: str, start_driver: Callable[..., Awaitable[Driver]]
) -> None:
    driver = await start_driver(oneshot="1")
    await driver.events_until(is_snapshot)
    assert (await driver.wait_record("fds_left_open"))["fds_left_open"] == 0
    # Closed by the source, not by the garbage collector (which warns about an unclosed socket).
    assert "ResourceWarning" not in driver.log


async def test_overflow_dumps_again(netns: str, start_driver: Callable[..., Awaitable[Driver]]) -> None:
    driver = await start_driver(rcvbuf="4096", stall="1")
    await driver.events_until(is_snapshot)
    await driver.wait_record("stalled")
    names = [f"dpo{i}" for i in range(12)]
    for name in names:  # while nobody reads: far more than 4 KiB of RTM_NEWLINK
        await add_veth(netns, name, f"{name}p")
        await ip(netns, "link", "set", name, "up")
    await ip(netns, "link", "set", "dpo0p", "up")
    await driver.resume()

    events = await driver.events_until(is_snapshot)
    snapshot = events[-1]
    assert isinstance(snapshot, LinkSnapshot)
    assert "dropped link messages" in driver.log
    assert "skipped" not in driver.log
    assert set(snapshot.links) == {"lo", *names, *(f"{name}p" for name in names)}
    assert snapshot.links["dpo0"] == LinkState(await ifindex(netns, "dpo0"), True, True)
    assert snapshot.links["dpo5"] == LinkState(await ifindex(netns, "dpo5"), True, False)
    assert snapshot.links["dpo5p"] == LinkState(await ifindex(netns, "dpo5p"), False, False)
    # Still listening after the overflow.
    await ip(netns, "link", "del", "dpo3")
    await driver.events_until(deleted("dpo3"))


async def test_bridge_port_messages_are_not_link_events(
    netns: str, start_driver: Callable[..., Awaitable[Driver]]
) -> None:
    await ip(netns, "link", "add", "dpbr", "type", "bridge")
    await add_veth(netns, "dpa", "dpb")
    driver = await start_driver()
    await driver.events_until(is_snapshot)
    # Joining and leaving a bridge makes the kernel send AF_BRIDGE RTM_NEWLINK and RTM_DELLINK.
    await ip(netns, "link", "set", "dpa", "master", "dpbr")
    await ip(netns, "link", "set", "dpa", "nomaster")
    await add_veth(netns, "dpy", "dpz")  # the end marker
    events = await driver.events_until(changed("dpy"))
    assert None not in changes_for(events, "dpa")
    assert "skipped" not in driver.log


# --------------------------------------------------------------------------------------------
# The read loop on crafted datagrams


def newlink(
    index: int, name: str | None, flags: int = 0, *, kind: int = RTM_NEWLINK, seq: int = 0, msg_flags: int = 0,
    family: int = 0,
) -> bytes:
    msg = _LinkHeaderMsg()
    msg["header"]["type"] = kind
    msg["header"]["flags"] = msg_flags
    msg["header"]["sequence_number"] = seq
    msg["family"] = family
    msg["index"] = index
    msg["flags"] = flags
    msg["attrs"] = [("IFLA_MTU", 1500)] + ([("IFLA_IFNAME", name)] if name is not None else [])
    msg.encode()
    return bytes(msg.data)


def done(seq: int, msg_flags: int = NLM_F_MULTI) -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_DONE, msg_flags, seq, 0, 0)


def error(seq: int, code: int) -> bytes:
    """NLMSG_ERROR for a link dump request: the error code, then the request it answers."""
    request = struct.pack("=IHHIIBxHiII", 32, 18, 0x301, seq, 0, 0, 0, 0, 0, 0)
    return struct.pack("=IHHIIi", 20 + len(request), NLMSG_ERROR, 0, seq, 0, -code) + request


class FakeNetlink:
    """Stands in for ``_Netlink``: hands out queued datagrams (or raises queued errors)."""

    def __init__(self) -> None:
        self.marshal = MarshalRtnl()
        _link_policy_only(self.marshal)
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

    def parse(self, data: bytes) -> Iterator[Any]:
        return _parse_datagram(self.marshal, data)

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


if __name__ == "__main__":
    _driver_main()

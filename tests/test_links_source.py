"""The rtnetlink link source against real veth pairs in a throw-away network namespace.

The source runs in the driver process (``tests.linkdriver``) started with ``ip netns exec`` in
the test's namespace, while the test, in the root namespace, changes links there with ``ip -n``.
Nothing here touches the machine's own interfaces; the namespace is deleted afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from tests.daemonrun import REPO_ROOT
from tests.linkdriver import TIMEOUT, Driver, LineReader


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
async def start_driver(netns: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Driver]]]:
    """Start the driver in ``netns``; keyword arguments become its DPT_* environment."""
    processes: list[trio.Process] = []

    async def start(**options: str) -> Driver:
        stderr_path = tmp_path / f"driver-{len(processes)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{f"DPT_{key.upper()}": value for key, value in options.items()}}
        command = [
            "ip", "netns", "exec", netns,
            sys.executable, "-W", "always::ResourceWarning", "-m", "tests.linkdriver",
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


DUMP_BOTH_WAYS = """
import json, select
from pyroute2 import IPRoute
from daemon.sources._rtnetlink import RTM_NEWLINK, NLMSG_DONE, Message, dump_request, open_socket, parse_datagram

ours, sock = [], open_socket()
sock.send(dump_request(1))
while not any(m.type == NLMSG_DONE for m in ours if isinstance(m, Message)):
    select.select([sock], [], [], 5)
    ours += list(parse_datagram(sock.recv(65536)))
links = [[m.ifindex, m.ifname, m.ifflags] for m in ours if isinstance(m, Message) and m.type == RTM_NEWLINK]
with IPRoute() as ipr:
    theirs = [[m["index"], m.get_attr("IFLA_IFNAME"), m["flags"]] for m in ipr.get_links()]
print(json.dumps({"ours": links, "pyroute2": theirs, "malformed": [m.reason for m in ours if not isinstance(m, Message)]}))
"""


async def test_our_framing_of_a_real_link_dump_agrees_with_pyroute2s_full_decoder(netns):
    await add_veth(netns, "dpa0", "dpb0")
    await add_veth(netns, "dp-long-name15", "dp.peer")  # 15 characters, and a dot
    await ip(netns, "link", "set", "dpa0", "up")
    await ip(netns, "link", "set", "dpb0", "up")
    await ip(netns, "link", "add", "dpbr0", "type", "bridge")
    await ip(netns, "link", "set", "dpb0", "master", "dpbr0")  # the bridge's AF_BRIDGE messages too
    result = await trio.run_process(["ip", "netns", "exec", netns, sys.executable, "-c", DUMP_BOTH_WAYS],
                                    capture_stdout=True, cwd=REPO_ROOT)
    dumped = json.loads(result.stdout)
    assert dumped["malformed"] == []
    assert sorted(dumped["ours"]) == sorted(dumped["pyroute2"])
    assert {name for _, name, _ in dumped["ours"]} == {"lo", "dpa0", "dpb0", "dp-long-name15", "dp.peer", "dpbr0"}

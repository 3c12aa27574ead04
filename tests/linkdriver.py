"""The link-source driver: ``LinkSource`` run in a process of its own, inside a test's network
namespace (``ip netns exec NS python -m tests.linkdriver``), printing each event as a JSON line;
and :class:`Driver`, the test side that reads those lines back as events.

rtnetlink is per network namespace, so the source under test has to run in the namespace where
the test changes links; the test itself stays in the root namespace and uses ``ip -n``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from daemon.core import Event, LinkChanged, LinkSnapshot, LinkState
from daemon.sources.links import RECEIVE_BUFFER_BYTES, LinkSource

SOURCE_TASK = "links"
TIMEOUT = 10.0


# --------------------------------------------------------------------------------------------
# The driver: runs in the test namespace, prints events as JSON lines on stdout.
#
#   {"snapshot": {name: [ifindex, admin_up, lower_up]}, "steps": N}
#   {"changed": name, "state": [ifindex, admin_up, lower_up] | null, "steps": N}
#
# and, after the first snapshot, depending on its environment:
#
#   DPT_IDLE=seconds  {"idle_steps": N}   how often the source's task ran while nothing happened
#                                         (seconds of a clock that jumps once every task waits:
#                                         any timer of the source would fire, in no time)
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
    clock = trio.testing.MockClock(autojump_threshold=0) if "DPT_IDLE" in options else None
    trio.run(_drive, source, counter, options, instruments=[counter], clock=clock)


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


if __name__ == "__main__":
    _driver_main()

"""Checks on systemd units and the journal inside a booted test container."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.waiting import wait_until

from .container import Container

STATE_PROPERTIES = ("ActiveState", "SubState", "MainPID", "NRestarts", "Result", "StatusText",
                    "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic",
                    "ExecMainStartTimestampMonotonic")


@dataclass(frozen=True)
class UnitState:
    active: str
    sub: str
    main_pid: int
    restarts: int
    result: str
    status_text: str
    properties: dict[str, str]

    @property
    def pair(self) -> str:
        return f"{self.active}/{self.sub}"


def unit_state(container: Container, unit: str) -> UnitState:
    output = container.run(["systemctl", "show", unit, *(f"--property={name}" for name in STATE_PROPERTIES)]).stdout
    properties = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
    return UnitState(properties["ActiveState"], properties["SubState"], int(properties["MainPID"] or 0),
                     int(properties.get("NRestarts") or 0), properties.get("Result", ""),
                     properties.get("StatusText", ""), properties)


@dataclass
class StartTrace:
    """What ``systemctl show`` said, sampled from ``systemctl start --no-block`` until the end."""

    unit: str
    samples: list[tuple[float, UnitState]] = field(default_factory=list)

    @property
    def final(self) -> UnitState:
        return self.samples[-1][1]

    def transitions(self) -> list[str]:
        """Distinct consecutive ``active/sub`` pairs, e.g. ['activating/start', 'active/running']."""
        pairs: list[str] = []
        for _, state in self.samples:
            if not pairs or pairs[-1] != state.pair:
                pairs.append(state.pair)
        return pairs

    def seconds_in(self, pair: str, with_main_pid: bool = True) -> float:
        """How long the samples saw ``pair`` (and, if asked, a running main process)."""
        times = [t for t, s in self.samples if s.pair == pair and (s.main_pid > 0 or not with_main_pid)]
        return times[-1] - times[0] if times else 0.0


def start_and_trace(container: Container, unit: str, timeout: float) -> StartTrace:
    """``systemctl start --no-block`` and sample the state until it is no longer activating (or
    ``timeout``). Resets the unit's failure state and start rate limit first: the tests start it
    more often than StartLimitBurst allows, and that is not what they test."""
    container.run(["systemctl", "reset-failed", unit], check=False)
    trace = StartTrace(unit)
    started = time.monotonic()
    container.run(["systemctl", "start", "--no-block", unit])
    while True:
        state = unit_state(container, unit)
        now = time.monotonic() - started
        trace.samples.append((now, state))
        if state.active not in ("activating", "inactive") or now > timeout:
            return trace
        if state.active == "inactive" and now > 1.0:  # never picked up: a start job that vanished
            return trace
        time.sleep(0.02)


def assert_became_active(trace: StartTrace, timeout: float) -> None:
    """The check every readiness test relies on: a Type=notify unit whose process never sends
    READY=1 stays activating/start and fails this."""
    final = trace.final
    if final.pair != "active/running":
        raise AssertionError(
            f"{trace.unit} did not become active/running within {timeout}s (no READY=1?): states "
            f"{trace.transitions()}, last {final.pair} MainPID={final.main_pid} Result={final.result}")


def wait_for_state(container: Container, unit: str, predicate: Callable[[UnitState], bool], timeout: float,
                   what: str) -> UnitState:
    seen: list[UnitState] = []

    def reached() -> UnitState | None:
        seen.append(unit_state(container, unit))
        return seen[-1] if predicate(seen[-1]) else None

    found: UnitState = wait_until(reached, timeout, lambda: f"{unit}: {what}; last {seen[-1]}", interval=0.05)
    return found


def journal_cursor(container: Container) -> str:
    """The cursor of the newest journal entry (read entries after it with ``after=``)."""
    output = container.run(["journalctl", "-n", "1", "-o", "json", "--no-pager"]).stdout.strip()
    return json.loads(output.splitlines()[-1])["__CURSOR"] if output else ""


def journal(container: Container, *matches: str, unit: str | None = None, after: str = "") -> list[dict[str, str]]:
    """``journalctl -o json`` entries (oldest first), optionally for one unit, after a cursor,
    and with field matches such as ``RESOURCE=example.com/tun``."""
    command = ["journalctl", "-o", "json", "--no-pager"]
    if unit:
        command += ["-u", unit]
    if after:
        command += [f"--after-cursor={after}"]
    output = container.run([*command, *matches]).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def wait_for_journal(container: Container, predicate: Callable[[dict[str, str]], bool], *, unit: str | None = None,
                     after: str = "", timeout: float = 15.0, what: str = "") -> dict[str, str]:
    def tail() -> str:
        messages = [entry.get("MESSAGE", "") for entry in journal(container, unit=unit, after=after)][-30:]
        return f"journal entry {what}; last messages:\n" + "\n".join(map(str, messages))

    found: dict[str, str] = wait_until(
        lambda: next((entry for entry in journal(container, unit=unit, after=after) if predicate(entry)), None),
        timeout, tail, interval=0.1)
    return found


def message(entry: dict[str, str]) -> str:
    """MESSAGE as text (journalctl gives a byte array for non-UTF-8 messages)."""
    value = entry.get("MESSAGE", "")
    return bytes(value).decode(errors="replace") if isinstance(value, list) else str(value)


def source_monotonic(entry: dict[str, str]) -> float:
    """When the process logged the entry, in CLOCK_MONOTONIC seconds (the clock systemd's
    *TimestampMonotonic properties use; containers share it with the host). journald stamps
    reception with both clocks; the sender's own time comes as _SOURCE_REALTIME_TIMESTAMP."""
    received_monotonic = int(entry["__MONOTONIC_TIMESTAMP"])
    if "_SOURCE_REALTIME_TIMESTAMP" not in entry:
        return received_monotonic / 1e6
    offset = int(entry["__REALTIME_TIMESTAMP"]) - received_monotonic
    return (int(entry["_SOURCE_REALTIME_TIMESTAMP"]) - offset) / 1e6

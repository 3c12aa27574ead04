"""The state directory's one writer (daemon/holdings/_active.py): the lock two instances take in
turn, whoever holds it dying any way at all, the gate a handover closes, and the handover's
request and answer over a real unix socket."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from daemon.holdings import (
    Handover,
    StateLock,
    WriteGate,
    WritesClosed,
    instance_name,
    not_active_here,
    request_handover,
)
from tests.waiting import wait_until_async


def test_a_second_instance_cannot_take_the_lock_and_learns_who_holds_it(tmp_path: Path) -> None:
    first, second = StateLock(tmp_path, "devplugd pid 1 in pod old"), StateLock(tmp_path, "devplugd pid 2")
    assert first.try_take()
    assert not second.try_take() and not second.held
    assert second.holder().startswith("devplugd pid 1 in pod old, since ")
    first.release()
    assert second.try_take()
    second.release()


async def test_a_waiting_instance_gets_the_lock_the_moment_it_is_released(tmp_path: Path) -> None:
    first, second = StateLock(tmp_path, "first"), StateLock(tmp_path, "second")
    assert first.try_take()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(second.take)
        await trio.sleep(0.2)  # a wait that would have ended by now if the lock were not held
        assert not second.held
        first.release()
        await wait_until_async(lambda: second.held, what="the lock taken by the waiter")
    assert second.holder().startswith("second, since")
    second.release()


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_the_lock_of_a_holder_that_dies_any_way_is_free_at_once(tmp_path: Path, signal_name: str) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, sys, time
        from daemon.holdings import StateLock
        assert StateLock(pathlib.Path({str(tmp_path)!r}), "doomed").try_take()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    waiter = StateLock(tmp_path, "next")
    assert not waiter.try_take()
    holder.send_signal(getattr(__import__("signal"), signal_name))
    holder.wait(10)
    assert waiter.try_take()
    waiter.release()


async def test_a_closed_gate_waits_for_the_call_inside_and_refuses_the_next() -> None:
    gate = WriteGate()
    finished: list[str] = []
    release = trio.Event()

    async def a_prepare_in_flight(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with gate.inside():
            task_status.started()
            await release.wait()
            finished.append("prepare")

    async with trio.open_nursery() as nursery:
        await nursery.start(a_prepare_in_flight)
        with trio.move_on_after(0.2):
            await gate.close("handed over to the new pod", timeout=10)
            finished.append("closed early")
        assert finished == []  # the close is still waiting for the call inside
        release.set()
        assert await gate.close("handed over to the new pod", timeout=10)
        assert finished == ["prepare"]
    with pytest.raises(WritesClosed, match="handed over to the new pod"), gate.inside():
        pass


async def test_a_handover_request_is_answered_once_the_state_is_handed_over(tmp_path: Path) -> None:
    handover = Handover(tmp_path)
    answers: list[object] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(handover.serve)

        async def ask() -> None:
            answers.append(await request_handover(tmp_path, "devplugd pid 9 in pod new"))
        nursery.start_soon(ask)
        await handover.requested.wait()
        assert handover.requester == "devplugd pid 9 in pod new" and answers == []
        handover.answer = {"handed_over": True, "message": "passive"}
        handover.done.set()
    assert answers == [{"handed_over": True, "message": "passive"}]
    assert not (tmp_path / "handover.sock").exists()  # a passive instance takes no more requests
    assert await request_handover(tmp_path, "another") is None


def test_active_here_is_the_lock_holders_pod_while_its_process_runs(tmp_path: Path) -> None:
    lock = StateLock(tmp_path, instance_name("pod-a"))
    assert "No such file" in (not_active_here(tmp_path, "pod-a") or "")
    assert lock.try_take()
    assert not_active_here(tmp_path, "pod-a") is None
    assert "is active, not this pod's devplugd" in (not_active_here(tmp_path, "pod-b") or "")
    assert "is active, not this pod's devplugd" in (not_active_here(tmp_path, None) or "")
    lock.release()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "active.lock").write_text(f"devplugd pid {gone.stdout.strip()} in pod pod-a, since 2026-12-02\n")
    assert "that process is gone" in (not_active_here(tmp_path, "pod-a") or "")

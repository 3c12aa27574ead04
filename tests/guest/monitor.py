"""QEMU's monitor, driven from inside the guest: HMP commands at moments the guest script picks.

Host side, ``MonitorRelay`` (started by ``run_in_guest(..., monitor=True)``): QEMU runs with a
QMP socket (``-qmp unix:PATH,server=on,wait=off``); a thread on the host watches
``share/.guest/req/`` and, for each request file ``NNNN.cmd`` the guest renames into place, runs
its text as an HMP command (QMP's ``human-monitor-command``: the same HMP commands and output as
``-monitor unix:``, but framed as JSON, so there is no prompt or echo to parse) and writes the
reply to ``NNNN.out`` (JSON ``{"reply": text, "error": null | text, "host_ms": float}``, renamed
into place once whole). ``share/.guest/monitor.log`` records every request with its time and
reply, and the QMP events QEMU sent meanwhile.

Guest side, ``hmp`` and ``inject_aer`` (for scripts run in the guest): write the request, poll
for the reply; over the 9p share a round trip takes 5-30 ms under TCG. Because the guest waits
for the reply, it knows when the injection or hot-plug happened: anything it sees after
``hmp`` returns was caused by or raced with it.

AER through QEMU 7.2 (shared/docs/real-kernel-devices.md, section 1): inject on a *port*'s qdev
id (``rp0``...; endpoints such as nvme have no AER capability), only uncorrectable errors
(QEMU 7.2 drops correctable ones and ``-a``). ``UNSUP``/``COMP_TIME`` are non-fatal (every
function below the port gets ``change`` uevents ``ERROR_EVENT=BEGIN_RECOVERY`` then
``SUCCESSFUL_RECOVERY``), ``MALF_TLP`` is fatal (recovery succeeds only below a port with
``slow_link=True``; on a default port every function gets ``FAILED_RECOVERY``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tests.waiting import wait_until

REQUEST_DIR = "req"  # under the share's .guest/ control directory
CONTROL_DIR = ".guest"  # machine.CONTROL_DIR (not imported: this module also runs in the guest)
POLL_SECONDS = 0.003  # host: request directory scan period; guest: reply poll period
CONNECT_SECONDS = 30.0  # QEMU creates the socket before the guest starts: this is generous
NON_FATAL = "UNSUP"  # uncorrectable, non-fatal in a default UESvrt: no reset, VFs survive
FATAL = "MALF_TLP"  # uncorrectable, fatal: a secondary bus reset (the PF's VFs do not survive it)


class MonitorError(RuntimeError):
    """No monitor, no reply in time, or QEMU refused the command."""


# ---------------------------------------------------------------- host side


class MonitorRelay:
    """Relays request files from the guest to QEMU's QMP socket; one thread, stopped with ``stop``."""

    def __init__(self, socket_path: Path, control: Path) -> None:
        self.socket_path = socket_path
        self.requests = control / REQUEST_DIR
        self.requests.mkdir(parents=True, exist_ok=True)
        for leftover in self.requests.iterdir():  # an earlier run's requests must not be replayed
            leftover.unlink()
        self.log_path = control / "monitor.log"
        self.log_path.write_text("")
        self.error: BaseException | None = None
        self.handled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qemu-monitor-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            with self._connect() as sock, sock.makefile("rwb") as stream:
                self._handshake(stream)
                self._serve(stream)
        except BaseException as exc:  # reported in monitor.log and by run_in_guest's failure message
            self.error = exc
            self._log(f"relay stopped: {exc!r}")

    def _connect(self) -> socket.socket:
        failed = MonitorError(f"cannot connect to QEMU's QMP socket {self.socket_path}")

        def connected() -> socket.socket | None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(os.fspath(self.socket_path))
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self._stop.is_set():
                    raise failed from None
                return None

        try:
            return wait_until(connected, CONNECT_SECONDS, interval=0.01)
        except AssertionError:
            raise failed from None

    def _handshake(self, stream: BinaryIO) -> None:
        greeting = self._read_message(stream)
        if "QMP" not in greeting:
            raise MonitorError(f"not a QMP greeting: {greeting}")
        self._call(stream, {"execute": "qmp_capabilities"})
        self._log(f"connected: QEMU {greeting['QMP'].get('version', {}).get('qemu')}")

    def _serve(self, stream: BinaryIO) -> None:
        done: set[str] = set()
        while not self._stop.is_set():
            pending = sorted(name for name in os.listdir(self.requests) if name.endswith(".cmd") and name not in done)
            for name in pending:
                done.add(name)
                self._handle(stream, name.removesuffix(".cmd"))
            if not pending:
                time.sleep(POLL_SECONDS)

    def _handle(self, stream: BinaryIO, number: str) -> None:
        command = (self.requests / f"{number}.cmd").read_text().strip()
        started = time.monotonic()
        answer = self._call(stream, {"execute": "human-monitor-command", "arguments": {"command-line": command}})
        host_ms = round((time.monotonic() - started) * 1000, 2)
        error = answer.get("error")
        reply = {"reply": answer.get("return", ""),
                 "error": None if error is None else f"{error.get('class')}: {error.get('desc')}", "host_ms": host_ms}
        part = self.requests / f"{number}.out.part"
        part.write_text(json.dumps(reply))
        part.rename(self.requests / f"{number}.out")
        self.handled += 1
        self._log(f"{number} {command!r} -> {reply['error'] or reply['reply']!r} ({host_ms} ms)")

    def _call(self, stream: BinaryIO, message: dict[str, Any]) -> dict[str, Any]:
        stream.write(json.dumps(message).encode() + b"\n")
        stream.flush()
        while True:
            answer = self._read_message(stream)
            if "event" in answer:
                self._log(f"event {answer['event']} {json.dumps(answer.get('data', {}))}")
                continue
            return answer

    @staticmethod
    def _read_message(stream: BinaryIO) -> dict[str, Any]:
        line = stream.readline()
        if not line:
            raise MonitorError("QEMU closed the QMP socket")
        message: dict[str, Any] = json.loads(line)
        return message

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {line}\n")


# ---------------------------------------------------------------- guest side


@dataclass(frozen=True)
class Reply:
    """One HMP command's answer, with the guest's ``time.monotonic()`` around the round trip."""

    command: str
    text: str
    requested_at: float
    replied_at: float
    host_ms: float


def _request_dir() -> Path:
    directory = Path(os.environ["GUEST_SHARE"]) / CONTROL_DIR / REQUEST_DIR
    if not directory.is_dir():
        raise MonitorError(f"no {directory}: the guest was booted without run_in_guest(..., monitor=True)")
    return directory


def hmp(command: str, *, timeout: float = 15.0) -> Reply:
    """Run one HMP command in QEMU (from the guest) and return its reply; raises MonitorError when
    QEMU's QMP refuses it or no reply comes within ``timeout``. HMP reports a command's own errors
    as text (``invalid error status value``...): check ``text``."""
    directory = _request_dir()
    numbers = [int(name.split(".")[0]) for name in os.listdir(directory) if name.split(".")[0].isdigit()]
    number = max(numbers, default=-1) + 1
    while True:  # O_EXCL: two guest processes may ask at once
        name = f"{number:04d}"
        try:
            descriptor = os.open(directory / f"{name}.cmd.part", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            number += 1
    with os.fdopen(descriptor, "w") as request:
        request.write(command + "\n")
    requested_at = time.monotonic()
    os.rename(directory / f"{name}.cmd.part", directory / f"{name}.cmd")
    reply_path = directory / f"{name}.out"
    try:
        wait_until(reply_path.exists, timeout, interval=POLL_SECONDS)
    except AssertionError:
        raise MonitorError(f"no reply to {command!r} within {timeout} s (is the host relay running?)") from None
    replied_at = time.monotonic()
    answer = json.loads(reply_path.read_text())
    if answer["error"]:
        raise MonitorError(f"{command!r}: {answer['error']}")
    return Reply(command, answer["reply"], requested_at, replied_at, answer["host_ms"])


def inject_aer(port: str, error: str = NON_FATAL, *, timeout: float = 15.0) -> Reply:
    """``pcie_aer_inject_error <port> <error>``: an uncorrectable error on the root port with qdev id
    ``port`` (see ``tests.guest.devices.ports``). Returns once QEMU has injected it (reply
    ``OK id: rp0 root bus: 0000:00, bus: 0 devfn: 1.0``); the recovery uevents follow 10-60 ms
    later for a non-fatal error, about 1.2 s (success) or 2.1 s (failure) later for a fatal one."""
    reply = hmp(f"pcie_aer_inject_error {port} {error}", timeout=timeout)
    if not reply.text.startswith("OK"):
        raise MonitorError(f"QEMU did not inject {error} on {port}: {reply.text.strip()!r}")
    return reply

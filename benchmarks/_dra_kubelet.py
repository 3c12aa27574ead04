"""The kubelet stand-in (``tests/kubelet.py``) for a DRA benchmark, in a process of its own.

A real kubelet and a real API server are separate processes. Run in the benchmark's process, the
stand-in decoding a 4096-device health message would hold the GIL that the API stand-in needs to
handle and stamp the slice write the daemon sends at about the same moment (``dra_taints``).

* ``python -m benchmarks._dra_kubelet DEVICE_PLUGIN_DIR PLUGINS_REGISTRY_DIR --driver D --pool P
  [--watch DEVICE ...] [--no-health-stream]`` (the child): starts ``FakeKubelet`` on the two
  directories (``dra_health_gate`` off with ``--no-health-stream``), prints ``ready``, then one
  line per change it sees, each a JSON list:

      ["dra", registered, registrations, health_streams, health_service]   (when these change)
      ["health", stamp, devices, {device: health}, {health: count}]       (each health message)
      ["error", text]                                                      (a registration error)

  ``stamp`` is the stand-in's own arrival stamp of the message (``time.monotonic()``, taken in
  its asyncio thread once the message is decoded: the clock is system-wide, so it compares with
  the parent's); ``devices`` how many devices it reports; then the health of each ``--watch``
  device of pool ``--pool`` that it reports, and how many devices it reports per health. Only
  the watched devices are named, so the parent never parses 4096 entries per change. Exits at
  EOF on its stdin (the parent closed it, or died).
* ``KubeletProcess`` (the parent's side): starts the child with this interpreter, collects its
  lines in a thread, and answers waits on them; ``close()`` ends the child and reaps it (killed
  after 5 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent


class HealthMessage(NamedTuple):
    stamp: float  # the child's time.monotonic() on the message's arrival
    devices: int  # how many devices the message reports
    health: dict[str, str]  # watched device name -> "Healthy" / "Unhealthy" / "Unknown", if reported
    counts: dict[str, int]  # health -> how many devices the message reports with it


# -- the child ------------------------------------------------------------------------------------
def child(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the kubelet stand-in in its own process (see the module)")
    parser.add_argument("device_plugin_dir", type=Path)
    parser.add_argument("plugins_registry_dir", type=Path)
    parser.add_argument("--driver", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--watch", action="append", default=[], help="a device whose health is reported")
    parser.add_argument("--no-health-stream", action="store_true")
    arguments = parser.parse_args(argv)

    from tests.kubelet import FakeKubelet  # grpc and the generated stubs: only in this process

    stopping = threading.Event()

    def watch_stdin() -> None:
        while os.read(sys.stdin.fileno(), 4096):
            pass
        stopping.set()

    out = sys.stdout

    def say(*fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    kubelet = FakeKubelet(arguments.device_plugin_dir, arguments.plugins_registry_dir,
                          dra_health_gate=not arguments.no_health_stream)
    try:
        kubelet.start()
        threading.Thread(target=watch_stdin, name="stdin", daemon=True).start()
        say("ready")
        state = kubelet.dra_state(arguments.driver)
        watched = [(arguments.pool, name) for name in arguments.watch]
        sent = 0  # health messages reported
        dra: tuple[Any, ...] = ()
        errors = 0

        def news(_: Any) -> bool:
            return (stopping.is_set() or len(state.health_messages) > sent
                    or (state.registered, state.registrations, state.health_streams, state.health_service) != dra
                    or len(state.errors) + len(kubelet.watcher_errors) > errors)

        while not stopping.is_set():
            with contextlib.suppress(AssertionError):  # nothing new within the hour: wait again
                kubelet.wait_for(news, 3600, "news")
            now = (state.registered, state.registrations, state.health_streams, state.health_service)
            if now != dra:
                dra = now
                say("dra", *now)
            problems = [*state.errors, *kubelet.watcher_errors]
            for problem in problems[errors:]:
                say("error", problem)
            errors = len(problems)
            messages = state.health_messages
            while sent < len(messages):
                message = messages[sent]
                if message:
                    stamp = next(iter(message.values())).received_at
                    counts: dict[str, int] = {}
                    for record in message.values():
                        counts[record.health] = counts.get(record.health, 0) + 1
                    say("health", stamp, len(message),
                        {key[1]: message[key].health for key in watched if key in message}, counts)
                else:
                    say("health", time.monotonic(), 0, {}, {})
                messages[sent] = {}  # 4096 records each: keep only the count in this process
                sent += 1
    finally:
        kubelet.close()
    return 0


# -- the parent -----------------------------------------------------------------------------------
class KubeletProcess:
    """The child above, started and read from the benchmark's process (see the module)."""

    def __init__(self, python: str, device_plugin_dir: Path, plugins_registry_dir: Path, *, driver: str,
                 pool: str, watch: list[str], health_stream: bool = True, stderr_path: Path | None = None,
                 timeout: float = 30.0) -> None:
        self.health_messages: list[HealthMessage] = []
        self.registered = False
        self.registrations = 0
        self.health_streams = 0
        self.health_service = ""
        self.errors: list[str] = []
        self._condition = threading.Condition()
        self._stderr_path = stderr_path
        stderr = open(stderr_path, "wb") if stderr_path is not None else None  # noqa: SIM115 - the child holds it
        try:
            self._process = subprocess.Popen(
                [python, "-m", "benchmarks._dra_kubelet", str(device_plugin_dir), str(plugins_registry_dir),
                 "--driver", driver, "--pool", pool, *(f"--watch={name}" for name in watch),
                 *([] if health_stream else ["--no-health-stream"])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO_ROOT)
        finally:
            if stderr is not None:
                stderr.close()
        self._ready = False
        self._thread = threading.Thread(target=self._collect, name="kubelet-process", daemon=True)
        self._thread.start()
        try:
            self.wait_for(lambda k: k._ready, timeout, "the kubelet stand-in process ready")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def _collect(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                kind, *rest = json.loads(line)
            except ValueError:
                continue
            with self._condition:
                if kind == "ready":
                    self._ready = True
                elif kind == "health":
                    stamp, devices, health, counts = rest
                    self.health_messages.append(HealthMessage(float(stamp), int(devices), health, counts))
                elif kind == "dra":
                    self.registered, self.registrations, self.health_streams, self.health_service = rest
                elif kind == "error":
                    self.errors.append(str(rest[0]))
                self._condition.notify_all()
        with self._condition:
            self._condition.notify_all()  # the child is gone: waits see it at once

    def _what(self, what: str) -> str:
        code = self._process.poll()
        stderr = ""
        if self._stderr_path is not None:
            with contextlib.suppress(OSError):
                stderr = self._stderr_path.read_text(errors="replace")[-2000:]
        return (f"kubelet stand-in process: {what}; registered={self.registered} registrations="
                f"{self.registrations} health streams={self.health_streams} ({self.health_service or 'none'}) "
                f"health messages={len(self.health_messages)} errors={self.errors[-3:]}"
                f"{f'; EXITED with {code}' if code is not None else ''}{f'; stderr: {stderr}' if stderr else ''}")

    def wait_for(self, predicate: Callable[[KubeletProcess], bool], timeout: float = 10.0, what: str = "") -> None:
        """Until ``predicate(self)`` holds, woken by every line of the child; AssertionError after
        ``timeout`` or as soon as the child has exited without it."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self._process.poll() is not None and not self._thread.is_alive()):
                    raise AssertionError(f"not within {timeout}s: {self._what(what or str(predicate))}")
                self._condition.wait(min(remaining, 0.25))

    def wait_for_dra(self, timeout: float = 10.0) -> None:
        self.wait_for(lambda k: k.registered, timeout, "the DRA driver registered")

    def messages_since(self, stamp: float) -> list[HealthMessage]:
        """The health messages that arrived at ``stamp`` or later, in order."""
        with self._condition:
            return [m for m in self.health_messages if m.stamp >= stamp]

    def close(self) -> None:
        """EOF on the child's stdin, so it closes the stand-in and exits; killed after 5 s. Reaped."""
        assert self._process.stdin is not None
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        if self._process.poll() is None:
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._thread.join(5)


if __name__ == "__main__":
    sys.exit(child())

"""Running the real daemon from this checkout: its command line, a started process with its
log, and the control-socket CLI."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    workdir: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 10.0) -> None:
        self.wait_until(lambda: text in self.log, f"logging {text!r}", timeout)

    def wait_until(self, predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
        """:func:`tests.waiting.wait_until` while the daemon runs: its exit ends the wait at once;
        both failures show its log."""
        def holds_while_running() -> Any:
            if result := predicate():
                return result
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited {self.process.returncode} before {what}:\n{self.log}")
            return result
        return wait_until(holds_while_running, timeout, lambda: f"daemon did not get to {what}:\n{self.log}")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"daemon did not stop within {timeout}s:\n{self.log}") from None


def daemon_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "daemon", *arguments]


def control_cli(control_socket: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``devplugd ARGUMENTS --control-socket CONTROL_SOCKET``, its output captured as text."""
    return subprocess.run(daemon_command(*arguments, "--control-socket", str(control_socket)),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def wait_for_control(control_socket: Path, timeout: float = 10) -> None:
    """Until the daemon's host API answers ``devplugd list`` on ``control_socket``."""
    wait_until(lambda: control_cli(control_socket, "list", "-o", "json").returncode == 0, timeout,
               "the control socket never answered", interval=0.05)


def run_cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``devplugd ARGUMENTS`` from this checkout, its output captured as text."""
    return subprocess.run(daemon_command(*arguments), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

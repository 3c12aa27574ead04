"""The kubelet stand-in (tests/kubelet.py) running inside the container as a transient unit.

It runs with the package's own venv python (grpc and the daemon's generated modules are there),
under the container's systemd (``systemd-run``), so it lives in the container's cgroup and dies
with it. Its view is a JSON file the test polls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .container import Container

TESTS_DIR = Path(__file__).resolve().parents[1]
STAGING = "/e2e"  # test files inside the container (ignored by the purge check)


class KubeletStandIn:
    unit = "e2e-kubelet.service"
    state_path = "/run/e2e-kubelet.json"

    def __init__(self, container: Container, python: str) -> None:
        self.container = container
        self.python = python
        container.copy_in(TESTS_DIR / "kubelet.py", f"{STAGING}/kubelet.py")
        container.copy_in(Path(__file__).with_name("kubelet_driver.py"), f"{STAGING}/kubelet_driver.py")

    def start(self, register_delay: float = 0.0, timeout: float = 20.0) -> None:
        """Listen on kubelet.sock; every Register is held ``register_delay`` seconds."""
        self.stop()
        self.container.run(["rm", "-f", self.state_path])
        self.container.run(["systemd-run", f"--unit={self.unit}", "--service-type=exec", "--collect", "--quiet",
                            self.python, f"{STAGING}/kubelet_driver.py", "--state", self.state_path,
                            "--register-delay", str(register_delay)])
        self.wait_for(lambda view: view.get("listening", False), timeout, "kubelet.sock listening")

    def stop(self) -> None:
        self.container.run(["systemctl", "stop", self.unit], check=False)
        self.container.run(["systemctl", "reset-failed", self.unit], check=False)

    def view(self) -> dict[str, Any]:
        completed = self.container.run(["cat", self.state_path], check=False)
        return json.loads(completed.stdout) if completed.returncode == 0 and completed.stdout else {}

    def registered(self) -> dict[str, dict[str, Any]]:
        """Resources the stand-in has a connected client for, with their device counts."""
        return {name: state for name, state in self.view().get("resources", {}).items() if state["connected"]}

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.view()
            if view and predicate(view):
                return view
            if time.monotonic() > deadline:
                status = self.container.run(["systemctl", "status", "--no-pager", "-n", "20", self.unit], check=False)
                raise AssertionError(f"kubelet stand-in: timed out after {timeout}s waiting for {what}; "
                                     f"view={view}\n{status.stdout}")
            time.sleep(0.1)

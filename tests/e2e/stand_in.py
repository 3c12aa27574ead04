"""The kubelet stand-in (tests/kubelet.py) running inside the container as a transient unit.

It runs with the package's own venv python (grpc and the daemon's generated modules are there),
under the container's systemd (``systemd-run``), so it lives in the container's cgroup and dies
with it. Its view is a JSON file the test polls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.waiting import wait_until

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
        for module in ("__init__.py", "waiting.py"):  # kubelet.py waits with tests.waiting
            container.copy_in(TESTS_DIR / module, f"{STAGING}/tests/{module}")
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
        def matched() -> dict[str, Any] | None:
            view = self.view()
            return view if view and predicate(view) else None

        def failure() -> str:
            status = self.container.run(["systemctl", "status", "--no-pager", "-n", "20", self.unit], check=False)
            return f"kubelet stand-in: {what}; view={self.view()}\n{status.stdout}"

        found: dict[str, Any] = wait_until(matched, timeout, failure, interval=0.1)
        return found

"""Runs *inside* the test container, with the package's venv python (it has grpc and daemon):
tests/kubelet.py's FakeKubelet on the real kubelet.sock, its view written as JSON on every change.

    python kubelet_driver.py --state FILE [--dir /var/lib/kubelet/device-plugins] [--register-delay S]

``--register-delay`` holds every Register call that long before the kubelet dials the plugin, as a
slow kubelet would: the daemon's READY=1 waits for its pools to be registered, so this holds
READY back. SIGTERM: stop listening (kubelet.sock is removed) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kubelet.py is copied next to this file

from kubelet import FakeKubelet


def view(kubelet: FakeKubelet, listening: bool) -> dict[str, object]:
    return {
        "listening": listening,
        "resources": {name: {"connected": state.connected, "registrations": state.registrations,
                             "devices": len(state.devices), "healthy": len(state.healthy),
                             "registered_at": state.registered_at}
                      for name, state in sorted(kubelet.resources.items())},
        "register_errors": list(kubelet.register_errors),
        "clock": "CLOCK_MONOTONIC",
    }


def write(path: Path, content: dict[str, object]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content, sort_keys=True))
    os.replace(partial, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"))
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--register-delay", type=float, default=0.0)
    arguments = parser.parse_args()

    kubelet = FakeKubelet(arguments.dir)
    if arguments.register_delay:
        connect = kubelet.connect

        async def slow_connect(*args: object, **kwargs: object) -> None:
            await asyncio.sleep(arguments.register_delay)
            await connect(*args, **kwargs)  # type: ignore[arg-type]

        kubelet.connect = slow_connect  # type: ignore[method-assign]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    kubelet.start()
    last = None
    try:
        while not stop.is_set():
            try:
                current = view(kubelet, True)
            except RuntimeError:  # the kubelet's thread changed a dict while we copied it
                continue
            if current != last:
                write(arguments.state, current)
                last = current
            stop.wait(0.05)
    finally:
        kubelet.close()
        write(arguments.state, view(kubelet, False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

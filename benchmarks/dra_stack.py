"""What the gRPC stack alone costs a DRA call: NodePrepareResources of no claims, as a grpc-go
client (the kubelet's) times it, to three servers that do nothing else, calls taken in turn:

* a grpc-go server (``benchmarks/go_driver``: the reference driver, which for no claims does
  nothing);
* a grpc.aio server on plain asyncio (``benchmarks._bare_server --dra --host asyncio``);
* the same grpc.aio server hosted as devplugd hosts its own, in trio through trio-asyncio, each
  call going into trio and back (``trio_as_aio``) as the daemon's servicer calls its preparer
  (``--host trio``).

Each call comes ``--gap`` after the last call to any server, so every thread on the way is idle
when it comes, as a kubelet's calls find a driver. ``benchmarks/dra_prepare.py`` times the
daemon's own empty call the same way: the difference between the two Python rows is the
trio-asyncio bridge, between ``asyncio`` and Go the Python gRPC server. Needs Debian's Go packages
(``benchmarks/_go_kubelet.py``). Never asserts timings.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import PYTHON, REPO_ROOT, machine_line, short_tmp
from benchmarks._events import clean_up, latency_row, revision_line
from benchmarks._go_kubelet import GoBuildError, GoDriver, GoKubelet, build

SERVERS = ("grpc-go", "grpc.aio on asyncio", "grpc.aio in trio (trio-asyncio)")
WIDTH = 40


def bare_server(socket: Path, host: str) -> subprocess.Popen[str]:
    server = subprocess.Popen([PYTHON, "-m", "benchmarks._bare_server", "--socket", str(socket), "--dra",
                               "--host", host], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    if server.stdout.readline().strip() != "READY":
        raise RuntimeError(f"the bare server ({host}) did not start (exit {server.wait()})")
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="timed calls to each server (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls to each first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.02, help="seconds before each call (default: %(default)s)")
    arguments = parser.parse_args(argv)
    print(f"dra_stack: NodePrepareResources of no claims, {arguments.calls} to each of {len(SERVERS)} servers in "
          f"turn, {arguments.gap * 1000:g} ms apart, timed by a grpc-go client", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    with short_tmp() as base:
        try:
            kubelet_binary = build(base / "go")
            driver_binary = build(base / "go", "go_driver")
        except GoBuildError as error:
            print(f"cannot run: {error}")
            return 1
        closers = []
        try:
            with (base / "go-driver.log").open("w") as driver_log:
                go_driver = GoDriver(driver_binary, base / "go.sock", "http://127.0.0.1:1", "", "bench.example.com",
                                     base / "cdi", base / "devinfo", base / "state", driver_log)
            closers.append(go_driver.close)
            sockets = [base / "go.sock"]
            for host in ("asyncio", "trio"):
                server = bare_server(base / f"{host}.sock", host)
                closers += [server.wait, server.terminate]
                sockets.append(base / f"{host}.sock")
            clients = [GoKubelet(kubelet_binary, str(socket)) for socket in sockets]
            closers += [client.close for client in clients]
            for client in clients:
                for _ in range(arguments.warmup):
                    client.prepare(None)
            seconds: list[list[float]] = [[] for _ in clients]
            for _ in range(arguments.calls):
                for client, times in zip(clients, seconds, strict=True):
                    time.sleep(arguments.gap)
                    times.append(client.prepare(None)[0])
        finally:
            clean_up(*reversed(closers))
    print()
    for name, times in zip(SERVERS, seconds, strict=True):
        print(latency_row(name, times, width=WIDTH))
    return 0


if __name__ == "__main__":
    sys.exit(main())

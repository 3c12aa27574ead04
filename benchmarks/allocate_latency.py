"""Allocate latency: the daemon against a bare grpc.aio server answering the same message.

1. The daemon serves one netDevice pool of 64 vfio-pci VFs and registers it with the kubelet
   stand-in (``--registration kubelet``), so the daemon is in its production state: registered,
   one ListAndWatch stream open. The benchmark takes the endpoint from the stand-in
   (``state.endpoint``) and dials that socket directly.
2. One Allocate through the stand-in captures the daemon's real AllocateResponse.
3. A separate client process (``benchmarks._allocate_client``: sync grpcio, one channel) makes
   ``--warmup`` untimed calls, then ``--calls`` sequential timed Allocate calls of one device each
   (devices round-robin over the pool).
4. The same client, the same way, against a bare grpc.aio server (``benchmarks._bare_server``)
   that returns the captured response: first hosted by plain asyncio, then by trio +
   trio_asyncio (``open_loop`` + ``aio_as_trio``), on the same kind of unix socket.

Prints p50/p90/p99/max/mean per server, server CPU per call, and the ratios; never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks._common import (
    PYTHON,
    REPO_ROOT,
    Daemon,
    DaemonFailure,
    build_sriov_host,
    bytecode_env,
    check_exit,
    host_tmp,
    machine_line,
    netdevice_config,
    percentile,
    pf_netdev,
    process_cpu_seconds,
    report_failure,
    short_tmp,
    vf_address,
    wait_kubelet,
)
from tests.kubelet import FakeKubelet

VFS = 64
RESOURCE_NAME = "alloc_pool"
RESOURCE = f"intel.com/{RESOURCE_NAME}"
TARGET_RATIO = 1.15  # the daemon's own work: its p50 over the bare trio + trio-asyncio server's
TARGET_P99_MS = 1.5


class ClientFailure(Exception):
    pass


def run_client(socket_path: str, ids: list[str], calls: int, warmup: int, server_pid: int) -> dict:
    """Run the client process; return its latencies plus the server's CPU seconds during the run."""
    cpu_before = process_cpu_seconds(server_pid)
    completed = subprocess.run(
        [PYTHON, "-m", "benchmarks._allocate_client", "--socket", socket_path, "--calls", str(calls),
         "--warmup", str(warmup), "--ids", ",".join(ids)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    cpu_after = process_cpu_seconds(server_pid)
    if completed.returncode != 0:
        raise ClientFailure(f"client exited {completed.returncode}:\n{completed.stderr[-3000:]}")
    result = json.loads(completed.stdout)
    result["server_cpu_per_call"] = (cpu_after - cpu_before) / (calls + warmup)
    return result


def start_bare(kind: str, socket_path: Path, response_file: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [PYTHON, "-m", "benchmarks._bare_server", "--socket", str(socket_path), "--response", str(response_file),
         "--host", kind],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if line.strip() != "READY":
        process.kill()
        _, stderr = process.communicate()
        raise ClientFailure(f"bare {kind} server did not start: {line!r}\n{stderr[-3000:]}")
    return process


def stop_process(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def summarize(latencies_ns: list[int]) -> dict[str, float]:
    values = [v / 1e6 for v in latencies_ns]  # ms
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat daemon / bare asyncio / bare trio this many times, pooling latencies")
    arguments = parser.parse_args(argv)

    print(f"allocate_latency: {arguments.calls} sequential Allocate calls of 1 device (after {arguments.warmup} "
          f"warm-up calls), client in its own process, x{arguments.rounds} round(s)", flush=True)
    print(machine_line(), flush=True)
    with short_tmp() as base, host_tmp() as host_dir:
        host = build_sriov_host(host_dir / "host", 1, VFS)
        ids = [vf_address(0, vf) for vf in range(VFS)]
        env = bytecode_env(base)
        kubelet = FakeKubelet(base / "device-plugins")
        kubelet.start()
        # a devinfo file is checked (and written when needed) at every Allocate: on tmpfs, as /var/run is in production.
        daemon = Daemon(base, host, netdevice_config([(RESOURCE_NAME, [pf_netdev(0)])]), env=env,
                        devinfo_dir=host_dir / "devinfo")
        bare: subprocess.Popen[str] | None = None
        latencies: dict[str, list[int]] = {"daemon": [], "bare asyncio": [], "bare trio+trio_asyncio": []}
        cpu: dict[str, list[float]] = {name: [] for name in latencies}
        try:
            daemon.start()
            wait_kubelet(kubelet, daemon, lambda k: RESOURCE in k.resources and k.resources[RESOURCE].connected
                         and len(k.resources[RESOURCE].devices) == VFS, 20, f"{RESOURCE} listed with {VFS} devices")
            endpoint = kubelet.resources[RESOURCE].endpoint
            response = kubelet.allocate(RESOURCE, [ids[0]])
            response_file = base / "response.bin"
            response_file.write_bytes(response.SerializeToString())
            container = response.container_responses[0]
            print(f"daemon endpoint {endpoint}; captured AllocateResponse: {response.ByteSize()} bytes, "
                  f"{len(container.envs)} envs, {len(container.devices)} device specs", flush=True)
            for round_index in range(arguments.rounds):
                result = run_client(endpoint, ids, arguments.calls, arguments.warmup, daemon.pid)
                daemon.check_alive()
                if result["error_count"]:
                    print(f"daemon: {result['error_count']} failed calls, e.g. {result['errors'][:3]}")
                latencies["daemon"] += result["latencies_ns"]
                cpu["daemon"].append(result["server_cpu_per_call"])
                for kind, label in (("asyncio", "bare asyncio"), ("trio", "bare trio+trio_asyncio")):
                    socket_path = base / f"bare-{kind}.sock"
                    bare = start_bare(kind, socket_path, response_file, env)
                    try:
                        result = run_client(str(socket_path), ids, arguments.calls, arguments.warmup, bare.pid)
                    finally:
                        stop_process(bare)
                        bare = None
                        socket_path.unlink(missing_ok=True)
                    latencies[label] += result["latencies_ns"]
                    cpu[label].append(result["server_cpu_per_call"])
                print(f"round {round_index + 1} done", flush=True)
            daemon_log = daemon.log
            code, _ = daemon.stop()
            check_exit(code, daemon.log)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        except ClientFailure as error:
            print(f"\nCLIENT/SERVER FAILURE: {error}")
            print("---- daemon log (last lines) ----\n" + "\n".join(daemon.log.splitlines()[-40:]))
            return 1
        finally:
            if bare is not None:
                stop_process(bare)
            daemon.kill()
            kubelet.close()

    warnings = [line for line in daemon_log.splitlines() if " WARNING " in line or " ERROR " in line]
    print(f"\n{'server':<26}{'calls':>7}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'mean':>10}"
          f"{'server CPU/call':>18}")
    stats = {}
    for label, values in latencies.items():
        stats[label] = s = summarize(values)
        cpu_us = statistics.fmean(cpu[label]) * 1e6
        print(f"{label:<26}{s['n']:>7}{s['p50']:>8.3f}ms{s['p90']:>8.3f}ms{s['p99']:>8.3f}ms{s['max']:>8.2f}ms"
              f"{s['mean']:>8.3f}ms{cpu_us:>14.0f} µs")
    d, a, t = stats["daemon"], stats["bare asyncio"], stats["bare trio+trio_asyncio"]
    print(f"\nratio daemon p50 / bare asyncio p50     = {d['p50'] / a['p50']:.2f}x")
    print(f"ratio bare trio p50 / bare asyncio p50  = {t['p50'] / a['p50']:.2f}x   (the trio-asyncio bridge alone)")
    print(f"ratio daemon p50 / bare trio p50        = {d['p50'] / t['p50']:.2f}x   (the daemon's own work per call; "
          f"target <= {TARGET_RATIO}x: {'within' if d['p50'] / t['p50'] <= TARGET_RATIO else 'OVER'})")
    print(f"ratio daemon mean / bare asyncio mean   = {d['mean'] / a['mean']:.2f}x")
    print(f"daemon p99 = {d['p99']:.3f} ms   (target <= {TARGET_P99_MS} ms: "
          f"{'within' if d['p99'] <= TARGET_P99_MS else 'OVER'})")
    gap = d["p50"] - a["p50"]
    if gap > 0:
        bridge = t["p50"] - a["p50"]
        print(f"p50 gap daemon - bare asyncio = {gap * 1000:.0f} µs, of which the bridge (bare trio - bare asyncio) "
              f"= {bridge * 1000:.0f} µs ({bridge / gap:.0%})")
    if warnings:
        print(f"daemon log warnings/errors during the run: {len(warnings)}; first: {warnings[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One uevent -> the DRA pool's new generation stored on the API server stand-in.

The daemon runs as a DRA driver (``--node-name node1``, ``--kubeconfig`` for the stand-in of
``tests/apiserver.py``, real HTTP through the official client) with one DRA pool,
``intel.com/sriov_vfs``: every vfio-pci VF of the fake host, published as ResourceSlices of pool
``node1/intel.com/sriov-vfs`` (at most 128 devices a slice). Uevents come over the ``unix:`` seam.
For each pool size (``--sizes``, default 8, 128 and 1024 VFs: one slice, one full slice, eight
full slices), a fresh fake host, stand-in and daemon; then each cycle takes the last VF of one PF
(the PFs in turn)

* **remove**: out of the fake sysfs (its ``virtfn`` link, its IOMMU group link, its directory),
  then ``remove@<devpath>`` is sent: the pool loses it (size - 1; the slice count stays);
* **add**: made again in sysfs and bound to vfio-pci, then ``add@<devpath>`` is sent: it is back.

The sysfs change is made before the clock starts; **time zero is just before ``sendto``**. The
clock stops at the stand-in's stamp of the write that completed the pool's new generation showing
the change: every slice of the pool at that generation, as many as ``resourceSliceCount``, the VF
in (or out of) their devices. The stamp is taken by the stand-in's thread that stored the write,
under its lock (a listener in a subclass of the stand-in, ``benchmarks/dra_common.py``; nothing
polls). Every change raises the generation, so with 8 slices every change is 8 PUTs.

Also printed: the time to the first slice write, slice writes and API requests per change, extra
generations in the ``--gap`` after each change (should be 0), wrong device counts, and the daemon's
CPU per change by thread. Never asserts timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks._common import (
    DaemonFailure,
    check_exit,
    host_tmp,
    machine_line,
    percentile,
    report_failure,
    short_tmp,
)
from benchmarks._common import vf_address as sriov_vf_address
from benchmarks._events import (
    Seam,
    clean_up,
    cpu_by_thread_name,
    latency_row,
    revision_line,
    thread_cpu_ns,
    uevent_payload,
)
from benchmarks.dra_common import (
    NODE,
    SLICE_DEVICES,
    StampedApiServer,
    add_vf,
    build_dra_host,
    dra_bytecode_env,
    dra_config,
    dra_daemon,
    in_process_slice_costs,
    iommu_group,
    kinds_text,
    remove_vf,
    requests_by_kind,
    wait_generation,
)
from daemon.dra import device_name

TARGET_P50, TARGET_P99 = 0.020, 0.050
ACTIONS = ("remove", "add")
WIDTH = 40


def run_size(size: int, base: Path, host_dir: Path, env: dict[str, str], arguments: argparse.Namespace) -> dict:
    workdir = base / f"n{size}"
    workdir.mkdir()
    started = time.perf_counter()
    host, pfs, per_pf = build_dra_host(host_dir / f"host{size}", size)
    built = time.perf_counter() - started
    api = StampedApiServer().start()
    api.add_node(NODE)
    seam = Seam(workdir / "uevents.sock")
    daemon = dra_daemon(workdir, host, dra_config(), api, seam, env)
    slices = -(-size // SLICE_DEVICES)
    try:
        daemon.start()
        seam.wait_ready(daemon)
        first = wait_generation(api, daemon, 0, lambda g: len(g.names) == size, 60,
                                f"the pool published with {size} devices")
        print(f"\n[{size} VFs: {pfs} PF(s) x {per_pf}, {slices} slice(s)] host built in {built:.1f} s; pool "
              f"published (generation {first.generation}, {first.slices} slices) "
              f"{first.stamp - daemon.started_mono:.2f} s after Popen", flush=True)
        time.sleep(0.3)
        latencies: dict[str, list[float]] = {action: [] for action in ACTIONS}
        first_write: list[float] = []
        standin: list[float] = []  # per change: the stand-in's handling of the requests up to the stamp
        rest: list[float] = []  # the latency less that: the daemon, its client, the loopback
        writes_per_change: list[int] = []
        requests: dict[str, int] = {}
        extra = wrong = 0
        cpu_before = None
        timed_from = None
        for number in range(arguments.warmup + arguments.samples):
            if number == arguments.warmup:
                cpu_before = thread_cpu_ns(daemon.pid)
                timed_from = len(api.handled)
            pf = number % pfs
            vf = per_pf - 1
            address = sriov_vf_address(pf, vf)
            name = device_name(address)
            group = iommu_group(pf, vf, per_pf)
            for action in ACTIONS:
                with api._cond:
                    generations_before, writes_before, handled_before = (len(api.generations), len(api.writes),
                                                                         len(api.handled))
                if action == "remove":
                    devpath = remove_vf(host, pf, vf, group)
                    payload = uevent_payload("remove", devpath, "pci", PCI_SLOT_NAME=address)
                    expected = size - 1
                else:
                    add_vf(host, pf, vf, group)
                    payload = uevent_payload("add", host.devpath(address), "pci", PCI_SLOT_NAME=address)
                    expected = size
                present = action == "add"
                sent = seam.send_payload(payload)
                generation = wait_generation(api, daemon, generations_before, lambda g: (name in g.names) == present,
                                             arguments.timeout, f"{address} {action}d: a generation showing it")
                time.sleep(arguments.gap)
                if number < arguments.warmup:
                    continue
                latencies[action].append(generation.stamp - sent)
                with api._cond:
                    window = [r for r in api.handled[handled_before:] if not r.watch and r.start <= generation.stamp]
                in_standin = sum(min(r.end, generation.stamp) - r.start for r in window)
                standin.append(in_standin)
                rest.append(generation.stamp - sent - in_standin)
                first_write.append(api.writes[writes_before].stamp - sent)
                writes_per_change.append(len(api.writes) - writes_before)
                extra += sum(1 for g in api.generations[generations_before:] if g.pool == generation.pool) - 1
                if len(generation.names) != expected or generation.slices != slices:
                    wrong += 1
                    print(f"  wrong generation after {action} of {address}: {len(generation.names)} devices in "
                          f"{generation.slices} slices")
        assert cpu_before is not None and timed_from is not None
        used = cpu_by_thread_name(cpu_before, thread_cpu_ns(daemon.pid), daemon.pid)
        with api._cond:
            timed = [r for r in api.handled[timed_from:] if not r.watch]
        requests = requests_by_kind(timed)
        handling = [r.end - r.start for r in timed if r.method == "PUT"]
        code, stop_seconds = daemon.stop()
        check_exit(code, daemon.log)
        errors = list(api.internal_errors)
    finally:
        clean_up(daemon.kill, api.close, seam.close)
    costs = in_process_slice_costs(host, workdir)
    changes = len(latencies["remove"]) + len(latencies["add"])
    return {"size": size, "slices": slices, "latencies": latencies, "first_write": first_write,
            "writes": writes_per_change, "requests": requests, "changes": changes, "extra": extra, "wrong": wrong,
            "cpu": used, "stop": stop_seconds, "code": code, "internal_errors": errors, "handling": handling,
            "costs": costs, "standin": standin, "rest": rest}


def report(result: dict) -> None:
    size, changes = result["size"], result["changes"]
    latencies = result["latencies"]
    both = latencies["remove"] + latencies["add"]
    print(f"\n{size} VFs, {result['slices']} slice(s): sendto -> the stand-in stored the generation showing the change")
    print(latency_row("remove (VF leaves the pool)", latencies["remove"], width=WIDTH))
    print(latency_row("add (VF back)", latencies["add"], width=WIDTH))
    print(latency_row("both", both, width=WIDTH))
    print(latency_row("  of which the stand-in's handling", result["standin"], width=WIDTH))
    print(latency_row("  the rest (daemon, client, loopback)", result["rest"], width=WIDTH))
    print(latency_row("sendto -> first slice write stored", result["first_write"], width=WIDTH))
    writes = result["writes"]
    print(f"  slice writes per change: min {min(writes)}, max {max(writes)}, mean {sum(writes) / len(writes):.2f}; "
          f"API requests in all ({changes} changes): {kinds_text(result['requests']) or 'none'}")
    print(f"  extra generations after a change: {result['extra']}; wrong generations: {result['wrong']}; "
          f"stand-in internal errors: {len(result['internal_errors'])}")
    used = result["cpu"]
    parts = ", ".join(f"{name} {ns / changes / 1000:.0f}" for name, ns in sorted(used.items(), key=lambda i: -i[1])
                      if ns / changes >= 1000)
    print(f"  daemon CPU per change: {sum(used.values()) / changes / 1000:.0f} us ({parts} us by thread)")
    print(latency_row("the stand-in handling one PUT", result["handling"], width=WIDTH))
    costs = result["costs"]
    print(f"  in this process, the daemon's steps of one write (medians): slice_devices of the whole pool "
          f"({costs['devices']} devices) {costs['slice_devices'] * 1000:.2f} ms, slice_bodies "
          f"{costs['slice_bodies'] * 1000:.2f} ms; per slice ({min(costs['devices'], SLICE_DEVICES)} devices, "
          f"{costs['body_bytes'] / 1000:.0f} kB): the client's sanitize_for_serialization "
          f"{costs['sanitize'] * 1000:.2f} ms, json.dumps {costs['dumps'] * 1000:.2f} ms, json.loads of it "
          f"{costs['loads'] * 1000:.2f} ms (the answer, and again the watch event)")
    print(f"  SIGTERM -> exit {result['stop'] * 1000:.0f} ms, exit code {result['code']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 128, 1024],
                        help="pool sizes in VFs, 64 per PF (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=100, help="remove+add cycles per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed cycles first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds after each change (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    arguments = parser.parse_args(argv)

    print(f"dra_slices: one DRA pool of vfio-pci VFs, sizes {arguments.sizes}; {arguments.samples} remove + "
          f"{arguments.samples} add uevents per size through the unix seam, gap {arguments.gap * 1000:.0f} ms; "
          f"clock stops at the stand-in's stamp of the write completing the new generation (a listener in "
          f"its _commit, no polling)", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    results = []
    with short_tmp() as base, host_tmp() as host_dir:
        env = dra_bytecode_env(base)
        try:
            for size in arguments.sizes:
                results.append(run_size(size, base, host_dir, env, arguments))
        except DaemonFailure as error:
            report_failure(error)
            return 1
    for result in results:
        report(result)
    print(f"\ntargets: p50 <= {TARGET_P50 * 1000:.0f} ms, p99 <= {TARGET_P99 * 1000:.0f} ms (both directions):")
    for result in results:
        both = result["latencies"]["remove"] + result["latencies"]["add"]
        p50, p99 = percentile(both, 50), percentile(both, 99)
        ok = p50 <= TARGET_P50 and p99 <= TARGET_P99
        rest50, rest99 = percentile(result["rest"], 50), percentile(result["rest"], 99)
        print(f"  {result['size']:5d} VFs ({result['slices']} slice(s)): p50 {p50 * 1000:6.2f} ms, p99 {p99 * 1000:6.2f} ms "
              f"({'within target' if ok else 'OVER target'}); less the stand-in's own handling: p50 "
              f"{rest50 * 1000:6.2f} ms, p99 {rest99 * 1000:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One uevent on a big host: unbind/bind one VF among 4096 -> the changed list of its pool.

The fake host and pools are cold_start's: 64 i40e PFs x 64 VFs bound to vfio-pci (4096 VFs), 16
``netDevice`` pools of 256 (``intel.com/sriov_pool00`` ... ``sriov_pool15``). The daemon runs with
``--uevent-source unix:PATH`` and is registered with the kubelet stand-in, every pool listed.

Each sample picks a VF (a fixed pseudo-random sequence over all 4096), then

* **unbind**: removes its ``driver`` link in the fake sysfs (as the kernel does before it sends
  the event), then sends ``unbind@<devpath>`` (SUBSYSTEM=pci): the VF has no driver any more, so
  it leaves its pool (255 devices);
* **bind**: links it to vfio-pci again and sends ``bind@<devpath>`` with ``DRIVER=vfio-pci``: it
  comes back (256).

Latency is from just before ``sendto`` on the seam to the stand-in receiving the first list of
that pool with the change (it stamps every message on arrival). The sysfs change is made before
the clock starts. Between samples the benchmark sleeps ``--gap`` (default 50 ms), past the
stream's 20 ms coalescing window. It also counts messages on the 15 other pools (there should be
none: only the changed resource's stream is woken), and for contrast times, in this process, a
full rescan + build of the same host: what each event would cost if it meant a rescan.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from benchmarks._common import (
    Daemon,
    DaemonFailure,
    build_sriov_host,
    bytecode_env,
    check_exit,
    host_tmp,
    machine_line,
    median,
    percentile,
    report_failure,
    short_tmp,
    vf_address,
    wait_kubelet,
)
from benchmarks._events import (
    Seam,
    clean_up,
    cpu_by_thread_name,
    latency_row,
    revision_line,
    thread_cpu_ns,
    uevent_payload,
    wait_message,
)
from benchmarks.cold_start import (
    DEVICES_PER_POOL,
    PFS,
    PFS_PER_POOL,
    POOLS,
    RESOURCES,
    VFS_PER_PF,
    in_process_tree_build,
    pool_config,
)
from tests.kubelet import FakeKubelet

TARGET_P50, TARGET_P99 = 0.002, 0.010


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200, help="unbind+bind pairs (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed pairs first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between events (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    arguments = parser.parse_args(argv)

    print(f"seam_latency: {PFS} PFs x {VFS_PER_PF} VFs = {PFS * VFS_PER_PF} vfio-pci VFs in {POOLS} pools; "
          f"{arguments.samples} unbind + {arguments.samples} bind uevents through the unix seam, "
          f"gap {arguments.gap * 1000:.0f} ms", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    with short_tmp() as base, host_tmp() as host_dir:
        started = time.perf_counter()
        host = build_sriov_host(host_dir / "host", PFS, VFS_PER_PF)
        print(f"fake host built in {time.perf_counter() - started:.1f} s (not timed)", flush=True)
        env = bytecode_env(base)
        seam = Seam(base / "uevents.sock")
        kubelet = FakeKubelet(base / "device-plugins")
        kubelet.start()
        daemon = Daemon(base, host, pool_config(), env=env)
        daemon.arguments += ["--uevent-source", seam.argument]
        try:
            daemon.start()
            seam.wait_ready(daemon)
            wait_kubelet(kubelet, daemon, lambda k: all(
                k.state(r).connected and len(k.state(r).devices) == DEVICES_PER_POOL for r in RESOURCES),
                60, f"all {POOLS} pools listed with {DEVICES_PER_POOL} devices")
            listed = time.monotonic() - daemon.started_mono
            print(f"daemon registered, all pools listed {listed:.2f} s after Popen", flush=True)
            time.sleep(0.3)

            rng = random.Random(arguments.seed)
            total = arguments.warmup + arguments.samples
            picks = [divmod(n, VFS_PER_PF) for n in rng.sample(range(PFS * VFS_PER_PF), total)]
            latencies: dict[str, list[float]] = {"unbind": [], "bind": []}
            extra = 0
            wrong = 0
            others_before = {r: len(kubelet.state(r).messages) for r in RESOURCES}
            own_messages = 0
            cpu_before = None
            for number, (pf, vf) in enumerate(picks):
                if number == arguments.warmup:
                    cpu_before = thread_cpu_ns(daemon.pid)
                    others_before = {r: len(kubelet.state(r).messages) for r in RESOURCES}
                    own_messages = 0
                address = vf_address(pf, vf)
                resource = RESOURCES[pf // PFS_PER_POOL]
                state = kubelet.state(resource)
                devpath = host.devpath(address)
                for action in ("unbind", "bind"):
                    if action == "unbind":
                        host.unbind(address)
                        payload = uevent_payload("unbind", devpath, "pci")
                        predicate = lambda m, a=address: a not in m  # noqa: E731
                        expected = DEVICES_PER_POOL - 1
                    else:
                        host.bind(address, "vfio-pci")
                        payload = uevent_payload("bind", devpath, "pci", DRIVER="vfio-pci")
                        predicate = lambda m, a=address: a in m  # noqa: E731
                        expected = DEVICES_PER_POOL
                    before = len(state.messages)
                    sent = seam.send_payload(payload)
                    index = wait_message(kubelet, daemon, resource, before, predicate, arguments.timeout,
                                         f"{resource}: {address} after {action}")
                    if number >= arguments.warmup:
                        latencies[action].append(state.received_at[index] - sent)
                    message = state.messages[index]
                    if len(message) != expected or any(h != "Healthy" for h, _ in message.values()):
                        wrong += 1
                        print(f"  wrong list after {action} of {address}: {len(message)} devices, "
                              f"{sum(h != 'Healthy' for h, _ in message.values())} not Healthy")
                    time.sleep(arguments.gap)
                    if number >= arguments.warmup:
                        extra += len(state.messages) - before - 1
                        own_messages += len(state.messages) - before
            assert cpu_before is not None
            used = cpu_by_thread_name(cpu_before, thread_cpu_ns(daemon.pid), daemon.pid)
            events = 2 * arguments.samples
            # Messages on pools other than the one changed, over the timed samples.
            all_messages = sum(len(kubelet.state(r).messages) - others_before[r] for r in RESOURCES)
            stray = all_messages - own_messages
            code, stop_seconds = daemon.stop()
            check_exit(code, daemon.log)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        finally:
            clean_up(daemon.kill, kubelet.close, seam.close)

        rescans = in_process_tree_build(host, base, repeats=3)

    both = latencies["unbind"] + latencies["bind"]
    print(f"\nsendto -> changed list received ({arguments.warmup} warm-up pairs not counted):")
    print(latency_row("unbind (VF leaves its pool)", latencies["unbind"]))
    print(latency_row("bind (VF comes back)", latencies["bind"]))
    print(latency_row("both", both))
    print(f"  extra messages on the changed pool: {extra}; messages on the other {POOLS - 1} pools: {stray}; "
          f"wrong lists: {wrong}")
    total_cpu = sum(used.values())
    parts = ", ".join(f"{name} {ns / events / 1000:.0f}" for name, ns in sorted(used.items(), key=lambda i: -i[1])
                      if ns / events >= 1000)
    print(f"  daemon CPU per event: {total_cpu / events / 1000:.0f} us ({parts} us by thread)")
    print(f"  SIGTERM -> exit {stop_seconds * 1000:.0f} ms, exit code {code}")
    full = [r["total"] for r in rescans]
    print(f"\nfor contrast, in this process: a full scan + build + tree of this host takes median "
          f"{median(full) * 1000:.0f} ms (scan {median([r['scan'] for r in rescans]) * 1000:.0f} ms, build "
          f"{median([r['build'] for r in rescans]) * 1000:.0f} ms, tree {median([r['tree'] for r in rescans]) * 1000:.0f}"
          f" ms); one event end-to-end: p50 {percentile(both, 50) * 1000:.2f} ms")
    p50, p99 = percentile(both, 50), percentile(both, 99)
    ok = p50 <= TARGET_P50 and p99 <= TARGET_P99
    print(f"\ntargets: p50 <= {TARGET_P50 * 1000:.0f} ms, p99 <= {TARGET_P99 * 1000:.0f} ms: p50 {p50 * 1000:.2f} ms, "
          f"p99 {p99 * 1000:.2f} ms ({'within target' if ok else 'OVER target'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

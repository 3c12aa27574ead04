"""Real kernel events -> the kubelet stand-in receiving the changed ListAndWatch list.

The daemon runs in a fresh network namespace (``ip netns exec``) with ``--uevent-source kernel``
and ``--dev-root /dev``, against a small fake PCI host whose PF netdev is named after a real veth
in that namespace. Two pools:

* ``devplugd.io/carrier_vfs``: 8 VFs bound to vfio-pci under the fake PF ``0000:01:00.0``, whose
  netdev is ``dpf0``; ``dpf0`` is a real veth in the namespace (peer ``dpf0p``). A vfio VF has no
  netdev, so its health follows the PF's link: Unhealthy while ``dpf0`` is up without carrier.
* ``devplugd.io/taps``: a devNode pool of ``/dev/tap*``. An anchor macvtap (``dtap0`` on
  ``dpf0``) keeps it non-empty (an empty pool is not registered).

(1) carrier: set ``dpf0p`` down (``dpf0`` loses carrier: every VF Unhealthy), then up again
    (Healthy). (2) macvtap: create ``dtap1`` on ``dpf0`` (the kernel makes ``/dev/tapN`` and sends
    a ``macvtap`` uevent with ``DEVNAME=tapN``: the pool gains ``tapN``), then delete it.

Clock starts (this process's ``time.monotonic()``):

* **from request**: just before ``send()`` of the rtnetlink request on a NETLINK_ROUTE socket
  this process opened inside the namespace (a hand-built message, no process spawned per change);
* **from ack**: when the kernel's ack of that request arrived (the change is done);
* **from kernel event**: when a listener thread in this process, with its own sockets in the
  namespace on the same groups the daemon reads (rtnetlink links, uevents), woke up for the
  event (``dpf0``'s carrier flip; the ``macvtap`` uevent).

The clock stops when the stand-in received the first list of that pool showing the change (it
stamps every message on arrival). Between samples the benchmark sleeps ``--gap`` (default 50 ms)
so that the stream's 20 ms coalescing window has passed and each change is sent at once.
Never asserts; prints p50/p90/p99/max.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks._common import (
    PYTHON,
    Daemon,
    DaemonFailure,
    bytecode_env,
    check_exit,
    host_tmp,
    machine_line,
    percentile,
    report_failure,
    short_tmp,
    wait_kubelet,
)
from benchmarks._events import (
    KernelEventStamper,
    Netns,
    Rtnl,
    clean_up,
    cpu_by_thread_name,
    latency_row,
    revision_line,
    thread_cpu_ns,
    unique_netns_name,
    wait_message,
)
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

PF = "0000:01:00.0"
VFS = 8
PF_NETDEV, PEER = "dpf0", "dpf0p"
ANCHOR_TAP, SAMPLE_TAP = "dtap0", "dtap1"
PREFIX = "devplugd.io"
CARRIER_POOL = f"{PREFIX}/carrier_vfs"
TAP_POOL = f"{PREFIX}/taps"
TARGET_P50, TARGET_P99 = 0.003, 0.010


def config() -> dict:
    return {"resourceList": [
        {"resourceName": "carrier_vfs", "resourcePrefix": PREFIX,
         "selectors": {"drivers": ["vfio-pci"], "pfNames": [PF_NETDEV]}},
        {"resourceName": "taps", "resourcePrefix": PREFIX, "deviceType": "devNode",
         "selectors": {"paths": ["/dev/tap*"]}},
    ]}


def build_host(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.add_pf(PF, netdev=PF_NETDEV, total_vfs=VFS)
    host.add_vfs(PF, [f"0000:01:{0x10 + i >> 3:02x}.{(0x10 + i) & 7}" for i in range(VFS)], driver="vfio-pci",
                 iommu_groups=[100 + i for i in range(VFS)])
    return host


def all_health(expected: str):
    return lambda m: len(m) == VFS and all(health == expected for health, _ in m.values())


def measure_carrier(kubelet: FakeKubelet, daemon: Daemon, rtnl: Rtnl, stamper: KernelEventStamper, peer: int,
                    pf_index: int, cycles: int, gap: float, timeout: float) -> dict[str, list[float]]:
    state = kubelet.state(CARRIER_POOL)
    out: dict[str, list[float]] = {k: [] for k in ("down", "up", "kernel_ack", "down_kernel", "up_kernel",
                                                   "extra", "missing_kernel")}
    for _ in range(cycles):
        for up in (False, True):
            name = "up" if up else "down"
            before = len(state.messages)
            started, acked = rtnl.set_up(peer, up)
            index = wait_message(kubelet, daemon, CARRIER_POOL, before,
                                 all_health("Healthy" if up else "Unhealthy"), timeout,
                                 f"{CARRIER_POOL}: every VF {'Healthy' if up else 'Unhealthy'} after {PEER} {name}")
            received = state.received_at[index]
            out[name].append(received - started)
            out["kernel_ack"].append(acked - started)
            kernel = stamper.first(started, ("link", pf_index, True, up))
            if kernel is None:
                out["missing_kernel"].append(1)
            else:
                out[f"{name}_kernel"].append(received - kernel)
            time.sleep(gap)
            out["extra"].append(len(state.messages) - before - 1)  # messages besides the one awaited
            stamper.forget_before(started)
    return out


def measure_macvtap(kubelet: FakeKubelet, daemon: Daemon, rtnl: Rtnl, stamper: KernelEventStamper, lower: int,
                    cycles: int, gap: float, timeout: float) -> dict[str, list[float]]:
    state = kubelet.state(TAP_POOL)
    out: dict[str, list[float]] = {k: [] for k in ("add", "remove", "add_ack", "remove_ack", "add_kernel",
                                                   "remove_kernel", "extra", "wrong", "missing_kernel")}
    for _ in range(cycles):
        base = set(state.messages[-1])
        before = len(state.messages)
        started, acked = rtnl.add_macvtap(SAMPLE_TAP, lower)
        tap = f"tap{rtnl.index_of(SAMPLE_TAP)}"
        index = wait_message(kubelet, daemon, TAP_POOL, before, lambda m: tap in m, timeout,
                             f"{TAP_POOL} gains {tap}")
        received = state.received_at[index]
        out["add"].append(received - started)
        out["add_ack"].append(acked - started)
        kernel = stamper.first(started, ("uevent", "add", "macvtap", tap))
        if kernel is None:
            out["missing_kernel"].append(1)
        else:
            out["add_kernel"].append(received - kernel)
        if set(state.messages[index]) != base | {tap}:
            out["wrong"].append(1)
            print(f"  wrong list after adding {tap}: {sorted(state.messages[index])} (before: {sorted(base)})")
        time.sleep(gap)
        out["extra"].append(len(state.messages) - before - 1)
        stamper.forget_before(started)

        before = len(state.messages)
        started, acked = rtnl.delete(SAMPLE_TAP)
        index = wait_message(kubelet, daemon, TAP_POOL, before, lambda m: tap not in m, timeout,
                             f"{TAP_POOL} loses {tap}")
        received = state.received_at[index]
        out["remove"].append(received - started)
        out["remove_ack"].append(acked - started)
        kernel = stamper.first(started, ("uevent", "remove", "macvtap", tap))
        if kernel is None:
            out["missing_kernel"].append(1)
        else:
            out["remove_kernel"].append(received - kernel)
        if set(state.messages[index]) != base:
            out["wrong"].append(1)
            print(f"  wrong list after removing {tap}: {sorted(state.messages[index])} (expected {sorted(base)})")
        time.sleep(gap)
        out["extra"].append(len(state.messages) - before - 1)
        stamper.forget_before(started)
    return out


def cpu_line(used: dict[str, int], changes: int) -> str:
    """Total daemon CPU per change, then the threads that used any, biggest first."""
    total = sum(used.values()) / changes / 1000
    parts = [f"{name} {ns / changes / 1000:.0f}" for name, ns in sorted(used.items(), key=lambda i: -i[1])
             if ns / changes >= 1000]
    return f"{total:.0f} us ({', '.join(parts)} us by thread)"


def negative(values: list[float]) -> int:
    return sum(1 for value in values if value < 0)


def target_line(label: str, values: list[float]) -> str:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    ok = p50 <= TARGET_P50 and p99 <= TARGET_P99
    return (f"  {label:<44} p50 {p50 * 1000:5.2f} ms, p99 {p99 * 1000:5.2f} ms  "
            f"({'within target' if ok else 'OVER target'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200, help="samples of each change (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed cycles first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.05,
                        help="seconds between changes, past the 20 ms coalescing window (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per wait, seconds (default: %(default)s)")
    arguments = parser.parse_args(argv)

    print(f"event_latency: real rtnetlink carrier flips and macvtap nodes -> ListAndWatch; {arguments.samples} "
          f"samples each, gap {arguments.gap * 1000:.0f} ms", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    netns = Netns(unique_netns_name("ev"))
    with short_tmp() as base, host_tmp() as host_dir:
        kubelet: FakeKubelet | None = None
        daemon: Daemon | None = None
        rtnl: Rtnl | None = None
        stamper: KernelEventStamper | None = None
        try:
            netns.create()
            netns.ip("link", "add", PF_NETDEV, "type", "veth", "peer", "name", PEER)
            netns.ip("link", "set", PF_NETDEV, "up")
            netns.ip("link", "set", PEER, "up")
            netns.ip("link", "add", "link", PF_NETDEV, "name", ANCHOR_TAP, "type", "macvtap", "mode", "bridge")
            rtnl = Rtnl(netns)
            peer, pf_index = rtnl.index_of(PEER), rtnl.index_of(PF_NETDEV)
            anchor = f"tap{rtnl.index_of(ANCHOR_TAP)}"
            if not (Path("/dev") / anchor).exists():
                print(f"WARNING: /dev/{anchor} does not exist after creating {ANCHOR_TAP}")
            host = build_host(host_dir / "host")
            env = bytecode_env(base)
            kubelet = FakeKubelet(base / "device-plugins")
            kubelet.start()
            daemon = Daemon(base, host, config(), env=env)
            daemon.arguments = [*netns.exec_prefix(), *daemon.arguments,
                                "--dev-root", "/dev", "--uevent-source", "kernel"]
            daemon.start()
            print(f"namespace {netns.name}: veth {PF_NETDEV} (ifindex {pf_index}) <-> {PEER} (ifindex {peer}); "
                  f"anchor macvtap {ANCHOR_TAP} = /dev/{anchor}; daemon pid {daemon.pid}", flush=True)
            wait_kubelet(kubelet, daemon, lambda k: len(k.state(CARRIER_POOL).devices) == VFS
                         and k.state(CARRIER_POOL).healthy == set(k.state(CARRIER_POOL).devices)
                         and anchor in k.state(TAP_POOL).devices, 30, "both pools listed (8 healthy VFs, the anchor tap)")
            comm = Path(f"/proc/{daemon.pid}/comm").read_text().strip()
            stamper = KernelEventStamper(netns, PYTHON)
            time.sleep(0.2)

            cycles_note = f"({arguments.warmup} warm-up cycles not counted)"
            measure_carrier(kubelet, daemon, rtnl, stamper, peer, pf_index, arguments.warmup, arguments.gap,
                            arguments.timeout)
            cpu0 = thread_cpu_ns(daemon.pid)
            carrier = measure_carrier(kubelet, daemon, rtnl, stamper, peer, pf_index, arguments.samples,
                                      arguments.gap, arguments.timeout)
            carrier_cpu = cpu_by_thread_name(cpu0, thread_cpu_ns(daemon.pid), daemon.pid)
            measure_macvtap(kubelet, daemon, rtnl, stamper, pf_index, arguments.warmup, arguments.gap,
                            arguments.timeout)
            cpu0 = thread_cpu_ns(daemon.pid)
            taps = measure_macvtap(kubelet, daemon, rtnl, stamper, pf_index, arguments.samples, arguments.gap,
                                   arguments.timeout)
            taps_cpu = cpu_by_thread_name(cpu0, thread_cpu_ns(daemon.pid), daemon.pid)

            code, stop_seconds = daemon.stop()
            print(f"\n(1) carrier: {PEER} down/up -> {CARRIER_POOL} all Unhealthy / all Healthy {cycles_note}")
            for name in ("down", "up"):
                print(latency_row(f"{name}, from request", carrier[name]))
                print(latency_row(f"{name}, from kernel event ({PF_NETDEV})", carrier[f"{name}_kernel"]))
            both = carrier["down"] + carrier["up"]
            both_kernel = carrier["down_kernel"] + carrier["up_kernel"]
            print(latency_row("down+up, from request", both))
            print(latency_row("down+up, from kernel event", both_kernel))
            print(latency_row("(kernel: request -> ack)", carrier["kernel_ack"]))
            print(f"  extra messages (besides the one awaited): {sum(carrier['extra'])}; "
                  f"kernel stamps after the list arrived: {negative(both_kernel)}; "
                  f"kernel events not seen by the listener: {len(carrier['missing_kernel'])}; "
                  f"daemon CPU per change: {cpu_line(carrier_cpu, 2 * arguments.samples)}")
            print(f"\n(2) macvtap: create/delete {SAMPLE_TAP} on {PF_NETDEV} -> {TAP_POOL} gains/loses /dev/tapN "
                  f"{cycles_note}")
            for name in ("add", "remove"):
                print(latency_row(f"{name}, from request", taps[name]))
                print(latency_row(f"{name}, from kernel event (uevent)", taps[f"{name}_kernel"]))
            taps_both = taps["add"] + taps["remove"]
            taps_kernel = taps["add_kernel"] + taps["remove_kernel"]
            print(latency_row("add+remove, from request", taps_both))
            print(latency_row("add+remove, from kernel event", taps_kernel))
            print(latency_row("(kernel: create request -> ack)", taps["add_ack"]))
            print(latency_row("(kernel: delete request -> ack)", taps["remove_ack"]))
            print(f"  extra messages: {sum(taps['extra'])}; wrong lists: {len(taps['wrong'])}; "
                  f"kernel stamps after the list arrived: {negative(taps_kernel)}; kernel events not "
                  f"seen by the listener: {len(taps['missing_kernel'])}")
            print(f"  daemon CPU per change: {cpu_line(taps_cpu, 2 * arguments.samples)}")
            print(f"\ndaemon process: {comm!r} (pid {daemon.pid}, exec'd by ip netns exec); SIGTERM -> exit "
                  f"{stop_seconds * 1000:.0f} ms, exit code {code}")
            print(f"\ntargets: p50 <= {TARGET_P50 * 1000:.0f} ms, p99 <= {TARGET_P99 * 1000:.0f} ms")
            print(target_line("carrier down+up, from request", both))
            print(target_line("carrier down+up, from kernel event", both_kernel))
            print(target_line("macvtap add+remove, from request", taps_both))
            print(target_line("macvtap add+remove, from kernel event", taps_kernel))
            check_exit(code, daemon.log)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        finally:
            clean_up(*(step for step in (stamper and stamper.close, daemon and daemon.kill,
                                         kubelet and kubelet.close, rtnl and rtnl.close) if step),
                     netns.delete)
    return 0


if __name__ == "__main__":
    sys.exit(main())

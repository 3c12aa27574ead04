"""One VF's carrier loss in a 4096-VF DRA pool -> the taint written in place; then 20 hotplugs.

Issue 22's targets for device taints, measured against the real daemon process:

* The fake host has 64 i40e PFs x 64 VFs (``benchmarks/_common.build_sriov_host``), 4096 VFs in
  one DRA pool, ``intel.com/sriov_vfs`` (``allocationApi: dra``, ``unhealthyTaint`` left at its
  default, ``NoSchedule``; selectors ``drivers: [vfio-pci, iavf]``). A pool that may carry taints
  has slices of at most 64 devices: 64 full slices. VF 0 of PF 0 is bound to iavf and has a
  netdev, ``dvf0``, which is the name of a REAL veth in a fresh network namespace (peer
  ``dvf0p``); the other 4095 are vfio-pci (no netdev). The PFs' netdevs (``ens<i>f0``) do not
  exist in the namespace, so the PF check (``checkHealthOnPf``) never makes a VF Unhealthy.
* The daemon runs in that namespace (``ip netns exec``), so rtnetlink's carrier changes reach it;
  uevents come over the ``unix:`` seam (a path socket: no namespace in the way). It is a DRA
  driver against the stamping API-server stand-in (``benchmarks/dra_common.StampedApiServer``,
  feature gate ``DRADeviceTaints`` on: it keeps taints and validates as 1.37 does), whose
  listening socket is made inside the namespace (on the namespace's own loopback, set up there),
  and it registers with the kubelet stand-in (``tests/kubelet.py``) through ``plugins_registry``;
  the stand-in follows the plugin's DRAResourceHealth stream (v1), as a 1.37 kubelet does. The
  kubelet stand-in runs in a process of its own (``benchmarks/_dra_kubelet.py``), as a real
  kubelet does: in this process, its decoding of each 4096-device health message held the GIL
  the API stand-in needed to handle and stamp the slice PUT sent at the same moment. It reports
  each health message's arrival stamp (``time.monotonic()``, a system-wide clock), its size and
  the VF's health in it over a pipe; the API stand-in stays in this process.

(1) **carrier**: ``dvf0p`` down (``dvf0`` stays admin-up and loses its carrier: the VF is
    Unhealthy, ``devplugd.io/carrier-lost``), then up again. ``--samples`` (100) of each after
    ``--warmup`` (5) cycles, ``--gap`` (0.1 s) after each change. The change is one hand-built
    RTM_NEWLINK on a NETLINK_ROUTE socket this process opened in the namespace
    (``benchmarks/_events.Rtnl``). Clock starts: **from request**, just before its ``send()``;
    **from kernel event**, when ``benchmarks/_stamper.py`` (a separate process in the namespace on
    the groups the daemon reads) woke up for ``dvf0``'s RTM_NEWLINK with the new carrier state.
    Clock stop: the stand-in's stamp (taken in ``_commit``, under its lock, by the thread that
    stores) of the first slice write whose devices carry the VF with the ``carrier-lost`` taint
    (loss), or carry it without one (recovery). Also: the kubelet stand-in's arrival stamp of the
    first health message that shows the VF Unhealthy (Healthy), slice writes per change (target 1),
    whether every write kept the pool's generation (target: yes), the time the pool was incomplete
    (target 0), the split of the latency at the stand-in's start of handling the PUT, and the
    daemon's CPU per change by thread.
(2) **hotplug**: ``--hotplugs`` (20) VFs made one at a time under a 65th PF (``0000:41:00.0``,
    no VFs at the start), each bound to vfio-pci in the fake sysfs, then its ``add`` uevent sent
    over the seam; time zero just before ``sendto``, stop at the stamp of the write that completed
    the pool with the VF in it. The first one finds the 64 slices full: it takes a 65th slice, a
    new generation (65 writes, by design); the next ones go to that slice while it has room (one
    write each). Printed per hotplug.
(3) Every answer of the API stand-in over the run, by status: 4xx counted (target: no 422).

Never asserts timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import (
    PYTHON,
    Daemon,
    DaemonFailure,
    check_exit,
    host_tmp,
    machine_line,
    percentile,
    pf_address,
    pf_netdev,
    report_failure,
    short_tmp,
)
from benchmarks._common import vf_address as sriov_vf_address
from benchmarks._dra_kubelet import KubeletProcess
from benchmarks._events import (
    KernelEventStamper,
    Netns,
    Rtnl,
    Seam,
    clean_up,
    cpu_by_thread_name,
    latency_row,
    revision_line,
    thread_cpu_ns,
    uevent_payload,
    unique_netns_name,
)
from benchmarks.dra_common import (
    DRIVER,
    NODE,
    POOL,
    RESOURCE_NAME,
    TAINTED_SLICE_DEVICES,
    Handled,
    StampedApiServer,
    add_vf,
    build_dra_host,
    dra_bytecode_env,
    dra_daemon,
    incomplete_seconds,
    iommu_group,
    kinds_text,
    requests_by_kind,
    wait_api,
    wait_generation,
)
from daemon.dra import device_name
from tests.fakesysfs import FakeHost

VFS = 4096
PFS, PER_PF = 64, 64
VF_NETDEV, PEER = "dvf0", "dvf0p"
NETDEV_VF = sriov_vf_address(0, 0)  # the VF bound to iavf, with the veth's name as its netdev
HOTPLUG_PF = PFS  # the 65th PF, 0000:41:00.0, which gets the hotplugged VFs
TAINT_KEY = f"{DRIVER}/carrier-lost"
EFFECT = "NoSchedule"
TARGET_P50, TARGET_P99 = 0.020, 0.050
WIDTH = 46


def config() -> dict[str, Any]:
    return {"resourceList": [{"resourceName": RESOURCE_NAME, "allocationApi": "dra",
                              "selectors": {"drivers": ["vfio-pci", "iavf"]}}]}


def build_host(root: Path) -> FakeHost:
    """4096 vfio-pci VFs (64 PFs x 64), then VF 0 of PF 0 moved to iavf with netdev ``dvf0``, and
    a 65th PF with no VFs yet (the hotplugs go there)."""
    host, _, _ = build_dra_host(root, VFS)
    host.unbind(NETDEV_VF)
    host.bind(NETDEV_VF, "iavf")
    host.add_netdev(NETDEV_VF, VF_NETDEV)
    host.add_pf(pf_address(HOTPLUG_PF), netdev=pf_netdev(HOTPLUG_PF), total_vfs=64, numa_node=0,
                bridge=f"0000:00:{HOTPLUG_PF // 8 + 1:02x}.{HOTPLUG_PF % 8}")
    return host


def carries(name: str, tainted: bool) -> Callable[[Any], bool]:
    """A slice write that holds ``name`` with (``tainted``) or without our carrier-lost taint."""
    def check(write: Any) -> bool:
        if write.pool != POOL or name not in write.names:
            return False
        has = any(device == name and key == TAINT_KEY for device, key, _ in write.taints)
        return has == tainted
    return check


def health_of(kubelet: KubeletProcess, name: str, since: float, wanted: str) -> float | None:
    """The arrival stamp of the first health message that arrived at ``since`` or later and
    reports the VF as ``wanted``."""
    return next((m.stamp for m in kubelet.messages_since(since) if m.health.get(name) == wanted), None)


def put_of(handled: list[Handled], stamp: float) -> Handled | None:
    """The slice PUT whose handling stored the write stamped ``stamp``: the latest one started
    before it that was still being handled then."""
    candidates = [r for r in handled if r.method == "PUT" and "/resourceslices/" in r.path
                  and r.start <= stamp <= r.end]
    return max(candidates, key=lambda r: r.start) if candidates else None


def measure_carrier(api: StampedApiServer, kubelet: KubeletProcess, daemon: Daemon, rtnl: Rtnl,
                    stamper: KernelEventStamper, peer: int, vf_index: int, cycles: int, gap: float,
                    timeout: float, follow_health: bool = True) -> dict[str, list[float]]:
    name = device_name(NETDEV_VF)
    keys = [f"{w}_{what}" for w in ("loss", "recovery")
            for what in ("request", "kernel", "health", "health_kernel", "to_put", "standin", "writes", "kept",
                         "incomplete", "ack", "extra_health")] + ["missing_kernel", "missing_health"]
    out: dict[str, list[float]] = {key: [] for key in keys}
    for _ in range(cycles):
        for up in (False, True):
            which = "recovery" if up else "loss"
            with api._cond:
                writes_before, handled_before = len(api.writes), len(api.handled)
                generation_before = next((w.generation for w in reversed(api.writes) if w.pool == POOL), -1)
            started, acked = rtnl.set_up(peer, up)
            check = carries(name, not up)

            def found() -> Any:
                return next((w for w in api.writes[writes_before:] if check(w)), None)

            write = wait_api(api, daemon, found, timeout,
                             f"a slice write with {name} {'without' if up else 'with'} the {TAINT_KEY} taint "
                             f"after {PEER} {'up' if up else 'down'}")
            wanted = "Healthy" if up else "Unhealthy"
            if follow_health:
                try:
                    kubelet.wait_for(lambda k: health_of(k, name, started, wanted) is not None, timeout,
                                     f"a health message with {name} {wanted}")
                except AssertionError:
                    pass  # counted as missing
            health = health_of(kubelet, name, started, wanted) if follow_health else None
            kernel = stamper.first(started, ("link", vf_index, True, up))
            time.sleep(gap)
            with api._cond:
                window = api.writes[writes_before:]
                handled = [r for r in api.handled[handled_before:] if not r.watch]
                end = time.monotonic()
                incomplete = incomplete_seconds(api, POOL, started, end)
            out[f"{which}_request"].append(write.stamp - started)
            out[f"{which}_ack"].append(acked - started)
            put = put_of(handled, write.stamp)
            if put is not None:
                out[f"{which}_to_put"].append(put.start - started)
                out[f"{which}_standin"].append(write.stamp - put.start)
            if kernel is None:
                out["missing_kernel"].append(1)
            else:
                out[f"{which}_kernel"].append(write.stamp - kernel)
            if health is None:
                if follow_health:
                    out["missing_health"].append(1)
            else:
                out[f"{which}_health"].append(health - started)
                if kernel is not None:
                    out[f"{which}_health_kernel"].append(health - kernel)
                out[f"{which}_extra_health"].append(len(kubelet.messages_since(started)) - 1)
            pool_writes = [w for w in window if w.pool == POOL]
            out[f"{which}_writes"].append(len(pool_writes))
            out[f"{which}_kept"].append(float(all(w.kind == "MODIFIED" and w.generation == generation_before
                                                  for w in pool_writes)))
            out[f"{which}_incomplete"].append(incomplete)
            stamper.forget_before(started)
    return out


def measure_hotplugs(api: StampedApiServer, daemon: Daemon, host: FakeHost, seam: Seam, count: int, gap: float,
                     timeout: float) -> list[dict[str, Any]]:
    rows = []
    for vf in range(count):
        address = sriov_vf_address(HOTPLUG_PF, vf)
        name = device_name(address)
        with api._cond:
            writes_before, generations_before = len(api.writes), len(api.generations)
            generation_before = next((w.generation for w in reversed(api.writes) if w.pool == POOL), -1)
        add_vf(host, HOTPLUG_PF, vf, iommu_group(HOTPLUG_PF, vf, PER_PF))
        sent = seam.send_payload(uevent_payload("add", host.devpath(address), "pci", PCI_SLOT_NAME=address))
        generation = wait_generation(api, daemon, generations_before, lambda g: name in g.names, timeout,
                                     f"hotplugged {address} in a complete generation of the pool")
        time.sleep(gap)
        with api._cond:
            window = [w for w in api.writes[writes_before:] if w.pool == POOL]
            incomplete = incomplete_seconds(api, POOL, sent, time.monotonic())
        rows.append({"vf": address, "latency": generation.stamp - sent, "writes": len(window),
                     "generation": (generation_before, generation.generation), "slices": generation.slices,
                     "devices": len(generation.names), "incomplete": incomplete,
                     "kinds": sorted({w.kind for w in window})})
    return rows


def four_xx(api: StampedApiServer) -> dict[int, int]:
    counts: dict[int, int] = {}
    for request in api.requests:
        counts[request.status] = counts.get(request.status, 0) + 1
    return counts


def cpu_line(used: dict[str, int], changes: int) -> str:
    total = sum(used.values()) / changes / 1000
    parts = [f"{name} {ns / changes / 1000:.0f}" for name, ns in sorted(used.items(), key=lambda i: -i[1])
             if ns / changes >= 1000]
    return f"{total:.0f} us ({', '.join(parts)} us by thread)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100, help="timed carrier loss+recovery cycles (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed cycles first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds after each change (default: %(default)s)")
    parser.add_argument("--hotplugs", type=int, default=20, help="VFs hotplugged one at a time (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    parser.add_argument("--no-health-stream", action="store_true",
                        help="the kubelet stand-in does not open the DRAResourceHealth stream (for comparison: "
                             "the daemon then builds no health message per change)")
    arguments = parser.parse_args(argv)
    follow_health = not arguments.no_health_stream

    print(f"dra_taints: one DRA pool of {VFS} VFs (slices of {TAINTED_SLICE_DEVICES}); {arguments.samples} carrier "
          f"losses + recoveries of one VF's real veth ({arguments.warmup} warm-up cycles, gap "
          f"{arguments.gap * 1000:.0f} ms), then {arguments.hotplugs} VF hotplugs over the unix seam; the clock stops "
          f"at the stand-in's stamp of the slice write (DRADeviceTaints on)", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    netns = Netns(unique_netns_name("dt"))
    with short_tmp() as base, host_tmp() as host_dir:
        api: StampedApiServer | None = None
        kubelet: KubeletProcess | None = None
        daemon: Daemon | None = None
        rtnl: Rtnl | None = None
        stamper: KernelEventStamper | None = None
        seam: Seam | None = None
        try:
            netns.create()
            netns.ip("link", "set", "lo", "up")  # the namespace's own loopback, for the API stand-in
            netns.ip("link", "add", VF_NETDEV, "type", "veth", "peer", "name", PEER)
            netns.ip("link", "set", VF_NETDEV, "up")
            netns.ip("link", "set", PEER, "up")
            rtnl = Rtnl(netns)
            peer, vf_index = rtnl.index_of(PEER), rtnl.index_of(VF_NETDEV)
            started = time.perf_counter()
            host = build_host(host_dir / "host")
            print(f"host built in {time.perf_counter() - started:.1f} s: {PFS} PFs x {PER_PF} VFs, {NETDEV_VF} on "
                  f"iavf as {VF_NETDEV}; namespace {netns.name}: veth {VF_NETDEV} (ifindex {vf_index}) <-> {PEER} "
                  f"(ifindex {peer})", flush=True)
            env = dra_bytecode_env(base)
            with netns.entered():  # the stand-in's listening socket lives in the namespace
                api = StampedApiServer(feature_gates={"DRADeviceTaints"}).start()
            api.add_node(NODE)
            seam = Seam(base / "uevents.sock")
            kubelet = KubeletProcess(PYTHON, base / "device-plugins", base / "plugins_registry", driver=DRIVER,
                                     pool=POOL, watch=[device_name(NETDEV_VF)], health_stream=follow_health,
                                     stderr_path=base / "kubelet.stderr")
            daemon = dra_daemon(base, host, config(), api, seam, env)
            daemon.arguments = [*netns.exec_prefix(), *daemon.arguments]
            daemon.start()
            seam.wait_ready(daemon)
            first = wait_generation(api, daemon, 0, lambda g: len(g.names) == VFS, 90,
                                    f"the pool published with {VFS} devices")
            kubelet.wait_for_dra(timeout=30)
            name = device_name(NETDEV_VF)
            if follow_health:
                kubelet.wait_for(lambda k: any(m.devices == VFS for m in k.health_messages), 30,
                                 f"a health message with all {VFS} devices")
            stream = f"health stream {kubelet.health_service} open" if follow_health \
                else "health stream NOT followed (--no-health-stream)"
            print(f"pool published (generation {first.generation}, {first.slices} slices) "
                  f"{first.stamp - daemon.started_mono:.2f} s after Popen; driver registered, {stream}; daemon pid "
                  f"{daemon.pid}, kubelet stand-in pid {kubelet.pid} (its own process)", flush=True)
            stamper = KernelEventStamper(netns, PYTHON)
            time.sleep(0.3)

            measure_carrier(api, kubelet, daemon, rtnl, stamper, peer, vf_index, arguments.warmup, arguments.gap,
                            arguments.timeout, follow_health)
            cpu0 = thread_cpu_ns(daemon.pid)
            with api._cond:
                handled_from = len(api.handled)
            carrier = measure_carrier(api, kubelet, daemon, rtnl, stamper, peer, vf_index, arguments.samples,
                                      arguments.gap, arguments.timeout, follow_health)
            carrier_cpu = cpu_by_thread_name(cpu0, thread_cpu_ns(daemon.pid), daemon.pid)
            with api._cond:
                carrier_requests = requests_by_kind([r for r in api.handled[handled_from:] if not r.watch])
                put_handling = [r.end - r.start for r in api.handled[handled_from:] if r.method == "PUT"]
            cpu0 = thread_cpu_ns(daemon.pid)
            hotplugs = measure_hotplugs(api, daemon, host, seam, arguments.hotplugs, arguments.gap,
                                        arguments.timeout)
            hotplug_cpu = cpu_by_thread_name(cpu0, thread_cpu_ns(daemon.pid), daemon.pid)
            code, stop_seconds = daemon.stop()
            statuses = four_xx(api)
            errors = list(api.internal_errors)
            log = daemon.log
            check_exit(code, log)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        finally:
            clean_up(*(step for step in (stamper and stamper.close, daemon and daemon.kill,
                                         kubelet and kubelet.close, api and api.close, seam and seam.close,
                                         rtnl and rtnl.close) if step), netns.delete)

    changes = 2 * arguments.samples
    print(f"\n(1) carrier: {PEER} down / up -> the slice write with {name} tainted {TAINT_KEY} ({EFFECT}) / "
          f"untainted ({arguments.warmup} warm-up cycles not counted)")
    for which, label in (("loss", "loss"), ("recovery", "recovery")):
        print(latency_row(f"{label}, from request", carrier[f"{which}_request"], width=WIDTH))
        print(latency_row(f"{label}, from kernel event ({VF_NETDEV})", carrier[f"{which}_kernel"], width=WIDTH))
        print(latency_row("  request -> the PUT reaches the stand-in", carrier[f"{which}_to_put"], width=WIDTH))
        print(latency_row("  the stand-in: PUT start -> stored", carrier[f"{which}_standin"], width=WIDTH))
        print(latency_row(f"{label}, request -> health message", carrier[f"{which}_health"], width=WIDTH))
        print(latency_row(f"{label}, kernel event -> health message", carrier[f"{which}_health_kernel"],
                          width=WIDTH))
    print(latency_row("(kernel: request -> ack)", carrier["loss_ack"] + carrier["recovery_ack"], width=WIDTH))
    for which in ("loss", "recovery"):
        writes = carrier[f"{which}_writes"]
        kept = carrier[f"{which}_kept"]
        incomplete = carrier[f"{which}_incomplete"]
        print(f"  {which}: slice writes per change min {min(writes):.0f}, max {max(writes):.0f}, mean "
              f"{sum(writes) / len(writes):.2f}; generation kept in {sum(kept):.0f}/{len(kept)}; pool incomplete "
              f"{sum(incomplete) * 1000:.1f} ms in all (max {max(incomplete) * 1000:.1f} ms in one change); "
              f"extra health messages {sum(carrier[f'{which}_extra_health']):.0f}")
    print(f"  API requests over the {changes} timed changes: {kinds_text(carrier_requests)}")
    print(latency_row("the stand-in handling one PUT", put_handling, width=WIDTH))
    print(f"  kernel events not seen by the stamper: {len(carrier['missing_kernel'])}; health messages not seen: "
          f"{len(carrier['missing_health'])}")
    print(f"  daemon CPU per change: {cpu_line(carrier_cpu, changes)}")

    print(f"\n(2) hotplug: {len(hotplugs)} VFs added one at a time under {pf_address(HOTPLUG_PF)} (add uevent over "
          f"the seam) -> the write completing the pool with the VF")
    for number, row in enumerate(hotplugs, 1):
        before, after = row["generation"]
        print(f"  {number:2d}. {row['vf']}: {row['latency'] * 1000:7.2f} ms, {row['writes']:2d} write(s) "
              f"({'/'.join(row['kinds'])}), generation {before} -> {after}"
              f"{' (kept)' if before == after else ''}, {row['slices']} slices, {row['devices']} devices, pool "
              f"incomplete {row['incomplete'] * 1000:.1f} ms")
    roomy = [row for row in hotplugs if row["generation"][0] == row["generation"][1]]
    if roomy:
        print(f"  with room in a slice: {len(roomy)} hotplugs, writes each: {sorted({r['writes'] for r in roomy})}, "
              f"latency p50 {percentile([r['latency'] for r in roomy], 50) * 1000:.2f} ms, max "
              f"{max(r['latency'] for r in roomy) * 1000:.2f} ms")
    print(f"  daemon CPU per hotplug: {cpu_line(hotplug_cpu, max(1, len(hotplugs)))}")

    bad = {status: count for status, count in statuses.items() if 400 <= status < 500}
    print(f"\n(3) the API stand-in's answers over the whole run, by status: "
          f"{', '.join(f'{count} x {status}' for status, count in sorted(statuses.items()))}; 4xx: "
          f"{sum(bad.values())} ({', '.join(f'{c} x {s}' for s, c in sorted(bad.items())) or 'none'}); 422: "
          f"{bad.get(422, 0)}; stand-in internal errors: {len(errors)}")
    problems = [line for line in log.splitlines() if " ERROR " in line or " WARNING " in line]
    print(f"  daemon log: {len(problems)} WARNING/ERROR lines" + "".join(f"\n    {line}" for line in problems[:5]))
    print(f"  SIGTERM -> exit {stop_seconds * 1000:.0f} ms, exit code {code}")

    print(f"\ntargets: the taint's write p50 <= {TARGET_P50 * 1000:.0f} ms, p99 <= {TARGET_P99 * 1000:.0f} ms after "
          f"the event; 1 write per change; generation unchanged; pool never incomplete; no 422:")
    for which in ("loss", "recovery"):
        for start in ("request", "kernel"):
            values = carrier[f"{which}_{start}"]
            if not values:
                continue
            p50, p99 = percentile(values, 50), percentile(values, 99)
            ok = p50 <= TARGET_P50 and p99 <= TARGET_P99
            print(f"  {which:<8} from {start:<7}: p50 {p50 * 1000:6.2f} ms, p90 {percentile(values, 90) * 1000:6.2f} ms, "
                  f"p99 {p99 * 1000:6.2f} ms, max {max(values) * 1000:6.2f} ms ({'within target' if ok else 'OVER target'})")
    all_writes = carrier["loss_writes"] + carrier["recovery_writes"]
    all_kept = carrier["loss_kept"] + carrier["recovery_kept"]
    incomplete_total = sum(carrier["loss_incomplete"] + carrier["recovery_incomplete"])
    print(f"  writes per change: {'1' if set(all_writes) == {1} else sorted(set(all_writes))}; generation kept: "
          f"{'yes' if all(all_kept) else f'no ({len(all_kept) - sum(all_kept):.0f} changes bumped it)'}; pool "
          f"incomplete: {incomplete_total * 1000:.1f} ms; hotplugs with room: "
          f"{'1 write each' if roomy and all(r['writes'] == 1 for r in roomy) else 'see above'}; 422 answers: "
          f"{bad.get(422, 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

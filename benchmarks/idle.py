"""Idle: the daemon registered and serving, then nothing happens. CPU used and wakeups, per thread.

The config is the bundled ``config/default.json`` unchanged (devNode pools ``/dev/kvm``,
``/dev/net/tun``, ``/dev/vhost-net`` x 110; vfio and kernel VF pools; accelerators). The daemon
runs with the real ``/dev`` as ``--dev-root`` (the devNode pools find real nodes; one whose node
does not exist has no devices and is not registered) and a fake sysfs: 2 PFs with 8 VFs on
vfio-pci, 2 PFs with 8 VFs on iavf (with netdevs), and one QAT-like accelerator on ``4xxx``. The
uevent source is the default (``auto``: udev if udevd runs, else the kernel's netlink group), and
rtnetlink watches the namespace the daemon runs in: this one, or a fresh one with ``--netns``.

Once every non-empty pool is registered and listed, the benchmark waits ``--settle`` seconds,
then watches for ``--seconds`` (default 60): every second it reads, for each thread of the
daemon, ``/proc/<pid>/task/<tid>/{comm,stat,status,schedstat}`` (reading them does not wake the
daemon). It reports:

* CPU: utime+stime of the process (``/proc/<pid>/stat``, clock ticks) and the sum of the
  threads' ``schedstat`` run time (nanoseconds), as a percentage of one CPU over the window;
* wakeups: voluntary + nonvoluntary context switches, per thread (``task/*/status``), by thread
  name (``task/*/comm``; the thread whose tid is the pid is the Python main thread, which runs
  trio, the asyncio loop inside it, and every handler), and in how many of the one-second
  intervals each thread woke at all: a thread that wakes periodically shows up in (nearly)
  every interval;
* what could have woken it legitimately: uevents and link messages the kernel sent in the
  daemon's namespace during the window (a listener process beside it counts them), and
  ListAndWatch messages the stand-in received (there should be none).

Targets: no periodic wakeups of the Python thread; CPU <= 0.1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import (
    CLOCK_TICKS,
    PYTHON,
    REPO_ROOT,
    Daemon,
    DaemonFailure,
    bytecode_env,
    host_tmp,
    machine_line,
    report_failure,
    short_tmp,
    wait_kubelet,
)
from benchmarks._events import KernelEventStamper, Netns, clean_up, revision_line, unique_netns_name
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

TARGET_CPU_PERCENT = 0.1
DEFAULT_CONFIG = REPO_ROOT / "config" / "default.json"


@dataclass(frozen=True)
class ThreadSample:
    name: str
    ticks: int  # utime + stime
    run_ns: int  # schedstat
    voluntary: int
    nonvoluntary: int

    @property
    def switches(self) -> int:
        return self.voluntary + self.nonvoluntary


def read_threads(pid: int) -> dict[int, ThreadSample]:
    samples = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{entry}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            voluntary = nonvoluntary = 0
            with open(f"{base}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        nonvoluntary = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited while we read it
        samples[int(entry)] = ThreadSample(name, int(fields[11]) + int(fields[12]), run_ns, voluntary, nonvoluntary)
    return samples


def process_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def build_host(root: Path) -> FakeHost:
    host = FakeHost(root)
    for pf in range(4):
        address = f"0000:{pf + 1:02x}:00.0"
        host.add_pf(address, netdev=f"ens{pf}f0", total_vfs=8, numa_node=pf % 2, bridge=f"0000:00:{pf + 1:02x}.0")
        vfs = [f"0000:{pf + 1:02x}:{(0x10 + vf) >> 3:02x}.{(0x10 + vf) & 7}" for vf in range(8)]
        if pf < 2:
            host.add_vfs(address, vfs, driver="vfio-pci", iommu_groups=[100 + 8 * pf + vf for vf in range(8)],
                         numa_node=pf % 2)
        else:
            host.add_vfs(address, vfs, driver="iavf", netdev_names=[f"ens{pf}f0v{vf}" for vf in range(8)],
                         iommu_groups=[100 + 8 * pf + vf for vf in range(8)], numa_node=pf % 2)
    host.add_pci("0000:6b:00.0", device="4940", class_code="120000", driver="4xxx", bridge="0000:00:10.0")
    return host


def expected_pools(config: dict, host: FakeHost) -> dict[str, int]:
    """The pools that will have devices here, with their device counts (for the wait)."""
    expected = {}
    for entry in config["resourceList"]:
        resource = f"{entry.get('resourcePrefix', 'intel.com')}/{entry['resourceName']}"
        if entry.get("deviceType") == "devNode":
            paths = entry["selectors"]["paths"]
            if all(os.path.exists(p) for p in paths):
                expected[resource] = entry.get("count", 1) * len(paths)
    expected["devplugd.io/sriov_dpdk_vfs"] = 16
    expected["devplugd.io/sriov_kernel_vfs"] = 16
    expected["devplugd.io/accelerators"] = 1
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the idle window (default: %(default)s)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between everything listed and the window (default: %(default)s)")
    parser.add_argument("--netns", action="store_true",
                        help="run the daemon in a fresh network namespace (default: this one)")
    parser.add_argument("--timeout", type=float, default=30.0)
    arguments = parser.parse_args(argv)

    print(f"idle: default config, registered, then {arguments.seconds:g} s of nothing "
          f"(after {arguments.settle:g} s to settle)", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    config = json.loads(DEFAULT_CONFIG.read_text())
    netns = Netns(unique_netns_name("idle")) if arguments.netns else None
    with short_tmp() as base, host_tmp() as host_dir:
        kubelet: FakeKubelet | None = None
        daemon: Daemon | None = None
        stamper: KernelEventStamper | None = None
        try:
            if netns is not None:
                netns.create()
            host = build_host(host_dir / "host")
            expected = expected_pools(config, host)
            env = bytecode_env(base)
            kubelet = FakeKubelet(base / "device-plugins")
            kubelet.start()
            daemon = Daemon(base, host, config, env=env)
            daemon.arguments += ["--dev-root", "/dev"]
            if netns is not None:
                daemon.arguments = [*netns.exec_prefix(), *daemon.arguments]
            daemon.start()
            wait_kubelet(kubelet, daemon, lambda k: all(
                k.state(r).connected and len(k.state(r).devices) == n for r, n in expected.items()),
                arguments.timeout, f"pools listed: {expected}")
            print(f"daemon pid {daemon.pid} in {'namespace ' + netns.name if netns else 'this network namespace'}; "
                  f"registered and listed: " + ", ".join(f"{r} ({n})" for r, n in expected.items()), flush=True)
            uevent_line = next((line for line in daemon.log.splitlines() if "uevents:" in line), "")
            print(f"  {uevent_line[24:].strip()}" if uevent_line else "  (no 'uevents:' line in the log)")
            stamper = KernelEventStamper(netns, PYTHON)
            time.sleep(arguments.settle)

            messages_before = {r: len(kubelet.state(r).messages) for r in kubelet.resources}
            registrations_before = {r: kubelet.state(r).registrations for r in kubelet.resources}
            pid = daemon.pid
            start_mono = time.monotonic()
            start_ticks = process_ticks(pid)
            first = read_threads(pid)
            samples = [first]
            deadline = start_mono + arguments.seconds
            next_read = start_mono + 1.0
            while next_read <= deadline + 1e-6:
                time.sleep(max(0.0, next_read - time.monotonic()))
                daemon.check_alive()
                samples.append(read_threads(pid))
                next_read += 1.0
            end_mono = time.monotonic()
            end_ticks = process_ticks(pid)
            window = end_mono - start_mono
            events = stamper.between(start_mono, end_mono)
            stray_messages = sum(len(kubelet.state(r).messages) - n for r, n in messages_before.items())
            stray_registrations = sum(kubelet.state(r).registrations - n for r, n in registrations_before.items())
            code, stop_seconds = daemon.stop()
        except DaemonFailure as error:
            report_failure(error)
            return 1
        finally:
            clean_up(*(step for step in (stamper and stamper.close, daemon and daemon.kill,
                                         kubelet and kubelet.close, netns and netns.delete) if step))

    last = samples[-1]
    intervals = len(samples) - 1
    tids = sorted(set(first) | set(last), key=lambda t: (t != pid, t))
    print(f"\nwindow {window:.1f} s, {intervals} one-second intervals; {len(first)} threads at the start, "
          f"{len(last)} at the end")
    print(f"  {'tid':>7}  {'thread':<18} {'CPU ms':>8} {'ticks':>5} {'vol cs':>7} {'invol cs':>8} "
          f"{'wakeups/s':>9}  {'intervals with a wakeup':>23}")
    total_ns = 0
    main_switches = 0
    main_intervals = 0
    for tid in tids:
        a, b = first.get(tid), last.get(tid)
        if a is None or b is None:
            state = "started during the window" if a is None else "exited during the window"
            print(f"  {tid:>7}  {(a or b).name:<18} ({state})")  # type: ignore[union-attr]
            continue
        woke = sum(1 for s0, s1 in zip(samples, samples[1:])
                   if tid in s0 and tid in s1 and s1[tid].switches != s0[tid].switches)
        switches = b.switches - a.switches
        run_ns = b.run_ns - a.run_ns
        total_ns += run_ns
        label = "python main" if tid == pid else b.name
        if tid == pid:
            main_switches, main_intervals = switches, woke
        print(f"  {tid:>7}  {label:<18} {run_ns / 1e6:8.2f} {b.ticks - a.ticks:5d} {b.voluntary - a.voluntary:7d} "
              f"{b.nonvoluntary - a.nonvoluntary:8d} {switches / window:9.2f}  {woke:>11d} of {intervals}")
    by_name: dict[str, list[int]] = {}
    for tid in tids:
        if tid in first and tid in last and tid != pid:
            by_name.setdefault(last[tid].name, []).append(last[tid].switches - first[tid].switches)
    ticks_percent = (end_ticks - start_ticks) / CLOCK_TICKS / window * 100
    ns_percent = total_ns / 1e9 / window * 100
    print("  by thread name (other than the Python main thread): " + ", ".join(
        f"{name} x{len(v)}: {sum(v)} switches ({sum(v) / window:.2f}/s)" for name, v in sorted(by_name.items())))
    uevents = [r for _, r in events if r[0] == "uevent"]
    links = [r for _, r in events if r[0] != "uevent"]
    print(f"\nkernel events in the daemon's namespace during the window: {len(uevents)} uevents, "
          f"{len(links)} link messages" + (f" (uevents: {sorted({f'{r[1]} {r[2]}' for r in uevents})})" if uevents else ""))
    print(f"stand-in: {stray_messages} ListAndWatch messages and {stray_registrations} registrations during the window")
    print(f"daemon: SIGTERM -> exit {stop_seconds * 1000:.0f} ms, exit code {code}")
    print(f"\nCPU over the window: {ticks_percent:.3f} % of one CPU by utime+stime ({end_ticks - start_ticks} ticks of "
          f"{1000 / CLOCK_TICKS:.0f} ms), {ns_percent:.4f} % by schedstat ({total_ns / 1e6:.2f} ms)")
    print(f"Python main thread: {main_switches} context switches, woke in {main_intervals} of {intervals} intervals")
    periodic = main_intervals >= max(2, intervals // 2)
    print(f"\ntargets: CPU <= {TARGET_CPU_PERCENT} %: {max(ticks_percent, ns_percent):.4f} % "
          f"({'within target' if max(ticks_percent, ns_percent) <= TARGET_CPU_PERCENT else 'OVER target'}); "
          f"no periodic wakeups of the Python thread: "
          f"{'none' if main_switches == 0 else ('PERIODIC' if periodic else 'a few, not periodic')} "
          f"({main_switches} switches in {main_intervals} of {intervals} intervals, "
          f"{len(uevents) + len(links)} kernel events in the window)")
    if code != 0:
        print(f"DAEMON FAILURE: exit code after SIGTERM {code} (None = had to be killed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

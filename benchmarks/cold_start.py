"""Cold start at scale: 64 PFs x 64 VFs (4096 vfio-pci VFs) in 16 netDevice pools.

The fake host is built once (outside every timing). Each run starts a fresh kubelet stand-in,
then the real daemon process, and measures from ``Popen`` to

(a) every pool registered with the stand-in (the stand-in's ``registered_at``, taken inside its
    Register handler after GetDevicePluginOptions returned), and
(b) every pool's first ListAndWatch list received with all its 256 devices (``first_list_at``);

plus the daemon's VmRSS/VmHWM as soon as (a) holds, and a breakdown from the daemon's own log
lines (millisecond timestamps). Prints per-run figures and min/median; never asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks._common import (
    Daemon,
    DaemonFailure,
    build_sriov_host,
    bytecode_env,
    check_exit,
    first_log_time,
    host_tmp,
    machine_line,
    median,
    ms,
    netdevice_config,
    pf_netdev,
    report_failure,
    short_tmp,
    verdict,
    wait_kubelet,
)
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

PFS = 64
VFS_PER_PF = 64
POOLS = 16
PFS_PER_POOL = PFS // POOLS
DEVICES_PER_POOL = PFS_PER_POOL * VFS_PER_PF
PREFIX = "intel.com"
TARGET_REGISTERED = 1.5
TARGET_RSS_MIB = 65.0  # compared in MB and in MiB


def pool_config() -> dict:
    """Pool k selects PFs 4k..4k+3 by netdev name with an explicit VF range (``ens<i>f0#0-63``)."""
    pools = []
    for k in range(POOLS):
        names = [f"{pf_netdev(pf)}#0-{VFS_PER_PF - 1}" for pf in range(k * PFS_PER_POOL, (k + 1) * PFS_PER_POOL)]
        pools.append((f"sriov_pool{k:02d}", names))
    return netdevice_config(pools)


RESOURCES = [f"{PREFIX}/sriov_pool{k:02d}" for k in range(POOLS)]


def one_run(index: int, base: Path, host: FakeHost, timeout: float, env: dict[str, str]) -> dict[str, float]:
    run_dir = base / f"r{index}"
    run_dir.mkdir()
    kubelet = FakeKubelet(run_dir / "device-plugins")
    kubelet.start()
    daemon = Daemon(run_dir, host, pool_config(), env=env)
    try:
        daemon.start()
        t0 = daemon.started_mono

        def registered(k: FakeKubelet) -> bool:
            return all(r in k.resources and k.resources[r].registrations >= 1 for r in RESOURCES)

        def listed(k: FakeKubelet) -> bool:
            return all(r in k.resources and k.resources[r].connected
                       and len(k.resources[r].devices) == DEVICES_PER_POOL for r in RESOURCES)

        wait_kubelet(kubelet, daemon, registered, timeout, f"all {POOLS} pools registered")
        rss_kib, hwm_kib = daemon.status_kib("VmRSS"), daemon.status_kib("VmHWM")
        wait_kubelet(kubelet, daemon, listed, timeout, f"all {POOLS} pools listed with {DEVICES_PER_POOL} devices")
        states = [kubelet.resources[r] for r in RESOURCES]
        result = {
            "first_registered": min(s.registered_at for s in states) - t0,
            "all_registered": max(s.registered_at for s in states) - t0,
            "all_listed": max(s.first_list_at for s in states) - t0,
            "rss_mib": rss_kib / 1024,
            "hwm_mib": hwm_kib / 1024,
        }
        # Breakdown from the daemon's log (wall clock, ms resolution), relative to Popen.
        times = daemon.log_times()
        wall0 = daemon.started_wall
        marks = {
            "log_config_loaded": first_log_time(times, lambda m: "devplugd: config " in m and " pools" in m),
            "log_loop_up": first_log_time(times, lambda m: "registration mode:" in m),
            "log_tree_published": first_log_time(times, lambda m: " devices (" in m and "healthy)" in m),
            "log_first_serving": first_log_time(times, lambda m: "devplugd.deviceplugin: serving " in m),
        }
        for key, stamp in marks.items():
            result[key] = (stamp - wall0) if stamp is not None else float("nan")
        if marks["log_loop_up"] is not None and marks["log_tree_published"] is not None:
            result["log_tree_build"] = marks["log_tree_published"] - marks["log_loop_up"]
        else:
            result["log_tree_build"] = float("nan")
        code, stop_seconds = daemon.stop()
        result["stop"] = stop_seconds
        check_exit(code, daemon.log)
        return result
    finally:
        daemon.kill()
        kubelet.close()


def in_process_tree_build(host: FakeHost, config_dir: Path, repeats: int = 3) -> list[dict[str, float]]:
    """scan, build and DeviceTree.build (with listings) in this process: the worker-thread and
    kernel-loop part of a cold start, split so the report can say where the time goes."""
    import json
    from types import MappingProxyType

    from daemon import app
    from daemon.core import ResourcePool
    from daemon.core._tree import DeviceTree
    from daemon.settings import Settings

    config_path = config_dir / "inproc-config.json"
    config_path.write_text(json.dumps(pool_config()))
    settings = Settings(config_path=config_path, sysfs_root=host.sys, dev_root=host.dev, proc_root=host.proc,
                        devinfo_dir=config_dir / "devinfo")
    handlers, config = app.load(settings)
    handler = handlers["pci"]
    configured = config.pools_of("pci")
    results = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        facts = handler.scan()
        t1 = time.perf_counter()
        built = handler.build(facts, configured)
        t2 = time.perf_counter()
        pools = [ResourcePool(p.resource, "pci", p, MappingProxyType(dict(built.get(p.resource, {}))))
                 for p in configured]
        tree = DeviceTree.build(1, pools)
        for pool in tree.pools.values():
            _ = pool.listing
        t3 = time.perf_counter()
        total = sum(len(p.devices) for p in tree.pools.values())
        if total != PFS * VFS_PER_PF:
            print(f"WARNING: the pools cover {total} devices, not {PFS * VFS_PER_PF}")
        results.append({"scan": t1 - t0, "build": t2 - t1, "tree": t3 - t2, "total": t3 - t0})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="start the daemon with the inherited environment (no warmed .pyc prefix)")
    arguments = parser.parse_args(argv)

    print(f"cold_start: {PFS} PFs x {VFS_PER_PF} VFs = {PFS * VFS_PER_PF} vfio-pci VFs, {POOLS} netDevice pools "
          f"of {DEVICES_PER_POOL}; {arguments.runs} runs", flush=True)
    print(machine_line(), flush=True)
    with short_tmp() as base, host_tmp() as host_dir:
        started = time.perf_counter()
        host = build_sriov_host(host_dir / "host", PFS, VFS_PER_PF)
        print(f"fake host built in {time.perf_counter() - started:.1f} s under {host_dir} (not timed below)",
              flush=True)
        env = bytecode_env(base, enabled=not arguments.no_bytecode_cache)
        print("daemon bytecode: " + ("inherited environment (PYTHONDONTWRITEBYTECODE="
                                     f"{env.get('PYTHONDONTWRITEBYTECODE', 'unset')})" if arguments.no_bytecode_cache
                                     else "warmed .pyc prefix (as an installed package)"), flush=True)
        results = []
        try:
            for index in range(arguments.runs):
                result = one_run(index, base, host, arguments.timeout, env)
                results.append(result)
                print(f"run {index + 1}: all registered {ms(result['all_registered'])}  all listed "
                      f"{ms(result['all_listed'])}  first registered {ms(result['first_registered'])}  "
                      f"RSS {result['rss_mib']:5.1f} MiB  HWM {result['hwm_mib']:5.1f} MiB  "
                      f"tree build (log) {ms(result['log_tree_build'])}  SIGTERM->exit {ms(result['stop'])}",
                      flush=True)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        inproc = in_process_tree_build(host, base)

    def row(label: str, key: str, unit: str = "ms") -> None:
        values = [r[key] for r in results]
        if unit == "ms":
            print(f"  {label:<40} min {ms(min(values))}   median {ms(median(values))}")
        else:
            print(f"  {label:<40} min {min(values):8.1f} MiB   median {median(values):8.1f} MiB")

    print(f"\nsummary over {len(results)} runs (times from Popen):")
    row("(a) all pools registered", "all_registered")
    row("(b) all pools' first list (256 devices)", "all_listed")
    row("first pool registered", "first_registered")
    row("daemon VmRSS when all registered", "rss_mib", "MiB")
    row("daemon VmHWM when all registered", "hwm_mib", "MiB")
    print("  breakdown from the daemon log (ms resolution, from Popen):")
    row("  config loaded (imports + config)", "log_config_loaded")
    row("  trio + asyncio loop up", "log_loop_up")
    row("  first tree published", "log_tree_published")
    row("  first socket serving", "log_first_serving")
    row("  tree build = published - loop up", "log_tree_build")
    row("SIGTERM -> exit", "stop")
    print("  in-process, same host and config (warm dentry cache):")
    for key, label in (("scan", "PciHandler.scan (4160 functions)"), ("build", "PciHandler.build (16 pools)"),
                       ("tree", "DeviceTree.build + listings"), ("total", "total")):
        values = [r[key] for r in inproc]
        print(f"    {label:<38} min {ms(min(values))}   median {ms(median(values))}")
    registered = [r["all_registered"] for r in results]
    worst_rss = max(r["rss_mib"] for r in results)
    worst_hwm = max(r["hwm_mib"] for r in results)
    print(f"\ntargets: all registered <= {TARGET_REGISTERED * 1000:.0f} ms: median {median(registered) * 1000:.0f} ms "
          f"({verdict(median(registered), TARGET_REGISTERED)}), min {min(registered) * 1000:.0f} ms, "
          f"max {max(registered) * 1000:.0f} ms")
    print(f"         RSS <= {TARGET_RSS_MIB:.0f} MB: max VmRSS {worst_rss:.1f} MiB = {worst_rss * 1.048576:.1f} MB, "
          f"max VmHWM {worst_hwm:.1f} MiB = {worst_hwm * 1.048576:.1f} MB "
          f"({verdict(worst_hwm * 1.048576, TARGET_RSS_MIB)} in MB; "
          f"{verdict(worst_hwm, TARGET_RSS_MIB)} in MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

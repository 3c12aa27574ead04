"""Scalable functions at scale, in the auxNetDevice handler (no daemon): scan, build and the fold
of one SF's plug and unplug on a fake host with many SFs.

``--pfs`` ConnectX PFs (switchdev, uplink ``p0``-style names) with ``--sfs`` SFs each, bound, each
with its netdev and RDMA device, laid out by ``tests/auxsysfs.py`` under a tmpfs-backed
directory. Measured with ``time.perf_counter``: a full scan, a full build of two pools (by
``pfNames`` ranges and the rest), and, ``--cycles`` times, one more SF plugged (the SF's add and
its probe's uevents folded one by one, then the pools built) and removed again. Never asserts;
prints medians and maxima.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._common import host_tmp
from tests.auxpools import AuxPools, add_sf, remove_sf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pfs", type=int, default=4)
    parser.add_argument("--sfs", type=int, default=128, help="SFs per PF")
    parser.add_argument("--cycles", type=int, default=50)
    args = parser.parse_args()
    with host_tmp() as root:
        from tests.fakesysfs import FakeHost

        world = AuxPools(FakeHost(root / "host"))
        pfs = [f"0000:{0x10 + index:02x}:00.0" for index in range(args.pfs)]
        for index, pf in enumerate(pfs):
            world.tree.add_mlx5_pf(pf, uplink=f"enp{0x10 + index}s0f0np0", switchdev=True, rdma=f"mlx5_p{index}")
            for sfnum in range(args.sfs):
                add_sf(world.tree, pf, sfnum, netdev=f"en{index}s{sfnum}", rdma=f"mlx5_{index}_{sfnum}")
        pools = world.configure({"resourceName": "low", "selectors": {"auxTypes": ["sf"], "pfNames": [
            f"enp{0x10 + index}s0f0np0#0-{args.sfs // 2 - 1}" for index in range(args.pfs)]}},
            {"resourceName": "rest", "selectors": {"auxTypes": ["sf"]}})
        started = time.perf_counter()
        facts = world.handler.scan()
        scan = time.perf_counter() - started
        started = time.perf_counter()
        built = world.handler.build(facts, pools)
        build = time.perf_counter() - started
        offered = sum(len(devices) for devices in built.values())
        plug, unplug, per_event = [], [], []
        for cycle in range(args.cycles):
            name, events = add_sf(world.tree, pfs[cycle % len(pfs)], 10_000 + cycle, netdev=f"bench{cycle}",
                                  rdma=f"mlx5_b{cycle}")
            started = time.perf_counter()
            for event in events:
                facts = world.handler.fold(facts, event)
            world.handler.build(facts, pools)
            plug.append(time.perf_counter() - started)
            per_event.append(plug[-1] / len(events))
            events = remove_sf(world.tree, name)
            started = time.perf_counter()
            for event in events:
                facts = world.handler.fold(facts, event)
            world.handler.build(facts, pools)
            unplug.append(time.perf_counter() - started)
    print(f"auxnet: {args.pfs} PFs x {args.sfs} SFs = {offered} SFs offered")
    print(f"  scan {scan * 1e3:.1f} ms, build of 2 pools {build * 1e3:.1f} ms")
    print(f"  one SF plugged (its uevents folded, pools built): p50 {statistics.median(plug) * 1e3:.2f} ms, "
          f"max {max(plug) * 1e3:.2f} ms ({statistics.median(per_event) * 1e3:.2f} ms per event)")
    print(f"  one SF removed: p50 {statistics.median(unplug) * 1e3:.2f} ms, max {max(unplug) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

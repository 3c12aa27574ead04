"""What one /metrics scrape costs with a big tree: the exposition built in-process from the
daemon's own registry (``Metrics(standard=True)``), no HTTP.

A tree of ``--pools`` netDevice-like pools of ``--devices`` devices each (one
``devplugd_device_info`` series per device) and a kubelet checkpoint holding ``--allocated``
of them, one pod each (one ``devplugd_device_allocation_info`` series per allocated device,
read from the file at every scrape, as the daemon does). Prints the median and max of
``generate_latest`` over ``--scrapes`` scrapes and the size of one scrape. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest

from daemon.checkpoint import CHECKPOINT_NAME, CheckpointReader
from daemon.core import DeviceInfo
from daemon.core._tree import DeviceTree
from daemon.metrics import Metrics
from tests import trees


@dataclass(frozen=True)
class _Record:
    """A device record that names its PCI address, as the pci handler's does."""

    pci_address: str


def _tree(pools: int, devices: int) -> tuple[DeviceTree, list[tuple[str, str]]]:
    built, ids = [], []
    for index in range(pools):
        resource = f"intel.com/pool{index}"
        members = {}
        for number in range(devices):
            address = f"0000:{0x10 + index:02x}:{number // 8:02x}.{number % 8}"
            members[address] = DeviceInfo(numa_nodes=(index % 2,), details=_Record(address))
            ids.append((resource, address))
        built.append(trees.pool(resource, members, handler="pci"))
    return DeviceTree.build(1, built), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=8)
    parser.add_argument("--devices", type=int, default=512, help="devices per pool")
    parser.add_argument("--allocated", type=int, default=1024)
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        plugin_dir = Path(directory)
        tree, ids = _tree(args.pools, args.devices)
        entries = [{"PodUID": f"pod-{n}", "ContainerName": "app", "ResourceName": resource,
                    "DeviceIDs": {"-1": [device]}, "AllocResp": ""}
                   for n, (resource, device) in enumerate(ids[:args.allocated])]
        (plugin_dir / CHECKPOINT_NAME).write_text(json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 1}))
        metrics = Metrics(CheckpointReader(plugin_dir), standard=True)
        metrics.tree.offer(tree)
        times, size = [], 0
        for _ in range(args.scrapes):
            started = time.perf_counter()
            size = len(generate_latest(metrics.registry))
            times.append(time.perf_counter() - started)
    print(f"metrics scrape: {args.pools} pools x {args.devices} devices, {min(args.allocated, len(ids))} allocated")
    print(f"  p50 {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()

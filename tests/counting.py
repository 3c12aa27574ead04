"""A handler whose facts are just a number of devices, for the event loop's tests, and what
those tests look at: the endpoints' socket files and the kubelet's checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from daemon.checkpoint import CheckpointReader
from daemon.core import ConfiguredPool, DeviceInfo, Event, PoolEntry, Resync
from daemon.holdings import CLAIM, Holder, HoldingBook, Holdings, LostBook
from daemon.metrics import Metrics
from tests.kubelet import write_checkpoint_entries
from tests.waiting import wait_until_async


class CountingHandler:
    """A handler whose facts are a number of devices; it can be told to fail."""

    name: ClassVar[str] = "counting"
    device_types: ClassVar[frozenset[str]] = frozenset({"counted"})
    subsystems: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self.devices = 2
        self.scans = 0
        self.fail_build = False
        self.fail_scan = False
        self.fail_parse = False
        self.parsed = 0

    def parse_pool(self, entry: PoolEntry) -> None:
        self.parsed += 1
        if self.fail_parse:
            raise KeyError("a bug in the handler's parser")
        return None

    def scan(self) -> int:
        self.scans += 1
        if self.fail_scan:
            raise OSError("sysfs went away")
        return self.devices

    def fold(self, facts: int, event: Event) -> int:
        return self.scan() if isinstance(event, Resync) else facts

    def build(self, facts: int, pools: Sequence[ConfiguredPool]) -> dict[str, Any]:
        if self.fail_build:
            raise ValueError("bad fact")
        return {pool.resource: {f"d{n}": DeviceInfo() for n in range(facts)} for pool in pools}


async def wait_for_socket(directory: Path, resource: str, *, present: bool = True) -> None:
    await wait_until_async(lambda: bool(list(directory.glob(f"devplugd-{resource}-*.sock"))) == present, 5,
                           f"{resource}'s socket {'served' if present else 'gone'}", interval=0.01)


def write_checkpoint(directory: Path, *device_ids: str, resource: str = "example.com/things") -> None:
    """The kubelet's checkpoint with ``device_ids`` of ``resource`` allocated to one pod, written
    as the kubelet writes it (a temporary file renamed into place)."""
    write_checkpoint_entries(directory, [{"PodUID": "uid-1", "ContainerName": "app", "ResourceName": resource,
                                          "DeviceIDs": {"-1": list(device_ids)}, "AllocResp": ""}] if device_ids else [])


class ClaimsByDevice:
    """A claim book as a plain dict: (resource, device ID) -> the claim's ``namespace/name``."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], str] = {}

    def holders(self) -> dict[tuple[str, str], Holder]:
        return {key: Holder(CLAIM, name) for key, name in self.claims.items()}

    @property
    def lost_book(self) -> LostBook | None:
        return None


def holdings_for(device_plugin_dir: Path | None, leases: HoldingBook | None = None,
                 claims: HoldingBook | None = None) -> Holdings:
    """The daemon's holdings over these books (none given: one that holds nothing) and the
    kubelet's checkpoint in ``device_plugin_dir``."""
    nothing = ClaimsByDevice()
    return Holdings(leases if leases is not None else nothing, claims if claims is not None else nothing,
                    CheckpointReader(device_plugin_dir))


def batches(metrics: Metrics) -> int:
    """Batches of events the event loop has handled, as its metric counts them."""
    return int(metrics.registry.get_sample_value("devplugd_event_batches_total") or 0)


async def wait_for_batches(metrics: Metrics, count: int, timeout: float = 5.0) -> None:
    await wait_until_async(lambda: batches(metrics) >= count, timeout, f"{count} batches of events handled",
                           interval=0.001)


def reloads(metrics: Metrics) -> int:
    return int(metrics.registry.get_sample_value("devplugd_config_reloads_total", {"outcome": "ok"}) or 0)

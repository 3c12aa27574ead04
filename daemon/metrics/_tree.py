"""Gauges and info series read from the newest DeviceTree (and the kubelet's checkpoint) when
Prometheus scrapes: nothing is kept up to date between scrapes.

``offer`` (the notifier's subscriber method, on the trio thread) only replaces one reference;
``collect`` (on the HTTP server's thread) takes that reference once, so every series of one
scrape comes from the same immutable tree. The checkpoint is the daemon's one reader's reading,
parsed again (on the scrape's thread) only when the file changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from daemon.checkpoint import CheckpointReader, PodDevices
from daemon.core import DeviceInfo
from daemon.core._tree import DeviceTree

log = logging.getLogger("devplugd.metrics")

POOL_LABELS = ["resource"]
DEVICE_INFO_LABELS = ["resource", "device", "numa_node", "pci_address"]
ALLOCATION_LABELS = ["resource", "device", "pod_uid", "container"]


def pci_address(info: DeviceInfo) -> str:
    """The device's PCI address when its handler's record says one (``pci_address``), else ``""``."""
    address = getattr(info.details, "pci_address", None)
    return address if isinstance(address, str) else ""


def _families() -> dict[str, GaugeMetricFamily]:
    def pool(name: str, documentation: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, labels=POOL_LABELS)

    return {
        "devices": pool("devplugd_pool_devices", "Devices in the pool, in any state and whoever holds them."),
        "healthy": pool("devplugd_pool_healthy_devices", "Devices of the pool that are Healthy."),
        "vanished": pool("devplugd_pool_vanished_devices", "Devices of the pool gone from the host while held "
                         "(kept listed, Unhealthy, until their holder lets them go)."),
        "kubelet": pool("devplugd_pool_kubelet_allocated_devices",
                        "Devices of the pool the kubelet's checkpoint shows allocated to a pod."),
        "leased": pool("devplugd_pool_host_leased_devices", "Devices of the pool under a host lease."),
        "claimed": pool("devplugd_pool_dra_claimed_devices", "Devices of the pool prepared for a DRA claim."),
        "info": GaugeMetricFamily("devplugd_device_info", "One series per device of a pool (value 1).",
                                  labels=DEVICE_INFO_LABELS),
        "allocation": GaugeMetricFamily(
            "devplugd_device_allocation_info",
            "One series per device the kubelet's checkpoint shows allocated to a pod's container (value 1).",
            labels=ALLOCATION_LABELS),
    }


class TreeCollector(Collector):
    """A notifier subscriber and a prometheus_client collector. ``checkpoint`` reads the
    kubelet's checkpoint (``None``: no kubelet, no allocation series)."""

    def __init__(self, checkpoint: CheckpointReader | None = None) -> None:
        self._tree = DeviceTree.empty()
        self._checkpoint = checkpoint
        self._problem_lock = threading.Lock()  # scrapes may run in several server threads at once
        self._told_problem: str | None = None

    def offer(self, tree: DeviceTree) -> None:
        self._tree = tree

    def describe(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        return [*_families().values(), self._reads()]

    def _reads(self) -> CounterMetricFamily:
        return CounterMetricFamily("devplugd_kubelet_checkpoint_reads", "Times the kubelet's checkpoint was parsed "
                                   "(once per change of the file, whoever asks).",
                                   value=self._checkpoint.reads if self._checkpoint is not None else 0)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        tree = self._tree  # this one tree for the whole scrape
        holdings = self._holdings() if tree.pools else {}
        families = _families()
        for resource, pool in sorted(tree.pools.items()):
            labels = [resource]
            families["devices"].add_metric(labels, len(pool.devices))
            families["healthy"].add_metric(labels, pool.healthy_count)
            families["vanished"].add_metric(labels, len(pool.vanished))
            families["leased"].add_metric(labels, len(pool.leased))
            families["claimed"].add_metric(labels, len(pool.claimed))
            allocated = 0
            for device_id, info in sorted(pool.devices.items()):
                numa = ",".join(str(node) for node in info.numa_nodes)
                families["info"].add_metric([resource, device_id, numa, pci_address(info)], 1)
                holder = holdings.get((resource, device_id))
                if holder is not None:
                    allocated += 1
                    families["allocation"].add_metric([resource, device_id, *holder], 1)
            families["kubelet"].add_metric(labels, allocated)
        yield from families.values()
        yield self._reads()

    def _holdings(self) -> PodDevices:
        """The checkpoint's (resource, device) -> (pod UID, container); ``{}`` when it is missing
        or cannot be read, told in one log line until that changes."""
        if self._checkpoint is None or self._checkpoint.directory is None:
            return {}
        reading = self._checkpoint.read_if_changed()
        if not reading.exists:
            self._tell(f"no kubelet checkpoint in {self._checkpoint.directory}", logging.INFO)
            return {}
        if reading.error is not None:
            self._tell(reading.error, logging.WARNING)
            return {}
        self._tell(None, logging.INFO)
        return reading.holdings

    def _tell(self, problem: str | None, level: int) -> None:
        with self._problem_lock:
            if problem == self._told_problem:
                return
            self._told_problem = problem
        if problem is not None:
            log.log(level, "metrics: %s; devplugd_device_allocation_info is empty until it can be read", problem)
        else:
            log.info("metrics: the kubelet checkpoint is readable again")

"""The metrics on their own: the tree's gauges and info series on a built DeviceTree, the
allocation series from the kubelet's checkpoint (a missing or bad one: empty, one log line), a
scrape while the tree changes, the per-daemon registry, and the reaction-time stamps of a
ListAndWatch stream's mailbox."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import trio
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.checkpoint import CHECKPOINT_NAME, CheckpointReader
from daemon.core import HEALTHY, UNHEALTHY, DeviceInfo
from daemon.core._notifier import TreeStream
from daemon.core._tree import DeviceTree
from daemon.deviceplugin._servicer import listing_scope
from daemon.metrics import CHANGED, FAILED, IGNORED, UNCHANGED, Liveness, Metrics, MetricsServer, metrics_outcome
from daemon.settings import parse_host_port
from tests.trees import pool, tree


@dataclass(frozen=True)
class PciRecord:
    """A handler's device record that names a PCI address, as PciDetails does."""

    pci_address: str


def vf(address: str, health: str = HEALTHY, numa: tuple[int, ...] = (0,)) -> DeviceInfo:
    return DeviceInfo(health=health, numa_nodes=numa, details=PciRecord(address))


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def series(metrics: Metrics, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of ``name`` in one scrape."""
    return [s.labels for family in metrics.registry.collect() for s in family.samples if s.name == name]


def checkpoint(directory, entries) -> None:
    (directory / CHECKPOINT_NAME).write_text(json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 1}))


def two_pools() -> DeviceTree:
    dpdk = pool("intel.com/dpdk", {
        "0000:3b:02.0": vf("0000:3b:02.0"),
        "0000:3b:02.1": vf("0000:3b:02.1", UNHEALTHY, (1,)),
        "0000:3b:02.2": vf("0000:3b:02.2"),
        "0000:3b:02.3": vf("0000:3b:02.3", numa=()),
    }, leased=frozenset({"0000:3b:02.2"}), claimed=frozenset({"0000:3b:02.3"}), vanished={"0000:3b:02.1"})
    serial = pool("example.com/tty", {"port-1-4": DeviceInfo()})
    return tree(dpdk, serial, version=7)


def test_pool_gauges_count_devices_healthy_leased_claimed_and_vanished_per_resource():
    metrics = Metrics()
    metrics.tree.offer(two_pools())
    assert sample(metrics, "devplugd_pool_devices", resource="intel.com/dpdk") == 4
    assert sample(metrics, "devplugd_pool_healthy_devices", resource="intel.com/dpdk") == 3
    assert sample(metrics, "devplugd_pool_host_leased_devices", resource="intel.com/dpdk") == 1
    assert sample(metrics, "devplugd_pool_dra_claimed_devices", resource="intel.com/dpdk") == 1
    assert sample(metrics, "devplugd_pool_kubelet_allocated_devices", resource="intel.com/dpdk") == 0
    assert sample(metrics, "devplugd_pool_vanished_devices", resource="intel.com/dpdk") == 1
    assert sample(metrics, "devplugd_pool_devices", resource="example.com/tty") == 1
    assert sample(metrics, "devplugd_pool_vanished_devices", resource="example.com/tty") == 0


def test_device_info_names_each_device_its_numa_node_and_pci_address():
    metrics = Metrics()
    metrics.tree.offer(two_pools())
    info = series(metrics, "devplugd_device_info")
    assert {"resource": "intel.com/dpdk", "device": "0000:3b:02.1", "numa_node": "1",
            "pci_address": "0000:3b:02.1"} in info
    assert {"resource": "intel.com/dpdk", "device": "0000:3b:02.3", "numa_node": "",
            "pci_address": "0000:3b:02.3"} in info
    assert {"resource": "example.com/tty", "device": "port-1-4", "numa_node": "", "pci_address": ""} in info
    assert len(info) == 5


def test_an_empty_tree_has_no_pool_series():
    metrics = Metrics()
    assert series(metrics, "devplugd_pool_devices") == [] and series(metrics, "devplugd_device_info") == []


def test_allocation_info_names_the_pod_and_container_from_the_checkpoint(tmp_path):
    checkpoint(tmp_path, [
        {"PodUID": "uid-1", "ContainerName": "app", "ResourceName": "intel.com/dpdk",
         "DeviceIDs": {"0": ["0000:3b:02.0"], "1": ["0000:3b:02.1"]}},
        {"PodUID": "uid-2", "ContainerName": "other", "ResourceName": "example.com/unknown", "DeviceIDs": ["x"]},
    ])
    metrics = Metrics(CheckpointReader(tmp_path))
    metrics.tree.offer(two_pools())
    assert sorted(series(metrics, "devplugd_device_allocation_info"), key=lambda s: s["device"]) == [
        {"resource": "intel.com/dpdk", "device": "0000:3b:02.0", "pod_uid": "uid-1", "container": "app"},
        {"resource": "intel.com/dpdk", "device": "0000:3b:02.1", "pod_uid": "uid-1", "container": "app"},
    ]  # a resource that is none of ours: no series (bounded by our devices)
    assert sample(metrics, "devplugd_pool_kubelet_allocated_devices", resource="intel.com/dpdk") == 2


@pytest.mark.parametrize("content", [None, "{torn", '{"Data": {"PodDeviceEntries": 7}}'])
def test_a_missing_or_bad_checkpoint_gives_no_allocation_series_and_one_log_line(tmp_path, caplog, content):
    if content is not None:
        (tmp_path / CHECKPOINT_NAME).write_text(content)
    metrics = Metrics(CheckpointReader(tmp_path))
    metrics.tree.offer(two_pools())
    with caplog.at_level(logging.INFO, logger="devplugd"):
        for _ in range(3):  # three scrapes
            assert series(metrics, "devplugd_device_allocation_info") == []
            assert sample(metrics, "devplugd_pool_devices", resource="intel.com/dpdk") == 4  # the rest is there
    lines = [r for r in caplog.records if r.name == "devplugd.metrics"]
    assert len(lines) == 1, caplog.text
    assert str(tmp_path) in lines[0].getMessage()
    assert lines[0].levelno == (logging.INFO if content is None else logging.WARNING)
    checkpoint(tmp_path, [{"PodUID": "u", "ContainerName": "c", "ResourceName": "intel.com/dpdk",
                           "DeviceIDs": ["0000:3b:02.0"]}])
    assert len(series(metrics, "devplugd_device_allocation_info")) == 1  # readable again: series come back


def test_a_scrape_while_the_tree_changes_sees_one_whole_tree():
    small = tree(pool("a/x", ["d0"]), version=1)
    big = tree(pool("a/x", [f"d{i}" for i in range(200)], unhealthy=[f"d{i}" for i in range(200)]), version=2)
    metrics = Metrics()
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            metrics.tree.offer(big)
            metrics.tree.offer(small)

    publisher = threading.Thread(target=publish)
    publisher.start()
    seen = set()
    try:
        for _ in range(200):
            families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
            devices = families["devplugd_pool_devices"].samples[0].value
            healthy = families["devplugd_pool_healthy_devices"].samples[0].value
            listed = len(families["devplugd_device_info"].samples)
            assert (devices, healthy, listed) in {(1, 1, 1), (200, 0, 200)}
            seen.add(devices)
    finally:
        stop.set()
        publisher.join()
    assert seen == {1, 200}, "the publisher never changed the tree during a scrape"


def test_each_daemon_has_its_own_registry_with_the_standard_collectors():
    first, second = Metrics(standard=True), Metrics(standard=True)  # no "Duplicated timeseries"
    first.kernel_event("uevent", CHANGED)
    assert sample(first, "devplugd_kernel_events_total", source="uevent", outcome="changed") == 1
    assert sample(second, "devplugd_kernel_events_total", source="uevent", outcome="changed") is None
    assert REGISTRY.get_sample_value("devplugd_kernel_events_total", {"source": "uevent", "outcome": "changed"}) \
        is None
    names = {family.name for family in first.registry.collect()}
    assert {"process_cpu_seconds", "python_info", "python_gc_objects_collected"} <= names
    assert "python_info" not in {family.name for family in Metrics().registry.collect()}


def test_an_event_outcome_is_the_worst_of_its_folds():
    assert metrics_outcome([]) == IGNORED
    assert metrics_outcome([UNCHANGED, UNCHANGED]) == UNCHANGED
    assert metrics_outcome([UNCHANGED, CHANGED]) == CHANGED
    assert metrics_outcome([CHANGED, FAILED]) == FAILED


def test_a_conflated_list_answers_its_oldest_event():
    def stamped(version: int, devices: dict[str, DeviceInfo], arrival: float) -> DeviceTree:
        return tree(pool("a/x", devices), version=version, arrival=arrival)

    async def run() -> tuple[float | None, float | None]:
        stream = TreeStream(listing_scope("a/x", "test"), tree(pool("a/x", []), version=1))
        stream.offer(stamped(2, {"d1": DeviceInfo()}, 10.0))
        stream.offer(stamped(3, {"d1": DeviceInfo(), "d2": DeviceInfo()}, 11.0))  # replaces the first
        await stream.next(last_sent=0.0)
        first = stream.taken_arrival
        stream.offer(stamped(4, {"d3": DeviceInfo()}, 12.0))
        await stream.next(last_sent=0.0)
        return first, stream.taken_arrival

    assert asyncio.run(run()) == (10.0, 12.0)


def test_the_reaction_time_is_observed_only_for_lists_that_answer_an_event():
    metrics = Metrics()
    metrics.listandwatch_sent("a/x", None)  # a stream's first list
    metrics.listandwatch_sent("a/x", 0.0)
    assert sample(metrics, "devplugd_listandwatch_messages_total", resource="a/x") == 2
    assert sample(metrics, "devplugd_event_to_listandwatch_seconds_count", resource="a/x") == 1


@pytest.mark.parametrize(("text", "address"), [("127.0.0.1:9464", ("127.0.0.1", 9464)),
                                                ("[::1]:0", ("::1", 0)), ("node-1:80", ("node-1", 80))])
def test_metrics_address_is_host_and_port(text, address):
    assert parse_host_port(text) == address


@pytest.mark.parametrize("text", ["9464", ":9464", "host:", "host:http", "host:70000"])
def test_a_metrics_address_without_host_or_port_is_refused(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_host_port(text)


class SteppedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_healthz_turns_503_naming_the_silence_when_the_loop_stops_beating_and_metrics_stay_served() -> None:
    clock = SteppedClock()
    liveness = Liveness(clock=clock)
    metrics = Metrics()
    metrics.config_reloads.labels(outcome="ok").inc()
    server = MetricsServer(metrics.registry, ("127.0.0.1", 0), liveness)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert http_get(f"{base}/healthz") == (200, "ok\n")
        clock.now += 10.0  # the watchdog's limit: still alive
        assert http_get(f"{base}/healthz")[0] == 200
        clock.now += 1.5
        assert http_get(f"{base}/healthz") == (503, "the event loop has not run for 11.5s\n")
        status, text = http_get(f"{base}/metrics")  # a wedged loop does not stop the scrape
        assert status == 200 and 'devplugd_config_reloads_total{outcome="ok"} 1.0' in text
        liveness.beat()
        assert http_get(f"{base}/healthz") == (200, "ok\n")
    finally:
        server.close()


async def test_the_loop_task_keeps_liveness_fresh_while_the_loop_runs(autojump_clock: trio.abc.Clock) -> None:
    liveness = Liveness(clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(liveness.keep_beating)
        await trio.sleep(60)
        assert liveness.alive() and liveness.silence() <= 1.0
        nursery.cancel_scope.cancel()
    await trio.sleep(30)
    assert not liveness.alive()

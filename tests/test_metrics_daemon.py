"""The real daemon's /metrics: scraped over HTTP while VFs are hot-plugged through the uevent
seam, checked by ``promtool check metrics``, scraped by a real Prometheus server, and the bad
inputs (an address that cannot be bound, a kubelet checkpoint that cannot be read)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.checkpoint import CHECKPOINT_NAME
from tests.daemonrun import REPO_ROOT, DaemonProcess, control_cli, wait_for_control
from tests.seam import PF, create_vfs
from tests.waiting import wait_until

CONFIG = {"resourceList": [{"resourceName": "dpdk", "selectors": {"drivers": ["vfio-pci"]}}]}
DPDK = "intel.com/dpdk"
# the queries of docs/metrics.md (its promql blocks, one a line): the reaction-time p99s, and
# "which pod holds which VF"
DOC_QUERIES = [line for block in re.findall(r"```promql\n(.*?)```", (REPO_ROOT / "docs/metrics.md").read_text(), re.S)
               for line in block.splitlines() if line.strip()]
HOLDERS = next(query for query in DOC_QUERIES if query.startswith("devplugd_device_allocation_info"))


def metrics_url(daemon: DaemonProcess) -> str:
    """The URL the daemon says it serves (started with port 0: the kernel's choice)."""
    found = daemon.wait_until(lambda: re.search(r"metrics: serving (http://\S+/metrics)", daemon.log),
                              "serving metrics")
    return found.group(1)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def scrape_until(daemon: DaemonProcess, url: str, holds: Callable[[str], Any], what: str) -> str:
    """The first scrape for which ``holds(text)`` is true."""
    def attempt() -> str | None:
        text = scrape(url)
        return text if holds(text) else None
    result: str = daemon.wait_until(attempt, what)
    return result


def value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def start(run_daemon, seam, *extra: str) -> tuple[DaemonProcess, str]:
    daemon = run_daemon(CONFIG, "--uevent-source", f"unix:{seam.path}", "--metrics-address", "127.0.0.1:0", *extra)
    seam.wait_ready()
    return daemon, metrics_url(daemon)


def test_a_hotplug_moves_the_device_gauge_and_the_reaction_time_histogram(host, kubelet, run_daemon, seam):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 2)
    before = scrape_until(daemon, url, lambda t: value(t, "devplugd_pool_devices", resource=DPDK) == 2,
                          "the gauge at 2 devices")
    reactions = value(before, "devplugd_event_to_listandwatch_seconds_count", resource=DPDK) or 0
    (added,) = create_vfs(host, seam, 2, 1)
    kubelet.wait_for_devices(DPDK, 3)
    after = scrape_until(
        daemon, url, lambda t: (value(t, "devplugd_event_to_listandwatch_seconds_count", resource=DPDK) or 0) > reactions,
        "a reaction time observed")
    assert value(after, "devplugd_pool_devices", resource=DPDK) == 3
    assert value(after, "devplugd_pool_healthy_devices", resource=DPDK) == 3
    assert value(after, "devplugd_device_info", resource=DPDK, device=added, pci_address=added, numa_node="0") == 1
    assert value(after, "devplugd_kernel_events_total", source="uevent", outcome="changed") >= 1
    assert value(after, "devplugd_event_to_listandwatch_seconds_sum", resource=DPDK) > 0  # measured, not asserted
    assert value(after, "devplugd_register_calls_total", resource=DPDK) >= 1
    assert value(after, "devplugd_listandwatch_messages_total", resource=DPDK) >= 2
    kubelet.allocate(DPDK, [added])
    answered = scrape(url)
    assert value(answered, "devplugd_allocate_calls_total", resource=DPDK) == 1
    assert value(answered, "devplugd_allocate_duration_seconds_count", resource=DPDK) == 1
    assert value(answered, "devplugd_allocate_refusals_total", resource=DPDK) == 0
    assert value(answered, "process_resident_memory_bytes") > 0
    assert daemon.stop() == 0


def test_a_real_scrape_passes_promtool_check_metrics(host, kubelet, run_daemon, seam, short_tmp):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    kubelet.write_checkpoint({DPDK: [create_vfs(host, None, 2, 1)[0]]})
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 3)
    text = scrape_until(daemon, url, lambda t: value(t, "devplugd_device_allocation_info"), "an allocation series")
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is needed"
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr + text
    assert checked.stdout + checked.stderr == "", checked.stdout + checked.stderr  # no lint finding either


def test_a_metrics_address_that_cannot_be_bound_exits_2_naming_it(run_daemon):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = run_daemon(CONFIG, "--uevent-source", "none", "--metrics-address", f"127.0.0.1:{port}")
        assert daemon.process.wait(30) == 2
    assert f"--metrics-address 127.0.0.1:{port}: cannot serve metrics there" in daemon.log


def test_a_metrics_address_that_is_not_host_and_port_exits_2(run_daemon):
    daemon = run_daemon(CONFIG, "--uevent-source", "none", "--metrics-address", "9464")
    assert daemon.process.wait(30) == 2
    assert "--metrics-address: '9464' is not HOST:PORT" in daemon.log


def test_a_corrupt_checkpoint_empties_the_allocation_series_with_one_log_line(host, kubelet, run_daemon, seam,
                                                                                short_tmp):
    host.add_pf(PF, netdev="ens1f0")
    (vf0, _) = create_vfs(host, None, 0, 2)
    (short_tmp / "device-plugins" / CHECKPOINT_NAME).write_text("{torn")
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 2)
    for _ in range(3):
        text = scrape(url)
        assert value(text, "devplugd_device_allocation_info") is None
        assert value(text, "devplugd_pool_devices", resource=DPDK) == 2  # the pool is still there
    assert daemon.log.count("metrics: cannot read the kubelet checkpoint") == 1, daemon.log
    kubelet.write_checkpoint({DPDK: [vf0]}, pod="uid-7", container="dpdk-app")
    text = scrape(url)
    assert value(text, "devplugd_device_allocation_info", resource=DPDK, device=vf0, pod_uid="uid-7",
                 container="dpdk-app") == 1
    assert value(text, "devplugd_pool_kubelet_allocated_devices", resource=DPDK) == 1
    kubelet.wait_for_devices(DPDK, 2)  # still served to the kubelet throughout
    assert daemon.stop() == 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def api(base: str, path: str, **query: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}?{urllib.parse.urlencode(query)}", timeout=5) as response:
        document = json.load(response)
    assert document["status"] == "success", document
    return document["data"]


def query_value(base: str, promql: str) -> float | None:
    result = api(base, "/api/v1/query", query=promql)["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(short_tmp: Path):
    """Start a Prometheus server scraping ``target`` every second; yields its API's base URL."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus (Debian package prometheus) is needed"
    started: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        config = short_tmp / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "devplugd", "static_configs": [{"targets": [target]}]}],
        }))
        address = f"127.0.0.1:{free_port()}"
        log = open(short_tmp / "prometheus.log", "wb")  # noqa: SIM115 (the process writes it until the end)
        started.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={short_tmp / 'tsdb'}",
             f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT))
        base = f"http://{address}"

        def ready() -> bool:
            if started[-1].poll() is not None:
                raise AssertionError((short_tmp / "prometheus.log").read_text())
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False
        wait_until(ready, 30, lambda: "prometheus never got ready:\n" + (short_tmp / "prometheus.log").read_text(),
                   interval=0.1)
        return base

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_real_prometheus_scrapes_the_daemon_and_sees_a_hotplug(host, kubelet, run_daemon, seam, prometheus):
    host.add_pf(PF, netdev="ens1f0")
    (held, _) = create_vfs(host, None, 0, 2)
    kubelet.write_checkpoint({DPDK: [held]}, pod="uid-9", container="app")
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 2)
    target = urllib.parse.urlsplit(url).netloc
    base = prometheus(target)

    def our_target() -> dict[str, Any] | None:
        for active in api(base, "/api/v1/targets")["activeTargets"]:
            if active["scrapeUrl"] == url and active["health"] == "up":
                return active
        return None
    wait_until(our_target, 30, lambda: f"target {url} never up: {api(base, '/api/v1/targets')}", interval=0.2)
    devices = f'devplugd_pool_devices{{resource="{DPDK}"}}'
    reactions = f'sum(devplugd_event_to_listandwatch_seconds_count{{resource="{DPDK}"}})'
    wait_until(lambda: query_value(base, devices) == 2, 30, "Prometheus never had the 2 devices", interval=0.2)
    before = query_value(base, reactions) or 0.0
    create_vfs(host, seam, 2, 1)
    kubelet.wait_for_devices(DPDK, 3)
    wait_until(lambda: query_value(base, devices) == 3, 30, "Prometheus never saw the third device", interval=0.2)
    wait_until(lambda: (query_value(base, reactions) or 0.0) > before, 30, "no reaction time in Prometheus",
               interval=0.2)
    assert query_value(base, 'up{job="devplugd"}') == 1
    assert query_value(base, "python_info") == 1  # the standard collectors came along
    assert len(DOC_QUERIES) >= 3, DOC_QUERIES
    for query in DOC_QUERIES:  # the docs' queries are valid PromQL over our series
        api(base, "/api/v1/query", query=query)
    (holder,) = api(base, "/api/v1/query", query=HOLDERS)["result"]
    assert holder["metric"]["pci_address"] == held and holder["metric"]["pod_uid"] == "uid-9"
    assert daemon.stop() == 0


def test_counters_follow_a_kubelet_restart_config_reloads_and_host_leases(host, kubelet, run_daemon, seam, short_tmp):
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 2)
    control = short_tmp / "control.sock"
    wait_for_control(control)
    granted = control_cli(control, "allocate", DPDK, "--owner", "vm", "-o", "json")
    assert granted.returncode == 0, granted.stderr
    assert control_cli(control, "allocate", DPDK, "-n", "5", "--owner", "vm").returncode != 0
    assert control_cli(control, "release", json.loads(granted.stdout)["lease"]).returncode == 0
    config = daemon.workdir / "config-0.json"
    config.write_text("{torn")
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for_log("config reload refused")
    config.write_text(json.dumps(CONFIG))
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_for_log("config reloaded")
    kubelet.restart()
    text = scrape_until(daemon, url, lambda t: value(t, "devplugd_register_calls_total", resource=DPDK) == 2,
                        "registered again after the kubelet's restart")
    assert value(text, "devplugd_kubelet_restarts_total") == 1
    for outcome in ("granted", "refused", "released"):
        assert value(text, "devplugd_host_leases_total", outcome=outcome) == 1, outcome
    # the config's inotify watch reloads too (a write may be two events): at least one of each
    assert value(text, "devplugd_config_reloads_total", outcome="refused") >= 1
    assert value(text, "devplugd_config_reloads_total", outcome="ok") >= 1
    assert value(text, "devplugd_register_failures_total", resource=DPDK) in (None, 0)
    assert daemon.stop() == 0


def test_healthz_answers_ok_beside_metrics_on_the_same_port(run_daemon, seam):
    """The DaemonSet's liveness probe: /healthz on the metrics port, 200 while the loop runs."""
    daemon, url = start(run_daemon, seam)
    health = url.removesuffix("/metrics") + "/healthz"
    with urllib.request.urlopen(health, timeout=5) as response:
        assert (response.status, response.read()) == (200, b"ok\n")
    assert "devplugd_kernel_events_total" in scrape(url)
    assert daemon.stop() == 0


def test_a_scrape_has_no_created_series(run_daemon, seam):
    """prometheus_client's ``*_created`` (one more series per counter and histogram child, a
    timestamp nobody graphs) is turned off in the daemon."""
    daemon, url = start(run_daemon, seam)
    text = scrape(url)
    assert "devplugd_kernel_events_total" in text and "devplugd_event_to_listandwatch_seconds" in text
    assert "_created" not in text
    assert daemon.stop() == 0


def test_a_lost_lease_book_is_a_metric_until_it_is_cleared(host, kubelet, run_daemon, seam, short_tmp):
    (short_tmp / "state").mkdir()
    (short_tmp / "state" / "leases.json").write_text("{ torn")
    host.add_pf(PF, netdev="ens1f0")
    create_vfs(host, None, 0, 2)
    daemon, url = start(run_daemon, seam)
    text = scrape_until(daemon, url, lambda t: value(t, "devplugd_lost_books", book="lease") == 1, "lease book lost")
    assert value(text, "devplugd_lost_books", book="claim") == 0
    assert control_cli(short_tmp / "control.sock", "clear-lost", "leases").returncode == 0
    scrape_until(daemon, url, lambda t: value(t, "devplugd_lost_books", book="lease") == 0, "lease book cleared")


def test_the_checkpoint_is_parsed_once_per_change_however_many_list_calls_and_scrapes(
        host, kubelet, run_daemon, seam, short_tmp):
    """The host API, the metrics and the event loop share one reader: List after List and scrape
    after scrape of an unchanged checkpoint parse it once; a new checkpoint once more."""
    host.add_pf(PF, netdev="ens1f0")
    vfs = create_vfs(host, None, 0, 2)
    kubelet.write_checkpoint({DPDK: [vfs[0]]})
    daemon, url = start(run_daemon, seam)
    kubelet.wait_for_devices(DPDK, 2)
    wait_for_control(short_tmp / "control.sock")
    for _ in range(10):
        listed = json.loads(control_cli(short_tmp / "control.sock", "list", "-o", "json").stdout)
        assert {d["id"]: d["holder"] for d in listed[0]["devices"]} == {vfs[0]: "kubelet", vfs[1]: "free"}
        text = scrape(url)
    assert value(text, "devplugd_kubelet_checkpoint_reads_total") == 1
    kubelet.write_checkpoint({DPDK: [vfs[1]]})
    def holders() -> dict[str, str]:
        listed = json.loads(control_cli(short_tmp / "control.sock", "list", "-o", "json").stdout)
        return {d["id"]: d["holder"] for d in listed[0]["devices"]}
    daemon.wait_until(lambda: holders() == {vfs[0]: "free", vfs[1]: "kubelet"}, "the new checkpoint read")
    for _ in range(5):
        holders()
    assert value(scrape(url), "devplugd_kubelet_checkpoint_reads_total") == 2

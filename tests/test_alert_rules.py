"""deploy/alerts/: the Prometheus alert rules (docs/alerts.md), checked by promtool and against
the daemon they watch.

``devplugd-rules.yaml`` (a plain Prometheus rules file) is the one source of truth;
``prometheusrule.yaml`` (prometheus-operator's PrometheusRule) is rendered from it by this module:
``.venv/bin/python -m tests.test_alert_rules`` writes it again. ``devplugd-rules.test.yaml`` is
``promtool test rules``' unit tests, whose input series must be what a scrape of the daemon's
registry has (names, labels, histogram buckets), plus the labels a scrape adds; and a label
value a rule selects (``reason="error"``) must be one the daemon counts under, as the real
ResourceSlice publisher shows against the API server stand-in. promtool comes from Debian's
``prometheus`` package; without it these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import trio
import yaml
from markdown.extensions.toc import slugify
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.core import HEALTHY, UNHEALTHY, AllocationError, DeviceInfo, HandlerContext, Loan, ResourcePool
from daemon.core._config import parse_config
from daemon.core._handler import Hooks
from daemon.core._tree import DRA_ROAD, DeviceTree
from daemon.dra._kube import ApiLink
from daemon.dra._loans import ClaimLoans
from daemon.dra._pools import DraPools
from daemon.dra._prepared import ClaimBook
from daemon.dra._publisher import SlicePublisher
from daemon.handlers.pci import PciHandler
from daemon.metrics import Metrics
from daemon.settings import Settings
from tests.apiserver import SLICES_PATH, ApiServer
from tests.daemonrun import REPO_ROOT
from tests.fakesysfs import FakeHost
from tests.pci import add_nvme_pf
from tests.waiting import wait_until_async

DEPLOY = REPO_ROOT / "deploy"
ALERTS = DEPLOY / "alerts"
RULES = ALERTS / "devplugd-rules.yaml"
RULE_TESTS = ALERTS / "devplugd-rules.test.yaml"
PROMETHEUS_RULE = ALERTS / "prometheusrule.yaml"
POD_MONITOR = ALERTS / "podmonitor.yaml"
DOCS = REPO_ROOT / "docs" / "alerts.md"
RENDER = "python -m tests.test_alert_rules"

# The scrape job the rules assume (docs/alerts.md), and the labels a scrape adds to every series:
# Prometheus's job and instance, and what a PodMonitor's targets carry besides.
JOB = "devplugd"
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint"})
SEVERITIES = ("critical", "warning", "info")

Document = dict[str, Any]

PROMETHEUS_RULE_HEADER = """\
# GENERATED from devplugd-rules.yaml by `.venv/bin/python -m tests.test_alert_rules`: edit that
# file, then run this again (tests/test_alert_rules.py fails while the two differ).
# The alert rules for prometheus-operator (docs/alerts.md):
#   kubectl apply -f deploy/alerts/prometheusrule.yaml
# Not in deploy/kustomization.yaml: a cluster without prometheus-operator has no PrometheusRule kind.
# kube-prometheus selects every PrometheusRule (its older releases, those labelled prometheus: k8s
# and role: alert-rules); kube-prometheus-stack those labelled `release: <its release name>`.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: devplugd
  namespace: devplugd
  labels:
    app.kubernetes.io/name: devplugd
    prometheus: k8s
    role: alert-rules
"""


def render_prometheus_rule(rules_text: str) -> str:
    """The PrometheusRule whose ``spec`` is the rules file from its ``groups:`` on (its leading
    comments left out), indented as it is, comments and all."""
    groups = rules_text[re.search(r"^groups:", rules_text, re.MULTILINE).start():]  # type: ignore[union-attr]
    return PROMETHEUS_RULE_HEADER + "spec:\n" + textwrap.indent(groups, "  ")


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as stream:
        return yaml.safe_load(stream)


def _rules() -> list[Document]:
    return [rule for group in _load(RULES)["groups"] for rule in group["rules"]]


ALERT_RULES = {rule["alert"]: rule for rule in _rules() if "alert" in rule}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH: it comes with Debian's prometheus package "
                    "(apt-get install prometheus; CI installs it in .ci/run)", pytrace=False)
    return path


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}"
    return done.stdout


def _seconds(duration: str) -> int:
    """A Prometheus duration of whole units (``90s``, ``5m``, ``1h``) in seconds."""
    match = re.fullmatch(r"(\d+)([smh])", duration)
    assert match, f"not a duration this test reads: {duration!r}"
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]


# -- promtool ----------------------------------------------------------------------------------


def test_the_rules_file_passes_promtool_check_rules(promtool: str) -> None:
    assert f"SUCCESS: {len(_rules())} rules found" in _run(promtool, "check", "rules", str(RULES))


def test_the_prometheusrules_spec_passes_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    groups = tmp_path / "prometheusrule-spec.yaml"
    groups.write_text(yaml.safe_dump(_load(PROMETHEUS_RULE)["spec"]), encoding="utf-8")
    assert f"SUCCESS: {len(_rules())} rules found" in _run(promtool, "check", "rules", str(groups))


def test_the_unit_tests_pass_promtool_test_rules(promtool: str) -> None:
    assert "SUCCESS" in _run(promtool, "test", "rules", str(RULE_TESTS))


# -- one source of truth, and what prometheus-operator reads -----------------------------------


def test_the_prometheusrule_is_rendered_from_the_rules_file() -> None:
    rendered = render_prometheus_rule(RULES.read_text(encoding="utf-8"))
    assert PROMETHEUS_RULE.read_text(encoding="utf-8") == rendered, (
        f"{PROMETHEUS_RULE.name} is not {RULES.name} rendered: run `.venv/bin/{RENDER}`")
    assert _load(PROMETHEUS_RULE)["spec"] == _load(RULES)  # the same groups, exactly


def _kustomization() -> Document:
    kustomization: Document = _load(DEPLOY / "kustomization.yaml")
    return kustomization


def _daemonset() -> Document:
    (daemonset,) = [document for document in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text())
                    if document and document["kind"] == "DaemonSet"]
    return daemonset


def test_the_prometheus_operator_objects_are_in_the_daemons_namespace_and_left_out_of_the_kustomization() -> None:
    kustomization = _kustomization()
    for path, kind, spec_keys in [(PROMETHEUS_RULE, "PrometheusRule", {"groups"}),
                                  (POD_MONITOR, "PodMonitor", {"jobLabel", "selector", "podMetricsEndpoints"})]:
        document = _load(path)
        assert (document["apiVersion"], document["kind"]) == ("monitoring.coreos.com/v1", kind)
        assert document["metadata"]["name"] == "devplugd"
        assert document["metadata"]["namespace"] == kustomization["namespace"]
        assert set(document["spec"]) == spec_keys
        # a cluster without prometheus-operator would refuse the whole kustomization
        assert not any(Path(resource).parts[0] == ALERTS.name for resource in kustomization["resources"])


def test_the_pod_monitor_scrapes_the_daemonsets_metrics_port_as_the_job_the_rules_assume() -> None:
    spec = _load(POD_MONITOR)["spec"]
    pod = _daemonset()["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels[spec["jobLabel"]] == JOB
    (endpoint,) = spec["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    # no declared port to name (a hostPort would keep a rolling update's surge pod off the
    # node): the pod's IP (the node's, under hostNetwork) at the port the daemon listens on
    assert "ports" not in container and "port" not in endpoint and pod["spec"]["hostNetwork"] is True
    listening = {arg.rpartition(":")[2] for arg in container["args"] if arg.startswith("--metrics-address=")}
    assert listening == {str(container["livenessProbe"]["httpGet"]["port"])}
    assert {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_ip"], "targetLabel": "__address__",
            "replacement": f"$1:{listening.pop()}"} in endpoint["relabelings"]
    assert endpoint["path"] == "/metrics"
    assert {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "instance"} in endpoint["relabelings"]


# -- the rules' conventions, and the page that documents them ----------------------------------


@pytest.mark.parametrize("name", ALERT_RULES)
def test_each_alert_has_a_for_a_severity_and_annotations_naming_its_node_and_pool(name: str) -> None:
    rule = ALERT_RULES[name]
    assert _seconds(rule["for"]) > 0
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    if "devplugd_" in rule["expr"]:  # the daemon's own series: one per node, and per pool where labelled
        assert "$labels.instance" in annotations["description"]
        assert ("resource" in _exported_labels(rule["expr"])) == ("$labels.resource" in annotations["description"])
    elif "absent(" not in rule["expr"]:
        assert "$labels.instance" in annotations["description"]


@pytest.mark.parametrize("name", ALERT_RULES)
def test_each_alerts_runbook_is_its_section_of_docs_alerts_md_with_its_severity_and_for(name: str) -> None:
    rule = ALERT_RULES[name]
    page = DOCS.read_text(encoding="utf-8")
    # the anchor MkDocs (Python-Markdown's toc) and GitHub both give the heading `### DevplugdDown`
    anchor = slugify(name, "-")
    prefix, _, fragment = rule["annotations"]["runbook_url"].partition("#")
    assert fragment == anchor
    # docs/alerts.md as shipped; a site's address once it is made absolute (docs/alerts.md)
    assert {ALERT_RULES[other]["annotations"]["runbook_url"].partition("#")[0] for other in ALERT_RULES} == {prefix}
    assert prefix == "docs/alerts.md" or prefix.startswith("https://")
    headings = [slugify(heading, "-") for heading in re.findall(r"^#{1,6} (.+)$", page, re.MULTILINE)]
    assert anchor in headings, f"no section {name} in {DOCS.name}"
    row = f"| [{name}](#{anchor}) | {rule['labels']['severity']} | {rule['for']} |"
    assert row in page, f"the table of {DOCS.name} has no row starting {row}"


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (not a code block's comments), as MkDocs (Python-Markdown's
    toc) gives them."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return {slugify(heading, "-") for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_the_docs_page_links_only_to_its_own_sections_and_pages_beside_it() -> None:
    """A valid MkDocs page: deploy/ is outside docs/, so paths there are code, not links; a link
    to another page's section names one of its headings."""
    page = DOCS.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)]*)\)", page):
        path, _, fragment = target.partition("#")
        linked = DOCS.parent / path if path else DOCS
        assert not path or (re.fullmatch(r"[\w-]+\.md", path) and linked.is_file()), f"link to {target!r}"
        assert not fragment or fragment in _anchors(linked), f"link to {target!r}"


# -- the unit tests: every alert, firing and quiet, on series the daemon exports ---------------


def _unit_tests() -> list[Document]:
    tests: list[Document] = _load(RULE_TESTS)["tests"]
    return tests


@pytest.mark.parametrize("name", ALERT_RULES)
def test_each_alert_is_unit_tested_quiet_before_its_for_and_firing_after(name: str) -> None:
    rule = ALERT_RULES[name]
    quiet_then_firing = False
    quiet_anywhere = False
    for group in _unit_tests():
        cases = [case for case in group["alert_rule_test"] if case["alertname"] == name]
        quiet = [_seconds(case["eval_time"]) for case in cases if not case.get("exp_alerts")]
        quiet_anywhere |= bool(quiet)
        for case in cases:
            for alert in case.get("exp_alerts") or []:
                assert alert["exp_labels"]["severity"] == rule["labels"]["severity"]
                assert set(alert["exp_annotations"]) == set(rule["annotations"])
                fired_at = _seconds(case["eval_time"])
                assert fired_at >= _seconds(rule["for"])
                quiet_then_firing |= any(fired_at - _seconds(group["interval"]) <= at < fired_at for at in quiet)
    assert quiet_then_firing, f"no unit test of {name} where it is quiet one interval before it fires"
    assert quiet_anywhere


def _exposition() -> dict[str, set[frozenset[tuple[str, str]]]]:
    """Sample name -> the label sets of its samples, in a scrape of a daemon's registry whose
    instruments have all been used (a labelled counter or histogram has no sample until then)."""
    metrics = Metrics()
    devices = {"0000:3b:02.0": DeviceInfo(health=HEALTHY), "0000:3b:02.1": DeviceInfo(health=UNHEALTHY),
               "0000:3b:02.2": DeviceInfo(health=UNHEALTHY)}
    pool = ResourcePool("intel.com/dpdk", "pci", None, MappingProxyType(devices),  # type: ignore[arg-type]
                        vanished=frozenset({"0000:3b:02.2"}))
    metrics.tree.offer(DeviceTree.build(1, [pool]))
    metrics.register_calls.labels(pool.resource).inc()
    metrics.register_failures.labels(pool.resource).inc()
    metrics.listandwatch_sent(pool.resource, time.monotonic())
    metrics.dra_slice_write_failures.labels("error").inc()
    scraped: dict[str, set[frozenset[tuple[str, str]]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if not sample.name.endswith("_created"):  # the daemon turns those off
                scraped.setdefault(sample.name, set()).add(frozenset(sample.labels.items()))
    return scraped


EXPOSITION = _exposition()


def _label_names(name: str) -> frozenset[str]:
    (names,) = {frozenset(label for label, _ in labels) for labels in EXPOSITION[name]}
    return names


def _exported_labels(expr: str) -> frozenset[str]:
    return frozenset().union(*(_label_names(name) for name in re.findall(r"\bdevplugd_\w+", expr)))


def _selector(series: str) -> tuple[str, dict[str, str]]:
    match = re.fullmatch(r"([a-zA-Z_:][\w:]*)\{(.*)\}", series)
    assert match, f"not a series this test reads: {series}"
    return match[1], dict(re.findall(r'(\w+)="([^"]*)"', match[2]))


def test_the_rules_read_only_series_the_daemon_exports_and_the_scrape_jobs_up() -> None:
    for rule in _rules():
        expr = rule["expr"]
        for name in re.findall(r"\bdevplugd_\w+", expr):
            assert name in EXPOSITION, f"{rule['alert']}: the daemon exports no {name}"
        for matchers in re.findall(r"\bup\{([^}]*)\}", expr):
            assert matchers == f'job="{JOB}"', f"{rule['alert']}: up{{{matchers}}}"


def test_the_unit_tests_input_series_are_a_scrape_of_the_daemon_plus_target_labels() -> None:
    histograms: dict[tuple[str, frozenset[tuple[str, str]]], set[str]] = {}
    for group in _unit_tests():
        for entry in group["input_series"]:
            name, labels = _selector(entry["series"])
            assert {"job", "instance"} <= labels.keys()
            own = labels.keys() - TARGET_LABELS
            if name == "up":  # Prometheus's own: target labels only
                assert not own
                continue
            assert name in EXPOSITION, f"the daemon exports no {name}"
            assert own == _label_names(name), f"{entry['series']}: the daemon's {name} has {_label_names(name)}"
            if "le" in labels:
                rest = frozenset((k, v) for k, v in labels.items() if k != "le")
                histograms.setdefault((name, rest), set()).add(labels["le"])
    for (name, _), buckets in histograms.items():
        exported = {dict(labels)["le"] for labels in EXPOSITION[name]}
        # every bucket, as the daemon writes its bound ("1.0", "+Inf")
        assert buckets == exported, f"{name}: the daemon's buckets are {sorted(exported)}"


# -- label values the rules select: the ones the daemon counts under ----------------------------


def _rule_selections() -> dict[tuple[str, str], set[str]]:
    """(daemon series, label) -> the values the rules' selectors match it on (``=`` only: the
    rules use no other matcher on the daemon's series)."""
    selected: dict[tuple[str, str], set[str]] = {}
    for rule in _rules():
        for name, matchers in re.findall(r"\b(devplugd_\w+)\{([^}]*)\}", rule["expr"]):
            pairs = re.findall(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"', matchers)
            assert all(op == "=" for _, op, _ in pairs), f"{rule['alert']}: {matchers}"
            for label, _, value in pairs:
                assert label in _label_names(name), f"{rule['alert']}: the daemon's {name} has no {label}"
                selected.setdefault((name, label), set()).add(value)
    return selected


DRA_NODE, DRA_DRIVER, DRA_TOKEN = "node1", "devplugd.io", "node1-token"
WRITE_FAILURES = "devplugd_dra_slice_write_failures_total"
VFIO_REBINDS = "devplugd_dra_vfio_rebinds_total"


def _dra_tree(version: int, count: int) -> DeviceTree:
    """One DRA pool, example.com/things, of ``count`` plain Healthy devices."""
    document = {"resourceList": [{"resourceName": "things", "deviceType": "thing", "allocationApi": "dra",
                                  "selectors": {}}]}
    (configured,) = parse_config(json.dumps(document), "test", "example.com",
                                 {"thing": ("test", lambda entry: None)}).pools
    devices = {f"d{index:05d}": DeviceInfo(health=HEALTHY) for index in range(count)}
    return DeviceTree.build(version, [ResourcePool("example.com/things", "test", configured, devices,
                                                    road=DRA_ROAD)])


async def _publish_through_failures(api: ApiServer, kubeconfig: Path) -> Metrics:
    """The real SlicePublisher's metrics once the API server refused its pool (422), then failed
    the write of the pool's next devices once (500), which the publisher retried."""
    settings = Settings(kubeconfig=kubeconfig, node_name=DRA_NODE, dra_driver=DRA_DRIVER)
    link = ApiLink(settings)
    metrics = Metrics()
    sample = metrics.registry.get_sample_value

    pools: list[DraPools] = []
    publisher = SlicePublisher(settings, link, metrics, on_server=lambda on_server: pools[0].on_server(on_server))
    pools.append(DraPools(DRA_DRIVER, DRA_NODE, {}, publisher))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.run)
            api.fail_next("POST", SLICES_PATH + "$", 422, message="ResourceSlice.resource.k8s.io is invalid: injected")
            pools[0].offer(_dra_tree(1, 2))
            await wait_until_async(lambda: sample("devplugd_dra_pools_refused") == 1, what="a refused pool")
            assert sample(WRITE_FAILURES, {"reason": "refused"}) == 1
            api.fail_next("POST", SLICES_PATH + "$", 500, message="injected")
            pools[0].offer(_dra_tree(2, 3))  # its devices changed: tried again, failed once, retried
            await wait_until_async(lambda: sample("devplugd_dra_pools_refused") == 0 and bool(
                sample("devplugd_dra_slice_writes_total", {"operation": "create"})), what="the pool written")
            assert sample(WRITE_FAILURES, {"reason": "error"}) == 1
            assert sample(WRITE_FAILURES, {"reason": "refused"}) == 1
            nursery.cancel_scope.cancel()
    finally:
        link.close()
    return metrics


async def test_the_label_values_the_rules_select_are_those_the_daemon_counts_under(tmp_path: Path) -> None:
    """``reason="error"`` (DevplugdResourceSliceWritesFailing) counts the failures the publisher
    retries and not a refused pool, which devplugd_dra_pools_refused counts until its devices
    change (DevplugdResourceSlicesRefused): the values from the real publisher, not this file."""
    with ApiServer(token=DRA_TOKEN) as api:
        api.add_node(DRA_NODE)
        metrics = await _publish_through_failures(api, api.kubeconfig(tmp_path / "kubeconfig"))
    counted: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            for label, value in sample.labels.items():
                counted.setdefault((sample.name, label), set()).add(value)
    assert counted[(WRITE_FAILURES, "reason")] == {"error", "refused"}
    selected = _rule_selections()
    assert selected, "no rule selects on a label value of the daemon's series: this test checks nothing"
    for (name, label), values in selected.items():
        assert (name, label) in counted, f"a rule selects {name} by {label}, which this test does not make count"
        assert values <= counted[(name, label)], f"{name} by {label}: the daemon counts {counted[(name, label)]}"


def test_the_latency_bound_is_a_bucket_bound_of_the_histogram() -> None:
    """``p99 > 1`` is exact only when 1 s is a bucket's upper bound (not interpolated)."""
    expr = ALERT_RULES["DevplugdListAndWatchLatencyHigh"]["expr"]
    match = re.search(r"histogram_quantile\(0\.99, rate\((\w+)_bucket\[\w+\]\)\) > ([\d.]+)$", expr)
    assert match, expr
    buckets = {float(dict(labels)["le"]) for labels in EXPOSITION[f"{match[1]}_bucket"]}
    assert float(match[2]) in buckets


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(render_prometheus_rule(RULES.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PROMETHEUS_RULE.relative_to(REPO_ROOT)}", file=sys.stderr)


def test_a_device_that_cannot_go_back_counts_under_the_labels_the_vfio_rule_selects(tmp_path: Path) -> None:
    """DevplugdVfioDeviceNotGivenBack selects direction="back", outcome="failed": the real
    ClaimLoans and pci handler count a failed give-back there (the function's own driver is not
    loaded any more, on a fake sysfs), and nowhere else."""
    host = FakeHost(tmp_path / "host")
    (vf,) = add_nvme_pf(host, "0000:04:00.0", [None])
    (host.device_dir(vf) / "driver_override").write_text("(null)\n")  # as the kernel shows every function
    handler = PciHandler(HandlerContext(host.sys, host.dev, host.proc, tmp_path / "devinfo"))
    metrics = Metrics()
    loans = ClaimLoans({"pci": Hooks.of(handler)}, ClaimBook(tmp_path / "state"), lambda event: None, metrics)
    with pytest.raises(AllocationError, match="its driver mlx5_core is not loaded any more"):
        loans.give_back("claim default/vm", [Loan("pci", "example.com/nvme", vf, ((vf, "mlx5_core"),))])
    sample = metrics.registry.get_sample_value
    selected = {label: values for (name, label), values in _rule_selections().items() if name == VFIO_REBINDS}
    assert selected == {"direction": {"back"}, "outcome": {"failed"}}
    assert sample(VFIO_REBINDS, {"direction": "back", "outcome": "failed"}) == 1
    assert sample(VFIO_REBINDS, {"direction": "back", "outcome": "done"}) == 0

"""One daemon's counters and histograms, and the registry that serves them with the tree's
gauges. The daemon's parts get this object passed down and call its small methods."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from daemon.checkpoint import CheckpointReader

from ._liveness import Liveness
from ._tree import TreeCollector

# An event to the kubelet's list takes a few milliseconds; a burst is held up to 250 ms
# (COALESCE_MAX_DELAY); a loaded machine or a handler in a worker thread, seconds.
REACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ALLOCATE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BUILD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# a DRA call reads claims from the API server (one round trip, up to seconds when it is slow)
DRA_CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# the kinds of streams that follow the tree (devplugd_tree_streams)
LISTANDWATCH, DRA_HEALTH, HOST_WATCH = "listandwatch", "dra_health", "host_watch"

# the values of the labels with a fixed set (nothing event-specific: bounded by pools and handlers)
CHANGED, UNCHANGED, FAILED, IGNORED = "changed", "unchanged", "failed", "ignored"


def without_created_series() -> None:
    """No ``*_created`` series beside counters and histograms from now on, in this process
    (prometheus_client's switch is process-wide: the daemon's entry calls it, in-process tests
    that build Metrics keep the series)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]


class Metrics:
    """Everything one daemon counts; ``checkpoint`` is the daemon's reader of the kubelet's
    checkpoint (the allocation series). ``standard`` adds the process, platform and GC collectors
    (the daemon's own set; tests that build many loops leave them out: the GC collector hooks
    ``gc.callbacks``)."""

    def __init__(self, checkpoint: CheckpointReader | None = None, *, standard: bool = False) -> None:
        registry = self.registry = CollectorRegistry()
        self.tree = TreeCollector(checkpoint)
        registry.register(self.tree)
        # beaten by a task of the trio loop, answered at /healthz
        self.liveness = Liveness()
        if standard:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, documentation, labels, registry=registry)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...],
                      labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, documentation, labels, registry=registry, buckets=buckets)

        def gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, documentation, labels, registry=registry)

        self.kernel_events = counter(
            "devplugd_kernel_events", "Kernel events the event loop handled, by source (uevent, rtnetlink) and "
            "outcome (changed: a handler's facts changed; unchanged; failed: a handler raised; ignored: no "
            "handler wants it).", ("source", "outcome"))
        self.event_batches = counter("devplugd_event_batches", "Batches of events the event loop handled (a "
                                     "burst waiting on the bus is one batch, and at most one new tree).")
        self.resyncs = counter("devplugd_resyncs", "Full rescans asked for (start, a source's overflow), per "
                               "handler rescanned.", ("handler",))
        self.config_reloads = counter("devplugd_config_reloads", "Config reloads, by outcome (ok, refused).",
                                      ("outcome",))
        self.handler_errors = counter("devplugd_handler_errors", "Exceptions raised by a handler's hook, "
                                      "contained (the last good devices kept).", ("handler", "hook"))
        self.register_calls = counter("devplugd_register_calls", "Registrations with the kubelet tried "
                                      "(Register on kubelet.sock, or the plugin watcher's status).", ("resource",))
        self.register_failures = counter("devplugd_register_failures", "Registrations with the kubelet that "
                                         "failed or were refused.", ("resource",))
        self.kubelet_restarts = counter("devplugd_kubelet_restarts", "Kubelet restarts seen (kubelet.sock "
                                        "created again).")
        self.listandwatch_messages = counter("devplugd_listandwatch_messages", "ListAndWatch messages sent to "
                                             "the kubelet (each the full list of one resource).", ("resource",))
        self.allocate_calls = counter("devplugd_allocate_calls", "Allocate calls from the kubelet.", ("resource",))
        self.allocate_refusals = counter("devplugd_allocate_refusals", "Allocate calls answered with an error.",
                                         ("resource",))
        self.preferred_calls = counter("devplugd_preferred_allocation_calls", "GetPreferredAllocation calls from "
                                       "the kubelet.", ("resource",))
        self.preferred_refusals = counter("devplugd_preferred_allocation_refusals", "GetPreferredAllocation calls "
                                          "answered with an error.", ("resource",))
        self.host_leases = counter("devplugd_host_leases", "Host lease requests and releases, by outcome "
                                   "(granted, refused, released).", ("outcome",))
        self.reaction = histogram(
            "devplugd_event_to_listandwatch_seconds", "From an event reaching the event loop to the ListAndWatch "
            "message that includes its tree being sent to the kubelet.", REACTION_BUCKETS, ("resource",))
        self.allocate_duration = histogram("devplugd_allocate_duration_seconds", "Time to answer an Allocate "
                                           "call (refusals included).", ALLOCATE_BUCKETS, ("resource",))
        self.tree_build_duration = histogram("devplugd_tree_build_duration_seconds", "Time to build a new "
                                             "DeviceTree from the handlers' facts.", BUILD_BUCKETS)
        self.tree_streams = gauge("devplugd_tree_streams", "Open streams that follow the device tree, by kind "
                                  "(listandwatch, dra_health, host_watch).", ("kind",))
        self.lost_books = gauge("devplugd_lost_books", "1 while a book (lease, claim) that could not be read "
                                "holds every device it could have held, until `devplugd clear-lost`.", ("book",))
        # DRA: the kubelet's prepare calls and the ResourceSlices
        self.dra_prepare_duration = histogram("devplugd_dra_prepare_duration_seconds", "Time to answer a "
                                              "NodePrepareResources call (all its claims).", DRA_CALL_BUCKETS)
        self.dra_unprepare_duration = histogram("devplugd_dra_unprepare_duration_seconds", "Time to answer a "
                                                "NodeUnprepareResources call (all its claims).", DRA_CALL_BUCKETS)
        self.dra_claim_errors = counter("devplugd_dra_claim_errors", "Claims answered with an error, by call "
                                        "(prepare, unprepare).", ("call",))
        self.dra_slice_writes = counter("devplugd_dra_slice_writes", "ResourceSlice writes that succeeded, by "
                                        "operation (create, update, delete).", ("operation",))
        self.dra_slice_conflicts = counter("devplugd_dra_slice_conflicts", "ResourceSlice writes the API server "
                                           "answered 409 Conflict (read again and retried).")
        self.dra_slice_write_failures = counter(
            "devplugd_dra_slice_write_failures", "ResourceSlice writes that failed, by reason: refused (the API "
            "server rejected a pool's slices as invalid; not tried again until its devices change) or error (any "
            "other failure: unreachable, forbidden, this node missing from the API server, conflicts that did not "
            "settle; retried with backoff).",
            ("reason",))
        self.dra_pools_refused = gauge("devplugd_dra_pools_refused", "DRA pools whose ResourceSlices the API "
                                       "server refused as invalid, not published until their devices change.")
        self.dra_slice_syncs = counter("devplugd_dra_slice_syncs", "Rounds of the ResourceSlice publisher that "
                                       "left the API server publishing what the tree says.")
        self.dra_api_connected = gauge("devplugd_dra_api_connected", "1 once the API server answered and this "
                                       "node's Node object was found (ResourceSlices can be published).")
        self.dra_device_taints = gauge(
            "devplugd_dra_device_taints", "Devices published in ResourceSlices with a taint, by pool and cause "
            "(the taint key's name: carrier-lost, pcie-error, vanished, unhealthy).", ("resource", "cause"))
        self.dra_claim_status_writes = counter(
            "devplugd_dra_claim_status_writes", "Writes of a ResourceClaim's status.devices, by outcome (written, "
            "failed: retried).", ("outcome",))
        self.dra_orphaned_claims = counter(
            "devplugd_dra_orphaned_claims", "Prepared claims devplugd unprepared itself because their "
            "ResourceClaim is gone from the API server or has another UID.")
        self.dra_vfio_rebinds = counter(
            "devplugd_dra_vfio_rebinds", "Devices of vfioOnDemand pools moved for DRA claims, by direction "
            "(to_vfio at Prepare, back at Unprepare or after a failed Prepare) and outcome (done, failed).",
            ("direction", "outcome"))
        for direction in ("to_vfio", "back"):  # exported at 0: the first failure is an increase an alert sees
            for outcome in ("done", "failed"):
                self.dra_vfio_rebinds.labels(direction, outcome)
        self.dra_vfio_rebind_duration = histogram(
            "devplugd_dra_vfio_rebind_duration_seconds", "Time to take one claim's devices to vfio-pci (every "
            "function of their IOMMU groups).", DRA_CALL_BUCKETS)
        self.dra_vfio_lent_functions = gauge(
            "devplugd_dra_vfio_lent_functions", "PCI functions on vfio-pci for DRA claims now, away from their "
            "own drivers.")
        self.dra_reaction = histogram(
            "devplugd_event_to_resourceslice_seconds", "From an event reaching the event loop to the "
            "ResourceSlices of the pool it changed written on the API server.", REACTION_BUCKETS, ("resource",))

        # the per-event counter's children, looked up once each (labels() costs a lock and a few
        # microseconds, as much as a fold)
        self._kernel_event_children: dict[tuple[str, str], Counter] = {}

    def kernel_event(self, source: str, outcome: str) -> None:
        child = self._kernel_event_children.get((source, outcome))
        if child is None:
            child = self._kernel_event_children[(source, outcome)] = self.kernel_events.labels(source, outcome)
        child.inc()

    def handler_error(self, handler: str, hook: str) -> None:
        self.handler_errors.labels(handler, hook).inc()

    def listandwatch_sent(self, resource: str, event_arrival: float | None) -> None:
        """A message went to the kubelet; ``event_arrival`` is when the oldest event it answers
        reached the event loop (``None``: a stream's first list, which answers no event)."""
        self.listandwatch_messages.labels(resource).inc()
        if event_arrival is not None:
            self.reaction.labels(resource).observe(time.monotonic() - event_arrival)


def metrics_outcome(fold_outcomes: list[str]) -> str:
    """One event's outcome from its folds by each handler that wants it: FAILED if any raised,
    else CHANGED if any handler's facts changed, UNCHANGED, or IGNORED when no handler wants it."""
    if not fold_outcomes:
        return IGNORED
    for outcome in (FAILED, CHANGED):
        if outcome in fold_outcomes:
            return outcome
    return UNCHANGED

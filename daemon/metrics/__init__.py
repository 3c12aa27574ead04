"""Prometheus metrics: what the cluster sees of one daemon, served at ``--metrics-address``.

``Metrics`` is one daemon's set: its own ``CollectorRegistry`` (never the global one, so tests
run several daemons in one process), the counters and histograms the event loop, the endpoints
and the host API feed through thin calls, and ``TreeCollector``, a subscriber of the notifier
whose gauges and info series are read at scrape time from the one tree it last heard of (a
scrape while the tree changes sees one whole tree, never half of two). ``MetricsServer`` is
prometheus_client's HTTP server in its own thread, so a scrape never waits on the trio loop, nor
the loop on a scrape. It also answers ``/healthz`` from ``Liveness``, which a task of the trio
loop beats every second (503 after 10 s without a beat, as the unit's watchdog would act). Off
unless ``--metrics-address`` is given: the instruments still count (a few hundred nanoseconds
each), nobody reads them.
"""

from ._instruments import (
    CHANGED,
    DRA_HEALTH,
    FAILED,
    HOST_WATCH,
    IGNORED,
    LISTANDWATCH,
    UNCHANGED,
    Metrics,
    metrics_outcome,
    without_created_series,
)
from ._liveness import Liveness
from ._server import MetricsServer

__all__ = [
    "CHANGED", "DRA_HEALTH", "FAILED", "HOST_WATCH", "IGNORED", "LISTANDWATCH", "UNCHANGED", "Liveness", "Metrics",
    "MetricsServer", "metrics_outcome", "without_created_series",
]

"""prometheus_client's HTTP server, in a thread of its own, for one daemon's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """Serves ``/metrics`` on ``(host, port)`` until ``close``. Binding happens in the
    constructor, so a busy or invalid address raises ``OSError`` before the daemon starts."""

    def __init__(self, registry: CollectorRegistry, address: tuple[str, int]) -> None:
        host, port = address
        self._server, self._thread = start_http_server(port, host, registry=registry)

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the kernel's choice for port 0)."""
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

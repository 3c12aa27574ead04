"""The metrics HTTP server, in a thread of its own, for one daemon: ``/healthz`` from the
loop's liveness, every other path prometheus_client's exposition of the registry."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ._liveness import Liveness

log = logging.getLogger("devplugd.metrics")

HEALTH_PATH = "/healthz"
StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def health_app(liveness: Liveness, metrics_app: WsgiApp) -> WsgiApp:
    """``/healthz``: 200 while the loop beats, 503 naming the silence once it has stopped."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)
        if liveness.alive():
            status, body = "200 OK", b"ok\n"
        else:
            status = "503 Service Unavailable"
            body = f"the event loop has not run for {liveness.silence():.1f}s\n".encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    """Requests are not logged (a probe every 10 s, a scrape every 15 s); errors are, at debug."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics request: " + format, *args)


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` on ``(host, port)`` until ``close``. Binding happens in
    the constructor, so a busy or invalid address raises ``OSError`` before the daemon starts."""

    def __init__(self, registry: CollectorRegistry, address: tuple[str, int], liveness: Liveness) -> None:
        host, port = address
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        app = health_app(liveness, make_wsgi_app(registry))
        self._server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the kernel's choice for port 0)."""
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

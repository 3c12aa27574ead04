"""The DRA plugin's two sockets, served for the daemon's whole life.

* ``<dra_plugin_dir>/<driver>/dra.sock``: the kubelet's DRA services, ``DRAPlugin`` v1,
  ``DRAPlugin`` v1beta1 (for 1.32 and 1.33 kubelets: an adapter that converts each message to its
  v1 twin through its wire form, the field numbers being the same, and calls the one v1
  servicer) and ``DRAResourceHealth`` v1 and v1alpha1 (one stream of serialized messages sent as
  they are under either name, the messages being the same; a 1.37 kubelet picks v1, a 1.36 one
  knows only v1alpha1);
* ``<plugins_registry_dir>/<driver>-reg.sock``: ``pluginregistration.Registration``, which the
  kubelet's plugin watcher finds; its GetInfo names dra.sock as the endpoint.

With a pod UID (``--pod-uid``) both are named after it, as the Go helper names them for rolling
updates (``daemon.settings``), so the old and the new pod are registered side by side. When this
instance hands the state over to a new pod (``go_passive``), the calls in flight finish, later
prepares and unprepares are refused as retryable (UNAVAILABLE: the kubelet's next try goes to the
newest registration), health streams end and new ones stay silent (the kubelet keeps one health
cache per driver, which a passive instance must not write), and both sockets stay served, by a
passive instance that writes nothing, until ``stop_passive`` at the process's end.

dra.sock is served first, then the registration socket: the kubelet dials the endpoint as soon as
it registers us. When the kubelet removes one of them (it cleans its plugin directories when it
restarts), ``socket_removed`` wakes the task and the missing socket is served again at once; a
new dra.sock is followed by a new registration socket, so that the kubelet registers us again and
dials the new endpoint rather than waiting for its connection's reconnect backoff. A removal
event that is about a socket we already replaced (our own clean-up is reported too) is told
apart by the socket file's identity and ignored. Listen failures are logged and retried with a
backoff; nothing here ends the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import grpc
import trio
from trio_asyncio import aio_as_trio

from daemon._generated.dra.v1 import api_pb2 as dra_v1
from daemon._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from daemon._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from daemon._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from daemon._generated.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from daemon.holdings import WriteGate, WritesClosed
from daemon.registration import PluginRegistrationServicer
from daemon.settings import Settings
from daemon.sockets import refuse, remove_socket_file, socket_path_problem, start_unix_server
from daemon.supervise import Backoff

from ._health import HealthServicer

log = logging.getLogger("devplugd.dra")

PLUGIN_TYPE = "DRAPlugin"
# The services on dra.sock, as the kubelet names them, in the order it should pick them (§3.2)
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
STOP_GRACE = 0.2
PLUGIN_DIR_MODE = 0o750
# a handover waits this long at most for the prepares and unprepares in flight: a Prepare's own
# bounds (its claim's GET 10 s, a function's bind to vfio-pci 10 s each) under the kubelet's 45 s
DRAIN_TIMEOUT = 60.0


class _WireMessage(Protocol):
    """What ``convert`` needs of a protobuf message class (``google.protobuf.message.Message``,
    which mypy cannot see here: ``google`` is a namespace package)."""

    @classmethod
    def FromString(cls: type[_Message], serialized: bytes) -> _Message: ...

    def SerializeToString(self) -> bytes: ...

    def DiscardUnknownFields(self) -> None: ...


_Message = TypeVar("_Message", bound=_WireMessage)


def convert(message: _WireMessage, kind: type[_Message]) -> _Message:
    """``message`` as its twin ``kind`` of another API version (same field numbers), without the
    fields ``kind`` does not have (v1's ``share_id`` when answering a v1beta1 kubelet)."""
    converted = kind.FromString(message.SerializeToString())
    converted.DiscardUnknownFields()
    return converted


class V1beta1Adapter(dra_v1beta1_grpc.DRAPluginServicer):
    """``DRAPlugin`` v1beta1 in front of a v1 servicer."""

    def __init__(self, v1: dra_v1_grpc.DRAPluginServicer) -> None:
        self._v1 = v1

    async def NodePrepareResources(
        self,
        request: dra_v1beta1.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_v1beta1.NodePrepareResourcesRequest, dra_v1beta1.NodePrepareResourcesResponse],
    ) -> dra_v1beta1.NodePrepareResourcesResponse:
        answer = await self._v1.NodePrepareResources(
            convert(request, dra_v1.NodePrepareResourcesRequest), cast(Any, context))
        return convert(answer, dra_v1beta1.NodePrepareResourcesResponse)

    async def NodeUnprepareResources(
        self,
        request: dra_v1beta1.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_v1beta1.NodeUnprepareResourcesRequest, dra_v1beta1.NodeUnprepareResourcesResponse],
    ) -> dra_v1beta1.NodeUnprepareResourcesResponse:
        answer = await self._v1.NodeUnprepareResources(
            convert(request, dra_v1.NodeUnprepareResourcesRequest), cast(Any, context))
        return convert(answer, dra_v1beta1.NodeUnprepareResourcesResponse)


class GatedPlugin(dra_v1_grpc.DRAPluginServicer):
    """The v1 servicer behind a ``WriteGate``: once it is closed (handed over), a call is refused
    with UNAVAILABLE and the reason, which the kubelet retries (on the newest registration)."""

    def __init__(self, v1: dra_v1_grpc.DRAPluginServicer, gate: WriteGate) -> None:
        self._v1 = v1
        self._gate = gate

    async def NodePrepareResources(
        self,
        request: dra_v1.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[dra_v1.NodePrepareResourcesRequest, dra_v1.NodePrepareResourcesResponse],
    ) -> dra_v1.NodePrepareResourcesResponse:
        try:
            with self._gate.inside():
                answer: dra_v1.NodePrepareResourcesResponse = await self._v1.NodePrepareResources(request, context)
                return answer
        except WritesClosed as closed:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, str(closed))

    async def NodeUnprepareResources(
        self,
        request: dra_v1.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[dra_v1.NodeUnprepareResourcesRequest,
                                          dra_v1.NodeUnprepareResourcesResponse],
    ) -> dra_v1.NodeUnprepareResourcesResponse:
        try:
            with self._gate.inside():
                answer: dra_v1.NodeUnprepareResourcesResponse = await self._v1.NodeUnprepareResources(request, context)
                return answer
        except WritesClosed as closed:
            await refuse(context, grpc.StatusCode.UNAVAILABLE, str(closed))


class GatedHealth:
    """The health stream while this instance is active; once it has handed over, a stream that
    sends nothing and stays open until the server stops (an ended stream would clear the
    kubelet's health cache of the driver, which the active instance fills, every 5 s)."""

    def __init__(self, health: HealthServicer, gate: WriteGate) -> None:
        self._health = health
        self._gate = gate

    async def NodeWatchResources(self, request: object, context: object) -> AsyncIterator[bytes]:
        """(either version's method) Each message serialized, sent as it is."""
        if self._gate.closed is not None:
            await asyncio.Event().wait()  # until the call is cancelled
        async for message in self._health.watch():
            yield message


HEALTH_SERVICES = ("v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth")


def _as_is(message: bytes) -> bytes:
    return message


def add_health_services(health: GatedHealth, server: grpc.aio.Server) -> None:
    """``NodeWatchResources`` under both names, its messages' bytes written as they are."""
    handler = grpc.unary_stream_rpc_method_handler(
        health.NodeWatchResources, request_deserializer=health_v1alpha1.NodeWatchResourcesRequest.FromString,
        response_serializer=_as_is)
    server.add_generic_rpc_handlers(tuple(grpc.method_handlers_generic_handler(service, {"NodeWatchResources": handler})
                                          for service in HEALTH_SERVICES))


@dataclass
class _Served:
    path: Path
    server: grpc.aio.Server
    identity: tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns) of the socket file we bound


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


class DraSockets:
    """dra.sock and the registration socket; ``run`` is their whole life."""

    def __init__(
        self,
        settings: Settings,
        plugin: dra_v1_grpc.DRAPluginServicer,
        health: HealthServicer,
    ) -> None:
        self.plugin_socket = settings.dra_socket
        self.registration_socket = settings.dra_registration_socket
        self._driver = settings.dra_driver
        self._plugin = plugin
        self._health = health
        self._info = reg.PluginInfo(type=PLUGIN_TYPE, name=settings.dra_driver, endpoint=str(settings.dra_socket),
                                    supported_versions=SUPPORTED_VERSIONS)
        self.registered = False
        self.registration_error = ""
        self._plugin_served: _Served | None = None
        self._registration_served: _Served | None = None
        self._kick = trio.Event()
        self.gate = WriteGate()  # closed when this instance hands over: passive from then on

    @property
    def serving(self) -> bool:
        """Whether both sockets are served (by servers we started; the files may just have gone)."""
        return self._plugin_served is not None and self._registration_served is not None

    def socket_removed(self, path: str) -> None:
        """A socket was removed (inotify): if it is one of ours, look at both and serve again
        whatever is gone."""
        if Path(path) in (self.plugin_socket, self.registration_socket):
            self._kick.set()

    def _registration_status(self, registered: bool, error: str) -> None:
        self.registered = registered
        self.registration_error = "" if registered else (error or "no reason given")
        if registered:
            log.info("kubelet registered DRA driver %s (endpoint %s)", self._driver, self.plugin_socket)
        else:
            log.error("kubelet refused DRA driver %s: %s", self._driver, self.registration_error)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve dra.sock, then the registration socket, then report started (also when listening
        failed: it is retried with a backoff, and start-up is not held up by it); serve again
        whatever the kubelet removes; on cancellation stop both and remove their files."""
        backoff = Backoff()
        started = False
        try:
            while True:
                self._kick = trio.Event()
                retry_in: float | None = None
                try:
                    await self._serve_what_is_missing()
                    backoff.reset()
                except Exception as error:  # listen failures are retried, never fatal
                    retry_in = backoff.next_delay()
                    log.error("cannot serve DRA driver %s: %s; retrying in %.1fs", self._driver, error, retry_in)
                if not started:
                    started = True
                    task_status.started()
                if retry_in is not None:
                    await trio.sleep(retry_in)
                else:
                    await self._kick.wait()
        finally:
            if not self.passive:  # a passive instance's sockets stay until stop_passive
                with trio.CancelScope(shield=True):
                    await self._stop_registration()
                    await self._stop_plugin()

    @property
    def passive(self) -> bool:
        return self.gate.closed is not None

    async def go_passive(self, reason: str) -> bool:
        """This instance hands over: later calls refused with ``reason``, the calls in flight
        waited for (whether they all ended), health streams ended; the sockets stay served when
        ``run`` is cancelled, until ``stop_passive``."""
        drained = await self.gate.close(reason, DRAIN_TIMEOUT)
        self._health.close_streams()
        log.info("DRA driver %s is passive: its sockets stay registered, calls are refused (%s)",
                 self._driver, reason)
        return drained

    async def stop_passive(self) -> None:
        """Stop the sockets a passive instance kept (removing only files that are still ours)."""
        await self._stop_registration()
        await self._stop_plugin()

    @staticmethod
    def _gone(served: _Served | None) -> bool:
        return served is None or _identity(served.path) != served.identity

    async def _serve_what_is_missing(self) -> None:
        if self._gone(self._plugin_served):
            if self._plugin_served is not None:
                log.warning("%s was removed: serving DRA driver %s again", self.plugin_socket, self._driver)
            await self._stop_registration()  # registered again below, for the new endpoint
            await self._stop_plugin()
            self._plugin_served = await self._serve(self.plugin_socket, self._add_plugin_services)
            log.info("serving DRA driver %s on %s", self._driver, self.plugin_socket)
        if self._gone(self._registration_served):
            if self._registration_served is not None:
                log.warning("%s was removed: serving it again", self.registration_socket)
            await self._stop_registration()
            self._registration_served = await self._serve(self.registration_socket, self._add_registration)
            self.registration_error = ""  # a new registration: the kubelet's next word is about it
            log.info("DRA driver %s waits for the kubelet on %s", self._driver, self.registration_socket)

    def _add_plugin_services(self, server: grpc.aio.Server) -> None:
        plugin = GatedPlugin(self._plugin, self.gate)
        health = GatedHealth(self._health, self.gate)
        dra_v1_grpc.add_DRAPluginServicer_to_server(plugin, server)
        dra_v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Adapter(plugin), server)
        add_health_services(health, server)

    def _add_registration(self, server: grpc.aio.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(PluginRegistrationServicer(self._info, self._registration_status),
                                                    server)

    async def _serve(self, path: Path, add_services: Callable[[grpc.aio.Server], None]) -> _Served:
        if problem := socket_path_problem(path):
            raise OSError(problem)
        path.parent.mkdir(mode=PLUGIN_DIR_MODE, parents=True, exist_ok=True)
        remove_socket_file(path)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_services(server)
        # Shielded: a server cancelled half-started is never stopped and wedges grpc's shutdown;
        # starting takes milliseconds, and run's finally stops it.
        with trio.CancelScope(shield=True):
            await aio_as_trio(start_unix_server)(server, str(path))
        identity = _identity(path)
        if identity is None:  # removed the moment it was made: serve it again on the next look
            identity = (0, 0, 0)
            self._kick.set()
        return _Served(path, server, identity)

    async def _stop(self, served: _Served) -> None:
        with trio.CancelScope(shield=True):
            await aio_as_trio(served.server.stop)(STOP_GRACE)
        if _identity(served.path) == served.identity:  # never a socket someone made after ours went
            remove_socket_file(served.path)

    async def _stop_registration(self) -> None:
        served, self._registration_served = self._registration_served, None
        if served is not None:
            self.registered = False
            await self._stop(served)

    async def _stop_plugin(self) -> None:
        served, self._plugin_served = self._plugin_served, None
        if served is not None:
            self._health.close_streams()
            await self._stop(served)

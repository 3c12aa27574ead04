"""One resource's life on a socket: serve, then register, and start over when the kubelet says so.

The cycle, per resource, as one trio task:

1. start a gRPC server on a fresh socket (kubelet mode: a new name per start, in the
   device-plugin directory; watcher mode: a fixed name under plugins_registry);
2. kubelet mode: when ``kubelet.sock`` exists, call Register (the kubelet dials back inside it),
   retrying with backoff; watcher mode: the kubelet finds the socket and calls GetInfo;
3. wait until the kubelet restarts (``kubelet.sock`` created again) or our socket is removed;
4. end our ListAndWatch streams, stop the server, remove the socket, and go back to 1.

Old streams always end before the next Register, which avoids the kubelet's re-registration race.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import trio
from trio_asyncio import aio_as_trio

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon.core._handler import AnyHandler, Hooks
from daemon.core._notifier import Notifier
from daemon.holdings import HolderLookup
from daemon.metrics import Metrics
from daemon.settings import Settings
from daemon.sockets import SOCKET_PREFIX, remove_socket_file, socket_path_problem
from daemon.supervise import Backoff

from ._registration import register_with_kubelet, start_grpc_server, watcher_registration
from ._servicer import DevicePluginServicer

log = logging.getLogger("devplugd.deviceplugin")

STOP_GRACE = 0.2


def socket_file_name(resource: str, suffix: str, directory: Path) -> str:
    """``devplugd-<prefix>_<name>[-suffix].sock``, hashed when the path would be longer than gRPC
    serves (``GRPC_PATH_MAX``)."""
    readable = resource.replace("/", "_")
    tail = f"-{suffix}.sock" if suffix else ".sock"
    name = f"{SOCKET_PREFIX}{readable}{tail}"
    if socket_path_problem(directory / name):
        name = f"{SOCKET_PREFIX}{hashlib.sha256(resource.encode()).hexdigest()[:16]}{tail}"
    return name


def directory_problem(directory: Path) -> str | None:
    """Why no endpoint can be served in ``directory`` (even hashed, its socket paths would be
    longer than gRPC serves), or ``None``."""
    longest = directory / socket_file_name("x" * 300, f"{'f' * 12}.{10**9}", directory)
    if problem := socket_path_problem(longest):
        return f"the sockets of {directory} would not fit: {problem}"
    return None


class Kick:
    """Wakes an endpoint task with the reasons gathered since it last looked."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self.kubelet_started = False
        self.removed_sockets: set[str] = set()
        self.registration_failed = ""
        self.options_changed = False

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float = math.inf) -> None:
        with trio.move_on_after(timeout):
            await self._event.wait()

    def clear(self) -> None:
        self._event = trio.Event()
        self.kubelet_started = False
        self.removed_sockets = set()
        self.registration_failed = ""
        self.options_changed = False


class ResourceEndpoint:
    """Serves one resource and keeps it registered. ``run`` is its whole life."""

    def __init__(
        self,
        resource: str,
        handler_name: str,
        handler: AnyHandler,
        notifier: Notifier,
        settings: Settings,
        mode: str,
        on_change: Callable[[], None] = lambda: None,
        metrics: Metrics | None = None,
        holders: HolderLookup | None = None,
    ) -> None:
        self._on_change = on_change
        self._holders = holders
        self._metrics = metrics or Metrics()
        self.resource = resource
        self.handler_name = handler_name
        self._hooks = Hooks.of(handler)
        self._notifier = notifier
        self._settings = settings
        self._mode = mode
        self.kick = Kick()
        self.socket_path: Path | None = None
        self.registered = False
        self._generation = 0
        self._start_token = f"{int(time.time() * 1000):x}"
        self._servicer: DevicePluginServicer | None = None
        self._served_options: dp.DevicePluginOptions | None = None

    def _next_socket_path(self) -> Path:
        if self._mode == "watcher":
            directory = self._settings.plugins_registry_dir
            return directory / socket_file_name(self.resource, "", directory)
        self._generation += 1
        directory = self._settings.device_plugin_dir
        return directory / socket_file_name(self.resource, f"{self._start_token}.{self._generation}", directory)

    def kubelet_started(self) -> None:
        self.kick.kubelet_started = True
        self.kick.set()

    def socket_removed(self, path: str) -> None:
        self.kick.removed_sockets.add(path)
        self.kick.set()

    def check_options(self) -> None:
        """After a new tree: the kubelet reads the options (GetPreferredAllocation offered or not)
        only when a plugin registers, so options changed by a reload mean serving again."""
        if self._servicer is None or self._served_options is None:
            return
        if self._servicer.options() != self._served_options:
            self.kick.options_changed = True
            self.kick.set()

    def _registration_status(self, registered: bool, error: str) -> None:
        self._metrics.register_calls.labels(self.resource).inc()
        if not registered:
            self._metrics.register_failures.labels(self.resource).inc()
        if registered:
            log.info("kubelet registered %s through plugins_registry", self.resource, extra={"RESOURCE": self.resource})
            self.registered = True
            self._on_change()
        else:
            self.kick.registration_failed = error or "no reason given"
            self.kick.set()

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            socket_path = self._next_socket_path()
            self.kick.clear()
            servicer = DevicePluginServicer(
                self.resource, self._hooks, self._notifier, self._settings.cdi_in_allocate, self._metrics,
                self._holders,
            )
            registration = (
                watcher_registration(self.resource, self._registration_status)
                if self._mode == "watcher"
                else None
            )
            socket_path.parent.mkdir(parents=True, exist_ok=True)
            socket_path.unlink(missing_ok=True)
            try:
                # Shielded: a server cancelled half-started is never stopped and wedges grpc's
                # shutdown; starting takes milliseconds, and the finally below stops it.
                with trio.CancelScope(shield=True):
                    server = await aio_as_trio(start_grpc_server)(str(socket_path), servicer, registration)
            except Exception as error:  # listen failures are retried, never fatal
                delay = backoff.next_delay()
                log.error("cannot serve %s on %s: %s; retrying in %.1fs", self.resource, socket_path, error, delay,
                          extra={"RESOURCE": self.resource})
                await trio.sleep(delay)
                continue
            self.socket_path = socket_path
            self._servicer, self._served_options = servicer, servicer.options()
            log.info("serving %s on %s", self.resource, socket_path, extra={"RESOURCE": self.resource})
            self._on_change()
            try:
                await self._hold(socket_path, servicer, backoff)
            finally:
                self.registered = False
                self._servicer = self._served_options = None
                servicer.close_streams()
                with trio.CancelScope(shield=True):
                    await aio_as_trio(server.stop)(STOP_GRACE)
                    remove_socket_file(socket_path)
                    self.socket_path = None
                    self._on_change()

    async def _hold(self, socket_path: Path, servicer: DevicePluginServicer, backoff: Backoff) -> None:
        """Register as the mode says, then return when this socket has to be replaced."""
        retry_at = 0.0 if self._mode == "kubelet" else math.inf
        while True:
            if retry_at <= trio.current_time():
                # Without kubelet.sock there is nobody to call: wait for the kubelet to start.
                retry_at = math.inf
                if self._settings.kubelet_socket.exists():
                    retry_at = await self._register(socket_path, servicer, backoff)
            timeout = retry_at - trio.current_time() if math.isfinite(retry_at) else math.inf
            await self.kick.wait(max(timeout, 0.0))
            kick = self.kick
            if kick.kubelet_started and self._mode == "kubelet":
                log.info("kubelet (re)started: serving %s again", self.resource, extra={"RESOURCE": self.resource})
                return
            if str(socket_path) in kick.removed_sockets:
                log.warning("socket %s was removed: serving %s again", socket_path, self.resource,
                            extra={"RESOURCE": self.resource})
                return
            if kick.options_changed:
                log.info("options of %s changed: serving it again so that the kubelet reads them", self.resource,
                         extra={"RESOURCE": self.resource})
                return
            if kick.registration_failed:
                delay = backoff.next_delay()
                log.error("kubelet refused %s: %s; serving again in %.1fs", self.resource, kick.registration_failed,
                          delay, extra={"RESOURCE": self.resource})
                await trio.sleep(delay)
                return
            self.kick.clear()

    async def _register(self, socket_path: Path, servicer: DevicePluginServicer, backoff: Backoff) -> float:
        """Register once; return when to try again (``inf`` once registered)."""
        options = servicer.options()
        self._served_options = options
        self._metrics.register_calls.labels(self.resource).inc()
        try:
            await aio_as_trio(register_with_kubelet)(
                str(self._settings.kubelet_socket),
                socket_path.name,
                self.resource,
                options,
                self._settings.register_timeout,
            )
        except grpc.aio.AioRpcError as error:
            self._metrics.register_failures.labels(self.resource).inc()
            delay = backoff.next_delay()
            log.warning("Register %s with the kubelet failed: %s: %s; retrying in %.1fs", self.resource,
                        error.code().name, error.details(), delay, extra={"RESOURCE": self.resource})
            return trio.current_time() + delay
        backoff.reset()
        self.registered = True
        self._on_change()
        log.info("registered %s with the kubelet (endpoint %s)", self.resource, socket_path.name,
                 extra={"RESOURCE": self.resource})
        return math.inf


"""A kubelet stand-in that behaves like the kubelet's device manager, over real unix sockets.

It runs its own asyncio loop in a thread, so tests stay plain synchronous code while the daemon
under test runs as a real process.

* ``kubelet.sock`` serves ``v1beta1.Registration``: Register checks the version and the resource
  name, then *inside the call* dials the plugin's endpoint (a bare file name in the same
  directory) and calls GetDevicePluginOptions; after it returns, ListAndWatch is followed in the
  background. Every message replaces the resource's device list.
* Clients are kept per resource name, and when a ListAndWatch stream ends the kubelet
  disconnects *whatever client is current* for that name, as the real one does (section 3.6):
  a plugin that re-registers before closing its old stream loses its new registration.
* ``restart()`` stops, deletes every socket in the directory (as CleanupPluginDirectory does),
  then listens on a fresh ``kubelet.sock``.
* With ``plugins_registry``, it also watches that directory like the plugin watcher: GetInfo,
  validate, connect, GetDevicePluginOptions, ListAndWatch, NotifyRegistrationStatus.
* ``write_checkpoint`` writes ``kubelet_internal_checkpoint`` as the kubelet's file store does
  (a temporary ``.``-file in the same directory, renamed into place): which pod holds which device.

The DRA manager's side (dra-api.md §1, §2.2, §3.2), through the same plugin watcher:

* a ``DRAPlugin`` registration socket gets GetInfo; the service is chosen by walking the plugin's
  ``supported_versions`` in its order and taking the first this kubelet supports
  (``kubelet_versions``, by default ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``), or refused with
  the kubelet's error strings; then the endpoint is dialled (stricter than the kubelet, which
  connects lazily: a plugin that registers before it serves fails here) and
  NotifyRegistrationStatus is called. A registration socket that is removed or re-created
  deregisters the plugin (its connection closed, its health cleared), as the kubelet does.
* several instances of one driver (the old and the new pod of a rolling update, each with its
  own registration socket and endpoint; the same endpoint twice is refused) are registered side
  by side; a call goes to the most recently registered instance whose connection is up, else to
  the most recent one (``GetPlugin``), and the driver stays registered while any instance is;
  ``dra_instances`` lists them and ``DraDriverState.calls`` says which endpoint each call reached.
* ``prepare`` / ``unprepare`` call NodePrepareResources / NodeUnprepareResources through the
  chosen version's stubs with a 45 s deadline and apply the kubelet's response rules
  (``DraCallError``: unknown claim UIDs, skipped claims, a claim's error).
* when the plugin advertises a ``DRAResourceHealth`` version the stand-in knows (and
  ``dra_health_gate``), a NodeWatchResources stream of the first of ``dra_health_versions`` it
  advertises is kept open (a 1.37 kubelet: v1, else v1alpha1; a 1.36 one: v1alpha1 only; never both) (again 5 s after it ends, as 1.34 kubelets retry); each
  message updates the driver's health cache the kubelet's way (stamped on arrival, Unknown once
  older than its timeout, cleared when the stream ends); ``dra_health`` reads it.
* ``restart_dra()`` plays the kubelet's restart for DRA: its connections close, and the
  registration sockets and endpoints of the DRA plugins are removed (as the kubelet's plugin
  directory clean-up does); the plugins are registered again when their sockets come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon._generated.dra.v1 import api_pb2 as dra_v1
from daemon._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from daemon._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from daemon._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from daemon._generated.drahealth.v1 import api_pb2 as dra_health_v1
from daemon._generated.drahealth.v1 import api_pb2_grpc as dra_health_v1_grpc
from daemon._generated.drahealth.v1alpha1 import api_pb2 as dra_health
from daemon._generated.drahealth.v1alpha1 import api_pb2_grpc as dra_health_grpc
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from daemon.core._names import extended_resource_name_problem
from tests.waiting import wait_until

CHECKPOINT = "kubelet_internal_checkpoint"

# servicesSupportedByKubelet, and the stubs each one is called through
DRA_SERVICES: dict[str, tuple[Any, Any]] = {
    "v1.DRAPlugin": (dra_v1, dra_v1_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1, dra_v1beta1_grpc),
}
DRA_HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
DRA_HEALTH_V1_SERVICE = "v1.DRAResourceHealth"
# the health API versions a 1.37 kubelet knows, the one it prefers first
DRA_HEALTH_VERSIONS = (DRA_HEALTH_V1_SERVICE, DRA_HEALTH_SERVICE)
_HEALTH_APIS: dict[str, Any] = {DRA_HEALTH_V1_SERVICE: (dra_health_v1, dra_health_v1_grpc),
                                DRA_HEALTH_SERVICE: (dra_health, dra_health_grpc)}
DRA_CALL_TIMEOUT = 45.0  # defaultClientCallTimeout
DRA_DEFAULT_HEALTH_TIMEOUT = 30.0  # DefaultHealthTimeout
DRA_HEALTH_RETRY = 5.0  # wait.UntilWithContext(..., 5*time.Second)
_HEALTH_NAMES = {dra_health.HEALTHY: "Healthy", dra_health.UNHEALTHY: "Unhealthy"}


@dataclass
class PluginClient:
    resource: str
    endpoint: str
    channel: grpc.aio.Channel
    options: dp.DevicePluginOptions
    via: str  # "kubelet.sock" or "watcher"
    task: asyncio.Task[None] | None = None


@dataclass
class ResourceState:
    """What the kubelet knows about one resource."""

    devices: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    messages: list[dict[str, tuple[str, tuple[int, ...]]]] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)  # time.monotonic() of each message, on arrival
    registrations: int = 0
    connected: bool = False
    options: dp.DevicePluginOptions | None = None
    endpoint: str = ""
    registered_at: float = 0.0
    first_list_at: float = 0.0

    @property
    def healthy(self) -> set[str]:
        return {i for i, (health, _) in self.devices.items() if health == "Healthy"}


class DraCallError(Exception):
    """A DRA call the kubelet fails because of the plugin's answer (dra-api.md §1.4)."""


@dataclass(frozen=True)
class DeviceHealthRecord:
    """One device in the kubelet's DRA health cache."""

    health: str  # "Healthy", "Unhealthy" or "Unknown"
    message: str
    timeout: float  # seconds: health_check_timeout_seconds if > 0, else the default
    received_at: float  # time.monotonic() when the message arrived (the kubelet's LastUpdated)
    last_updated_time: int  # as the plugin sent it (the kubelet does not use it)

    def current(self, now: float) -> str:
        return "Unknown" if now - self.received_at > self.timeout else self.health


@dataclass
class DraRegistration:
    """One registered DRA plugin instance (a registration socket)."""

    driver: str
    registration_socket: str
    endpoint: str
    service: str  # the chosen DRAPlugin service, "v1.DRAPlugin" or "v1beta1.DRAPlugin"
    supported_versions: tuple[str, ...]
    channel: grpc.aio.Channel
    health_task: asyncio.Task[None] | None = None
    health_service: str = ""  # the DRAResourceHealth version chosen, "" for none


@dataclass
class DraDriverState:
    """What the kubelet knows about one DRA driver."""

    registrations: int = 0
    deregistrations: int = 0
    registered: bool = False
    service: str = ""
    endpoint: str = ""
    supported_versions: tuple[str, ...] = ()
    registered_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    health: dict[tuple[str, str], DeviceHealthRecord] = field(default_factory=dict)
    health_messages: list[dict[tuple[str, str], DeviceHealthRecord]] = field(default_factory=list)
    health_streams: int = 0  # NodeWatchResources streams opened
    health_service: str = ""  # the DRAResourceHealth version of the last stream opened
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, the endpoint it went to), in order
    # (method, seconds) of each call as the kubelet's gRPC client sees it: from the stub call to
    # its answer, on the stand-in's loop (not the hop of a test's thread into it)
    call_seconds: list[tuple[str, float]] = field(default_factory=list)

    def current_health(self, now: float | None = None) -> dict[tuple[str, str], tuple[str, str]]:
        """(pool, device) -> (health, message), with the timeout rule applied."""
        moment = time.monotonic() if now is None else now
        return {key: (record.current(moment), record.message if record.current(moment) != "Unknown" else "")
                for key, record in self.health.items()}


def write_checkpoint_entries(directory: Path, entries: list[dict[str, Any]]) -> int:
    """The kubelet's checkpoint with these ``PodDeviceEntries``, written as the kubelet writes it
    (a temporary file renamed into place); its size in bytes."""
    data = json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}).encode()
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{CHECKPOINT}.tmp"
    temporary.write_bytes(data)
    temporary.rename(directory / CHECKPOINT)
    return len(data)


def busy_node_checkpoint(directory: Path, pods: int = 20000, padding: int = 100) -> int:
    """The checkpoint of a busy node: ``pods`` pods, each holding a device of another resource,
    with ``padding`` bytes of allocation answer (several MB in all); its size in bytes."""
    return write_checkpoint_entries(directory, [
        {"PodUID": f"pod-{n:06d}", "ContainerName": "app", "ResourceName": "example.com/other",
         "DeviceIDs": {"0": [f"other-{n}"]}, "AllocResp": "x" * padding} for n in range(pods)])


def _go_quoted(values: Any) -> str:
    """Go's %q of a []string: ["a" "b"]."""
    return "[" + " ".join(json.dumps(str(value)) for value in values) + "]"


class FakeKubelet:
    def __init__(
        self,
        device_plugin_dir: Path,
        plugins_registry_dir: Path | None = None,
        kubelet_versions: tuple[str, ...] = tuple(DRA_SERVICES),
        dra_health_gate: bool = True,
        dra_health_versions: tuple[str, ...] = DRA_HEALTH_VERSIONS,
    ) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.plugins_registry_dir = plugins_registry_dir
        self.kubelet_versions = kubelet_versions
        self.dra_health_gate = dra_health_gate
        self.dra_health_versions = dra_health_versions
        self.dra: dict[str, DraDriverState] = {}
        self._dra_registrations: dict[str, DraRegistration] = {}  # by registration socket
        self.socket_path = device_plugin_dir / "kubelet.sock"
        self.resources: dict[str, ResourceState] = {}
        self.register_errors: list[str] = []
        self.watcher_errors: list[str] = []
        self._clients: dict[str, PluginClient] = {}
        self._condition = threading.Condition()
        # A plain asyncio loop: trio_asyncio replaces the default policy once imported.
        self._loop = asyncio.SelectorEventLoop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kubelet", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._watcher_task: asyncio.Future[Any] | None = None

    # -- thread-safe API for tests -------------------------------------------------------------
    def _call(self, coroutine: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> None:
        self.device_plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())

    def restart(self) -> None:
        """Stop, delete every socket in the device-plugin directory, listen again."""
        self.stop()
        for name in os.listdir(self.device_plugin_dir):
            path = self.device_plugin_dir / name
            if name != CHECKPOINT and stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        self.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def wait_for(self, predicate: Callable[[FakeKubelet], bool], timeout: float = 10.0, what: str = "") -> None:
        """Until ``predicate(self)`` holds, woken by every change the stand-in sees."""
        with self._condition:
            wait_until(lambda: predicate(self), timeout,
                       lambda: f"kubelet stand-in: {what or predicate}; resources={self.snapshot()}",
                       condition=self._condition)

    def write_checkpoint(self, allocated: dict[str, list[str]], pod: str = "uid-1", container: str = "app") -> None:
        """The checkpoint with ``allocated`` (resource -> device IDs) held by one pod's container."""
        write_checkpoint_entries(self.device_plugin_dir, [
            {"PodUID": pod, "ContainerName": container, "ResourceName": resource, "DeviceIDs": {"-1": device_ids},
             "AllocResp": ""} for resource, device_ids in allocated.items() if device_ids])

    def snapshot(self) -> dict[str, Any]:
        return {name: {"connected": s.connected, "registrations": s.registrations, "devices": len(s.devices)}
                for name, s in self.resources.items()}

    def state(self, resource: str) -> ResourceState:
        return self.resources.setdefault(resource, ResourceState())

    def wait_for_devices(self, resource: str, count: int, timeout: float = 10.0) -> ResourceState:
        self.wait_for(lambda k: k.state(resource).connected and len(k.state(resource).devices) == count,
                      timeout, f"{resource} connected with {count} devices")
        return self.state(resource)

    def allocate(self, resource: str, device_ids: list[str], timeout: float = 10.0) -> dp.AllocateResponse:
        request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=device_ids)])
        return self.call(resource, "Allocate", request, timeout)

    def offers_preferred_allocation(self, resource: str) -> bool:
        """Whether the plugin's GetDevicePluginOptions said ``get_preferred_allocation_available``."""
        options = self.state(resource).options
        return options is not None and options.get_preferred_allocation_available

    def preferred_allocation(
        self, resource: str, available: list[str], must_include: list[str], size: int, timeout: float = 10.0
    ) -> list[str]:
        """GetPreferredAllocation as the kubelet sends it (section 3.7): one
        ContainerPreferredAllocationRequest with ``size`` = the container's total request; only
        ``container_responses[0].deviceIDs`` is read, and no response means no preference. Like the
        kubelet, it does not call a plugin whose options do not offer it (AssertionError)."""
        if not self.offers_preferred_allocation(resource):
            raise AssertionError(f"kubelet stand-in: {resource} does not offer GetPreferredAllocation; "
                                 f"options={self.state(resource).options}")
        request = dp.PreferredAllocationRequest(container_requests=[dp.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        response = self.call(resource, "GetPreferredAllocation", request, timeout)
        return list(response.container_responses[0].deviceIDs) if response.container_responses else []

    def call(self, resource: str, method: str, request: Any, timeout: float = 10.0) -> Any:
        async def invoke() -> Any:
            client = self._clients[resource]
            stub = dp_grpc.DevicePluginStub(client.channel)
            return await getattr(stub, method)(request, timeout=timeout)
        return self._call(invoke(), timeout + 5)

    # -- DRA, thread-safe API for tests --------------------------------------------------------
    def dra_state(self, driver: str) -> DraDriverState:
        return self.dra.setdefault(driver, DraDriverState())

    def wait_for_dra(self, driver: str, registrations: int = 1, timeout: float = 10.0) -> DraDriverState:
        """Until ``driver`` is registered and has been at least ``registrations`` times."""
        self.wait_for(lambda k: k.dra_state(driver).registered and k.dra_state(driver).registrations >= registrations,
                      timeout, f"DRA driver {driver} registered ({registrations} registrations)")
        return self.dra_state(driver)

    def dra_instances(self, driver: str) -> list[tuple[str, str]]:
        """The registered instances of ``driver`` as (registration socket, endpoint), oldest first."""
        async def look() -> list[tuple[str, str]]:
            return [(r.registration_socket, r.endpoint) for r in self._dra_registrations.values() if r.driver == driver]
        result: list[tuple[str, str]] = self._call(look())
        return result

    def wait_for_dra_instances(self, driver: str, count: int, timeout: float = 10.0) -> list[tuple[str, str]]:
        """Until exactly ``count`` instances of ``driver`` are registered; them, oldest first."""
        self.wait_for(lambda k: sum(r.driver == driver for r in list(k._dra_registrations.values())) == count,
                      timeout, f"{count} registered instances of DRA driver {driver}")
        return self.dra_instances(driver)

    def prepare(
        self, claims: list[tuple[str, str, str]], driver: str | None = None,
        timeout: float = DRA_CALL_TIMEOUT, fail_on_claim_error: bool = True,
    ) -> dict[str, Any]:
        """NodePrepareResources for ``claims`` ((namespace, uid, name), one pod's batch): the
        answer per claim UID, in the chosen version's messages. Raises DraCallError as the kubelet
        fails (an unknown UID, skipped claims, and, with ``fail_on_claim_error``, a claim's error)
        and grpc.RpcError for a gRPC error."""
        return self._call(self._dra_call("NodePrepareResources", claims, driver, timeout, fail_on_claim_error),
                          timeout + 5)

    def unprepare(
        self, claims: list[tuple[str, str, str]], driver: str | None = None,
        timeout: float = DRA_CALL_TIMEOUT, fail_on_claim_error: bool = True,
    ) -> dict[str, Any]:
        """NodeUnprepareResources, as ``prepare``."""
        return self._call(self._dra_call("NodeUnprepareResources", claims, driver, timeout, fail_on_claim_error),
                          timeout + 5)

    def watch_health(self, driver: str | None = None) -> DraDriverState:
        """Open NodeWatchResources on ``driver``'s plugin unless a stream is open already (a
        kubelet with ``dra_health_gate`` opens it itself); the state holds the latest list."""
        async def open_stream() -> DraDriverState:
            registration = self._dra_plugin(driver)
            if registration.health_task is None or registration.health_task.done():
                registration.health_task = asyncio.ensure_future(self._watch_dra_health(registration))
            return self.dra_state(registration.driver)
        return self._call(open_stream())

    def watching_health(self, driver: str | None = None) -> bool:
        """Whether the stand-in has a NodeWatchResources stream on ``driver``'s plugin, open or
        opening (decided when the plugin registered: at once with ``dra_health_gate``)."""
        async def look() -> bool:
            task = self._dra_plugin(driver).health_task
            return task is not None and not task.done()
        return bool(self._call(look()))

    def dra_health(self, driver: str | None = None) -> dict[tuple[str, str], tuple[str, str]]:
        """The kubelet's health cache for ``driver``: (pool, device) -> (health, message), a
        device Unknown once its last report is older than its timeout."""
        name = driver if driver is not None else self._only_driver()
        return self.dra_state(name).current_health()

    def wait_for_health(
        self, predicate: Callable[[dict[tuple[str, str], tuple[str, str]]], bool], driver: str | None = None,
        timeout: float = 10.0, what: str = "",
    ) -> dict[tuple[str, str], tuple[str, str]]:
        self.wait_for(lambda k: predicate(k.dra_health(driver)), timeout, what or "DRA health")
        return self.dra_health(driver)

    def restart_dra(self) -> list[str]:
        """The kubelet restarts as far as DRA goes: its DRA connections close, the registration
        sockets and endpoints of the DRA plugins are removed; the plugin watcher starts again
        and registers every plugin whose socket comes back. Returns the paths removed."""
        return self._call(self._restart_dra())


    # -- the kubelet side ---------------------------------------------------------------------
    def _notify(self) -> None:
        with self._condition:
            self._condition.notify_all()

    async def _start(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_RegistrationService(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        if self.plugins_registry_dir is not None:
            self.plugins_registry_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._watcher_task = asyncio.ensure_future(self._watch_registry())

    async def _stop(self) -> None:
        if self._watcher_task is not None:
            self._watcher_task.cancel()
            self._watcher_task = None
        for client in list(self._clients.values()):
            await self._disconnect(client)
        for path in list(self._dra_registrations):
            await self._deregister_dra(path)
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    async def _disconnect(self, client: PluginClient) -> None:
        if client.task is not None:
            client.task.cancel()
        await client.channel.close()
        if self._clients.get(client.resource) is client:
            del self._clients[client.resource]
        self.state(client.resource).connected = False
        self._notify()

    async def connect(self, resource: str, socket_path: Path, via: str) -> None:
        """Dial the plugin (10 s), GetDevicePluginOptions, store the client (replacing, not
        closing, a previous one), then follow ListAndWatch in the background."""
        channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        await asyncio.wait_for(channel.channel_ready(), 10)
        options = await dp_grpc.DevicePluginStub(channel).GetDevicePluginOptions(dp.Empty())
        client = PluginClient(resource, str(socket_path), channel, options, via)
        self._clients[resource] = client
        state = self.state(resource)
        state.options = options
        state.endpoint = str(socket_path)
        state.registrations += 1
        state.registered_at = time.monotonic()
        state.connected = True
        self._notify()
        client.task = asyncio.ensure_future(self._list_and_watch(client))

    async def _list_and_watch(self, client: PluginClient) -> None:
        state = self.state(client.resource)
        try:
            async for message in dp_grpc.DevicePluginStub(client.channel).ListAndWatch(dp.Empty()):
                state.received_at.append(time.monotonic())  # before messages: readers index it by message
                devices = {d.ID: (d.health, tuple(n.ID for n in d.topology.nodes)) for d in message.devices}
                if not state.messages:
                    state.first_list_at = time.monotonic()
                state.devices = devices
                state.messages.append(devices)
                self._notify()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            pass
        # runClient: disconnect the client that is *current* for this name (the real race).
        current = self._clients.get(client.resource)
        if current is not None:
            await self._disconnect(current)
        state.connected = False
        self._notify()

    async def _watch_registry(self) -> None:
        assert self.plugins_registry_dir is not None
        seen: dict[str, float] = {}
        while True:
            present: set[str] = set()
            for directory, _, files in os.walk(self.plugins_registry_dir):
                for name in files:
                    path = Path(directory) / name
                    try:
                        status = os.lstat(path)
                    except OSError:
                        continue
                    if name.startswith(".") or not stat.S_ISSOCK(status.st_mode):
                        continue
                    present.add(str(path))
                    if seen.get(str(path)) == status.st_mtime:
                        continue
                    if str(path) in seen:  # re-created: the old registration goes first
                        await self._deregister_dra(str(path))
                    seen[str(path)] = status.st_mtime
                    asyncio.ensure_future(self._register_from_watcher(path))
            for gone in [p for p in seen if p not in present]:
                del seen[gone]
                await self._deregister_dra(gone)
            await asyncio.sleep(0.05)

    async def _register_from_watcher(self, path: Path) -> None:
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        try:
            await asyncio.wait_for(channel.channel_ready(), 10)
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=1)
            error = ""
            if info.type == "DRAPlugin":
                error = await self._register_dra(path, info)
            elif info.type != "DevicePlugin":
                error = f"no handler for plugin type {info.type!r}"
            elif "v1beta1" not in info.supported_versions:
                error = f"manager version, v1beta1, is not among plugin supported versions {list(info.supported_versions)}"
            elif problem := extended_resource_name_problem(info.name):
                error = f"the ResourceName {info.name!r} is invalid: {problem}"
            if not error and info.type == "DevicePlugin":
                try:
                    await self.connect(info.name, Path(info.endpoint) if info.endpoint else path, "watcher")
                except Exception as failure:
                    error = f"failed to connect: {failure}"
            if error:
                self.watcher_errors.append(error)
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=5)
        except Exception as failure:
            self.watcher_errors.append(f"{path}: {failure}")
        finally:
            await channel.close()
            self._notify()


    # -- the DRA manager's side ----------------------------------------------------------------
    def _only_driver(self) -> str:
        drivers = sorted({registration.driver for registration in self._dra_registrations.values()} or self.dra)
        if len(drivers) != 1:
            raise AssertionError(f"kubelet stand-in: name the DRA driver, there are {drivers}")
        return drivers[0]

    def _dra_plugin(self, driver: str | None) -> DraRegistration:
        """GetPlugin: the most recently registered instance of the driver whose connection is up,
        else the most recently registered one (the kubelet's heuristic: the newest is most likely
        the new pod of a rolling update)."""
        name = driver if driver is not None else self._only_driver()
        instances = [r for r in self._dra_registrations.values() if r.driver == name]
        if not instances:
            raise DraCallError(f"DRA driver {name} is not registered")
        for registration in reversed(instances):
            if registration.channel.get_state() == grpc.ChannelConnectivity.READY:
                return registration
        return instances[-1]

    def _choose_dra_service(self, versions: list[str]) -> tuple[str, str]:
        """validateSupportedServices: (chosen service, "") or ("", error)."""
        if not versions:
            return "", "empty list of supported gRPC services (aka supported versions)"
        for version in versions:
            if version in self.kubelet_versions:
                return version, ""
        return "", (f"none of services supported by the plugin ({_go_quoted(versions)}) "
                    f"are supported by the kubelet ({_go_quoted(self.kubelet_versions)})")

    async def _register_dra(self, path: Path, info: reg.PluginInfo) -> str:
        """ValidatePlugin and RegisterPlugin for a DRAPlugin socket; the error, or ""."""
        endpoint = info.endpoint or str(path)
        versions = list(info.supported_versions)
        state = self.dra_state(info.name)
        service, problem = self._choose_dra_service(versions)
        if problem:
            error = (f"RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions "
                     f"of DRA driver plugin {info.name} at endpoint {endpoint}: {problem}")
        elif not info.name:
            error = "RegisterPlugin error -- plugin validation failed with err: DRA driver name is empty"
        elif any(r.driver == info.name and r.endpoint == endpoint for r in self._dra_registrations.values()):
            error = f"endpoint {endpoint} already registered for DRA driver plugin {info.name}"
        else:
            channel = grpc.aio.insecure_channel(f"unix://{endpoint}")
            try:
                await asyncio.wait_for(channel.channel_ready(), 10)
            except (TimeoutError, grpc.RpcError) as failure:
                await channel.close()
                error = f"failed to connect to DRA driver {info.name} at {endpoint}: {failure!r}"
            else:
                registration = DraRegistration(info.name, str(path), endpoint, service, tuple(versions), channel)
                self._dra_registrations[str(path)] = registration
                state.registrations += 1
                state.registered = True
                state.service, state.endpoint, state.supported_versions = service, endpoint, tuple(versions)
                state.registered_at = time.monotonic()
                registration.health_service = next((v for v in self.dra_health_versions if v in versions), "")
                if self.dra_health_gate and registration.health_service:
                    registration.health_task = asyncio.ensure_future(self._watch_dra_health(registration))
                self._notify()
                return ""
        state.errors.append(error)
        return error

    async def _deregister_dra(self, registration_socket: str) -> None:
        """DeRegisterPlugin: close the connection, end the health stream (clearing the health)."""
        registration = self._dra_registrations.pop(registration_socket, None)
        if registration is None:
            return
        if registration.health_task is not None:
            registration.health_task.cancel()
        await registration.channel.close()
        state = self.dra_state(registration.driver)
        state.health = {}
        state.deregistrations += 1
        state.registered = any(r.driver == registration.driver for r in self._dra_registrations.values())
        self._notify()

    async def _watch_dra_health(self, registration: DraRegistration) -> None:
        """NodeWatchResources, opened again DRA_HEALTH_RETRY after it ends while registered."""
        state = self.dra_state(registration.driver)
        api, api_grpc = _HEALTH_APIS[registration.health_service]
        stub = api_grpc.DRAResourceHealthStub(registration.channel)
        while self._dra_registrations.get(registration.registration_socket) is registration:
            state.health_streams += 1
            state.health_service = registration.health_service
            try:
                async for message in stub.NodeWatchResources(api.NodeWatchResourcesRequest()):
                    now = time.monotonic()
                    reported = {
                        (d.device.pool_name, d.device.device_name): DeviceHealthRecord(
                            _HEALTH_NAMES.get(d.health, "Unknown"), d.message[:1024],
                            float(d.health_check_timeout_seconds) if d.health_check_timeout_seconds > 0
                            else DRA_DEFAULT_HEALTH_TIMEOUT, now, d.last_updated_time)
                        for d in message.devices
                    }
                    # updateHealthInfo: reported devices replaced, the others left to time out
                    state.health = {**state.health, **reported}
                    state.health_messages.append(reported)
                    self._notify()
            except grpc.aio.AioRpcError:
                pass
            finally:
                if self._dra_registrations.get(registration.registration_socket) is registration:
                    state.health = {}  # clearDriver, when the stream ends (deregistering clears it too)
                    self._notify()
            await asyncio.sleep(DRA_HEALTH_RETRY)

    async def _dra_call(
        self, method: str, claims: list[tuple[str, str, str]], driver: str | None, timeout: float,
        fail_on_claim_error: bool,
    ) -> dict[str, Any]:
        registration = self._dra_plugin(driver)
        state = self.dra_state(registration.driver)
        state.calls.append((method, registration.endpoint))
        messages, stubs = DRA_SERVICES[registration.service]
        request = getattr(messages, f"{method}Request")(
            claims=[messages.Claim(namespace=namespace, uid=uid, name=name) for namespace, uid, name in claims])
        call = getattr(stubs.DRAPluginStub(registration.channel), method)
        started = time.monotonic()
        response = await call(request, timeout=timeout)
        state.call_seconds.append((method, time.monotonic() - started))
        names = {uid: name for _, uid, name in claims}
        for uid, result in response.claims.items():
            if uid not in names:
                raise DraCallError(f"{method} returned result for unknown claim UID {uid}")
            if result.error and fail_on_claim_error:
                raise DraCallError(f"{method} failed for ResourceClaim {names[uid]}: {result.error}")
        unfinished = len(claims) - len(response.claims)
        if unfinished != 0:
            raise DraCallError(f"{method} skipped {unfinished} ResourceClaims")
        return dict(response.claims)

    async def _restart_dra(self) -> list[str]:
        if self._watcher_task is not None:
            self._watcher_task.cancel()
            self._watcher_task = None
        removed: list[str] = []
        for registration in list(self._dra_registrations.values()):
            await self._deregister_dra(registration.registration_socket)
            for socket_path in (registration.registration_socket, registration.endpoint):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(os.lstat(socket_path).st_mode):
                        os.unlink(socket_path)
                        removed.append(socket_path)
        if self.plugins_registry_dir is not None:
            self._watcher_task = asyncio.ensure_future(self._watch_registry())
        return removed


class _RegistrationService(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    async def Register(self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext) -> dp.Empty:
        kubelet = self._kubelet
        if request.version != "v1beta1":
            message = f'requested API version "{request.version}" is not supported by kubelet. Supported version is "[v1beta1]"'
        elif extended_resource_name_problem(request.resource_name):
            message = f'the ResourceName "{request.resource_name}" is invalid'
        elif "/" in request.endpoint:
            message = f"endpoint {request.endpoint!r} is not a file name in {kubelet.device_plugin_dir}"
        else:
            try:
                await kubelet.connect(request.resource_name, kubelet.device_plugin_dir / request.endpoint, "kubelet.sock")
                return dp.Empty()
            except Exception as failure:
                message = f"failed to dial device plugin: {failure}"
        kubelet.register_errors.append(message)
        kubelet._notify()
        await context.abort(grpc.StatusCode.UNKNOWN, message)
        raise AssertionError

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
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from daemon.core import extended_resource_name_problem

CHECKPOINT = "kubelet_internal_checkpoint"


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


class FakeKubelet:
    def __init__(self, device_plugin_dir: Path, plugins_registry_dir: Path | None = None) -> None:
        self.device_plugin_dir = device_plugin_dir
        self.plugins_registry_dir = plugins_registry_dir
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
        deadline = time.monotonic() + timeout
        with self._condition:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"kubelet stand-in: timed out waiting for {what or predicate}; "
                                         f"resources={self.snapshot()}")
                self._condition.wait(remaining)

    def write_checkpoint(self, allocated: dict[str, list[str]], pod: str = "uid-1", container: str = "app") -> None:
        """The checkpoint with ``allocated`` (resource -> device IDs) held by one pod's container."""
        entries = [{"PodUID": pod, "ContainerName": container, "ResourceName": resource,
                    "DeviceIDs": {"-1": device_ids}, "AllocResp": ""}
                   for resource, device_ids in allocated.items() if device_ids]
        document = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}
        temporary = self.device_plugin_dir / f".{CHECKPOINT}.tmp"
        temporary.write_text(json.dumps(document))
        temporary.rename(self.device_plugin_dir / CHECKPOINT)

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
            for directory, _, files in os.walk(self.plugins_registry_dir):
                for name in files:
                    path = Path(directory) / name
                    try:
                        status = os.lstat(path)
                    except OSError:
                        continue
                    if name.startswith(".") or not stat.S_ISSOCK(status.st_mode):
                        continue
                    if seen.get(str(path)) == status.st_mtime:
                        continue
                    seen[str(path)] = status.st_mtime
                    asyncio.ensure_future(self._register_from_watcher(path))
            await asyncio.sleep(0.05)

    async def _register_from_watcher(self, path: Path) -> None:
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        try:
            await asyncio.wait_for(channel.channel_ready(), 10)
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=1)
            error = ""
            if info.type != "DevicePlugin":
                error = f"no handler for plugin type {info.type!r}"
            elif "v1beta1" not in info.supported_versions:
                error = f"manager version, v1beta1, is not among plugin supported versions {list(info.supported_versions)}"
            elif problem := extended_resource_name_problem(info.name):
                error = f"the ResourceName {info.name!r} is invalid: {problem}"
            if not error:
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

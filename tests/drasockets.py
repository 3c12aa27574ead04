"""The DRA sockets served in the test's own trio run, found by the kubelet stand-in's plugin
watcher, with inotify telling them of removed sockets as the daemon's source does; and a v1
DRAPlugin servicer that records what reaches it."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import trio
import trio_asyncio

from daemon._generated.dra.v1 import api_pb2 as dra_v1
from daemon._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from daemon.core import Event
from daemon.core._events import PluginSocketRemoved
from daemon.core._notifier import Notifier
from daemon.core._tree import DeviceTree
from daemon.dra import DraSockets, HealthServicer
from daemon.metrics import Metrics
from daemon.settings import Settings
from daemon.sources.inotify import InotifySource
from tests.kubelet import DRA_HEALTH_VERSIONS, DRA_SERVICES, FakeKubelet

DRIVER = "devplugd.io"
NODE = "node1"
POOL = "node1/example.com/x"


class RecordingPlugin(dra_v1_grpc.DRAPluginServicer):
    """Answers each claim with one device named after it (with a share ID, which only v1 has),
    and records every request as the v1 servicer got it. ``skip`` are claim UIDs left out of the
    answer, ``unknown_uid`` an extra UID put in it, ``errors`` claim UID -> error to answer."""

    def __init__(self) -> None:
        self.prepared: list[dra_v1.NodePrepareResourcesRequest] = []
        self.unprepared: list[dra_v1.NodeUnprepareResourcesRequest] = []
        self.skip: set[str] = set()
        self.unknown_uid = ""
        self.errors: dict[str, str] = {}

    async def NodePrepareResources(self, request: dra_v1.NodePrepareResourcesRequest,
                                   context: Any) -> dra_v1.NodePrepareResourcesResponse:
        self.prepared.append(request)
        response = dra_v1.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.uid in self.skip:
                continue
            answer = response.claims[claim.uid]
            if claim.uid in self.errors:
                answer.error = self.errors[claim.uid]
                continue
            answer.devices.add(request_names=["vf"], pool_name=POOL, device_name=f"dev-{claim.name}",
                               cdi_device_ids=[f"{DRIVER}/claim={claim.uid}"], share_id=f"share-{claim.uid}")
        if self.unknown_uid:
            response.claims[self.unknown_uid].SetInParent()
        return response

    async def NodeUnprepareResources(self, request: dra_v1.NodeUnprepareResourcesRequest,
                                     context: Any) -> dra_v1.NodeUnprepareResourcesResponse:
        self.unprepared.append(request)
        response = dra_v1.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            if claim.uid not in self.skip:
                response.claims[claim.uid].error = self.errors.get(claim.uid, "")
        return response


class LookingSockets(DraSockets):
    """DraSockets that count their looks at what is missing (``looks``): a look that has come
    after a removal event proves the event was acted on, whatever it did."""

    looks = 0

    async def _serve_what_is_missing(self) -> None:
        await super()._serve_what_is_missing()
        self.looks += 1


@dataclass
class DraRig:
    settings: Settings
    sockets: LookingSockets
    kubelet: FakeKubelet
    notifier: Notifier
    plugin: RecordingPlugin
    health: HealthServicer
    metrics: Metrics
    run_ended: list[str] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)  # paths of the removal events forwarded, in order

    def health_streams(self) -> int:
        """The open health streams, subscribed to the notifier, as the daemon's metric counts them."""
        return int(self.metrics.registry.get_sample_value("devplugd_tree_streams", {"kind": "dra_health"}) or 0)

    async def kubelet_call(self, function: Callable[..., Any], *arguments: Any, **keywords: Any) -> Any:
        """A call of the stand-in's blocking API, from a worker thread: our servers answer it on
        this thread."""
        return await trio.to_thread.run_sync(functools.partial(function, *arguments, **keywords))


async def _forward_removals(receive: trio.MemoryReceiveChannel[Event], rig: DraRig) -> None:
    """What the integrator wires: the inotify source's PluginSocketRemoved to ``socket_removed``
    (each path kept in ``rig.removals`` once forwarded)."""
    async for event in receive:
        if isinstance(event, PluginSocketRemoved):
            rig.sockets.socket_removed(event.path)
            rig.removals.append(event.path)


def dra_settings(directory: Path) -> Settings:
    return Settings(device_plugin_dir=directory / "device-plugins", plugins_registry_dir=directory / "plugins_registry",
                    dra_plugin_dir=directory / "plugins", dra_driver=DRIVER, node_name=NODE)


@asynccontextmanager
async def serving_dra(
    directory: Path,
    kubelet_versions: tuple[str, ...] = tuple(DRA_SERVICES),
    resend_interval: float = 10.0,
    with_inotify: bool = True,
    tree: DeviceTree | None = None,
    dra_health_gate: bool = True,
    dra_health_versions: tuple[str, ...] = DRA_HEALTH_VERSIONS,
) -> AsyncIterator[DraRig]:
    """DraSockets serving in this trio run (started: both sockets served), a kubelet stand-in
    watching the registry directory, and inotify on both socket directories; ``tree`` is
    published before anything is served."""
    settings = dra_settings(directory)
    kubelet = FakeKubelet(settings.device_plugin_dir, settings.plugins_registry_dir, kubelet_versions=kubelet_versions,
                          dra_health_gate=dra_health_gate, dra_health_versions=dra_health_versions)
    kubelet.start()
    try:
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            notifier = Notifier()
            if tree is not None:
                notifier.publish(tree)
            plugin = RecordingPlugin()
            metrics = Metrics()
            health = HealthServicer(notifier, NODE, resend_interval=resend_interval, metrics=metrics)
            sockets = LookingSockets(settings, plugin, health)
            rig = DraRig(settings, sockets, kubelet, notifier, plugin, health, metrics)
            if with_inotify:
                inotify = InotifySource([settings.plugins_registry_dir, settings.dra_socket.parent], None, None)
                send, receive = trio.open_memory_channel[Event](100)
                nursery.start_soon(inotify.run, send)
                nursery.start_soon(_forward_removals, receive, rig)

            async def run_sockets(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await sockets.run(task_status=task_status)
                    rig.run_ended.append("returned")
                except BaseException as error:
                    rig.run_ended.append(type(error).__name__)
                    raise

            await nursery.start(run_sockets)
            yield rig
            nursery.cancel_scope.cancel()
    finally:
        kubelet.close()


async def get_info(socket_path: Path) -> Any:
    """GetInfo on a registration socket, as the plugin watcher calls it."""

    async def call() -> Any:
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            return await reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)

    return await trio_asyncio.aio_as_trio(call)()

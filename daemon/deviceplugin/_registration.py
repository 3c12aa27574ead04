"""Registration with the kubelet, both ways: Register on ``kubelet.sock``, or a
``pluginregistration.Registration`` service beside DevicePlugin on a plugins_registry socket that
the kubelet's plugin watcher finds. Asyncio coroutines: call them through ``aio_as_trio``."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from daemon.registration import PluginRegistrationServicer
from daemon.sockets import start_unix_server

from ._servicer import DevicePluginServicer

API_VERSION = "v1beta1"


def watcher_registration(resource: str, on_status: Callable[[bool, str], None]) -> PluginRegistrationServicer:
    """pluginregistration.Registration, served beside DevicePlugin on a plugins_registry socket."""
    info = reg.PluginInfo(type="DevicePlugin", name=resource, endpoint="", supported_versions=[API_VERSION])
    return PluginRegistrationServicer(info, on_status)


async def start_grpc_server(
    socket_path: str,
    servicer: DevicePluginServicer,
    registration: PluginRegistrationServicer | None,
) -> grpc.aio.Server:
    """Listen on ``socket_path`` (an asyncio coroutine: call it through aio_as_trio)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    dp_grpc.add_DevicePluginServicer_to_server(servicer, server)
    if registration is not None:
        reg_grpc.add_RegistrationServicer_to_server(registration, server)
    return await start_unix_server(server, socket_path)


async def register_with_kubelet(
    kubelet_socket: str, endpoint: str, resource: str, options: dp.DevicePluginOptions, timeout: float
) -> None:
    """Call Register on kubelet.sock (asyncio coroutine). Raises grpc.aio.AioRpcError."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = dp_grpc.RegistrationStub(channel)
        await stub.Register(
            dp.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=resource, options=options),
            timeout=timeout,
        )

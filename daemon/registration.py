"""The kubelet plugin watcher's side of a plugin: ``pluginregistration.Registration`` on a socket
in ``plugins_registry``, answering GetInfo with what the plugin is and hearing whether the
kubelet took it. Device-plugin endpoints (watcher mode) and the DRA driver both serve it."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon._generated.pluginregistration.v1 import api_pb2_grpc as reg_grpc


class PluginRegistrationServicer(reg_grpc.RegistrationServicer):
    """GetInfo answers ``info``; NotifyRegistrationStatus is passed to ``on_status(registered,
    error)``."""

    def __init__(self, info: reg.PluginInfo, on_status: Callable[[bool, str], None]) -> None:
        self._info = info
        self._on_status = on_status

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[reg.InfoRequest, reg.PluginInfo]
    ) -> reg.PluginInfo:
        return self._info

    async def NotifyRegistrationStatus(
        self,
        request: reg.RegistrationStatus,
        context: grpc.aio.ServicerContext[reg.RegistrationStatus, reg.RegistrationStatusResponse],
    ) -> reg.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()

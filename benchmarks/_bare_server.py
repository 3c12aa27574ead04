"""A bare grpc.aio server for the benchmarks' baselines: nothing is done per call.

``python -m benchmarks._bare_server --socket PATH --response FILE --host asyncio|trio``: a
DevicePlugin server (allocate_latency) whose Allocate answers with one precomputed
AllocateResponse (captured from the daemon).

``python -m benchmarks._bare_server --socket PATH --dra --host asyncio|trio``: a DRAPlugin server
(dra_stack) whose NodePrepareResources and NodeUnprepareResources answer with no claims; hosted
in trio, each call goes into trio and back through ``trio_as_aio``, as the daemon's servicer
calls its preparer.

* ``asyncio``: plain ``asyncio.run``; no trio anywhere.
* ``trio``: the same server created inside ``trio.run`` + ``trio_asyncio.open_loop()`` and started
  with ``aio_as_trio`` (as the daemon hosts its servers), so the difference to ``asyncio`` is the
  trio-asyncio bridge alone.

Prints ``READY`` on stdout once serving; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from daemon._generated.dra.v1 import api_pb2 as dra
from daemon._generated.dra.v1 import api_pb2_grpc as dra_grpc

# what a server adds to a grpc.aio server it is given (its servicer)
AddServicer = Callable[[grpc.aio.Server], None]


class FixedAllocate(dp_grpc.DevicePluginServicer):
    def __init__(self, response: dp.AllocateResponse) -> None:
        self._response = response

    async def GetDevicePluginOptions(self, request: dp.Empty, context: grpc.aio.ServicerContext) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions()

    async def Allocate(self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext) -> dp.AllocateResponse:
        return self._response


class EmptyDra(dra_grpc.DRAPluginServicer):
    """Answers with no claims; ``hop`` (trio's host: into trio and back) awaited first."""

    def __init__(self, hop: Callable[[], Awaitable[None]] | None) -> None:
        self._hop = hop

    async def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext) -> dra.NodePrepareResourcesResponse:
        if self._hop is not None:
            await self._hop()
        return dra.NodePrepareResourcesResponse()

    async def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext) -> dra.NodeUnprepareResourcesResponse:
        if self._hop is not None:
            await self._hop()
        return dra.NodeUnprepareResourcesResponse()


async def start_server(socket_path: str, add: AddServicer) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # the daemon's options
    add(server)
    if server.add_insecure_port(f"unix://{socket_path}") == 0:
        raise OSError(f"cannot listen on {socket_path}")
    await server.start()
    return server


def ready() -> None:
    print("READY", flush=True)


async def run_asyncio(socket_path: str, add: AddServicer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await start_server(socket_path, add)
    ready()
    await stop.wait()
    await server.stop(0)


async def run_trio(socket_path: str, add: AddServicer) -> None:
    import trio
    import trio_asyncio
    from trio_asyncio import aio_as_trio

    async with trio_asyncio.open_loop():
        server = await aio_as_trio(start_server)(socket_path, add)
        try:
            ready()
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
        finally:
            with trio.CancelScope(shield=True):
                await aio_as_trio(server.stop)(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--response", type=Path, help="a serialized AllocateResponse: a DevicePlugin server")
    what.add_argument("--dra", action="store_true", help="a DRAPlugin server")
    parser.add_argument("--host", choices=("asyncio", "trio"), required=True)
    arguments = parser.parse_args(argv)
    if arguments.dra:
        add = dra_servicer(arguments.host == "trio")
    else:
        response = dp.AllocateResponse.FromString(arguments.response.read_bytes())

        def add(server: grpc.aio.Server) -> None:
            dp_grpc.add_DevicePluginServicer_to_server(FixedAllocate(response), server)
    if arguments.host == "asyncio":
        asyncio.run(run_asyncio(arguments.socket, add))
    else:
        import trio

        trio.run(run_trio, arguments.socket, add)
    return 0


def dra_servicer(into_trio: bool) -> AddServicer:
    """Adds an ``EmptyDra`` (``into_trio``: whose calls hop into trio and back)."""
    hop = None
    if into_trio:
        from trio_asyncio import trio_as_aio

        async def nothing() -> None:
            return None

        hop = trio_as_aio(nothing)

    def add(server: grpc.aio.Server) -> None:
        dra_grpc.add_DRAPluginServicer_to_server(EmptyDra(hop), server)
    return add


if __name__ == "__main__":
    sys.exit(main())

"""A bare grpc.aio DevicePlugin server for allocate_latency's baselines: Allocate answers with one
precomputed AllocateResponse (captured from the daemon), nothing else is done per call.

``python -m benchmarks._bare_server --socket PATH --response FILE --host asyncio|trio``

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
from pathlib import Path

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc


class FixedAllocate(dp_grpc.DevicePluginServicer):
    def __init__(self, response: dp.AllocateResponse) -> None:
        self._response = response

    async def GetDevicePluginOptions(self, request: dp.Empty, context: grpc.aio.ServicerContext) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions()

    async def Allocate(self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext) -> dp.AllocateResponse:
        return self._response


async def start_server(socket_path: str, response: dp.AllocateResponse) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # the daemon's options
    dp_grpc.add_DevicePluginServicer_to_server(FixedAllocate(response), server)
    if server.add_insecure_port(f"unix://{socket_path}") == 0:
        raise OSError(f"cannot listen on {socket_path}")
    await server.start()
    return server


def ready() -> None:
    print("READY", flush=True)


async def run_asyncio(socket_path: str, response: dp.AllocateResponse) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await start_server(socket_path, response)
    ready()
    await stop.wait()
    await server.stop(0)


async def run_trio(socket_path: str, response: dp.AllocateResponse) -> None:
    import trio
    import trio_asyncio
    from trio_asyncio import aio_as_trio

    async with trio_asyncio.open_loop():
        server = await aio_as_trio(start_server)(socket_path, response)
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
    parser.add_argument("--response", type=Path, required=True, help="a serialized AllocateResponse")
    parser.add_argument("--host", choices=("asyncio", "trio"), required=True)
    arguments = parser.parse_args(argv)
    response = dp.AllocateResponse.FromString(arguments.response.read_bytes())
    if arguments.host == "asyncio":
        asyncio.run(run_asyncio(arguments.socket, response))
    else:
        import trio

        trio.run(run_trio, arguments.socket, response)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Allocate client of allocate_latency, run as its own process so its cost is the same for
every server measured: a synchronous grpcio client on one channel, calls strictly in sequence.

``python -m benchmarks._allocate_client --socket PATH --calls N --warmup W --ids A,B,...``
prints one JSON object: ``{"latencies_ns": [...], "errors": [...]}``. Request k asks for
device ``ids[k % len(ids)]`` (one device per call, one container request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--ids", required=True, help="comma-separated device IDs, used round-robin")
    parser.add_argument("--timeout", type=float, default=5.0)
    arguments = parser.parse_args(argv)

    ids = arguments.ids.split(",")
    requests = [dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=[device_id])])
                for device_id in ids]
    errors: list[str] = []
    latencies: list[int] = []
    with grpc.insecure_channel(f"unix://{arguments.socket}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        allocate = dp_grpc.DevicePluginStub(channel).Allocate
        for index in range(arguments.warmup):
            allocate(requests[index % len(requests)], timeout=arguments.timeout)
        clock = time.perf_counter_ns
        for index in range(arguments.calls):
            request = requests[index % len(requests)]
            started = clock()
            try:
                allocate(request, timeout=arguments.timeout)
            except grpc.RpcError as error:
                errors.append(f"call {index}: {error.code().name}: {error.details()}")  # type: ignore[attr-defined]
                continue
            latencies.append(clock() - started)
    json.dump({"latencies_ns": latencies, "errors": errors[:20], "error_count": len(errors)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

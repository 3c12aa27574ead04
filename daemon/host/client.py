"""The host-side commands: ``devplugd list|watch|allocate|release|leases|clear-lost|explain`` over
the control socket.

Human tables by default, JSON for scripts. Exit codes: 0 done; 1 refused by the daemon (the
reason on stderr); 3 the daemon is not running (nothing listens on the control socket).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon._generated.devplugd.host.v1 import host_pb2_grpc as host_grpc
from daemon.core import LEFT_OUT, TOOK

from ._leases import Lease
from ._messages import holder_text

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_NOT_RUNNING = 3
TIMEOUT = 30.0
DELTA_KINDS = {host.Delta.ADDED: "added", host.Delta.REMOVED: "removed", host.Delta.CHANGED: "changed"}


class NotRunning(Exception):
    pass


def _stub(control_socket: Path) -> tuple[grpc.Channel, host_grpc.HostStub]:
    if not control_socket.exists():
        raise NotRunning(f"devplugd is not running: no control socket at {control_socket}")
    channel = grpc.insecure_channel(f"unix://{control_socket}")
    return channel, host_grpc.HostStub(channel)


def _device_json(device: host.Device) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": device.id, "health": device.health, "holder": device.holder,
                             "numa_nodes": list(device.numa_nodes)}
    if device.lease:
        entry["lease"] = device.lease
    if device.owner:
        entry["owner"] = device.owner
    return entry


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def _tell_lost(lost_books: list[str]) -> None:
    for lost in lost_books:
        print(f"devplugd: LOST BOOK: {lost}", file=sys.stderr)


def command_list(control_socket: Path, output: str) -> int:
    channel, stub = _stub(control_socket)
    with channel:
        response = stub.List(host.ListRequest(), timeout=TIMEOUT)
    _tell_lost(list(response.lost_books))
    pools = [{"resource": p.resource, "allocation_api": p.allocation_api or "devicePlugin",
              "devices": [_device_json(d) for d in p.devices], **({"no_devices": p.no_devices} if p.no_devices else {})}
             for p in response.pools]
    if output == "json":
        print(json.dumps(pools, indent=1))
        return EXIT_OK
    rows = [[p.resource, p.allocation_api or "devicePlugin", d.id, d.health, ",".join(map(str, d.numa_nodes)) or "-",
             holder_text(d)] for p in response.pools for d in p.devices]
    rows += [[p["resource"], p["allocation_api"], "-", "-", "-", f"no devices: {p['no_devices']}"]
             for p in pools if not p["devices"] and "no_devices" in p]
    _print_table(rows, ["RESOURCE", "API", "DEVICE", "HEALTH", "NUMA", "HOLDER"])
    return EXIT_OK


def _watch_events(control_socket: Path) -> Iterator[host.WatchEvent]:
    channel, stub = _stub(control_socket)
    with channel:
        yield from stub.Watch(host.WatchRequest())


def command_watch(control_socket: Path, output: str) -> int:
    try:
        for event in _watch_events(control_socket):
            if event.HasField("snapshot"):
                line: dict[str, object] = {
                    "version": event.version, "kind": "snapshot",
                    "pools": [{"resource": p.resource, "devices": [_device_json(d) for d in p.devices]}
                              for p in event.snapshot.pools]}
                text = f"v{event.version} snapshot: " + ", ".join(
                    f"{p.resource} ({len(p.devices)})" for p in event.snapshot.pools)
            else:
                delta = event.delta
                line = {"version": event.version, "kind": DELTA_KINDS.get(delta.kind, "unknown"),
                        "resource": delta.resource, "device": _device_json(delta.device)}
                text = (f"v{event.version} {line['kind']} {delta.resource} {delta.device.id} "
                        f"{delta.device.health} {delta.device.holder}")
            print(json.dumps(line) if output == "json" else text, flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK


def command_allocate(control_socket: Path, resource: str, count: int, device_ids: list[str], owner: str | None,
                     numa_node: int | None, output: str) -> int:
    request = host.AllocateRequest(resource=resource, count=count if not device_ids else 0, device_ids=device_ids,
                                   owner=owner or default_owner())
    if numa_node is not None:
        request.numa_node = numa_node
    channel, stub = _stub(control_socket)
    with channel:
        lease = stub.Allocate(request, timeout=TIMEOUT)
    described = describe_lease(lease)
    if output == "json":
        print(json.dumps(described, indent=1))
    elif output == "podman":
        arguments = [f"--device={name}" for name in lease.cdi_devices] or [
            f"--device={s.host_path}:{s.container_path}:{s.permissions}" for s in lease.device_specs]
        print(" ".join(arguments))
    else:
        print(f"DEVPLUGD_LEASE={lease.lease}")
        for key, value in sorted(lease.envs.items()):
            print(f"{key}={value}")
    return EXIT_OK


def command_release(control_socket: Path, lease: str) -> int:
    channel, stub = _stub(control_socket)
    with channel:
        stub.Release(host.ReleaseRequest(lease=lease), timeout=TIMEOUT)
    return EXIT_OK


def command_leases(control_socket: Path, output: str) -> int:
    channel, stub = _stub(control_socket)
    with channel:
        response = stub.Leases(host.LeasesRequest(), timeout=TIMEOUT)
    _tell_lost([response.lost] if response.lost else [])
    leases = [describe_lease(lease) for lease in response.leases]
    if output == "json":
        print(json.dumps(leases, indent=1))
        return EXIT_OK
    _print_table([[x["lease"], x["resource"], x["owner"], ",".join(x["devices"]),
                   ("missing: " + ",".join(x["missing_devices"])) if x["missing_devices"] else ""] for x in leases],
                 ["LEASE", "RESOURCE", "OWNER", "DEVICES", ""])
    return EXIT_OK


def command_clear_lost(control_socket: Path, book: str, operator: str | None) -> int:
    """Tell the daemon that the devices a lost book held are free: they are offered again."""
    channel, stub = _stub(control_socket)
    with channel:
        answer = stub.ClearLost(host.ClearLostRequest(book=book, operator=operator or default_owner()),
                                timeout=TIMEOUT)
    print(f"devplugd: {answer.message}")
    return EXIT_OK


def command_explain(control_socket: Path, device: str, output: str) -> int:
    """Why ``device`` is, or is not, in each pool of the running config."""
    channel, stub = _stub(control_socket)
    with channel:
        response = stub.Explain(host.ExplainRequest(device=device), timeout=TIMEOUT)
    print_explanation(response, output)
    return EXIT_OK


def print_explanation(response: host.ExplainResponse, output: str) -> None:
    """An ``Explain`` answer: one line per pool, in config order, then the summary (``-o json``:
    the message as JSON, field names as in the proto)."""
    if output == "json":
        print(json.dumps(explanation_json(response), indent=1))
        return
    for known in response.known_as:
        print(f"{known.device}: {known.description}")
    for pool in response.pools:
        print(f"pool {pool.resource}: {_verdict_text(pool)}")
    print(f"=> {response.summary}")


def explanation_json(response: host.ExplainResponse) -> dict[str, Any]:
    """The JSON shape of an ``Explain`` answer that scripts rely on (``explain -o json``)."""
    pools = []
    for pool in response.pools:
        entry: dict[str, Any] = {"resource": pool.resource, "device_type": pool.device_type,
                                 "outcome": pool.outcome, "reason": pool.reason}
        if pool.outcome == TOOK:
            entry.update(device=_device_json(pool.device), health_reason=pool.health_reason,
                         allocation_api=pool.allocation_api)
        pools.append(entry)
    return {"device": response.device, "summary": response.summary, "pools": pools,
            "known_as": [{"handler": k.handler, "device": k.device, "description": k.description}
                         for k in response.known_as]}


def _verdict_text(pool: host.PoolVerdict) -> str:
    if pool.outcome == TOOK:
        device = pool.device
        health = device.health + (f" ({pool.health_reason})" if pool.health_reason else "")
        held = f", {holder_text(device)}" if device.holder else ""
        return f"takes it as {device.id} ({pool.reason}): {health}{held}, through {pool.allocation_api}"
    if pool.outcome == LEFT_OUT:
        return f"left out: {pool.reason}"
    return pool.reason


def describe_lease(message: host.Lease) -> dict[str, Any]:
    """The JSON shape of a lease that scripts rely on (``allocate -o json``, ``leases -o json``)."""
    return Lease.from_message(message).to_json(missing_devices=message.missing_devices)


def default_owner() -> str:
    return f"{os.environ.get('SUDO_USER') or os.environ.get('USER') or 'root'}@{socket.gethostname()}"


def run_client(function: Any, *arguments: Any) -> int:
    """Run a command; turn a refusal or an absent daemon into a message on stderr and an exit code."""
    try:
        return int(function(*arguments))
    except NotRunning as error:
        print(f"devplugd: {error}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"devplugd: the daemon is not running (its control socket does not answer): {error.details()}",
                  file=sys.stderr)
            return EXIT_NOT_RUNNING
        print(f"devplugd: {error.details()}", file=sys.stderr)
        return EXIT_REFUSED

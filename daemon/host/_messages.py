"""How the host API shows a device of a pool and who holds it (List, Watch, Explain, the CLI)."""

from __future__ import annotations

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon.core import ResourcePool
from daemon.holdings import CLAIM, KUBELET, LEASE, Holder


def device_message(pool: ResourcePool, device_id: str, holder: Holder | None) -> host.Device:
    info = pool.devices[device_id]
    device = host.Device(id=device_id, health=info.health, numa_nodes=info.numa_nodes, holder="free")
    if holder is None:
        return device
    device.holder = holder.kind
    if holder.kind == LEASE:
        device.lease, device.owner = holder.name, holder.detail
    elif holder.kind in (CLAIM, KUBELET):
        device.owner = holder.name or holder.describe()
    else:  # a lost book: where its file went, and why
        device.lease, device.owner = holder.name, holder.detail
    return device


def holder_text(device: host.Device) -> str:
    """Who holds ``device`` as the CLI and explain's summary say it: ``free``, or its holder with
    the lease and owner it names."""
    if device.holder == "free":
        return "free"
    return device.holder + f" {device.lease} {device.owner}".rstrip()

"""Allocation answers: what one container request gets, the default answer, and the errors.

A handler that cannot answer raises ``AllocationError`` naming the device and the reason;
anything else a handler hook raises is a bug in the handler, reported as ``HandlerFailed`` so
that the caller refuses the one request and goes on (see ``allocate_container``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ._tree import DeviceSpec, Mount, ResourcePool


@dataclass
class ContainerAllocation:
    """The answer for one container request (becomes a ContainerAllocateResponse)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    specs: list[DeviceSpec] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    # devices whose record in the tree was found out of date and read afresh for this answer:
    # their CDI spec may still say the old thing, so they get no CDI name
    reread: set[str] = field(default_factory=set)


class UseDefault(Exception):
    """Raised by ``Allocator.allocate`` to ask for the core's default answer."""


class AllocationError(Exception):
    """The handler cannot answer this Allocate; the message names the device and the reason."""


class HandlerFailed(Exception):
    """A handler hook raised something it should not have; the message names the handler and the
    hook, the original exception is the cause."""


def default_allocation(pool: ResourcePool, device_ids: Sequence[str]) -> ContainerAllocation:
    """The union of the devices' specs (first per host path), mounts (first per container path),
    envs and annotations, in request order."""
    allocation = ContainerAllocation()
    seen_hosts: set[str] = set()
    seen_mounts: set[str] = set()
    for device_id in device_ids:
        info = pool.devices[device_id]
        for spec in info.specs:
            if spec.host_path not in seen_hosts:
                seen_hosts.add(spec.host_path)
                allocation.specs.append(spec)
        for mount in info.mounts:
            if mount.container_path not in seen_mounts:
                seen_mounts.add(mount.container_path)
                allocation.mounts.append(mount)
        for key, value in info.envs.items():
            allocation.envs.setdefault(key, value)
        for key, value in info.annotations.items():
            allocation.annotations.setdefault(key, value)
    return allocation

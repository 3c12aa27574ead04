"""IOMMU groups, the kernel's unit of passthrough.

Only one process can open ``/dev/vfio/<group>``, and the kernel attaches a group to a container
only when it is *viable*: every function in it bound to vfio-pci, to pci-stub or to no driver
(PCI bridges do not count). So the functions of a group that a pool offers through vfio are one
device, never two devices two pods could get:

* a group with one function (the common SR-IOV VF) is that function's device, as it always was;
* a group of several functions whose vfio-bound functions a pool offers is one device named by
  the lowest PCI address among them, in the pool of that function, carrying every function: the
  group's specs once, health Unhealthy when any function is, the NUMA nodes of them all;
* a group that is not viable (a function bound to a host driver) is offered nowhere, until the
  last such function is unbound or moves to vfio-pci.

A ``vfioOnDemand`` pool (through DRA) takes functions on their host drivers, and a claim that
asks rebinds the device's whole group to vfio-pci: so a group of several functions is one device
of such a pool (named and made as above) when every function of it but its bridges is in that
pool, and is offered nowhere otherwise (some function would stay on its host driver, or be in
another pool's hands).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from daemon.core import HEALTHY, UNHEALTHY, AllocationError, DeviceInfo, SysfsError, list_dir, read_hex_id

from ._allocation import VFIO_DRIVER, PciDetails, first_per_host_path
from ._facts import PciDevice

# drivers that leave a group viable; the kernel also lets PCI bridges keep theirs (pcieport)
VIABLE_DRIVERS = frozenset({VFIO_DRIVER, "pci-stub"})
BRIDGE_CLASSES = ("0604", "0609")


def is_bridge_class(class_code: str) -> bool:
    """A PCI bridge: it may keep its driver (pcieport) without making its group not viable."""
    return class_code.startswith(BRIDGE_CLASSES)


def is_bridge_at(sysfs_root: str, address: str) -> bool:
    """Whether the function at ``address`` is a PCI bridge (one that cannot be read is not)."""
    try:
        class_code = read_hex_id(f"{sysfs_root}/bus/pci/devices/{address}/class", 6)
    except SysfsError:
        return False
    return class_code is not None and is_bridge_class(class_code)


def functions_beside(sysfs_root: str, group: str, functions: Collection[str], address: str) -> list[str]:
    """The functions of IOMMU group ``group`` as sysfs lists them now, bridges aside, that are not
    among ``functions`` (those of the device ``address`` names); AllocationError naming it when
    the group cannot be listed."""
    try:
        members = list_dir(f"{sysfs_root}/kernel/iommu_groups/{group}/devices")
    except SysfsError as error:
        raise AllocationError(f"{address}: {error}") from error
    return [member for member in members if member not in functions and not is_bridge_at(sysfs_root, member)]


def blocking_functions(members: Iterable[PciDevice]) -> list[PciDevice]:
    """The functions that keep a group from being viable: bound to a host driver."""
    return [device for device in members
            if not is_bridge_class(device.class_code)
            and device.driver is not None and device.driver not in VIABLE_DRIVERS]


def passthrough_group(device: PciDevice) -> str | None:
    """The group through which ``device`` is handed out whole, or ``None`` (not vfio-bound, or
    a no-IOMMU group, which the kernel gives each device alone)."""
    if device.driver != VFIO_DRIVER or device.iommu_group is None or device.noiommu:
        return None
    return device.iommu_group


def group_device(functions: Sequence[tuple[str, DeviceInfo]]) -> tuple[str, DeviceInfo]:
    """One device for the offered functions of a group (``(address, info)``, lowest first)."""
    ordered = sorted(functions)
    if len(ordered) == 1:
        return ordered[0]
    address, primary = ordered[0]
    infos = [info for _, info in ordered]
    details: PciDetails = primary.details
    members = tuple(info.details for info in infos[1:])
    return address, replace(
        primary,
        health=UNHEALTHY if any(info.health != HEALTHY for info in infos) else HEALTHY,
        fault=next((info.fault for info in infos if info.fault is not None), None),
        numa_nodes=tuple(sorted({node for info in infos for node in info.numa_nodes})),
        specs=tuple(first_per_host_path([spec for info in infos for spec in info.specs])),
        details=replace(details, members=members),
    )


def group_index(devices: Iterable[PciDevice]) -> dict[str, tuple[str, ...]]:
    """IOMMU group -> the addresses of its functions (no-IOMMU groups left out). Tuples, not
    sets: nearly every group has one function, and 4096 one-element sets cost 0.7 MB more."""
    index: dict[str, tuple[str, ...]] = {}
    for device in devices:
        if device.iommu_group is not None and not device.noiommu:
            index[device.iommu_group] = (*index.get(device.iommu_group, ()), device.address)
    return index


def apply_groups(
    functions: Mapping[str, Mapping[str, DeviceInfo]],
    groups: Iterable[tuple[str, ...]],
    devices: Mapping[str, PciDevice],
    placed: Mapping[str, str],
    on_demand: frozenset[str] = frozenset(),
) -> dict[str, dict[str, DeviceInfo]]:
    """The pools of the resources the groups of several functions change, from the per-function
    placements: each such group's vfio-bound functions taken out of their pools, and put back as
    one device in the pool of the lowest of them when the group is viable. Pools no group
    touches are not in the result."""
    changed: dict[str, dict[str, DeviceInfo]] = {}

    def pool(resource: str) -> dict[str, DeviceInfo]:
        if resource not in changed:
            changed[resource] = dict(functions[resource])
        return changed[resource]

    for addresses in groups:
        if len(addresses) < 2:
            continue
        lendable = sorted(a for a in addresses if placed.get(a) in on_demand)
        offered = sorted(a for a in addresses
                         if a in placed and a not in lendable and passthrough_group(devices[a]) is not None)
        if not offered and not lendable:
            continue
        # every placed function of the group leaves its pool; the group comes back as one device or not at all
        taken = [(address, pool(placed[address]).pop(address)) for address in (*lendable, *offered)]
        if lendable:
            if not offered and _whole_in_one_pool(addresses, lendable, devices, placed):
                address, info = group_device(taken)
                pool(placed[lendable[0]])[address] = info
            continue
        if blocking_functions(devices[a] for a in addresses if a in devices):
            continue
        address, info = group_device(taken)
        pool(placed[offered[0]])[address] = info
    return changed


def _whole_in_one_pool(addresses: Iterable[str], lendable: Sequence[str], devices: Mapping[str, PciDevice],
                       placed: Mapping[str, str]) -> bool:
    """Every function of the group but its bridges is in the ``vfioOnDemand`` pool of the first."""
    resource = placed[lendable[0]]
    return all(placed.get(a) == resource for a in addresses
               if a in devices and not is_bridge_class(devices[a].class_code))

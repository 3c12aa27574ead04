"""Why a PCI function is, or is not, in a pool (``devplugd explain``), with the build's own rules:
``ineligibility`` (device type, a PF with VFs, the default route), each selector's
``refusing_key``, first pool wins, ``unusable_reason`` and the IOMMU group's viability.

A function is named by its PCI address (``0000:3b:02.1`` or ``3b:02.1``), one of its netdevs, or
its VFIO group node (``/dev/vfio/12``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from daemon.core import (
    LEFT_OUT,
    REFUSED,
    TOOK,
    ConfiguredPool,
    DeviceInfo,
    Explanation,
    Mismatch,
    Offered,
    PoolVerdict,
    first_pool_wins,
    refused_by_selectors,
)

from ._ddp import read_ddp_profile
from ._facts import PciDevice, PciFacts
from ._groups import blocking_functions, passthrough_group
from ._pools import PciPoolSpec, ineligibility, lent_as_at_home, unhealthy_reason, unusable_reason

DEFAULT_DOMAIN = "0000:"


def find_function(facts: PciFacts, name: str) -> PciDevice | None:
    """The function ``name`` names: a PCI address (the domain may be left out), a netdev, or a
    VFIO group node (the group's lowest function)."""
    wanted = name.strip().lower()
    for address in (wanted, DEFAULT_DOMAIN + wanted):
        if address in facts.devices:
            return facts.devices[address]
    if wanted.startswith("/dev/vfio/"):
        group = wanted.rsplit("/", 1)[1].removeprefix("noiommu-")
        members = sorted(a for a, d in facts.devices.items() if d.iommu_group == group)
        return facts.devices[members[0]] if members else None
    return next((d for _, d in sorted(facts.devices.items()) if name.strip() in d.netdevs), None)


def describe(device: PciDevice) -> str:
    """What the handler knows of ``device``, in one line."""
    parts = [f"PCI function {device.vendor}:{device.device}", f"class {device.class_code}",
             f"driver {device.driver or 'none'}"]
    if device.pf_address:
        parts.append(f"VF {device.vf_index} of {device.pf_netdev or device.pf_address}"
                     + (f" ({device.pf_address})" if device.pf_netdev else ""))
    elif device.is_pf:
        parts.append(f"PF with {device.num_vfs} VFs enabled")
    if device.netdevs:
        parts.append(f"netdev {','.join(device.netdevs)}")
    if device.iommu_group is not None:
        parts.append(f"{'no-IOMMU ' if device.noiommu else ''}IOMMU group {device.iommu_group}")
    if device.numa_node is not None:
        parts.append(f"NUMA node {device.numa_node}")
    return ", ".join(parts)


def _mismatches(device: PciDevice, spec: PciPoolSpec,
                ddp_profile: Callable[[str], str | None]) -> list[Mismatch | None]:
    """What each selector object of the pool says of ``device`` (``None``: it admits it)."""
    return [selector.mismatch(device, ddp_profile) for selector in spec.selectors]


def _offered_under(devices: Mapping[str, DeviceInfo], address: str) -> str | None:
    """The ID under which ``devices`` offer the function ``address``: its own, or its group's."""
    if address in devices:
        return address
    for device_id, info in devices.items():
        if any(member.device.address == address for member in info.details.members):
            return device_id
    return None


def _group_problem(facts: PciFacts, device: PciDevice) -> str | None:
    """Why the function's IOMMU group keeps it from being offered, naming what blocks it."""
    group = passthrough_group(device)
    if group is None:
        return None
    members = [d for d in facts.devices.values() if d.iommu_group == group]
    blocking = blocking_functions(members)
    if len(members) < 2 or not blocking:
        return None
    named = ", ".join(f"{d.address} is bound to {d.driver}" for d in sorted(blocking, key=lambda d: d.address))
    return f"its IOMMU group {group} is not viable: {named} (every function of a group must be on vfio-pci, " \
        "pci-stub or no driver)"


def _placed_verdict(facts: PciFacts, device: PciDevice, pool: ConfiguredPool[PciPoolSpec], selector: int,
                    offered: Offered) -> PoolVerdict:
    admits = f"selectors[{selector}] admit it" if len(pool.spec.selectors) > 1 else "its selectors admit it"
    if (unusable := unusable_reason(device)) is not None:
        return PoolVerdict(pool.resource, LEFT_OUT, f"{admits}, but {unusable}")
    # a vfioOnDemand pool takes a group whole or not at all: the pool lists it, or says why not
    if not pool.spec.vfio_on_demand and (group := _group_problem(facts, device)) is not None:
        return PoolVerdict(pool.resource, LEFT_OUT, f"{admits}, but {group}")
    devices = offered.get(pool.resource, {})
    device_id = _offered_under(devices, device.address)
    if device_id is None:
        return PoolVerdict(pool.resource, LEFT_OUT, f"{admits}, but the pool does not list it yet")
    info = devices[device_id]
    functions = [record.device for record in info.details.functions]
    reasons = [r for f in functions if (r := unhealthy_reason(f, facts.links, pool.spec.check_health_on_pf,
                                                              facts.recovery))]
    reason = admits if device_id == device.address else \
        f"{admits}; offered with its IOMMU group {device.iommu_group} as {device_id}"
    return PoolVerdict(pool.resource, TOOK, reason, device_id, info.health, "; ".join(reasons))


def explain(facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]], name: str,
            offered: Offered) -> Explanation | None:
    device = find_function(facts, name)
    if device is None:
        return None
    ddp_profile = lru_cache(maxsize=None)(read_ddp_profile)
    judged = lent_as_at_home(device, facts.lent)  # as the build judges it: a lent function by its own driver

    def refusal(pool: ConfiguredPool[PciPoolSpec]) -> PoolVerdict | None:
        if judged is not device and not pool.spec.vfio_on_demand:
            return PoolVerdict(pool.resource, REFUSED, f"a DRA claim has it on vfio-pci (its own driver: "
                               f"{judged.driver or 'none'}): it stays in its vfioOnDemand pool")
        if (why := ineligibility(judged, pool.spec.device_type)) is not None:
            return PoolVerdict(pool.resource, REFUSED, why)
        return refused_by_selectors(pool.resource, _mismatches(judged, pool.spec, ddp_profile))

    def placed(pool: ConfiguredPool[PciPoolSpec]) -> PoolVerdict:
        return _placed_verdict(facts, device, pool, _mismatches(judged, pool.spec, ddp_profile).index(None), offered)

    return Explanation("pci", device.address, describe(device), first_pool_wins(pools, refusal, placed))


def _admits(device: PciDevice, pool: ConfiguredPool[PciPoolSpec], ddp_profile: Callable[[str], str | None],
            lent: bool = False) -> bool:
    """The build's own test (``_pools``' placer; ``device`` as it judges it, ``lent``: a DRA claim
    has it on vfio-pci): no reasons made, it runs for every function."""
    if lent and not pool.spec.vfio_on_demand:
        return False
    return ineligibility(device, pool.spec.device_type) is None and any(
        selector.refusing_key(device, ddp_profile) is None for selector in pool.spec.selectors)


def why_empty(facts: PciFacts, pools: Sequence[ConfiguredPool[PciPoolSpec]], resource: str) -> str:
    ddp_profile = lru_cache(maxsize=None)(read_ddp_profile)
    target = next(pool for pool in pools if pool.resource == resource)
    admitted = taken_earlier = 0
    for function in facts.devices.values():
        device, lent = lent_as_at_home(function, facts.lent), function.address in facts.lent
        if _admits(device, target, ddp_profile, lent):
            first = next(pool for pool in pools if _admits(device, pool, ddp_profile, lent))
            admitted, taken_earlier = (admitted + 1, taken_earlier) if first is target else \
                (admitted, taken_earlier + 1)
    seen = f"{len(facts.devices)} PCI functions on this host"
    if admitted == 0 and taken_earlier == 0:
        return f"no PCI function matches its selectors ({seen}; `devplugd explain ADDRESS` says what refuses one)"
    if admitted == 0:
        return f"the {taken_earlier} functions its selectors match were taken by earlier pools ({seen})"
    return f"the {admitted} functions it admits are left out (their IOMMU group is not viable, or they are " \
        "not usable through vfio: `devplugd explain ADDRESS` says why)"

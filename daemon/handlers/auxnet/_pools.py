"""From SF facts and pool configs to the devices of each resource, as the SR-IOV plugin assigns
them: each SF goes to the first pool and selector (in file order) that admits it.

Considered are the SFs whose own driver is bound (an unbound SF has no netdev and no RDMA
device to hand out: upstream still lists it, we do not) whose PF upstream would list them
under: a network function bound to a driver, with a netdev. The device ID is the auxiliary
device name; the NUMA node is the PF's. An SF is Unhealthy while its netdev's link is
administratively up without carrier.

What an SF contributes to Allocate is worked out here too: the device specs (its RDMA character
devices for an ``isRdma`` selector, ``/dev/vhost-net`` and ``/dev/net/tun`` for ``needVhostNet``
when both exist, as for a netDevice VF) and its ``_INFO`` entry (``generic``, ``rdma``, ``vhost``,
``extra``; the ``additionalInfo`` of ``"*"`` first, then of the PF's PCI address, which upstream
keys SFs by).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from daemon.core import HEALTHY, UNHEALTHY, ConfiguredPool, DeviceInfo, DeviceMap, DeviceSpec, Fault, carrier_lost
from daemon.handlers._sriov_allocation import extra_info, rdma_specs_and_info, vhost_net_specs_and_info

from ._discovery import AuxFacts, ParentPf, ScalableFunction
from ._selectors import AuxSelector


@dataclass(frozen=True)
class AuxPoolSpec:
    selectors: tuple[AuxSelector, ...]


@dataclass(frozen=True, slots=True)
class AuxDetails:
    """A pool device's record: the SF, its PF, and its ``_INFO`` entry (provider -> key -> value)."""

    sf: ScalableFunction
    pf: ParentPf
    info: Mapping[str, Mapping[str, str]]


def fault(sf: ScalableFunction, facts: AuxFacts) -> Fault | None:
    """Why the SF is Unhealthy (its link is up without carrier), or ``None``."""
    state = facts.links.get(sf.netdev) if sf.netdev is not None else None
    if state is None or not state.carrier_lost or sf.netdev is None:
        return None
    return carrier_lost(sf.netdev)


def unhealthy_reason(sf: ScalableFunction, facts: AuxFacts) -> str | None:
    """Why the SF is Unhealthy, in words, or ``None``."""
    found = fault(sf, facts)
    return found.reason if found is not None else None


def specs_and_info(sf: ScalableFunction, pf: ParentPf, selector: AuxSelector, facts: AuxFacts,
                   additional_info: Mapping[str, Mapping[str, str]] | None,
                   vhost_available: bool) -> tuple[tuple[DeviceSpec, ...], dict[str, dict[str, str]]]:
    specs: list[DeviceSpec] = []
    info: dict[str, dict[str, str]] = {"generic": {"deviceID": sf.name}}
    if additional_info is not None:
        info["extra"] = extra_info(additional_info, pf.address)  # upstream keys SFs by their PF
    if selector.is_rdma and sf.rdma_devices:
        rdma_specs, info["rdma"] = rdma_specs_and_info(sf.rdma_devices, dict(sf.rdma_char_devices))
        specs.extend(rdma_specs)
    vhost_specs, vhost_info = vhost_net_specs_and_info(selector.need_vhost_net, vhost_available)
    specs.extend(vhost_specs)
    info.update(vhost_info)
    return tuple(specs), info


def build_pools(facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]],
                vhost_available: bool) -> dict[str, DeviceMap]:
    """The devices of each pool; ``vhost_available``: both ``/dev/vhost-net`` and ``/dev/net/tun``
    are there (``needVhostNet`` hands out both or neither)."""
    devices: dict[str, dict[str, DeviceInfo]] = {pool.resource: {} for pool in pools}
    for name, sf in sorted(facts.sfs.items()):
        pf = facts.pfs.get(sf.pf_address)
        if pf is None or sf.driver is None or not pf.offers_sfs:
            continue
        placed = _place(sf, pf, pools)
        if placed is None:
            continue
        pool, selector = placed
        specs, info = specs_and_info(sf, pf, selector, facts, pool.entry.additional_info, vhost_available)
        numa = pf.numa_node
        found = fault(sf, facts)
        devices[pool.resource][name] = DeviceInfo(
            health=HEALTHY if found is None else UNHEALTHY,
            fault=found,
            numa_nodes=(numa,) if numa is not None and not pool.entry.exclude_topology else (),
            specs=specs,
            details=AuxDetails(sf, pf, info),
        )
    return dict(devices)


def _place(sf: ScalableFunction, pf: ParentPf, pools: Sequence[ConfiguredPool[AuxPoolSpec]],
           ) -> tuple[ConfiguredPool[AuxPoolSpec], AuxSelector] | None:
    for pool in pools:
        for selector in pool.spec.selectors:
            if selector.matches(sf, pf):
                return pool, selector
    return None

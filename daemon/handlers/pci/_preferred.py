"""GetPreferredAllocation for PCI pools: which of the offered devices a container should get.

The kubelet calls with one request (section 3.7 of the kubelet API notes): ``available`` (the
candidates, which include the devices it has already chosen), ``must_include`` (those chosen
devices) and ``size`` (the container's whole request). It keeps only the answer's IDs that are
candidates and fills any shortfall itself, so the answer should be complete and valid.

Vocabulary. A device's *group* is its PF: a VF's group is its ``pf_address``; a device that is
not a VF is a group of its own. A group's NUMA node is that of its first free device (all
functions of a PF sit on the same node); ``None`` (unknown) is a bucket of its own, ranked after
every known node. The *free* devices of a group are its candidates not already in the answer,
taken in VF-index order (then PCI address order). Ties between groups are broken by PCI address
order of the group key, between nodes by node id. IDs offered but absent from ``devices`` (the
pool changed since the kubelet's view) are still candidates, but are used only after every
known device, in PCI address order.

Every answer:

* starts with the must-include IDs that are offered, in their given order, without duplicates;
* has no duplicates and only offered IDs;
* has ``min(size, number of distinct offered IDs)`` IDs, or exactly the must-include IDs when
  those already reach ``size`` (the kubelet requires them all);
* depends on the offered IDs as a set, not on their order.

``packed`` (keep whole PFs, then whole NUMA nodes, free for later requests):

1. Fill the groups holding must-include devices: more must-include devices first, then fewer
   free devices.
2. Then, per NUMA node of the must-include devices (more must-include devices first), *fill*
   the node's other groups.
3. Then, for the other known nodes, repeatedly: if one group can supply everything still
   needed, take it from the group with the fewest free devices that suffices (best fit, across
   all these nodes); otherwise *fill* one node: the node with the fewest free devices that
   suffices, else the node with the most free devices.
4. Then *fill* the groups with an unknown NUMA node; then the unknown IDs.

To *fill* a set of groups: while something is needed, if one group suffices take it from the
best-fitting group (fewest free devices that suffice); otherwise take every free device of the
group with the most free devices (touching as few PFs as possible) and repeat.

``spread`` (balance the container across PFs): take one device at a time from the group that
has given this answer the fewest devices so far, must-include devices counted. Ties go to a
group on a must-include device's NUMA node, then a group with a known node, then the group with
the most free devices at the start, then PCI address order. The unknown IDs come last.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ._facts import PciDevice

PACKED = "packed"
SPREAD = "spread"
POLICIES = (PACKED, SPREAD)

_AddressKey = tuple[int, int, int, int, int, str]


def _address_key(address: str) -> _AddressKey:
    """Numeric PCI address order (domain, bus, device, function); malformed IDs sort after."""
    try:
        domain, bus, rest = address.split(":")
        slot, function = rest.split(".")
        return (0, int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16), address)
    except ValueError:
        return (1, 0, 0, 0, 0, address)


@dataclass(frozen=True, slots=True)
class _Group:
    key: str
    numa: int | None
    free: tuple[str, ...]  # candidates not yet in the answer, in take order
    must: int  # must-include devices in this group

    @property
    def order(self) -> _AddressKey:
        return _address_key(self.key)


def _group_key(device_id: str, device: PciDevice) -> str:
    return device.pf_address if device.pf_address is not None else device_id


def _groups(devices: Mapping[str, PciDevice], candidates: Iterable[str], must: Sequence[str]) -> list[_Group]:
    members: dict[str, list[tuple[str, PciDevice]]] = {}
    for device_id in candidates:
        device = devices[device_id]
        members.setdefault(_group_key(device_id, device), []).append((device_id, device))
    must_counts = Counter(_group_key(i, devices[i]) for i in must if i in devices)
    groups = []
    for key, pairs in members.items():
        pairs.sort(key=lambda pair: (pair[1].vf_index < 0, pair[1].vf_index, _address_key(pair[0])))
        free = tuple(device_id for device_id, _ in pairs)
        groups.append(_Group(key, pairs[0][1].numa_node, free, must_counts[key]))
    return sorted(groups, key=lambda g: g.order)


def _best_fit(groups: Iterable[_Group], need: int) -> _Group | None:
    fitting = [g for g in groups if len(g.free) >= need]
    return min(fitting, key=lambda g: (len(g.free), g.order)) if fitting else None


def _fill(groups: Sequence[_Group], need: int) -> list[str]:
    taken: list[str] = []
    left = list(groups)
    while need > len(taken) and left:
        still = need - len(taken)
        fit = _best_fit(left, still)
        if fit is not None:
            return taken + list(fit.free[:still])
        largest = min(left, key=lambda g: (-len(g.free), g.order))
        taken.extend(largest.free)
        left.remove(largest)
    return taken


def _packed(groups: list[_Group], must_nodes: Sequence[int], need: int) -> list[str]:
    taken: list[str] = []
    holding = sorted((g for g in groups if g.must), key=lambda g: (-g.must, len(g.free), g.order))
    for group in holding:
        taken.extend(group.free[: need - len(taken)])
    rest = [g for g in groups if not g.must]
    for node in must_nodes:
        taken.extend(_fill([g for g in rest if g.numa == node], need - len(taken)))
    nodes: dict[int, list[_Group]] = {}
    for group in rest:
        if group.numa is not None and group.numa not in must_nodes:
            nodes.setdefault(group.numa, []).append(group)
    while need > len(taken) and nodes:
        still = need - len(taken)
        fit = _best_fit((g for node_groups in nodes.values() for g in node_groups), still)
        if fit is not None:
            taken.extend(fit.free[:still])
            break
        sizes = {node: sum(len(g.free) for g in node_groups) for node, node_groups in nodes.items()}
        fitting = [node for node, free in sizes.items() if free >= still]
        node = min(fitting, key=lambda n: (sizes[n], n)) if fitting else min(sizes, key=lambda n: (-sizes[n], n))
        taken.extend(_fill(nodes.pop(node), still))
    taken.extend(_fill([g for g in rest if g.numa is None], need - len(taken)))
    return taken[:need]


def _spread(groups: list[_Group], must_nodes: Sequence[int], need: int) -> list[str]:
    rank = {g.key: (g.numa not in must_nodes, g.numa is None, -len(g.free), g.order) for g in groups}
    given = {g.key: g.must for g in groups}
    position = dict.fromkeys(rank, 0)
    taken: list[str] = []
    while len(taken) < need:
        open_groups = [g for g in groups if position[g.key] < len(g.free)]
        if not open_groups:
            break
        group = min(open_groups, key=lambda g: (given[g.key], rank[g.key]))
        taken.append(group.free[position[group.key]])
        position[group.key] += 1
        given[group.key] += 1
    return taken


def preferred_devices(
    policy: str,
    devices: Mapping[str, PciDevice],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """The IDs to prefer, by ``policy`` (``packed`` or ``spread``); see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"unknown allocationPolicy {policy!r}: expected one of {', '.join(POLICIES)}")
    offered = set(available)
    chosen = list(dict.fromkeys(i for i in must_include if i in offered))
    need = min(size, len(offered)) - len(chosen)
    if need <= 0:
        return chosen
    candidates = offered.difference(chosen)
    known = [i for i in candidates if i in devices]
    strangers = sorted(candidates.difference(known), key=_address_key)
    groups = _groups(devices, known, chosen)
    node_counts = Counter(devices[i].numa_node for i in chosen if i in devices)
    must_nodes = sorted((n for n in node_counts if n is not None), key=lambda n: (-node_counts[n], n))
    picked = (_packed if policy == PACKED else _spread)(groups, must_nodes, need)
    return chosen + picked + strangers[: need - len(picked)]

"""Why a device node is, or is not, in a devNode pool (``devplugd explain``), with the build's
rules: a node goes to the first pool (in file order) one of whose selectors takes it, by its
``paths`` and its ``udev`` properties.

A node is named by its ``/dev`` path or by a device ID of a devNode pool (``net_tun``,
``kvm-3``). A ``/dev`` path with no node behind it is still answered: which pools would take
it, and that the host does not have it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from daemon.core import (
    LEFT_OUT,
    TOOK,
    ConfiguredPool,
    Explanation,
    Mismatch,
    Offered,
    PoolVerdict,
    first_pool_wins,
    refused_by_selectors,
)
from daemon.handlers._devnodes import DEV_PREFIX

from ._nodes import NodeRecord
from ._selectors import NodeSelector

if TYPE_CHECKING:
    from . import DevNodePoolSpec

Facts = Mapping[str, NodeRecord]


def _relative_path(facts: Facts, pools: Sequence[ConfiguredPool[DevNodePoolSpec]], name: str,
                   offered: Offered) -> str | None:
    """The node ``name`` names, below /dev: a ``/dev`` path (whether or not it exists), or a
    device ID one of the pools offers."""
    if name.startswith(DEV_PREFIX):
        return name[len(DEV_PREFIX):].strip("/") or None
    for pool in pools:
        info = offered.get(pool.resource, {}).get(name)
        if info is not None and isinstance(info.details, NodeRecord):
            return info.details.relative_path
    return name if name in facts else None


def _refusal(selector: NodeSelector, relative: str, record: NodeRecord | None) -> Mismatch | None:
    if (refused := selector.path_mismatch(relative)) is not None:
        return refused
    if selector.udev is None or record is None:
        return None
    return selector.udev.mismatch(record.properties, record.ancestors)


def describe(relative: str, record: NodeRecord | None) -> str:
    if record is None:
        return f"no character or block device node {DEV_PREFIX}{relative} on this host"
    node = record.node
    parts = [f"{node.kind} device node {node.major}:{node.minor}"]
    if subsystem := record.properties.get("SUBSYSTEM"):
        parts.append(f"subsystem {subsystem}")
    if record.devpath:
        parts.append(f"device {record.devpath}")
    return ", ".join(parts)


def explain(facts: Facts, pools: Sequence[ConfiguredPool[DevNodePoolSpec]], name: str,
            offered: Offered) -> Explanation | None:
    relative = _relative_path(facts, pools, name.strip(), offered)
    if relative is None:
        return None
    record = facts.get(relative)

    def refusal(pool: ConfiguredPool[DevNodePoolSpec]) -> PoolVerdict | None:
        return refused_by_selectors(pool.resource, [_refusal(s, relative, record) for s in pool.spec.selectors])

    def placed(pool: ConfiguredPool[DevNodePoolSpec]) -> PoolVerdict:
        if record is None:
            return PoolVerdict(pool.resource, LEFT_OUT, f"its selectors would take {DEV_PREFIX}{relative}, but this "
                               "host has no such node (under --dev-root)")
        return _taken(pool.resource, record, offered)

    return Explanation("devnode", DEV_PREFIX + relative, describe(relative, record),
                       first_pool_wins(pools, refusal, placed))


def _taken(resource: str, record: NodeRecord, offered: Offered) -> PoolVerdict:
    ids = [i for i, info in offered.get(resource, {}).items() if info.details == record]  # in the build's order
    if not ids:
        return PoolVerdict(resource, LEFT_OUT, "its selectors take it, but the pool does not list it (its device "
                           "ID clashes with another node's, or the pool has not caught up)")
    shares = "" if len(ids) == 1 else f"; {len(ids)} shares, {ids[0]} … {ids[-1]}"
    return PoolVerdict(resource, TOOK, f"its selectors take it{shares}", ids[0], offered[resource][ids[0]].health)


def why_empty(facts: Facts, pools: Sequence[ConfiguredPool[DevNodePoolSpec]], resource: str) -> str:
    pool = next(p for p in pools if p.resource == resource)
    selectors = pool.spec.selectors
    globs = [DEV_PREFIX + "/".join(parts) for s in selectors for parts in (s.patterns or ())]
    matching = [r for r in facts if any(s.path_mismatch(r) is None for s in selectors)]
    if not matching:
        where = f" ({', '.join(globs)})" if globs else ""
        return f"this host has no device node its paths name{where}"
    return f"{len(matching)} nodes match its paths, but their udev properties do not match or an earlier pool " \
        f"took them (`devplugd explain {DEV_PREFIX}{matching[0]}` says which)"

"""Why a scalable function is, or is not, in an auxNetDevice pool (``devplugd explain``), with
the build's rules: an SF bound to a driver, on a PF that offers SFs, goes to the first pool and
selector (in file order) that admits it.

An SF is named by its auxiliary device name, which is its device ID (``mlx5_core.sf.4``), or by
its netdev.
"""

from __future__ import annotations

from collections.abc import Sequence

from daemon.core import (
    LEFT_OUT,
    TOOK,
    ConfiguredPool,
    Explanation,
    Offered,
    PoolVerdict,
    first_pool_wins,
    refused_by_selectors,
)

from ._discovery import AuxFacts, ScalableFunction
from ._pools import AuxPoolSpec, unhealthy_reason


def find_sf(facts: AuxFacts, name: str) -> ScalableFunction | None:
    wanted = name.strip()
    if wanted in facts.sfs:
        return facts.sfs[wanted]
    return next((sf for _, sf in sorted(facts.sfs.items()) if wanted in sf.netdevs), None)


def describe(sf: ScalableFunction) -> str:
    parts = [f"scalable function {sf.sfnum} of PF {sf.pf_address}", f"driver {sf.driver or 'none'}"]
    if sf.netdevs:
        parts.append(f"netdev {','.join(sf.netdevs)}")
    return ", ".join(parts)


def _unoffered(facts: AuxFacts, sf: ScalableFunction) -> str | None:
    pf = facts.pfs.get(sf.pf_address)
    if pf is None:
        return f"its PF {sf.pf_address} is not known"
    if sf.driver is None:
        return "it is bound to no driver"
    if not pf.offers_sfs:
        return f"its PF {pf.address} does not offer SFs (driver {pf.driver or 'none'})"
    return None


def explain(facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]], name: str,
            offered: Offered) -> Explanation | None:
    sf = find_sf(facts, name)
    if sf is None:
        return None
    pf = facts.pfs.get(sf.pf_address)

    def refusal(pool: ConfiguredPool[AuxPoolSpec]) -> PoolVerdict | None:
        if pf is None:
            return PoolVerdict(pool.resource, LEFT_OUT, f"its PF {sf.pf_address} is not known")
        return refused_by_selectors(pool.resource, [selector.mismatch(sf, pf) for selector in pool.spec.selectors])

    def placed(pool: ConfiguredPool[AuxPoolSpec]) -> PoolVerdict:
        if (unoffered := _unoffered(facts, sf)) is not None:
            return PoolVerdict(pool.resource, LEFT_OUT, f"its selectors admit it, but {unoffered}")
        info = offered.get(pool.resource, {}).get(sf.name)
        if info is None:
            return PoolVerdict(pool.resource, LEFT_OUT, "its selectors admit it, but the pool does not list it yet")
        return PoolVerdict(pool.resource, TOOK, "its selectors admit it", sf.name, info.health,
                           unhealthy_reason(sf, facts) or "")

    return Explanation("auxnet", sf.name, describe(sf), first_pool_wins(pools, refusal, placed))


def why_empty(facts: AuxFacts, pools: Sequence[ConfiguredPool[AuxPoolSpec]], resource: str) -> str:
    pool = next(p for p in pools if p.resource == resource)
    matching = [sf for sf in facts.sfs.values() if (pf := facts.pfs.get(sf.pf_address)) is not None
                and any(s.matches(sf, pf) for s in pool.spec.selectors)]
    if not matching:
        return f"no scalable function matches its selectors ({len(facts.sfs)} SFs on this host)"
    return f"{len(matching)} SFs match its selectors, but an earlier pool took them or they are not bound " \
        f"(`devplugd explain {matching[0].name}` says which)"

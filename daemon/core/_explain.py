"""Why a device is, or is not, in a pool: the answer behind ``devplugd explain``.

A handler that implements ``Explainer`` says what it knows of a device the user named (a PCI
address, a ``/dev`` path, a USB ID, a device ID) and, for each of its pools in config order,
whether the pool took it, the first selector key that refused it with the device's value, or why
it was left out (an earlier pool took it, its IOMMU group is not viable, it carries the default
route). The handlers answer with the functions their builds decide with, so the answer is the
build's own reason, not a second opinion; which pool offers the device, under which ID, comes
from what was built (``offered``), not from a second build.

``Explaining`` asks every handler that serves pools and says why a pool is empty; the host API
adds what the tree and the holdings know (the device's health, road and holder).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from ._config import ConfiguredPool, DaemonConfig
from ._tree import DeviceInfo

log = logging.getLogger("devplugd.core")

# What a pool did with the device
TOOK = "took"  # the pool offers it (under ``device_id``)
REFUSED = "refused"  # the pool's device type or every selector object refuses it
TAKEN_EARLIER = "taken earlier"  # an earlier pool admits it first: each device goes to one pool
LEFT_OUT = "left out"  # admitted, but not offered (e.g. its IOMMU group is not viable)
OTHER_KIND = "other kind"  # the pool takes another kind of device

Offered = Mapping[str, Mapping[str, DeviceInfo]]  # resource -> the devices it offers now


def wanted(values: Iterable[object]) -> str:
    """A selector's values as a refusal shows them: ``[vfio-pci, igb_uio]``."""
    return "[" + ", ".join(str(value) for value in values) + "]"


@dataclass(frozen=True)
class Mismatch:
    """The selector key that refused a device, what it wants and what the device has."""

    key: str
    wants: str
    has: str

    def __str__(self) -> str:
        return f"{self.key}: wants {self.wants}, device has {self.has}"


@dataclass(frozen=True)
class PoolVerdict:
    """What one pool did with the device, and why."""

    resource: str
    outcome: str  # TOOK, REFUSED, TAKEN_EARLIER, LEFT_OUT, OTHER_KIND
    reason: str
    device_id: str = ""  # TOOK: the device's ID in the pool
    health: str = ""  # TOOK: as the handler sees the device now
    health_reason: str = ""  # TOOK and not Healthy: why


@dataclass(frozen=True)
class Explanation:
    """One handler's answer: the device as it names it, what it knows of it, and a verdict for
    each of its pools in config order."""

    handler: str
    device: str
    description: str
    verdicts: tuple[PoolVerdict, ...]


@runtime_checkable
class Explainer(Protocol):
    """Optional: the handler can say why a device is or is not in its pools."""

    def explain(self, facts: Any, pools: Sequence[ConfiguredPool[Any]], device: str,
                offered: Offered) -> Explanation | None:
        """``None`` when ``device`` names none of the handler's devices."""

    def why_empty(self, facts: Any, pools: Sequence[ConfiguredPool[Any]], resource: str) -> str:
        """Why the pool ``resource`` (one of ``pools``, the handler's) offers no device on this
        host, in a sentence."""


def refused_by_selectors(resource: str, mismatches: Sequence[Mismatch | None]) -> PoolVerdict | None:
    """The verdict of a pool by what each of its selector objects says of the device (``None``:
    admits it): ``None`` when one admits it, else a refusal naming the first key that refused it
    in each (numbered when there are several objects)."""
    refusals = [m for m in mismatches if m is not None]
    if len(refusals) < len(mismatches):
        return None
    if len(refusals) == 1:
        return PoolVerdict(resource, REFUSED, str(refusals[0]))
    return PoolVerdict(resource, REFUSED, "; ".join(f"selectors[{i}]: {m}" for i, m in enumerate(refusals)))


PoolT = TypeVar("PoolT", bound=ConfiguredPool[Any])


def first_pool_wins(pools: Sequence[PoolT], refusal: Callable[[PoolT], PoolVerdict | None],
                    placed: Callable[[PoolT], PoolVerdict]) -> tuple[PoolVerdict, ...]:
    """The verdicts of ``pools`` in config order where a device goes to the first pool that
    admits it: ``refusal`` is a pool's own refusal (``None``: it admits the device), ``placed``
    the verdict of the pool that got it; a later pool that admits it too is told it came late."""
    verdicts = []
    taker = None
    for pool in pools:
        refused = refusal(pool)
        if refused is not None:
            verdicts.append(refused)
        elif taker is None:
            taker = pool.resource
            verdicts.append(placed(pool))
        else:
            verdicts.append(PoolVerdict(pool.resource, TAKEN_EARLIER, f"its selectors admit it too, but the earlier "
                                        f"pool {taker} admits it first (a device goes to the first pool that admits "
                                        "it)"))
    return tuple(verdicts)


class Explaining:
    """The handlers' explanations over the facts and config the daemon (or ``explain --config``)
    has now."""

    def __init__(self, handlers: Mapping[str, object], config: Callable[[], DaemonConfig],
                 facts_of: Callable[[str], object | None]) -> None:
        self._explainers = {name: h for name, h in handlers.items() if isinstance(h, Explainer)}
        self._config = config
        self._facts_of = facts_of

    @property
    def config(self) -> DaemonConfig:
        return self._config()

    def explain(self, device: str, offered: Offered) -> list[Explanation]:
        """Every handler's answer for ``device`` (usually one: the handler whose device it is)."""
        config = self._config()
        answers = []
        for name, explainer in self._explainers.items():
            pools = config.pools_of(name)
            facts = self._facts_of(name)
            if not pools or facts is None:
                continue
            try:
                answer = explainer.explain(facts, pools, device, offered)
            except Exception as error:
                log.exception("handler %s failed to explain %r", name, device)
                answer = Explanation(name, device, f"handler {name} failed to explain it: "
                                     f"{type(error).__name__}: {error}", ())
            if answer is not None:
                answers.append(answer)
        return answers

    def why_empty(self, resource: str) -> str | None:
        """Why the pool ``resource`` offers nothing, from its handler; ``None`` if it cannot say."""
        pool = next((p for p in self._config().pools if p.resource == resource), None)
        if pool is None:
            return None
        explainer = self._explainers.get(pool.handler)
        facts = self._facts_of(pool.handler)
        if explainer is None or facts is None:
            return None
        try:
            return explainer.why_empty(facts, self._config().pools_of(pool.handler), resource)
        except Exception:
            log.exception("handler %s failed to say why %s is empty", pool.handler, resource)
            return None

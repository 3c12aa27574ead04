"""``devplugd explain``: for each pool of the config in order, what it did with one device and
why, from the handlers' explanations (``daemon.core._explain``), with what the tree and the
holdings add for the pool that offers it: its ID, health, road and holder.

The daemon answers over the host API (``Explain``) from its facts, config and tree as they are;
``devplugd explain --config FILE`` answers the same question without a daemon, from a scan and
a build of its own (no tree: nothing is held, health is what the scan shows).
"""

from __future__ import annotations

from collections.abc import Mapping

from daemon._generated.devplugd.host.v1 import host_pb2 as host
from daemon.core import REFUSED, TOOK, DeviceMap, Explanation, PoolVerdict
from daemon.core._config import DaemonConfig
from daemon.core._explain import OTHER_KIND, Explaining, Offered
from daemon.core._handler import AnyHandler
from daemon.core._tree import DeviceTree
from daemon.holdings import HolderLookup

from ._messages import device_message, holder_text

GONE = "gone from the host while held: listed Unhealthy until its holder lets it go"


def explain_response(device: str, explaining: Explaining, tree: DeviceTree | None,
                     holder: HolderLookup | None = None, offered: Offered | None = None) -> host.ExplainResponse:
    """The answer for ``device``: ``tree`` and ``holder`` are the daemon's (``None`` without one,
    then ``offered`` is what a fresh build offers)."""
    if offered is None:
        offered = {resource: pool.devices for resource, pool in tree.pools.items()} if tree is not None else {}
    config = explaining.config
    explanations = explaining.explain(device, offered)
    verdicts = {v.resource: v for e in explanations for v in e.verdicts}
    response = host.ExplainResponse(device=device, known_as=[
        host.KnownDevice(handler=e.handler, device=e.device, description=e.description) for e in explanations])
    for pool in config.pools:
        verdict = verdicts.get(pool.resource) or _vanished(tree, pool.resource, device) \
            or PoolVerdict(pool.resource, OTHER_KIND, f"takes {pool.entry.device_type} devices, not this kind"
                           if explanations else f"knows no {pool.entry.device_type} device by that name")
        message = host.PoolVerdict(resource=pool.resource, device_type=pool.entry.device_type,
                                   outcome=verdict.outcome, reason=verdict.reason,
                                   health_reason=verdict.health_reason,
                                   allocation_api=pool.entry.allocation_api)
        if verdict.outcome == TOOK:
            _fill_taken(message, verdict, tree, holder)
        response.pools.append(message)
    response.summary = summary(device, explanations, response)
    return response


def _vanished(tree: DeviceTree | None, resource: str, device: str) -> PoolVerdict | None:
    """A device the handler no longer sees, kept listed because something holds it."""
    pool = tree.pools.get(resource) if tree is not None else None
    if pool is None or device not in pool.vanished:
        return None
    return PoolVerdict(resource, TOOK, GONE, device, pool.devices[device].health, GONE)


def _fill_taken(message: host.PoolVerdict, verdict: PoolVerdict, tree: DeviceTree | None,
                holder: HolderLookup | None) -> None:
    pool = tree.pools.get(verdict.resource) if tree is not None else None
    if pool is None or verdict.device_id not in pool.devices:
        message.device.CopyFrom(host.Device(id=verdict.device_id, health=verdict.health))
        return
    message.allocation_api = pool.road
    message.device.CopyFrom(device_message(pool, verdict.device_id,
                                           holder(pool, verdict.device_id) if holder is not None else None))


def summary(device: str, explanations: list[Explanation], response: host.ExplainResponse) -> str:
    """Where the device is offered and to whom, or why no pool offers it, in one sentence."""
    taken = [v for v in response.pools if v.outcome == TOOK]
    if taken:
        pool = taken[0]
        said = f"{pool.resource} offers it as {pool.device.id}, {pool.device.health}"
        if pool.health_reason:
            said += f" ({pool.health_reason})"
        if pool.device.holder:
            said += f", {holder_text(pool.device)}"
        return f"{said}, through {pool.allocation_api}"
    if not explanations:
        return (f"devplugd sees no device {device!r}: not a PCI address or netdev, /dev path, USB ID or port, "
                "nor a device ID of a pool, on this host")
    left_out = [v for v in response.pools if v.outcome not in (REFUSED, OTHER_KIND)]
    if left_out:
        return f"no pool offers it: {left_out[0].resource}: {left_out[0].reason}"
    return "no pool offers it: every pool refuses it (each pool's line says why)"


def offered_by_build(handlers: Mapping[str, AnyHandler], config: DaemonConfig,
                     facts: Mapping[str, object]) -> Offered:
    """What a fresh build of every handler with pools offers (``explain --config``)."""
    offered: dict[str, DeviceMap] = {}
    for name, handler in handlers.items():
        pools = config.pools_of(name)
        if pools and name in facts:
            offered.update(handler.build(facts[name], pools))
    return offered


def scan_for(handlers: Mapping[str, AnyHandler], config: DaemonConfig) -> dict[str, object]:
    """The facts of every handler that serves a pool of ``config``."""
    return {name: handler.scan() for name, handler in handlers.items() if config.pools_of(name)}


def explain_without_daemon(handlers: Mapping[str, AnyHandler], config: DaemonConfig,
                           device: str) -> host.ExplainResponse:
    facts = scan_for(handlers, config)
    offered = offered_by_build(handlers, config, facts)
    return explain_response(device, Explaining(handlers, lambda: config, facts.get), None, offered=offered)


"""A DRA pool's devices as the ResourceSlice objects (``resource.k8s.io/v1``) of one pool.

``slice_bodies`` cuts the ``devices[]`` entries (``_devices.slice_devices``) into the slices of
one pool generation; ``slice_updates`` says how the slices on the server come to hold new
entries without one. Both are pure: the publisher decides when to call them and what to send.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ._view import JsonObject, slice_index

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 128  # ResourceSliceMaxDevices
# ResourceSliceMaxDevicesWithAdvancedFeatures: a slice holding any taint or shared device
MAX_TAINTED_DEVICES_PER_SLICE = 64
# The API server makes a generated name from at most 58 characters of generateName and 5 random
# ones (k8s.io/apiserver names.SimpleNameGenerator): we cut generateName there ourselves.
GENERATE_NAME_MAX = 63 - 5
INDEX_MIN_DIGITS = 5  # resourceSliceIndexMinLength of the Go helper
MANAGED_BY: Mapping[str, str] = MappingProxyType({"app.kubernetes.io/managed-by": "devplugd"})  # our objects' label


def generate_name(index: int, slice_count: int, driver: str, node_name: str) -> str:
    """``<index in hex>-<driver>-<node>-``, as the Go helper names slices from v0.36: the index
    has as many hex digits as the pool's last index needs, at least 5, so the names sort in
    slice order; cut to the 58 characters the API server keeps of a generateName, and never
    ending in a ``.`` (the server checks the prefix less a trailing ``-`` as a DNS subdomain)."""
    digits = max(INDEX_MIN_DIGITS, len(f"{max(slice_count - 1, 0):x}"))
    return f"{index:0{digits}x}-{driver}-{node_name}-"[:GENERATE_NAME_MAX].rstrip(".")


def slice_bodies(
    *,
    driver: str,
    node_name: str,
    node_uid: str | None,
    pool_name: str,
    generation: int,
    devices: Sequence[Mapping[str, Any]],
    max_devices: int = MAX_DEVICES_PER_SLICE,
) -> list[dict[str, Any]]:
    """The ResourceSlices of one pool at ``generation``: ``devices`` in order, at most
    ``max_devices`` a slice, each slice saying how many there are; one slice with no devices
    for an empty pool ("an empty pool is different from no pool"). Owned by the Node (when its
    UID is known), so they go when the node goes."""
    if not 1 <= max_devices <= MAX_DEVICES_PER_SLICE:
        raise ValueError(f"max_devices must be 1-{MAX_DEVICES_PER_SLICE}, not {max_devices}")
    if generation < 0:
        raise ValueError(f"generation must not be negative, not {generation}")
    chunks = [list(devices[start:start + max_devices]) for start in range(0, len(devices), max_devices)] or [[]]
    return [slice_body(driver=driver, node_name=node_name, node_uid=node_uid, pool_name=pool_name,
                       generation=generation, index=index, count=len(chunks), devices=chunk)
            for index, chunk in enumerate(chunks)]


def slice_body(
    *,
    driver: str,
    node_name: str,
    node_uid: str | None,
    pool_name: str,
    generation: int,
    index: int,
    count: int,
    devices: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Slice ``index`` of the ``count`` slices of one pool at ``generation``, holding ``devices``."""
    metadata: dict[str, Any] = {
        "generateName": generate_name(index, count, driver, node_name),
        "labels": dict(MANAGED_BY),
    }
    if node_uid is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True},
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": pool_name, "generation": generation, "resourceSliceCount": count},
            "devices": list(devices),
        },
    }


def slice_updates(
    existing: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]],
    max_devices: int = MAX_DEVICES_PER_SLICE, held: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, list[Mapping[str, Any]]] | None:
    """How the pool's slices on the server (``existing``) come to publish ``devices`` without a
    new generation: the new device list of each slice that changes, by slice name (``{}``: they
    publish it already). A device stays in the slice it is in (its entry replaced, a taint or an
    attribute changed), a device gone leaves its slice, a new one goes to the first slice with
    room. No device ever moves between slices, so every state the writes pass through is a
    complete pool without a duplicate, whichever slice lands first.

    ``None`` when it takes a new generation: no slices, slices of several generations or fewer
    than their ``resourceSliceCount`` (an incomplete pool), a device name in two slices or twice
    in ``devices``, a slice over ``max_devices`` (the cap went down), no room for a new device,
    or a slice of a pool of several left empty.

    ``held``: each slice's devices as the caller knows them to be there (the entries it wrote,
    by slice name), compared instead of the server's copies: an entry that did not change is
    the same object, so comparing costs nothing for it."""
    if not existing:
        return None
    pools = {(s["spec"]["pool"].get("generation"), s["spec"]["pool"].get("resourceSliceCount")) for s in existing}
    if len(pools) != 1 or next(iter(pools))[1] != len(existing):
        return None
    wanted = {device["name"]: device for device in devices}
    if len(wanted) != len(devices):
        return None
    current: dict[str, list[Mapping[str, Any]]] = {}
    placed: set[str] = set()
    for item in existing:
        name = item["metadata"]["name"]
        on_server = list(held[name]) if held is not None and name in held else item["spec"].get("devices") or []
        if len(on_server) > max_devices:
            return None
        for device in on_server:
            if device["name"] in placed:
                return None
            placed.add(device["name"])
        current[name] = on_server
    lists = {name: [wanted[d["name"]] for d in on_server if d["name"] in wanted] for name, on_server in current.items()}
    for device in devices:
        if device["name"] in placed:
            continue
        room = next((name for name, kept in lists.items() if len(kept) < max_devices), None)
        if room is None:
            return None
        lists[room].append(device)
    if len(lists) > 1 and any(not kept for kept in lists.values()):
        return None
    return {name: kept for name, kept in lists.items() if kept != current[name]}


def replacements(previous: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]],
                 held: Mapping[str, Sequence[Mapping[str, Any]]],
                 where: Mapping[str, str]) -> dict[str, list[Mapping[str, Any]]] | None:
    """``slice_updates``' answer without looking at every device, for the change a taint or an
    attribute makes: ``devices`` are ``previous`` (what the slices ``held`` publish) with some
    entries replaced by entries of the same name, each in the slice ``where`` says. ``None``
    when the change is any other (a device added, gone, moved): ask ``slice_updates``."""
    if len(previous) != len(devices):
        return None
    updates: dict[str, list[Mapping[str, Any]]] = {}
    for old, new in zip(previous, devices):
        if old is new:
            continue
        name = new["name"]
        if old["name"] != name or (slice_name := where.get(name)) is None:
            return None
        kept = updates.get(slice_name)
        if kept is None:
            kept = updates[slice_name] = list(held[slice_name])
        position = next((i for i, entry in enumerate(kept) if entry["name"] == name), None)
        if position is None:
            return None
        kept[position] = new
    return {slice_name: kept for slice_name, kept in updates.items() if kept != held[slice_name]}


def placed(existing: Sequence[JsonObject], bodies: Sequence[JsonObject],
           ) -> tuple[list[tuple[JsonObject, JsonObject | None]], list[JsonObject]]:
    """A new generation's ``bodies``, each with the slice it goes into (``None``: a new one): the
    one whose name has its index, so the names keep sorting in slice order (the allocator's);
    and the slices it does not need, to delete once it is complete."""
    into: dict[int, JsonObject] = {}
    obsolete = []
    for item in existing:
        index = slice_index(item["metadata"]["name"])
        if index is None or index >= len(bodies) or index in into:
            obsolete.append(item)
        else:
            into[index] = item
    return [(body, into.get(index)) for index, body in enumerate(bodies)], obsolete

"""What a device of the SR-IOV plugin's pools adds to an Allocate answer, byte for byte as upstream
writes it, for netDevice and accelerator functions (the pci handler) and auxNetDevice SFs (the
auxnet handler) alike:

* ``PCIDEVICE_<PREFIX>_<NAME>`` (only ``.`` replaced by ``_``, then upper-cased) = the IDs in
  request order, and ``..._INFO`` = ``{id: {provider: {key: value}}}`` as Go's json.Marshal
  writes it;
* the providers of ``_INFO`` that do not depend on the kind of device, with their device specs:
  ``extra`` (``additionalInfo``), ``rdma`` (an ``isRdma`` selector: the RDMA character devices)
  and ``vhost`` (a ``needVhostNet`` selector: ``/dev/vhost-net`` and ``/dev/net/tun``, both or
  neither).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from daemon.core import DeviceSpec, device_list_env_name

VHOST_NET = "/dev/vhost-net"
NET_TUN = "/dev/net/tun"
VHOST_NET_SPECS = (DeviceSpec(VHOST_NET, VHOST_NET), DeviceSpec(NET_TUN, NET_TUN))
VHOST_NET_INFO: Mapping[str, str] = MappingProxyType({"net-mount": VHOST_NET, "tun-mount": NET_TUN})

# Encoders are immutable once made; json.dumps with options would make one per call (every Allocate).
_GO_MAP_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def go_json(value: Any) -> str:
    """JSON as Go's encoding/json.Marshal writes a map: sorted keys, compact, HTML-escaped."""
    text = _GO_MAP_ENCODER.encode(value)
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def env_name(prefix: str, resource_name: str) -> str:
    """``PCIDEVICE_<prefix>_<name>``."""
    return device_list_env_name("PCIDEVICE", prefix, resource_name)


class HasInfo(Protocol):
    """A device record carrying its ``_INFO`` entry (a PCI function's, an SF's)."""

    @property
    def info(self) -> Mapping[str, Mapping[str, str]]: ...


class AllocationEnvs:
    """``PCIDEVICE_<PREFIX>_<NAME>`` (the IDs in request order) and its ``_INFO``, for one handler.

    Each device's entry of ``_INFO`` is encoded once and kept while its record is the same
    object (a tree keeps an unchanged device's record): an Allocate joins the kept entries in
    key order, as Go writes a map, instead of encoding them again."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[HasInfo, str]] = {}  # device ID -> (its record, "ID":{...})

    def envs(self, prefix: str, resource_name: str, device_ids: Sequence[str],
             details: Mapping[str, HasInfo]) -> dict[str, str]:
        key = env_name(prefix, resource_name)
        entries = ",".join(self._entry(device_id, details[device_id]) for device_id in sorted(device_ids))
        return {key: ",".join(device_ids), f"{key}_INFO": f"{{{entries}}}"}

    def _entry(self, device_id: str, record: HasInfo) -> str:
        known = self._entries.get(device_id)
        if known is not None and known[0] is record:
            return known[1]
        entry = go_json({device_id: record.info})[1:-1]
        self._entries[device_id] = (record, entry)
        return entry


def extra_info(additional_info: Mapping[str, Mapping[str, str]], key: str) -> dict[str, str]:
    """The ``extra`` provider of ``_INFO``: ``additionalInfo``'s ``"*"``, then ``key``'s over it."""
    extra: dict[str, str] = {}
    for each in ("*", key):
        extra.update(additional_info.get(each, {}))
    return extra


def rdma_specs_and_info(
    rdma_devices: Sequence[str], rdma_char_devices: Mapping[str, tuple[str, ...]]
) -> tuple[list[DeviceSpec], dict[str, str]]:
    """The character devices of ``rdma_devices`` as specs, and the ``rdma`` provider of ``_INFO``
    (``uverbs``, ``umad``, ``issm``, ``rdma_cm``: the last of each kind; ``rdma_dev``: the first)."""
    specs: list[DeviceSpec] = []
    rdma: dict[str, str] = {}
    for rdma_name in rdma_devices:
        for path in rdma_char_devices.get(rdma_name, ()):
            specs.append(DeviceSpec(path, path))
            for key in ("uverbs", "umad", "issm", "rdma_cm"):
                if key in path:
                    rdma[key] = path
                    break
    rdma["rdma_dev"] = rdma_devices[0]
    return specs, rdma


def vhost_net_available(dev_root: str) -> bool:
    """Whether ``/dev/vhost-net`` and ``/dev/net/tun`` are both there (upstream drops both specs
    when either is missing)."""
    return os.path.exists(f"{dev_root}/vhost-net") and os.path.exists(f"{dev_root}/net/tun")


def vhost_net_specs_and_info(
    need_vhost_net: bool, available: bool
) -> tuple[tuple[DeviceSpec, ...], dict[str, dict[str, str]]]:
    """What ``needVhostNet`` adds to a device's answer: both nodes as specs and the ``vhost``
    provider of ``_INFO`` (``net-mount``, ``tun-mount``) when the selector that admitted the
    device sets it and both nodes are there (``available``); nothing otherwise."""
    if not (need_vhost_net and available):
        return (), {}
    return VHOST_NET_SPECS, {"vhost": dict(VHOST_NET_INFO)}

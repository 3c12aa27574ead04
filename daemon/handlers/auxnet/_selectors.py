"""Selectors of the SR-IOV plugin's ``auxNetDevice`` pools, parsed and matched as upstream does
(``pkg/auxnetdevice/auxNetDeviceProvider.go``, ``pkg/resources/deviceSelectors.go``).

``{"auxTypes": ["sf"], "vendors": ["15b3"], "devices": ["101d"], "drivers": ["mlx5_core"],
"pfNames": ["enp3s0f0np0#0-7"], "rootDevices": ["0000:03:00.0#8"], "linkTypes": ["ether"],
"isRdma": true, "needVhostNet": true}``: fields combine with AND, values inside one list with OR,
an empty list does not filter. ``vendors``, ``devices`` and ``drivers`` are those of the SF's
parent PCI PF; ``auxTypes`` is required and may hold only ``"sf"`` (the middle part of the
auxiliary name ``mlx5_core.sf.4``), as upstream's ``ValidConfig`` demands; ``pfNames`` (the PF's
uplink representor) and ``rootDevices`` (the PF's address) take ``#`` ranges over the SF's
``sfnum`` (``daemon.handlers._sriov_selectors``); ``linkTypes`` is the SF netdev's link type (its
PF's when it has none); ``isRdma`` keeps SFs with an RDMA device and hands out its character
devices; ``needVhostNet`` (not a filter) adds ``/dev/vhost-net`` and ``/dev/net/tun``, as for a
netDevice (upstream's generic net selectors have it, shared by both types). Other keys are
ignored, as upstream ignores them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from daemon.core import ConfigError, ConfigObject, Mismatch, wanted
from daemon.handlers._sriov_selectors import pf_selected, warn_entry_problems

from ._discovery import SF_TYPE, ParentPf, ScalableFunction

log = logging.getLogger("devplugd.auxnet")

AUX_TYPES = (SF_TYPE,)


@dataclass(frozen=True)
class AuxSelector:
    """One selector object of a pool; its flags apply to the SFs it admitted."""

    json_path: str
    aux_types: tuple[str, ...]
    vendors: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    pf_names: tuple[str, ...] = ()
    root_devices: tuple[str, ...] = ()
    link_types: tuple[str, ...] = ()
    is_rdma: bool = False
    need_vhost_net: bool = False

    def matches(self, sf: ScalableFunction, pf: ParentPf) -> bool:
        return self.mismatch(sf, pf) is None

    def mismatch(self, sf: ScalableFunction, pf: ParentPf) -> Mismatch | None:
        """The first key that refuses the SF, what it wants and what the SF (or its PF: vendors,
        devices, drivers are the PF's, as upstream) has; ``None``: it matches."""
        if self.vendors and pf.vendor not in self.vendors:
            return Mismatch("vendors", wanted(self.vendors), f"{pf.vendor} (its PF's)")
        if self.devices and pf.device not in self.devices:
            return Mismatch("devices", wanted(self.devices), f"{pf.device} (its PF's)")
        if self.drivers and pf.driver not in self.drivers:
            return Mismatch("drivers", wanted(self.drivers), f"{pf.driver or 'no driver'} (its PF's)")
        if sf.aux_type not in self.aux_types:
            return Mismatch("auxTypes", wanted(self.aux_types), sf.aux_type)
        if self.pf_names and not pf_selected(self.pf_names, pf.name, sf.sfnum):
            return Mismatch("pfNames", wanted(self.pf_names), f"sfnum {sf.sfnum} of {pf.name or pf.address}")
        if self.root_devices and not pf_selected(self.root_devices, pf.address, sf.sfnum):
            return Mismatch("rootDevices", wanted(self.root_devices), f"sfnum {sf.sfnum} of {pf.address}")
        if self.link_types and sf.link_type(pf) not in self.link_types:
            return Mismatch("linkTypes", wanted(self.link_types), sf.link_type(pf) or "none")
        if self.is_rdma and not sf.rdma_devices:
            return Mismatch("isRdma", "an RDMA device", "none")
        return None


def parse_aux_types(selector: ConfigObject) -> tuple[str, ...]:
    aux_types = selector.string_list("auxTypes")
    if not aux_types:
        raise ConfigError(selector.path_of("auxTypes"),
                          'is required in an auxNetDevice selector: ["sf"] (scalable functions, the only '
                          "auxiliary devices supported, as upstream)")
    for position, aux_type in enumerate(aux_types):
        if aux_type not in AUX_TYPES:
            raise ConfigError(f"{selector.path_of('auxTypes')}[{position}]",
                              f'{aux_type!r} is not a supported auxiliary device type: only "sf" '
                              "(scalable functions) is, as upstream")
    return aux_types


def parse_selector(selector: ConfigObject) -> AuxSelector:
    parsed = AuxSelector(
        json_path=selector.json_path,
        aux_types=parse_aux_types(selector),
        vendors=selector.string_list("vendors"),
        devices=selector.string_list("devices"),
        drivers=selector.string_list("drivers"),
        pf_names=selector.string_list("pfNames"),
        root_devices=selector.string_list("rootDevices"),
        link_types=selector.string_list("linkTypes"),
        is_rdma=selector.get("isRdma", bool, False),
        need_vhost_net=selector.get("needVhostNet", bool, False),
    )
    if len(parsed.link_types) > 1:
        log.warning("%s: more than one link type given", selector.path_of("linkTypes"))
    warn_entry_problems(log, selector, parsed.pf_names, parsed.root_devices)
    return parsed

"""Selectors of the SR-IOV plugin's ``netDevice`` and ``accelerator`` pools, parsed and matched
exactly as upstream does (``pkg/resources/deviceSelectors.go``), and of our ``pciDevice`` pools
(any PCI function handed whole to a VM or a vfio workload).

Fields combine with AND, values inside one list with OR; an empty list does not filter.
``pfNames``/``rootDevices`` entries (``<PF netdev|PF address>[#<indices>]``) are matched as
``daemon.handlers._sriov_selectors`` says, over the VF index.

``pKeys`` (netDevice) are InfiniBand default partition keys, compared as 16-bit numbers (``"0x1"``
matches the kernel's ``0x0001``, where upstream compares the strings); they match only functions
with an InfiniBand link. ``vdpaType`` (``virtio`` or ``vhost``) keeps only VFs whose vDPA device
is bound to that vDPA bus driver; one selector object cannot have it with ``isRdma``.

``pciDevice`` selectors take ``classes`` (hex prefixes of the 6-digit class code: ``"0108"`` NVMe,
``"12"`` accelerators), ``vendors``, ``devices``, ``drivers``, ``pciAddresses``, ``pfNames`` and
``rootDevices``; a PF without a netdev is named in ``pfNames`` by its PCI address. Without
``drivers`` only functions bound to ``vfio-pci`` are offered: a device still owned by its host
driver is not ready to be handed out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from daemon.core import ConfigError, ConfigObject
from daemon.handlers._sriov_selectors import pf_selected, warn_entry_problems

from ._facts import PciDevice

log = logging.getLogger("devplugd.pci")

NET_DEVICE = "netDevice"
ACCELERATOR = "accelerator"
PCI_DEVICE = "pciDevice"
PCI_DEVICE_DEFAULT_DRIVERS = ("vfio-pci",)
CLASS_CODE_DIGITS = 6
VDPA_TYPES = ("virtio", "vhost")
INFINIBAND = "infiniband"


@dataclass(frozen=True)
class PciSelector:
    """One selector object of a pool. Flags (``is_rdma``, ``need_vhost_net``) apply to the devices
    this object admitted."""

    json_path: str
    vendors: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    pci_addresses: tuple[str, ...] = ()
    acpi_indexes: tuple[str, ...] = ()
    pf_names: tuple[str, ...] = ()
    root_devices: tuple[str, ...] = ()
    link_types: tuple[str, ...] = ()
    ddp_profiles: tuple[str, ...] = ()
    pkeys: frozenset[int] = frozenset()
    vdpa_type: str | None = None
    classes: tuple[str, ...] = ()
    is_rdma: bool = False
    need_vhost_net: bool = False
    # pciDevice: a PF without a netdev is named in pfNames by its PCI address
    pf_named_by_address: bool = False

    def matches(self, device: PciDevice, ddp_profile: Callable[[str], str | None]) -> bool:
        if self.vendors and device.vendor not in self.vendors:
            return False
        if self.devices and device.device not in self.devices:
            return False
        if self.drivers and device.driver not in self.drivers:
            return False
        if self.pci_addresses and device.address not in self.pci_addresses:
            return False
        if self.acpi_indexes and device.acpi_index not in self.acpi_indexes:
            return False
        if self.classes and not device.class_code.startswith(self.classes):
            return False
        if self.pf_names:
            pf_name = device.pf_netdev or (device.pf_address if self.pf_named_by_address else None)
            if not pf_selected(self.pf_names, pf_name, device.vf_index):
                return False
        if self.root_devices and not pf_selected(self.root_devices, device.pf_address, device.vf_index):
            return False
        if self.link_types and device.link_type not in self.link_types:
            return False
        if self.ddp_profiles and ddp_profile(device.address) not in self.ddp_profiles:
            return False
        if self.pkeys and (device.link_type != INFINIBAND or device.pkey not in self.pkeys):
            return False
        if self.is_rdma and not device.rdma_devices:
            return False
        if self.vdpa_type is not None and (device.vdpa is None or device.vdpa.vdpa_type != self.vdpa_type):
            return False
        return True


class _CommonFields(TypedDict):
    """The ``PciSelector`` fields every device type reads."""

    json_path: str
    vendors: tuple[str, ...]
    devices: tuple[str, ...]
    drivers: tuple[str, ...]
    pci_addresses: tuple[str, ...]


def parse_selector(selector: ConfigObject, device_type: str) -> PciSelector:
    """Read one selector object; fields that ``device_type`` does not use are ignored, as upstream."""
    common: _CommonFields = {
        "json_path": selector.json_path,
        "vendors": selector.string_list("vendors"),
        "devices": selector.string_list("devices"),
        "drivers": selector.string_list("drivers"),
        "pci_addresses": selector.string_list("pciAddresses"),
    }
    if device_type == PCI_DEVICE:
        pci_common: _CommonFields = {**common, "drivers": common["drivers"] or PCI_DEVICE_DEFAULT_DRIVERS}
        parsed = PciSelector(
            **pci_common,
            classes=parse_classes(selector),
            pf_names=selector.string_list("pfNames"),
            root_devices=selector.string_list("rootDevices"),
            pf_named_by_address=True,
        )
    elif device_type == NET_DEVICE:
        parsed = PciSelector(
            **common,
            acpi_indexes=selector.string_list("acpiIndexes"),
            pf_names=selector.string_list("pfNames"),
            root_devices=selector.string_list("rootDevices"),
            link_types=selector.string_list("linkTypes"),
            ddp_profiles=selector.string_list("ddpProfiles"),
            pkeys=parse_pkeys(selector),
            vdpa_type=parse_vdpa_type(selector),
            is_rdma=selector.get("isRdma", bool, False),
            need_vhost_net=selector.get("needVhostNet", bool, False),
        )
        if parsed.is_rdma and parsed.vdpa_type is not None:
            raise ConfigError(selector.path_of("vdpaType"),
                              "cannot be set in a selector object that also sets isRdma (as upstream refuses it); "
                              "put them in two selector objects")
        if len(parsed.link_types) > 1:
            log.warning("%s: more than one link type given", selector.path_of("linkTypes"))
    else:
        return PciSelector(**common)
    warn_entry_problems(log, selector, parsed.pf_names, parsed.root_devices)
    return parsed


def parse_classes(selector: ConfigObject) -> tuple[str, ...]:
    """``classes``: hex prefixes (an optional ``0x``, 1 to 6 digits) of the class code, lower-cased
    as sysfs's ``class`` file is read; anything else is a ConfigError naming the entry."""
    prefixes = []
    for position, text in enumerate(selector.string_list("classes")):
        digits = text[2:] if text[:2].lower() == "0x" else text
        if not digits or len(digits) > CLASS_CODE_DIGITS or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise ConfigError(
                f"{selector.path_of('classes')}[{position}]",
                f"{text!r} is not a class code prefix (1 to {CLASS_CODE_DIGITS} hex digits, e.g. \"0108\" for NVMe)",
            )
        prefixes.append(digits.lower())
    return tuple(prefixes)


def parse_pkeys(selector: ConfigObject) -> frozenset[int]:
    """``pKeys``: 16-bit hex numbers (an optional ``0x``, 1 to 4 digits); anything else is a
    ConfigError naming the entry."""
    keys = set()
    for position, text in enumerate(selector.string_list("pKeys")):
        digits = text[2:] if text[:2].lower() == "0x" else text
        if not 1 <= len(digits) <= 4 or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise ConfigError(f"{selector.path_of('pKeys')}[{position}]",
                              f"{text!r} is not a partition key (a 16-bit hex number, e.g. \"0x7fff\")")
        keys.add(int(digits, 16))
    return frozenset(keys)


def parse_vdpa_type(selector: ConfigObject) -> str | None:
    value = selector.get("vdpaType", str, "") or None
    if value is not None and value not in VDPA_TYPES:
        raise ConfigError(selector.path_of("vdpaType"),
                          f"unknown vDPA type {value!r} (expected one of: {', '.join(VDPA_TYPES)})")
    return value

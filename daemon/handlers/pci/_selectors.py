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

from daemon.core import ConfigError, ConfigObject, Mismatch, wanted
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
        return self.refusing_key(device, ddp_profile) is None

    def refusing_key(self, device: PciDevice, ddp_profile: Callable[[str], str | None]) -> str | None:
        """The first key that refuses ``device`` (its config name), or ``None``: it matches."""
        if self.vendors and device.vendor not in self.vendors:
            return "vendors"
        if self.devices and device.device not in self.devices:
            return "devices"
        if self.drivers and device.driver not in self.drivers:
            return "drivers"
        if self.pci_addresses and device.address not in self.pci_addresses:
            return "pciAddresses"
        if self.acpi_indexes and device.acpi_index not in self.acpi_indexes:
            return "acpiIndexes"
        if self.classes and not device.class_code.startswith(self.classes):
            return "classes"
        if self.pf_names and not pf_selected(self.pf_names, self._pf_name(device), device.vf_index):
            return "pfNames"
        if self.root_devices and not pf_selected(self.root_devices, device.pf_address, device.vf_index):
            return "rootDevices"
        if self.link_types and device.link_type not in self.link_types:
            return "linkTypes"
        if self.ddp_profiles and ddp_profile(device.address) not in self.ddp_profiles:
            return "ddpProfiles"
        if self.pkeys and (device.link_type != INFINIBAND or device.pkey not in self.pkeys):
            return "pKeys"
        if self.is_rdma and not device.rdma_devices:
            return "isRdma"
        if self.vdpa_type is not None and (device.vdpa is None or device.vdpa.vdpa_type != self.vdpa_type):
            return "vdpaType"
        return None

    def _pf_name(self, device: PciDevice) -> str | None:
        return device.pf_netdev or (device.pf_address if self.pf_named_by_address else None)

    def mismatch(self, device: PciDevice, ddp_profile: Callable[[str], str | None]) -> Mismatch | None:
        """What refuses ``device``: the key, what it wants, what the device has (for ``explain``)."""
        key = self.refusing_key(device, ddp_profile)
        if key is None:
            return None
        return Mismatch(key, *self._wants_and_has(key, device, ddp_profile))

    def _wants_and_has(self, key: str, device: PciDevice,
                       ddp_profile: Callable[[str], str | None]) -> tuple[str, str]:
        vf = f"VF {device.vf_index} of " if device.pf_address else ""
        if key in ("pfNames", "rootDevices"):
            pf = self._pf_name(device) if key == "pfNames" else device.pf_address
            return wanted(self.pf_names if key == "pfNames" else self.root_devices), \
                f"{vf}{pf}" if pf else "no PF (not a VF)"
        if key == "ddpProfiles":
            return wanted(self.ddp_profiles), ddp_profile(device.address) or "none"
        if key == "pKeys":
            has_pkey = device.link_type == INFINIBAND and device.pkey is not None
            return wanted(f"0x{pkey:04x}" for pkey in sorted(self.pkeys)), \
                f"pkey 0x{device.pkey:04x}" if has_pkey else f"link type {device.link_type or 'none'}"
        if key == "isRdma":
            return "an RDMA device", "none"
        if key == "vdpaType":
            vdpa = device.vdpa
            return str(self.vdpa_type), (vdpa.vdpa_type or "an unbound vDPA device") if vdpa else "no vDPA device"
        values, value = {
            "vendors": (self.vendors, device.vendor),
            "devices": (self.devices, device.device),
            "drivers": (self.drivers, device.driver or "no driver"),
            "pciAddresses": (self.pci_addresses, device.address),
            "acpiIndexes": (self.acpi_indexes, device.acpi_index or "none"),
            "classes": (self.classes, device.class_code),
            "linkTypes": (self.link_types, device.link_type or "none"),
        }[key]
        return wanted(values), value


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

"""What a PCI device says of itself in a DRA ResourceSlice (``PciHandler.dra_attributes``).

The two well-known attributes every PCI driver publishes (``resource.kubernetes.io/pciBusID``,
``resource.kubernetes.io/pcieRoot``, from ``k8s.io/dynamic-resource-allocation/deviceattribute``)
and, in the driver's own domain, what the SR-IOV selectors match on: ``vendor``, ``deviceId``,
``driver``, ``pfName``, ``pfPciAddress``, ``vfIndex``, ``netdev``, ``linkType``, ``iommuGroup``.
An attribute that does not apply (no driver bound, not a VF, no netdev, no IOMMU group) is left
out rather than published empty, so a CEL selector can test for it. A device that is an IOMMU
group of several functions is described by its lowest function, the one it is named after.

Everything comes from the facts read at discovery: this runs on the event loop, for every device
of every slice, and never reads the host.
"""

from __future__ import annotations

from daemon.core import AttributeValue
from daemon.handlers._functions import PCIE_ROOT

from ._allocation import PciDetails

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"


def pci_attributes(details: PciDetails) -> dict[str, AttributeValue]:
    device = details.device
    attributes: dict[str, AttributeValue] = {PCI_BUS_ID: device.address}
    if device.pcie_root is not None:
        attributes[PCIE_ROOT] = device.pcie_root
    attributes["vendor"] = hex_id(device.vendor)
    attributes["deviceId"] = hex_id(device.device)
    if device.driver is not None:
        attributes["driver"] = device.driver
    if device.pf_address is not None:
        if device.pf_netdev is not None:
            attributes["pfName"] = device.pf_netdev
        attributes["pfPciAddress"] = device.pf_address
        if device.vf_index >= 0:
            attributes["vfIndex"] = device.vf_index
    if device.netdev is not None:
        attributes["netdev"] = device.netdev
    if device.link_type:
        attributes["linkType"] = device.link_type
    if device.iommu_group is not None and device.iommu_group.isdigit():
        attributes["iommuGroup"] = int(device.iommu_group)
    return attributes


def hex_id(value: str) -> str:
    """A vendor or device ID as four lower-case hex digits (``0x8086`` -> ``8086``)."""
    body = value[2:] if value[:2].lower() == "0x" else value
    return body.lower().rjust(4, "0")

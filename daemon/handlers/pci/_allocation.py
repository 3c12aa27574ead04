"""What a PCI device contributes to an Allocate answer, byte-compatible with the SR-IOV plugin.

* device specs: vfio (``/dev/vfio/vfio`` and the IOMMU group; ``noiommu-N`` on the host side in
  no-IOMMU mode), uio, RDMA character devices, vhost-net/tun, a vhost vDPA device's
  ``/dev/vhost-vdpa-N``;
* ``PCIDEVICE_<PREFIX>_<NAME>`` and its ``..._INFO`` (``daemon.handlers._sriov_allocation``,
  which the auxnet handler's SFs share, with the ``extra``, ``rdma`` and ``vhost`` providers);
* ``PCI_RESOURCE_<RESOURCE>`` for KubeVirt.

The Multus device-info files of netDevice pools are ``_devinfo.py``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from daemon.core import DeviceSpec
from daemon.handlers._sriov_allocation import extra_info, rdma_specs_and_info, vhost_net_specs_and_info

from ._discovery import VfioBinding
from ._facts import PciDevice, VdpaDevice

log = logging.getLogger("devplugd.pci")

VFIO_DRIVER = "vfio-pci"
UIO_DRIVERS = frozenset({"uio", "igb_uio"})
VFIO_CONTAINER = "/dev/vfio/vfio"
IOMMU_NODE = "/dev/iommu"
_VFIO_CONTAINER_SPEC = DeviceSpec(VFIO_CONTAINER, VFIO_CONTAINER)  # one object for every vfio device


@dataclass(frozen=True, slots=True)
class PciDetails:
    """A pool device's allocation record: the facts plus its ``_INFO`` entry and devinfo extras.

    A device that is an IOMMU group of several functions (see ``_groups.py``) is the record of
    its lowest function, with the others' records in ``members``."""

    device: PciDevice
    info: Mapping[str, Mapping[str, str]]
    rdma_device: str | None
    members: tuple[PciDetails, ...] = ()
    vdpa: VdpaDevice | None = None  # taken by a vdpaType selector: the device-info file is of type vdpa

    @property
    def pci_address(self) -> str:
        """The device's own PCI address (its lowest function's, for a group), for the metrics."""
        return self.device.address

    @property
    def functions(self) -> tuple[PciDetails, ...]:
        """Every function handed out with this device: itself, then its group's others."""
        return (self, *self.members) if self.members else (self,)


def vfio_specs(device: PciDevice) -> tuple[DeviceSpec, ...]:
    if device.iommu_group is None:
        return ()
    container = f"/dev/vfio/{device.iommu_group}"
    host = f"/dev/vfio/noiommu-{device.iommu_group}" if device.noiommu else container
    return (_VFIO_CONTAINER_SPEC, DeviceSpec(container, host))


def iommufd_specs(device: PciDevice, dev_root: str, resource: str) -> tuple[DeviceSpec, ...]:
    """The device's own VFIO node and ``/dev/iommu``, for IOMMUFD users (KubeVirt, Kata), when
    the kernel made them (``vfio-dev/vfioN`` in sysfs); a node that is missing is logged and left
    out, the group node still works."""
    specs: list[DeviceSpec] = []
    for node in (f"/dev/vfio/devices/{device.vfio_cdev}", IOMMU_NODE):
        if os.path.exists(dev_root + node[len("/dev"):]):
            specs.append(DeviceSpec(node, node))
        else:
            log.warning("%s has %s/vfio-dev/%s but %s is missing; handing out its group node only",
                        device.address, device.address, device.vfio_cdev, node,
                        extra={"PCI_ADDR": device.address, "RESOURCE": resource})
    return tuple(specs) if len(specs) == 2 else ()


def first_per_host_path(specs: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """``specs`` without later repeats of a host path (two devices in one IOMMU group share it)."""
    by_host_path: dict[str, DeviceSpec] = {}
    for spec in specs:
        by_host_path.setdefault(spec.host_path, spec)
    return list(by_host_path.values())


def with_vfio_binding(details: PciDetails, binding: VfioBinding) -> PciDetails:
    """``details`` with the IOMMU group of ``binding`` (its specs and ``_INFO`` ``dev-mount``)."""
    device = replace(details.device, iommu_group=binding.iommu_group, noiommu=binding.noiommu)
    info = {provider: dict(values) for provider, values in details.info.items()}
    vfio = vfio_specs(device)
    if "vfio" in info and vfio:
        info["vfio"]["dev-mount"] = vfio[1].container_path
    return replace(details, device=device, info=info)


def device_specs_and_info(
    device: PciDevice,
    *,
    is_rdma: bool,
    need_vhost_net: bool,
    vhost_available: bool,
    rdma_char_devices: Mapping[str, tuple[str, ...]],
    additional_info: Mapping[str, Mapping[str, str]] | None,
    vdpa_type: str | None = None,
) -> tuple[tuple[DeviceSpec, ...], dict[str, dict[str, str]], str | None]:
    """The device specs, the ``_INFO`` providers and the devinfo ``rdma-device`` of one device
    (``vdpa_type``: its selector's ``vdpaType``, which the device's vDPA device matched)."""
    specs: list[DeviceSpec] = []
    info: dict[str, dict[str, str]] = {"generic": {"deviceID": device.address}}
    if device.driver == VFIO_DRIVER:
        vfio = vfio_specs(device)
        specs.extend(vfio)
        info["vfio"] = {"mount": VFIO_CONTAINER}
        if vfio:
            info["vfio"]["dev-mount"] = vfio[1].container_path
    elif device.driver in UIO_DRIVERS:
        info["uio"] = {}
        if device.uio_devices:
            uio_path = f"/dev/{device.uio_devices[0]}"
            specs.append(DeviceSpec(uio_path, uio_path))
            info["uio"]["mount"] = uio_path
    if additional_info is not None:
        info["extra"] = extra_info(additional_info, device.address)
    rdma_device = None
    if is_rdma and device.rdma_devices:
        rdma_specs, info["rdma"] = rdma_specs_and_info(device.rdma_devices, rdma_char_devices)
        specs.extend(rdma_specs)
        rdma_device = ",".join(device.rdma_devices)
    vhost_specs, vhost_info = vhost_net_specs_and_info(need_vhost_net, vhost_available)
    specs.extend(vhost_specs)
    info.update(vhost_info)
    if vdpa_type is not None and device.vdpa is not None:
        info["vdpa"] = {}
        if vdpa_path := vdpa_node_path(device.vdpa):
            specs.append(DeviceSpec(vdpa_path, vdpa_path))
            info["vdpa"]["mount"] = vdpa_path
    return tuple(specs), info, rdma_device


def vdpa_node_path(vdpa: VdpaDevice) -> str | None:
    """``/dev/vhost-vdpa-N`` of a vDPA device bound to vhost_vdpa (a virtio one has none)."""
    return f"/dev/{vdpa.vhost_node}" if vdpa.vdpa_type == "vhost" and vdpa.vhost_node else None


def kubevirt_env_name(resource: str) -> str:
    """``PCI_RESOURCE_<RESOURCE>``, the variable KubeVirt's host-device support reads for an
    external resource provider: the resource name upper-cased, ``/`` and ``.`` made ``_``."""
    return "PCI_RESOURCE_" + resource.upper().replace("/", "_").replace(".", "_")

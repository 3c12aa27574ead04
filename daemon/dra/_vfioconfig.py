"""The one claim parameter devplugd takes: ``VfioConfig``, an opaque config for our driver that
asks for a device of a ``vfioOnDemand`` pool on vfio-pci for this claim (as NVIDIA's
``VfioDeviceConfig`` with its ``IOMMUConfig`` does, or Intel's VFIO device class)::

    {"apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig", "backend": "legacy"}

``backend`` (``daemon.core._handler.VFIO_BACKENDS``): ``legacy`` (the default: ``/dev/vfio/vfio`` and
``/dev/vfio/<group>``, what KubeVirt and DPDK open), ``iommufd`` (the device's own
``/dev/vfio/devices/vfioN`` and ``/dev/iommu``; refused where the kernel has none) or
``preferIommufd`` (IOMMUFD where the kernel has it, the group otherwise).

It comes from the claim (``spec.devices.config[].opaque``) or from its DeviceClass
(``spec.config``: ``devplugd dra device-classes`` prints a ``-vfio`` class carrying it for each
pool that allows it), and reaches the allocation as ``status.allocation.devices.config[]`` with
``source`` ``FromClaim`` or ``FromClass``. A config with another ``apiVersion`` or ``kind``, an
unknown field or a wrong value is refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from daemon.core._handler import VFIO_BACKENDS, VFIO_LEGACY

CONFIG_API_VERSION = "devplugd.io/v1alpha1"
VFIO_CONFIG_KIND = "VfioConfig"
_FIELDS = ("apiVersion", "kind", "backend")


@dataclass(frozen=True)
class VfioConfig:
    """The device on vfio-pci for the claim, handed out through ``backend``."""

    backend: str = VFIO_LEGACY

    def to_json(self) -> dict[str, Any]:
        return {"apiVersion": CONFIG_API_VERSION, "kind": VFIO_CONFIG_KIND, "backend": self.backend}


def parse_vfio_config(parameters: Any, where: str) -> VfioConfig:
    """The ``VfioConfig`` of an opaque config's ``parameters`` (at ``where``, for the messages),
    or ValueError naming the field and what is wrong."""
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{where} is not an object (expected a {VFIO_CONFIG_KIND} of {CONFIG_API_VERSION})")
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != CONFIG_API_VERSION or kind != VFIO_CONFIG_KIND:
        raise ValueError(f"{where}: devplugd takes only kind {VFIO_CONFIG_KIND} of {CONFIG_API_VERSION}, not "
                         f"apiVersion {api_version!r}, kind {kind!r}")
    unknown = sorted(key for key in parameters if key not in _FIELDS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field of {VFIO_CONFIG_KIND} (it has "
                         f"{', '.join(_FIELDS)})")
    backend = parameters.get("backend", VFIO_LEGACY)
    if backend not in VFIO_BACKENDS:
        raise ValueError(f"{where}.backend: {backend!r} is not one of {', '.join(VFIO_BACKENDS)}")
    return VfioConfig(backend)

"""devplugd as a DRA driver: the pools whose config says ``allocationApi: dra``, published as
ResourceSlices and prepared for ResourceClaims by the kubelet's DRA manager.

The kubelet plugin's gRPC side (``DraSockets``, ``HealthServicer`` and the generated DRA modules
behind them) is imported on first use: a host without DRA pools never loads it (about 1 MB).
"""

from typing import Any

from ._deviceclasses import DeviceClassError, device_class_name, device_classes, rbac_objects
from ._devices import qualified_name_problem, slice_devices, string_problem
from ._driver import DraDriver
from ._names import device_name, pool_name
from ._prepared import ClaimBook
from ._slices import slice_bodies

_PLUGIN_SIDE = {"HealthServicer": "_health", "SUPPORTED_VERSIONS": "_sockets", "DraSockets": "_sockets",
                "V1beta1Adapter": "_sockets"}


def __getattr__(name: str) -> Any:
    if name in _PLUGIN_SIDE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_PLUGIN_SIDE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "SUPPORTED_VERSIONS",
    "ClaimBook",
    "DeviceClassError",
    "DraDriver",
    "DraSockets",
    "HealthServicer",
    "device_class_name",
    "device_classes",
    "device_name",
    "pool_name",
    "qualified_name_problem",
    "rbac_objects",
    "slice_bodies",
    "slice_devices",
    "string_problem",
]

"""devplugd as a DRA driver: the pools whose config says ``allocationApi: dra``, published as
ResourceSlices and prepared for ResourceClaims by the kubelet's DRA manager."""

from ._claims import ClaimBook
from ._deviceclasses import DeviceClassError, device_class_name, device_classes, rbac_objects, selector_expression
from ._driver import DraDriver
from ._health import HealthServicer
from ._names import device_name, pool_name
from ._slices import qualified_name_problem, slice_bodies, slice_devices, string_problem
from ._sockets import SUPPORTED_VERSIONS, DraSockets, V1beta1Adapter

__all__ = [
    "SUPPORTED_VERSIONS",
    "ClaimBook",
    "DeviceClassError",
    "DraDriver",
    "DraSockets",
    "HealthServicer",
    "V1beta1Adapter",
    "device_class_name",
    "device_classes",
    "device_name",
    "pool_name",
    "qualified_name_problem",
    "rbac_objects",
    "selector_expression",
    "slice_bodies",
    "slice_devices",
    "string_problem",
]

"""devplugd as a DRA driver: the pools whose config says ``allocationApi: dra``, published as
ResourceSlices and prepared for ResourceClaims by the kubelet's DRA manager."""

from ._health import HealthServicer
from ._names import device_name, pool_name
from ._sockets import SUPPORTED_VERSIONS, DraSockets, V1beta1Adapter

__all__ = ["SUPPORTED_VERSIONS", "DraSockets", "HealthServicer", "V1beta1Adapter", "device_name", "pool_name"]

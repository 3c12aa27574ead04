"""The kubelet's device-plugin API (v1beta1): one gRPC server per resource on its own unix
socket, served before it registers (on ``kubelet.sock``, or found through plugins_registry), and
served again when the kubelet restarts or removes our socket.

``Endpoints`` is the notifier's subscriber that keeps one ``ResourceEndpoint`` per resource with
devices; each endpoint's ``DevicePluginServicer`` answers ListAndWatch, Allocate,
GetPreferredAllocation and PreStartContainer from the current tree.
"""

from ._endpoint import directory_problem, socket_file_name
from ._endpoints import Endpoints
from ._servicer import ListingMessages, device_message

__all__ = [
    "Endpoints",
    "ListingMessages",
    "device_message",
    "directory_problem",
    "socket_file_name",
]

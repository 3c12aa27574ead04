"""The host API: devices for workloads that are not pods (``devplugd.host.v1.Host`` on the
control socket), the leases that hold them, and the CLI client (``daemon.host.client``).

``HostServicer`` answers List, Watch (a subscriber of the notifier per stream), Allocate,
Release and Leases; ``LeaseBook`` keeps the leases and their file; ``serve_control_socket``
serves it all on the control socket.
"""

from daemon.checkpoint import kubelet_allocations

from ._leases import Lease, LeaseBook, LeaseError, NotEnoughFree
from ._servicer import HostServicer, serve_control_socket

__all__ = [
    "HostServicer",
    "Lease",
    "LeaseBook",
    "LeaseError",
    "NotEnoughFree",
    "kubelet_allocations",
    "serve_control_socket",
]

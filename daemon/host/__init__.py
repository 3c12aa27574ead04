"""The host API: devices for workloads that are not pods (``devplugd.host.v1.Host`` on the
control socket), the leases that hold them, and the CLI client (``daemon.host.client``).

``HostServicer`` answers List, Watch (a subscriber of the notifier per stream), Allocate and
Release (through ``Granter``), Leases and ClearLost; ``LeaseBook`` keeps the leases and their
file; ``serve_control_socket`` serves it all on the control socket.
"""

from ._grant import Granter
from ._leases import LeaseBook
from ._servicer import HostServicer, serve_control_socket

__all__ = ["Granter", "HostServicer", "LeaseBook", "serve_control_socket"]

"""Every setting of one daemon, built once by the CLI and passed down (no globals)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from daemon.core import dns_subdomain_problem

KUBELET_SOCKET_NAME = "kubelet.sock"
REGISTRATION_MODES = ("auto", "kubelet", "watcher", "none")
DEFAULT_DRA_DRIVER = "devplugd.io"
KUBELET_KUBECONFIG = Path("/etc/kubernetes/kubelet.conf")
DRA_SOCKET_NAME = "dra.sock"


@dataclass(frozen=True)
class Settings:
    config_path: Path = Path("/etc/devplugd/config.json")
    resource_prefix: str = "intel.com"
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    registration: str = "auto"
    devinfo_dir: Path = Path("/var/run/k8s.cni.cncf.io/devinfo/dp")
    cdi_dir: Path = Path("/var/run/cdi")
    nfd_features_dir: Path = Path("/etc/kubernetes/node-feature-discovery/features.d")
    state_dir: Path = Path("/var/lib/devplugd")
    uevent_source: str = "auto"
    udev_data_dir: Path = Path("/run/udev/data")
    control_socket: Path = Path("/run/devplugd/control.sock")
    control_group: str | None = None
    cdi_in_allocate: bool = False
    register_timeout: float = 20.0
    # DRA: the driver name (ResourceSlice spec.driver), this node, the API server's credentials
    # (None: the in-cluster service account) and where the kubelet finds DRA plugin sockets
    dra_driver: str = DEFAULT_DRA_DRIVER
    node_name: str = "localhost"
    kubeconfig: Path | None = None
    dra_plugin_dir: Path = Path("/var/lib/kubelet/plugins")
    # where Prometheus scrapes /metrics (host, port); None: no metrics server
    metrics_address: tuple[str, int] | None = None

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET_NAME

    @property
    def dra_socket(self) -> Path:
        """The DRA plugin's gRPC socket, which the registration's GetInfo names."""
        return self.dra_plugin_dir / self.dra_driver / DRA_SOCKET_NAME

    @property
    def dra_registration_socket(self) -> Path:
        return self.plugins_registry_dir / f"{self.dra_driver}-reg.sock"

    def effective_registration(self) -> str:
        """``auto`` becomes ``watcher`` when the plugins_registry directory exists (as the SR-IOV
        plugin decides), else ``kubelet``."""
        if self.registration != "auto":
            return self.registration
        return "watcher" if self.plugins_registry_dir.is_dir() else "kubelet"


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:9464``) as (host, port); ValueError if not."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def dra_names_problem(driver: str, node_name: str | None) -> str | None:
    """Why the DRA driver name (a DNS subdomain of at most 63 characters) or the node name (a DNS
    subdomain) cannot be used, or ``None``."""
    if problem := dns_subdomain_problem(driver, 63):
        return f"--dra-driver {driver!r}: {problem}"
    if node_name is not None and (problem := dns_subdomain_problem(node_name)):
        return f"node name {node_name!r} (--node-name, $NODE_NAME or the host name): {problem}"
    return None

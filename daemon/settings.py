"""Every setting of one daemon, built once by the CLI and passed down (no globals).

Each setting is written once, here: its default, and for those ``devplugd run`` takes, its flag
and help (``option``); the CLI builds its parser and the Settings from these fields.
"""

from __future__ import annotations

import base64
import hashlib
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.core._names import dns_subdomain_problem

KUBELET_SOCKET_NAME = "kubelet.sock"
REGISTRATION_MODES = ("auto", "kubelet", "watcher", "none")
DEFAULT_DRA_DRIVER = "devplugd.io"
KUBELET_KUBECONFIG = Path("/etc/kubernetes/kubelet.conf")
DRA_SOCKET_NAME = "dra.sock"
# The Go helper's rolling-update names (k8s.io/dynamic-resource-allocation/kubeletplugin,
# RollingUpdateRegistrarSocketFile): its limit on the whole path, and how much of a SHA-256 digest
# goes into the two shorter forms
UNIX_PATH_MAX = 108
UID_HASH_BYTES = 8
DRIVER_UID_HASH_BYTES = 16


def option(value: Any, flag: str, help: str, *, show_default: bool = True, **argparse: Any) -> Any:
    """A setting ``devplugd run`` takes as ``flag``, ``value`` by default (``argparse``:
    add_argument's other keywords; its own ``default`` when the CLI works the value out itself)."""
    text = f"{help} (default: %(default)s)" if show_default else help
    return field(default=value, metadata={"flag": flag, "help": text, "argparse": argparse})


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:9464``) as (host, port); ValueError if not."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class Settings:
    config_path: Path = option(Path("/etc/devplugd/config.json"), "--config", "pool config file")
    resource_prefix: str = option("intel.com", "--resource-prefix",
                                  "prefix of resource names without their own resourcePrefix")
    sysfs_root: Path = option(Path("/sys"), "--sysfs-root", "where sysfs is read")
    dev_root: Path = option(Path("/dev"), "--dev-root", "where device nodes are found")
    proc_root: Path = option(Path("/proc"), "--proc-root",
                             "where procfs is read: default routes, the mount table for vfioOnDemand")
    device_plugin_dir: Path = option(Path("/var/lib/kubelet/device-plugins"), "--device-plugin-dir",
                                     "the kubelet's device-plugin directory, with kubelet.sock")
    plugins_registry_dir: Path = option(Path("/var/lib/kubelet/plugins_registry"), "--plugins-registry-dir",
                                        "the kubelet's plugin-watcher directory")
    registration: str = option(
        "auto", "--registration", "kubelet: Register on kubelet.sock; watcher: a socket under plugins_registry; "
        "none: serve sockets without registering; auto: watcher if the plugins_registry directory exists, else "
        "kubelet", choices=REGISTRATION_MODES)
    devinfo_dir: Path = option(Path("/var/run/k8s.cni.cncf.io/devinfo/dp"), "--devinfo-dir",
                               "where Multus device-info files are written")
    cdi_dir: Path = option(Path("/var/run/cdi"), "--cdi-dir", "CDI spec directory")
    nfd_features_dir: Path = option(
        Path("/etc/kubernetes/node-feature-discovery/features.d"), "--nfd-features-dir",
        "node-feature-discovery's features.d: node labels per pool are written there when it exists")
    state_dir: Path = option(Path("/var/lib/devplugd"), "--state-dir",
                             "state directory: the lease and claim books")
    uevent_source: str = option(
        "auto", "--uevent-source", "where uevents come from: udev (after udevd's rules), kernel (netlink, no "
        "udevd needed), auto (udev when udevd runs, else kernel), none, or unix:PATH (a datagram socket the "
        "daemon binds, fed in the kernel's wire format; for tests)", metavar="auto|udev|kernel|none|unix:PATH")
    udev_data_dir: Path = option(Path("/run/udev/data"), "--udev-data-dir",
                                 "udev's database, read for device properties and symlinks when the uevents "
                                 "come from udev (or unix:PATH)")
    control_socket: Path = option(Path("/run/devplugd/control.sock"), "--control-socket",
                                  "the host API's unix socket")
    control_group: str | None = option(None, "--control-group", "group owning the control socket (mode 0660), "
                                       "so its members can use it", show_default=False)
    cdi_in_allocate: bool = option(False, "--cdi", "also return CDI device names (cdi_devices) in the kubelet's "
                                   "Allocate answers", show_default=False, action="store_true")
    register_timeout: float = 20.0
    # DRA: the driver name (ResourceSlice spec.driver), this node, the API server's credentials
    # (None: the in-cluster service account) and where the kubelet finds DRA plugin sockets
    dra_driver: str = option(DEFAULT_DRA_DRIVER, "--dra-driver", "DRA driver name: spec.driver of our "
                             "ResourceSlices, a DNS subdomain of at most 63 characters")
    node_name: str = option("localhost", "--node-name", "this node's Kubernetes name (default: $NODE_NAME, else "
                            "the host name in lower case)", show_default=False, default=None)
    kubeconfig: Path | None = option(
        None, "--kubeconfig", f"the API server's address and credentials, for DRA pools (default: $KUBECONFIG, "
        f"else {KUBELET_KUBECONFIG} when it exists, else the in-cluster service account)", show_default=False)
    dra_plugin_dir: Path = option(Path("/var/lib/kubelet/plugins"), "--dra-plugin-dir",
                                  "the kubelet's DRA plugin directory: our socket is DIR/<driver>/dra.sock")
    # this instance's pod (the DaemonSet passes metadata.uid as $POD_UID): the DRA sockets carry it,
    # so the old and the new pod of a rolling update are registered side by side
    pod_uid: str | None = option(None, "--pod-uid", "the UID of the pod devplugd runs in (default: $POD_UID): "
                                 "the DRA sockets are named after it, as the Go helper's RollingUpdate names "
                                 "them, so two pods of a rolling update are registered side by side",
                                 show_default=False, metavar="UID")
    # where Prometheus scrapes /metrics (host, port); None: no metrics server
    metrics_address: tuple[str, int] | None = option(
        None, "--metrics-address", "serve Prometheus metrics at http://HOST:PORT/metrics (default: no metrics "
        "server)", show_default=False, metavar="HOST:PORT", type=parse_host_port)

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET_NAME

    @property
    def dra_socket(self) -> Path:
        """The DRA plugin's gRPC socket, which the registration's GetInfo names: ``dra.sock``, or
        ``dra-<pod UID>.sock`` with a pod UID, in ``<dra-plugin-dir>/<driver>/`` (the directory
        both pods of a rolling update share, as the Go helper has it)."""
        name = f"dra-{self.pod_uid}.sock" if self.pod_uid else DRA_SOCKET_NAME
        return self.dra_plugin_dir / self.dra_driver / name

    @property
    def dra_registration_socket(self) -> Path:
        if self.pod_uid:
            return self.plugins_registry_dir / rolling_update_registration_socket_name(
                self.plugins_registry_dir, self.dra_driver, self.pod_uid)
        return self.plugins_registry_dir / f"{self.dra_driver}-reg.sock"

    def effective_registration(self) -> str:
        """``auto`` becomes ``watcher`` when the plugins_registry directory exists (as the SR-IOV
        plugin decides), else ``kubelet``."""
        if self.registration != "auto":
            return self.registration
        return "watcher" if self.plugins_registry_dir.is_dir() else "kubelet"


def rolling_update_registration_socket_name(registry_dir: Path | str, driver: str, pod_uid: str) -> str:
    """The registration socket's name with a pod UID, as the Go helper chooses it (commit 70301bb
    and its review, June 2026): the first of ``<driver>-<pod UID>-reg.sock``,
    ``<driver>-<base64url(sha256(pod UID))[:8 bytes]>-reg.sock`` and
    ``dra-<base64url(sha256(driver NUL pod UID))[:16 bytes]>-reg.sock`` (unpadded URL-safe base64)
    whose path in ``registry_dir`` is at most 108 bytes long, else the last."""
    uid_hash = hashlib.sha256(pod_uid.encode()).digest()
    driver_uid_hash = hashlib.sha256(f"{driver}\0{pod_uid}".encode()).digest()
    candidates = (
        f"{driver}-{pod_uid}-reg.sock",
        f"{driver}-{_base64url(uid_hash[:UID_HASH_BYTES])}-reg.sock",
        f"dra-{_base64url(driver_uid_hash[:DRIVER_UID_HASH_BYTES])}-reg.sock",
    )
    for name in candidates:
        if len(os.fsencode(posixpath.normpath(posixpath.join(os.fspath(registry_dir), name)))) <= UNIX_PATH_MAX:
            return name
    return candidates[-1]


def _base64url(data: bytes) -> str:
    """Go's base64.RawURLEncoding: URL-safe, no padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def pod_uid_problem(pod_uid: str | None) -> str | None:
    """Why ``pod_uid`` cannot be part of a socket's name (a ``/`` or a NUL in it), or ``None``."""
    if pod_uid is not None and ("/" in pod_uid or "\0" in pod_uid):
        return f"--pod-uid {pod_uid!r}: a pod UID is part of a socket's file name, and has no '/' or NUL"
    return None


def dra_names_problem(driver: str, node_name: str | None) -> str | None:
    """Why the DRA driver name (a DNS subdomain of at most 63 characters) or the node name (a DNS
    subdomain) cannot be used, or ``None``."""
    if problem := dns_subdomain_problem(driver, 63):
        return f"--dra-driver {driver!r}: {problem}"
    if node_name is not None and (problem := dns_subdomain_problem(node_name)):
        return f"node name {node_name!r} (--node-name, $NODE_NAME or the host name): {problem}"
    return None

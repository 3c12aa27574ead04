"""The command line: ``devplugd run|check-config|dra ...``. It only builds Settings and calls the app."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from daemon import __version__
from daemon.logs import LEVELS, configure_logging
from daemon.settings import KUBELET_KUBECONFIG, REGISTRATION_MODES, Settings, dra_names_problem, parse_host_port

DEFAULTS = Settings()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devplugd",
        description="Kubernetes device plugin daemon: serves PCI and device-node pools to the kubelet.",
    )
    parser.add_argument("--version", action="version", version=f"devplugd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="serve the pools of a config file (in the foreground)")
    run.add_argument("--config", type=Path, default=DEFAULTS.config_path,
                     help="pool config file (default: %(default)s)")
    run.add_argument("--resource-prefix", default=DEFAULTS.resource_prefix,
                     help="prefix of resource names without their own resourcePrefix (default: %(default)s)")
    run.add_argument("--sysfs-root", type=Path, default=DEFAULTS.sysfs_root,
                     help="where sysfs is read (default: %(default)s)")
    run.add_argument("--dev-root", type=Path, default=DEFAULTS.dev_root,
                     help="where device nodes are found (default: %(default)s)")
    run.add_argument("--proc-root", type=Path, default=DEFAULTS.proc_root,
                     help="where procfs is read, for IPv4 default routes (default: %(default)s)")
    run.add_argument("--device-plugin-dir", type=Path, default=DEFAULTS.device_plugin_dir,
                     help="the kubelet's device-plugin directory, with kubelet.sock (default: %(default)s)")
    run.add_argument("--plugins-registry-dir", type=Path, default=DEFAULTS.plugins_registry_dir,
                     help="the kubelet's plugin-watcher directory (default: %(default)s)")
    run.add_argument("--registration", choices=REGISTRATION_MODES, default=DEFAULTS.registration,
                     help="kubelet: Register on kubelet.sock; watcher: a socket under plugins_registry; "
                          "none: serve sockets without registering; auto: watcher if the plugins_registry "
                          "directory exists, else kubelet (default: %(default)s)")
    run.add_argument("--devinfo-dir", type=Path, default=DEFAULTS.devinfo_dir,
                     help="where Multus device-info files are written (default: %(default)s)")
    run.add_argument("--cdi-dir", type=Path, default=DEFAULTS.cdi_dir, help="CDI spec directory (default: %(default)s)")
    run.add_argument("--nfd-features-dir", type=Path, default=DEFAULTS.nfd_features_dir,
                     help="node-feature-discovery's features.d: node labels per pool are written there when it "
                          "exists (default: %(default)s)")
    run.add_argument("--state-dir", type=Path, default=DEFAULTS.state_dir,
                     help="state directory (default: %(default)s)")
    run.add_argument("--uevent-source", default=DEFAULTS.uevent_source, metavar="auto|udev|kernel|none|unix:PATH",
                     help="where uevents come from: udev (after udevd's rules), kernel (netlink, no udevd "
                          "needed), auto (udev when udevd runs, else kernel), none, or unix:PATH (a datagram "
                          "socket the daemon binds, fed in the kernel's wire format; for tests) "
                          "(default: %(default)s)")
    run.add_argument("--udev-data-dir", type=Path, default=DEFAULTS.udev_data_dir,
                     help="udev's database, read for device properties and symlinks when the uevents come "
                          "from udev (or unix:PATH) (default: %(default)s)")
    run.add_argument("--control-socket", type=Path, default=DEFAULTS.control_socket,
                     help="the host API's unix socket (default: %(default)s)")
    run.add_argument("--control-group", default=None,
                     help="group owning the control socket (mode 0660), so its members can use it")
    run.add_argument("--cdi", action="store_true",
                     help="also return CDI device names (cdi_devices) in the kubelet's Allocate answers")
    run.add_argument("--dra-driver", default=DEFAULTS.dra_driver,
                     help="DRA driver name: spec.driver of our ResourceSlices, a DNS subdomain of at most 63 "
                          "characters (default: %(default)s)")
    run.add_argument("--node-name", default=None,
                     help="this node's Kubernetes name (default: $NODE_NAME, else the host name in lower case)")
    run.add_argument("--kubeconfig", type=Path, default=None,
                     help=f"the API server's address and credentials, for DRA pools (default: $KUBECONFIG, else "
                          f"{KUBELET_KUBECONFIG} when it exists, else the in-cluster service account)")
    run.add_argument("--dra-plugin-dir", type=Path, default=DEFAULTS.dra_plugin_dir,
                     help="the kubelet's DRA plugin directory: our socket is DIR/<driver>/dra.sock "
                          "(default: %(default)s)")
    run.add_argument("--metrics-address", type=_host_port, default=None, metavar="HOST:PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics (default: no metrics server)")
    run.add_argument("--log-level", choices=LEVELS, default="info", help="(default: %(default)s)")

    socket_help = f"the daemon's control socket (default: {DEFAULTS.control_socket})"
    listing = commands.add_parser("list", help="every pool and device, with who holds each one")
    listing.add_argument("-o", "--output", choices=("table", "json"), default="table")
    watch = commands.add_parser("watch", help="a snapshot, then one line per device added, removed or changed")
    watch.add_argument("-o", "--output", choices=("text", "json"), default="text")
    allocate = commands.add_parser("allocate", help="lease devices of a resource to a local workload")
    allocate.add_argument("resource")
    allocate.add_argument("-n", "--count", type=int, default=1, help="how many devices (default: %(default)s)")
    allocate.add_argument("--device", dest="devices", action="append", default=[], metavar="ID",
                          help="a device to lease (repeat for more); overrides -n")
    allocate.add_argument("--owner", help="who holds the lease (default: USER@HOSTNAME)")
    allocate.add_argument("--numa-node", type=int, help="prefer devices on this NUMA node")
    allocate.add_argument("-o", "--output", choices=("env", "json", "podman"), default="env",
                          help="env: shell assignments; json: the lease; podman: --device arguments")
    release = commands.add_parser("release", help="end a lease")
    release.add_argument("lease")
    leases = commands.add_parser("leases", help="the host leases in force")
    leases.add_argument("-o", "--output", choices=("table", "json"), default="table")
    for sub in (listing, watch, allocate, release, leases):
        sub.add_argument("--control-socket", type=Path, default=DEFAULTS.control_socket, help=socket_help)

    check = commands.add_parser("check-config", help="validate a config file: exit 0 if valid, 2 if not")
    check.add_argument("path", type=Path)
    check.add_argument("--resource-prefix", default=DEFAULTS.resource_prefix, help="(default: %(default)s)")

    dra = commands.add_parser("dra", help="what a cluster needs for the pools served through DRA")
    dra_commands = dra.add_subparsers(dest="dra_command", required=True, metavar="COMMAND")
    classes = dra_commands.add_parser(
        "device-classes", help="print a DeviceClass per DRA pool (KEP-5004 extended resource names) as YAML")
    classes.add_argument("--config", type=Path, default=DEFAULTS.config_path,
                         help="pool config file (default: %(default)s)")
    classes.add_argument("--dra-driver", default=DEFAULTS.dra_driver,
                         help="DRA driver name the daemon runs with (default: %(default)s)")
    classes.add_argument("--resource-prefix", default=DEFAULTS.resource_prefix, help="(default: %(default)s)")
    classes.add_argument("--rbac", action="store_true",
                         help="also print the ServiceAccount, ClusterRole and ClusterRoleBinding the daemon needs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.command in ("list", "watch", "allocate", "release", "leases"):
        return _client_command(arguments)
    from daemon import app  # after argument parsing, so --help and --version stay fast

    if arguments.command == "check-config":
        configure_logging("warning")
        return _check_config(arguments.path, arguments.resource_prefix)
    if arguments.command == "dra":
        configure_logging("warning")
        return _device_classes(arguments.config, arguments.dra_driver, arguments.resource_prefix, arguments.rbac)
    configure_logging(arguments.log_level)
    node_name = arguments.node_name or os.environ.get("NODE_NAME") or socket.gethostname().lower()
    # the node name from the environment or the host name is checked only when a pool uses DRA
    if problem := dra_names_problem(arguments.dra_driver, arguments.node_name):
        print(f"devplugd: {problem}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    settings = Settings(
        config_path=arguments.config,
        resource_prefix=arguments.resource_prefix,
        sysfs_root=arguments.sysfs_root,
        dev_root=arguments.dev_root,
        proc_root=arguments.proc_root,
        device_plugin_dir=arguments.device_plugin_dir,
        plugins_registry_dir=arguments.plugins_registry_dir,
        registration=arguments.registration,
        devinfo_dir=arguments.devinfo_dir,
        cdi_dir=arguments.cdi_dir,
        nfd_features_dir=arguments.nfd_features_dir,
        state_dir=arguments.state_dir,
        uevent_source=arguments.uevent_source,
        udev_data_dir=arguments.udev_data_dir,
        control_socket=arguments.control_socket,
        control_group=arguments.control_group,
        cdi_in_allocate=arguments.cdi,
        dra_driver=arguments.dra_driver,
        node_name=node_name,
        kubeconfig=_kubeconfig(arguments.kubeconfig),
        dra_plugin_dir=arguments.dra_plugin_dir,
        metrics_address=arguments.metrics_address,
    )
    return app.run(settings)


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _kubeconfig(given: Path | None) -> Path | None:
    """--kubeconfig, else $KUBECONFIG, else the kubelet's own when it exists; None: in-cluster."""
    if given is not None:
        return given
    if os.environ.get("KUBECONFIG"):
        return Path(os.environ["KUBECONFIG"])
    return KUBELET_KUBECONFIG if KUBELET_KUBECONFIG.exists() else None


def _client_command(arguments: argparse.Namespace) -> int:
    from daemon.host import client

    socket = arguments.control_socket
    if arguments.command == "list":
        return client.run_client(client.command_list, socket, arguments.output)
    if arguments.command == "watch":
        return client.run_client(client.command_watch, socket, arguments.output)
    if arguments.command == "allocate":
        return client.run_client(client.command_allocate, socket, arguments.resource, arguments.count,
                                 arguments.devices, arguments.owner, arguments.numa_node, arguments.output)
    if arguments.command == "release":
        return client.run_client(client.command_release, socket, arguments.lease)
    return client.run_client(client.command_leases, socket, arguments.output)


def _check_config(path: Path, resource_prefix: str) -> int:
    from daemon import app
    from daemon.core import ConfigFileError

    try:
        _, config = app.load(Settings(resource_prefix=resource_prefix), config_path=path)
    except ConfigFileError as error:
        print(f"devplugd: {error}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    for warning in config.warnings:
        print(f"devplugd: warning: {warning}", file=sys.stderr)
    for pool in config.pools:
        print(f"{pool.resource}\t{pool.entry.device_type}")
    print(f"config {path}: valid, {len(config.pools)} pools")
    return app.EXIT_OK


def _device_classes(path: Path, driver: str, resource_prefix: str, rbac: bool) -> int:
    """``dra device-classes``: the DeviceClasses (and with ``rbac`` the RBAC objects) as one
    multi-document YAML stream on stdout; a config without DRA pools needs neither."""
    from daemon import app
    from daemon.core import DRA_API, ConfigFileError
    from daemon.dra import DeviceClassError, device_classes, rbac_objects

    if problem := dra_names_problem(driver, None):
        print(f"devplugd: {problem}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    try:
        _, config = app.load(Settings(resource_prefix=resource_prefix), config_path=path)
        documents = device_classes(config, driver)
    except (ConfigFileError, DeviceClassError) as error:
        print(f"devplugd: {error}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    if not documents:
        print(f"devplugd: no pool of {path} has allocationApi {DRA_API!r}: no DeviceClasses, and no "
              "RBAC (the daemon does not use the API server)", file=sys.stderr)
        print(f"# devplugd: no DRA pools in {path}")
        return app.EXIT_OK
    if rbac:
        documents += rbac_objects(driver)
    import yaml  # PyYAML, a dependency of the kubernetes client: only this command needs it

    print(f"# devplugd dra device-classes: {len(config.dra_pools)} DRA pools of {path}, driver {driver}")
    sys.stdout.write(yaml.safe_dump_all(documents, sort_keys=False, explicit_start=True, width=4096))
    return app.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""The command line: ``devplugd run|check-config|dra ...`` and the host API's client commands.
It only builds Settings (from their fields, ``daemon.settings.option``) and calls the app."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from daemon import __version__
from daemon.logs import LEVELS, configure_logging
from daemon.settings import KUBELET_KUBECONFIG, Settings, dra_names_problem

DEFAULTS = Settings()
CLIENT_COMMANDS = ("list", "watch", "allocate", "release", "leases", "clear-lost", "explain")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devplugd",
        description="Kubernetes device plugin daemon: serves PCI and device-node pools to the kubelet.",
    )
    parser.add_argument("--version", action="version", version=f"devplugd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="serve the pools of a config file (in the foreground)")
    _add_settings(run)
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
    clear = commands.add_parser(
        "clear-lost", help="a book (leases, claims) whose file could not be read holds every device it could have "
        "held; say its devices are free, and they are offered again")
    clear.add_argument("book", choices=("leases", "claims"))
    clear.add_argument("--operator", help="who says so, for the log (default: USER@HOSTNAME)")
    explain = commands.add_parser(
        "explain", help="why a device is, or is not, in each pool: the first selector that refuses it and the "
        "device's value, or the pool that offers it with its health and holder")
    explain.add_argument("device", help="a PCI address (or netdev, or /dev/vfio/N), a /dev path, a USB ID "
                         "(vendor:product) or port, or a device ID")
    explain.add_argument("-o", "--output", choices=("table", "json"), default="table")
    explain.add_argument("--config", type=Path,
                         help="answer without a daemon: from this config file and a scan of the host")
    explain.add_argument("--sysfs-root", type=Path, default=DEFAULTS.sysfs_root,
                         help="with --config: where sysfs is (default: %(default)s)")
    explain.add_argument("--dev-root", type=Path, default=DEFAULTS.dev_root,
                         help="with --config: where /dev is (default: %(default)s)")
    explain.add_argument("--proc-root", type=Path, default=DEFAULTS.proc_root,
                         help="with --config: where /proc is, for the default route (default: %(default)s)")
    explain.add_argument("--resource-prefix", default=DEFAULTS.resource_prefix,
                         help="with --config (default: %(default)s)")
    for sub in (listing, watch, allocate, release, leases, clear, explain):
        sub.add_argument("--control-socket", type=Path, default=DEFAULTS.control_socket, help=socket_help)

    active = commands.add_parser(
        "active", help="exit 0 if this pod's devplugd (--pod-uid) is the active instance of the state directory, "
        "1 if not, saying why (a DaemonSet's readiness: a rolling update's new pod is Ready once it took over)")
    active.add_argument("--state-dir", type=Path, default=DEFAULTS.state_dir, help="(default: %(default)s)")
    active.add_argument("--pod-uid", default=os.environ.get("POD_UID") or None,
                        help="the pod devplugd runs in (default: $POD_UID)")

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
    if arguments.command == "explain" and arguments.config is not None:
        configure_logging("error")
        return _explain_without_daemon(arguments)
    if arguments.command in CLIENT_COMMANDS:
        return _client_command(arguments)
    if arguments.command == "active":
        from daemon.holdings import not_active_here

        if (why := not_active_here(arguments.state_dir, arguments.pod_uid)) is not None:
            print(f"devplugd: not active: {why}", file=sys.stderr)
            return 1
        return 0
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
    given = {f.name: getattr(arguments, f.name) for f in dataclasses.fields(Settings) if "flag" in f.metadata}
    settings = Settings(**{**given, "node_name": node_name, "kubeconfig": _kubeconfig(arguments.kubeconfig)})
    return app.run(settings)


def _add_settings(run: argparse.ArgumentParser) -> None:
    """One flag per Settings field that has one (``daemon.settings.option``), in field order."""
    types = typing.get_type_hints(Settings)
    for setting in dataclasses.fields(Settings):
        if "flag" not in setting.metadata:
            continue
        keywords = dict(setting.metadata["argparse"])
        if "action" not in keywords and "choices" not in keywords:  # named as the flag: --config CONFIG
            keywords.setdefault("metavar", setting.metadata["flag"].lstrip("-").upper().replace("-", "_"))
        if "type" in keywords:
            keywords["type"] = _argument_type(keywords["type"])
        elif "action" not in keywords and Path in (types[setting.name], *typing.get_args(types[setting.name])):
            keywords["type"] = Path
        keywords.setdefault("default", setting.default)
        run.add_argument(setting.metadata["flag"], dest=setting.name, help=setting.metadata["help"], **keywords)


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError told the way argparse tells a bad value."""
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parsed


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
    if arguments.command == "clear-lost":
        return client.run_client(client.command_clear_lost, socket, arguments.book, arguments.operator)
    if arguments.command == "explain":
        return client.run_client(client.command_explain, socket, arguments.device, arguments.output)
    return client.run_client(client.command_leases, socket, arguments.output)


def _check_config(path: Path, resource_prefix: str) -> int:
    from daemon import app
    from daemon.core._config import ConfigFileError

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


def _explain_without_daemon(arguments: argparse.Namespace) -> int:
    """``explain --config FILE``: the same answer as the daemon's, from a scan of the host."""
    from daemon import app
    from daemon.core._config import ConfigFileError
    from daemon.host._explain import explain_without_daemon
    from daemon.host.client import print_explanation

    settings = Settings(resource_prefix=arguments.resource_prefix, sysfs_root=arguments.sysfs_root,
                        dev_root=arguments.dev_root, proc_root=arguments.proc_root)
    try:
        handlers, config = app.load(settings, config_path=arguments.config)
    except ConfigFileError as error:
        print(f"devplugd: {error}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    print_explanation(explain_without_daemon(handlers, config, arguments.device.strip()), arguments.output)
    return app.EXIT_OK


def _device_classes(path: Path, driver: str, resource_prefix: str, rbac: bool) -> int:
    """``dra device-classes``: the DeviceClasses (and with ``rbac`` the RBAC objects) as one
    multi-document YAML stream on stdout; a config without DRA pools needs neither."""
    from daemon import app
    from daemon.core._config import DRA_API, ConfigFileError
    from daemon.core._handler import Hooks
    from daemon.dra import DeviceClassError, device_classes, rbac_objects

    if problem := dra_names_problem(driver, None):
        print(f"devplugd: {problem}", file=sys.stderr)
        return app.EXIT_BAD_CONFIG
    try:
        handlers, config = app.load(Settings(resource_prefix=resource_prefix), config_path=path)
        documents = device_classes(config, driver, lambda pool: Hooks.of(handlers[pool.handler]).lends(pool))
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

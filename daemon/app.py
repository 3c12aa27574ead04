"""The life of the daemon, in order: load → start → serve → stop.

``run(settings)`` is all the CLI calls. It reads like a table of contents: load the handlers and
the config (exit 2 on a bad one), then inside trio (with the asyncio loop that hosts grpc.aio)
start the kernel loop and the sources (inotify, uevents, rtnetlink), put the first ``Resync`` on
the bus, and serve until SIGTERM/SIGINT (SIGHUP reloads the config); then every endpoint ends
its streams, stops its server and removes its socket, and the handlers clean their side files.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import trio
import trio_asyncio

from daemon.core import ConfigChanged, Event, HandlerContext, HostChanges, LeasesChanged, Resync
from daemon.core._cdi import CdiWriter
from daemon.core._host import HostServicer, serve_control_socket
from daemon.core._leases import LeaseBook
from daemon.core._tree import DeviceTree
from daemon.core._config import ConfigFileError, DaemonConfig, load_config
from daemon.core._handler import Handler, tell_lifecycle
from daemon.core._notifier import Notifier
from daemon.core._plugins import PluginManager
from daemon.core._registry import HandlerLoadError, load_handlers, parser_table
from daemon.core._settings import Settings
from daemon.core._systemd import ServiceManager, status_line
from daemon.kernel import Kernel
from daemon.sources.inotify import InotifySource
from daemon.sources.links import LinkSource
from daemon.sources.uevents import make_uevent_source

log = logging.getLogger("devplugd")

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
EXIT_FAILURE = 1
BUS_CAPACITY = 1024
REGISTRATION_WAIT = 10.0
TEST_HANG_ENV = "DEVPLUGD_TEST_HANG_SIGNAL"


def handler_context(settings: Settings, host_changes: HostChanges | None = None) -> HandlerContext:
    return HandlerContext(
        sysfs_root=settings.sysfs_root,
        dev_root=settings.dev_root,
        proc_root=settings.proc_root,
        devinfo_dir=settings.devinfo_dir,
        host_changes=host_changes or HostChanges(),
    )


def load(
    settings: Settings, config_path: Path | None = None, host_changes: HostChanges | None = None
) -> tuple[dict[str, Handler], DaemonConfig]:
    """Find the handlers and validate the config with them. Raises ConfigFileError."""
    handlers = load_handlers(handler_context(settings, host_changes))
    config = load_config(config_path or settings.config_path, settings.resource_prefix, parser_table(handlers))
    return handlers, config


def run(settings: Settings) -> int:
    host_changes = HostChanges()
    try:
        handlers, config = load(settings, host_changes=host_changes)
    except ConfigFileError as error:
        log.error("%s", error, extra={"CONFIG_PATH": error.json_path})
        return EXIT_BAD_CONFIG
    except HandlerLoadError as error:
        log.error("%s", error)
        return EXIT_FAILURE
    try:
        make_uevent_source(settings.uevent_source, frozenset())
    except ValueError as error:
        log.error("--uevent-source %s: %s", settings.uevent_source, error)
        return EXIT_BAD_CONFIG
    for warning in config.warnings:
        log.warning("config %s: %s", config.source, warning)
    log.info("config %s: %d pools", config.source, len(config.pools))
    trio.run(_serve, settings, handlers, config, host_changes)
    return EXIT_OK


def uevent_subsystems(handlers: dict[str, Handler]) -> frozenset[str]:
    """The uevent subsystems any handler wants (empty: every subsystem)."""
    wanted: set[str] = set()
    for handler in handlers.values():
        if not handler.subsystems:
            return frozenset()
        wanted |= handler.subsystems
    return frozenset(wanted)


async def _serve(
    settings: Settings, handlers: dict[str, Handler], config: DaemonConfig, host_changes: HostChanges
) -> None:
    service = ServiceManager()
    leases = LeaseBook(settings.state_dir)
    leases.load()
    cdi = CdiWriter(settings.cdi_dir)
    cdi.remove_all()
    async with trio_asyncio.open_loop():
        notifier = Notifier()
        tell_lifecycle(handlers, config.pools, started=True)
        kernel: Kernel | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.keep_watchdog_fed, os.environ)
                plugins = PluginManager(settings, notifier, handlers, nursery)
                log.info("registration mode: %s", plugins.mode)
                plugins.remove_stale_sockets()
                send_channel, receive_channel = trio.open_memory_channel[Event](BUS_CAPACITY)
                kernel = Kernel(handlers, config, notifier, plugins, lambda: load(settings)[1], service,
                                leases.holders)

                def report_status(_: object = None) -> None:
                    service.status(status_line(notifier.tree, plugins.served_count, plugins.registered_count,
                                               plugins.mode))

                def published(tree: DeviceTree) -> None:
                    cdi.offer(tree)
                    report_status()

                kernel.on_published = published
                plugins.on_change = report_status
                nursery.start_soon(kernel.run, receive_channel)
                nursery.start_soon(cdi.run)
                host_changes.connect(lambda event: nursery.start_soon(send_channel.send, event))
                host_api = HostServicer(
                    notifier, handlers, leases, settings.device_plugin_dir,
                    lambda: nursery.start_soon(send_channel.send, LeasesChanged("lease")),
                )
                await nursery.start(serve_control_socket, settings.control_socket, settings.control_group, host_api)
                await _start_sources(nursery, settings, handlers, plugins.mode, send_channel)
                # Sources listen before the first scan, so nothing that happens during it is lost.
                await send_channel.send(Resync(None, "start"))
                nursery.start_soon(_announce_ready, kernel, plugins, settings, service)
                await _serve_signals(send_channel)
                log.info("stopping")
                service.stopping()
                nursery.cancel_scope.cancel()
        finally:
            tell_lifecycle(handlers, (kernel.config if kernel is not None else config).pools, started=False)
            cdi.remove_all()
    log.info("stopped")


async def _announce_ready(kernel: Kernel, plugins: PluginManager, settings: Settings, service: ServiceManager) -> None:
    """READY=1 once the first tree is served and, when a kubelet is there, every pool registered
    (waiting at most REGISTRATION_WAIT for a kubelet that does not answer: it is retried anyway)."""
    await kernel.first_tree_published.wait()
    wait_for_kubelet = plugins.mode == "kubelet" and settings.kubelet_socket.exists()
    with trio.move_on_after(REGISTRATION_WAIT):
        while not plugins.settled(registered=wait_for_kubelet):
            await plugins.wait_changed()
    service.ready()


async def _start_sources(
    nursery: trio.Nursery, settings: Settings, handlers: dict[str, Handler], mode: str,
    send_channel: trio.MemorySendChannel[Event],
) -> None:
    socket_dirs = [settings.plugins_registry_dir if mode == "watcher" else settings.device_plugin_dir]
    if mode == "watcher":
        socket_dirs.append(settings.device_plugin_dir)
    socket_dirs[0].mkdir(mode=0o750, parents=True, exist_ok=True)
    inotify = InotifySource(socket_dirs, settings.device_plugin_dir, settings.config_path)
    nursery.start_soon(inotify.run, send_channel.clone())
    uevents = make_uevent_source(settings.uevent_source, uevent_subsystems(handlers))
    await nursery.start(uevents.run, send_channel.clone())
    log.info("uevents: %s", uevents.describe())
    if any(getattr(handler, "wants_links", False) for handler in handlers.values()):
        await nursery.start(LinkSource().run, send_channel.clone())


async def _serve_signals(send_channel: trio.MemorySendChannel[Event]) -> None:
    """SIGHUP reloads the config; return on SIGTERM or SIGINT.

    Test-only: with ``DEVPLUGD_TEST_HANG_SIGNAL=1`` in the environment, SIGUSR2 wedges the event
    loop (a blocking sleep inside it), so tests can prove the systemd watchdog restarts us.
    """
    watched = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    hang_for_tests = os.environ.get(TEST_HANG_ENV) == "1"
    if hang_for_tests:
        watched.append(signal.SIGUSR2)
    with trio.open_signal_receiver(*watched) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                await send_channel.send(ConfigChanged("SIGHUP"))
                continue
            if hang_for_tests and signum == signal.SIGUSR2:
                log.warning("SIGUSR2 with %s=1: wedging the event loop on purpose", TEST_HANG_ENV)
                time.sleep(365 * 24 * 3600)  # blocks the whole loop: no more watchdog pings
            log.info("received %s", signal.Signals(signum).name)
            return

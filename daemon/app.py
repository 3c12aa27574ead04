"""The life of the daemon, in order: load → start → serve → stop.

``run(settings)`` is all the CLI calls. It reads like a table of contents: load the handlers and
the config (exit 2 on a bad one), start the metrics server when ``--metrics-address`` asks (exit
2 when it cannot bind), then inside trio (with the asyncio loop that hosts grpc.aio) subscribe
the consumers of the tree to the notifier (the device-plugin endpoints, the CDI writer, the NFD
node labels, the metrics, the STATUS line; the streams subscribe themselves, see below), serve the
host API, start the event loop and the sources (inotify, uevents, rtnetlink), put the first
``Resync`` on the bus, and serve until SIGTERM/SIGINT (SIGHUP reloads the config); then every
endpoint ends its streams, stops its server and removes its socket, and the handlers clean
their side files.

Before any of it touches what the node shares (the books, sockets, files, the metrics port),
the instance takes the state directory's lock (``holdings/_active.py``): a new pod of a rolling
update asks the active one to hand over and waits for the lock. The one asked stops writing
(``_stop_writing``), ends its active part, frees the port and the lock, and stays passive (its
DRA registration kept, refusing calls) until SIGTERM, leaving every shared file to the new one.

One uevent, from the kernel to the kubelet: ``sources/uevents.py`` puts it on the bus →
``loop.py`` batches it and routes it to a handler, whose fold reads the device again and patches
its pools → ``holdings/_assemble.py`` builds the next tree with who holds what →
``core/_notifier.py`` offers the tree to every subscriber → ``deviceplugin/_servicer.py`` sends
the ListAndWatch message. ListAndWatch streams, DRA health streams and host Watch streams
subscribe themselves to the notifier while they are open.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import trio
import trio_asyncio

from daemon.bus import Inbox
from daemon.cdi import CdiWriter
from daemon.checkpoint import CheckpointReader
from daemon.core import Event, HandlerContext, Resync
from daemon.core._config import ConfigFileError, DaemonConfig, load_config
from daemon.core._events import ClaimsChanged, ConfigChanged, LeasesChanged, PluginSocketRemoved
from daemon.core._explain import Explaining
from daemon.core._handler import AnyHandler, HostChanges, tell_lifecycle
from daemon.core._notifier import Notifier
from daemon.core._registry import HandlerLoadError, load_handlers, parser_table
from daemon.deviceplugin import Endpoints, directory_problem
from daemon.dra import ClaimBook, DraDriver
from daemon.holdings import Handover, Holdings, StateLock, WriteGate, become_active, instance_name
from daemon.host import Granter, HostServicer, LeaseBook, serve_control_socket
from daemon.hostcheck import log_host_problems
from daemon.loop import EventLoop
from daemon.metrics import Metrics, MetricsServer, without_created_series
from daemon.nfd import NfdFeatures
from daemon.service import ServiceManager, StatusReporter
from daemon.settings import Settings, dra_names_problem, pod_uid_problem
from daemon.sockets import socket_path_problem
from daemon.sources.inotify import InotifySource
from daemon.sources.links import LinkSource
from daemon.sources.uevents import carries_udev_properties, make_uevent_source, resolve_uevent_source
from daemon.supervise import Backoff, keep_running

log = logging.getLogger("devplugd")

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
EXIT_FAILURE = 1
BUS_CAPACITY = 1024
KUBELET_EVENTS_CAPACITY = 64
REGISTRATION_WAIT = 10.0
DRAIN_TIMEOUT = 10.0  # a handover waits this long at most for the grants and prepares in flight


def handler_context(settings: Settings, host_changes: HostChanges | None = None) -> HandlerContext:
    return HandlerContext(
        sysfs_root=settings.sysfs_root,
        dev_root=settings.dev_root,
        proc_root=settings.proc_root,
        devinfo_dir=settings.devinfo_dir,
        host_changes=host_changes or HostChanges(),
        udev_data=settings.udev_data_dir if carries_udev_properties(settings.uevent_source) else None,
    )


def load(
    settings: Settings, config_path: Path | None = None, host_changes: HostChanges | None = None
) -> tuple[dict[str, AnyHandler], DaemonConfig]:
    """Find the handlers and validate the config with them. Raises ConfigFileError."""
    handlers = load_handlers(handler_context(settings, host_changes))
    config = load_config(config_path or settings.config_path, settings.resource_prefix, parser_table(handlers))
    return handlers, config


def run(settings: Settings) -> int:
    # ``auto`` decided once: the handlers (reading udev's database or not) and the source agree;
    # the pod's UID from the downward API ($POD_UID) unless --pod-uid says it
    settings = dataclasses.replace(settings, uevent_source=resolve_uevent_source(settings.uevent_source),
                                   pod_uid=settings.pod_uid or os.environ.get("POD_UID") or None)
    if problem := pod_uid_problem(settings.pod_uid):
        log.error("%s", problem)
        return EXIT_BAD_CONFIG
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
    if config.dra_pools and (problem := dra_names_problem(settings.dra_driver, settings.node_name)):
        log.error("%s: needed for the DRA pools of %s", problem, config.source)
        return EXIT_BAD_CONFIG
    if problem := _socket_problem(settings, bool(config.dra_pools)):
        log.error("%s", problem)
        return EXIT_BAD_CONFIG
    for warning in config.warnings:
        log.warning("config %s: %s", config.source, warning)
    log_host_problems(handlers, config)  # as at each reload, below
    log.info("config %s: %d pools", config.source, len(config.pools))
    lock = StateLock(settings.state_dir, instance_name(settings.pod_uid))
    try:
        # the state directory's one writer: nothing shared (books, sockets, files, the metrics
        # port) is touched before the lock is ours
        if not trio.run(become_active, lock, settings.control_socket, settings.pod_uid is not None):
            return EXIT_OK
        without_created_series()
        checkpoint = CheckpointReader(settings.device_plugin_dir)
        metrics = Metrics(checkpoint, standard=True)
        try:
            metrics_server = _serve_metrics(settings, metrics)
        except OSError as error:
            log.error("--metrics-address %s: cannot serve metrics there: %s", _address(settings.metrics_address),
                      error)
            return EXIT_BAD_CONFIG
        served = [metrics_server] if metrics_server is not None else []

        def hand_over_shared() -> None:
            """What the next instance must have once this one hands over: the metrics port, the lock."""
            while served:
                served.pop().close()
            lock.release()

        try:
            trio.run(_serve, settings, handlers, config, host_changes, metrics, checkpoint, hand_over_shared)
        finally:
            hand_over_shared()
    finally:
        lock.release()
    return EXIT_OK


def _socket_problem(settings: Settings, dra: bool) -> str | None:
    """Why a socket the daemon must serve cannot be served where the settings put it: every
    one is a gRPC server, and gRPC has a shorter limit than the kernel (``GRPC_PATH_MAX``)."""
    if problem := socket_path_problem(settings.control_socket):
        return f"--control-socket: {problem}"
    directory = settings.plugins_registry_dir if settings.effective_registration() == "watcher" \
        else settings.device_plugin_dir
    if problem := directory_problem(directory):
        return f"device-plugin sockets: {problem}"
    if dra:
        for flag, path in (("--dra-plugin-dir", settings.dra_socket),
                           ("--plugins-registry-dir", settings.dra_registration_socket)):
            if problem := socket_path_problem(path):
                return f"{flag}: the DRA driver's socket: {problem}"
    return None


def _serve_metrics(settings: Settings, metrics: Metrics) -> MetricsServer | None:
    """The metrics server in its own thread, when ``--metrics-address`` is given. Raises OSError."""
    if settings.metrics_address is None:
        return None
    server = MetricsServer(metrics.registry, settings.metrics_address, metrics.liveness)
    log.info("metrics: serving http://%s/metrics", _address((settings.metrics_address[0], server.port)))
    return server


def _address(address: tuple[str, int] | None) -> str:
    host, port = address or ("", 0)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def uevent_subsystems(handlers: Mapping[str, AnyHandler]) -> frozenset[str]:
    """The uevent subsystems any handler wants (empty: every subsystem)."""
    wanted: set[str] = set()
    for handler in handlers.values():
        if not handler.subsystems:
            return frozenset()
        wanted |= handler.subsystems
    return frozenset(wanted)


async def _serve(
    settings: Settings, handlers: dict[str, AnyHandler], config: DaemonConfig, host_changes: HostChanges,
    metrics: Metrics, checkpoint: CheckpointReader, hand_over_shared: Callable[[], None],
) -> None:
    service = ServiceManager()
    leases = LeaseBook(settings.state_dir)
    leases.load()
    claims = ClaimBook(settings.state_dir)
    claims.load()
    holdings = Holdings(leases, claims, checkpoint)
    metrics.lost_books.labels("lease").set_function(lambda: float(leases.lost_book is not None))
    metrics.lost_books.labels("claim").set_function(lambda: float(claims.lost_book is not None))
    cdi = CdiWriter(settings.cdi_dir)
    cdi.remove_all()
    labels = NfdFeatures(settings.nfd_features_dir)
    parsers = parser_table(handlers)  # a reload is validated by the handlers that serve it

    def reload_config() -> DaemonConfig:  # what the host lacks for it is said, as at start
        return log_host_problems(handlers, load_config(settings.config_path, settings.resource_prefix, parsers))

    async with trio_asyncio.open_loop():
        notifier = Notifier()
        notifier.subscribe(metrics.tree)
        tell_lifecycle(handlers, config.pools, started=True)
        loop: EventLoop | None = None
        handover = Handover(settings.state_dir)
        host_gate = WriteGate()
        stop = trio.Event()
        passive = False
        try:
            async with trio.open_nursery() as outer:  # the process's life; the active part inside it
                outer.start_soon(service.keep_watchdog_fed, os.environ)
                outer.start_soon(metrics.liveness.keep_beating)
                send_channel, receive_channel = trio.open_memory_channel[Event](BUS_CAPACITY)
                outer.start_soon(_serve_signals, send_channel, stop, handover)
                active: tuple[trio.Nursery, trio.Event] = await outer.start(_active_part)
                nursery, active_part_ended = active
                kubelet_send, kubelet_receive = trio.open_memory_channel[Event](KUBELET_EVENTS_CAPACITY)
                inbox = Inbox(send_channel.clone())
                nursery.start_soon(inbox.run)
                leases.book.on_change = lambda: inbox.post(LeasesChanged("lease book"))
                claims.book.on_change = lambda: inbox.post(ClaimsChanged("claim book"))
                host_changes.connect(inbox.post)
                endpoints = Endpoints(settings, notifier, handlers, nursery, metrics, holdings.holder)
                log.info("registration mode: %s", endpoints.mode)
                endpoints.remove_stale_sockets()
                status = StatusReporter(service, endpoints, holdings.lost_books)
                endpoints.on_change = status.refresh
                inotify = _inotify(settings, endpoints.mode)
                dra = DraDriver(settings, handlers, notifier, claims, holdings, inbox.post, nursery,
                                inotify.add_socket_dir, metrics)
                if config.dra_pools:
                    dra.warm_up()
                for consumer in (endpoints, dra, cdi, labels, status):
                    notifier.subscribe(consumer)
                nursery.start_soon(_follow_kubelet, kubelet_receive, endpoints, dra)
                nursery.start_soon(keep_running, "the CDI writer", cdi.run, Backoff(first=0.1, maximum=10.0))
                nursery.start_soon(keep_running, "the node labels", labels.run, Backoff(first=0.1, maximum=10.0))
                loop = event_loop = EventLoop(handlers, config, notifier, reload_config, holdings, service, metrics,
                                              capacity=BUS_CAPACITY)
                nursery.start_soon(loop.run, receive_channel)
                explaining = Explaining(handlers, lambda: event_loop.config, event_loop.facts_of)
                host_api = HostServicer(notifier, Granter(notifier, handlers, leases, holdings, explaining.why_empty),
                                        leases, holdings, {"leases": leases.book, "claims": claims.book}, metrics,
                                        explaining, host_gate)
                await nursery.start(serve_control_socket, settings.control_socket, settings.control_group, host_api)
                await _start_sources(nursery, settings, handlers, inotify, send_channel, kubelet_send)
                for lent in dra.lent_at_start():  # folded into the first scan
                    await send_channel.send(lent)
                # Sources listen before the first scan, so nothing that happens during it is lost.
                await send_channel.send(Resync(None, "start"))
                nursery.start_soon(_announce_ready, loop, endpoints, settings, service)
                outer.start_soon(handover.serve)  # a new pod of a rolling update may ask from now on
                await _first(stop.wait, handover.requested.wait)
                passive = not stop.is_set()
                if passive:
                    await _stop_writing(handover, host_gate, dra)
                else:
                    log.info("stopping")
                    service.stopping()
                nursery.cancel_scope.cancel()
                await active_part_ended.wait()
                for book in (leases.book, claims.book):  # whole in the one file an earlier devplugd reads
                    await book.settle()
                    if passive:  # a call still in flight past the drain writes nothing once the lock goes
                        book.seal(f"this devplugd has handed over to {handover.requester}")
                if passive:
                    hand_over_shared()  # the metrics port and the lock, once nothing of ours writes
                    handover.answer = {"handed_over": True, "message": f"{instance_name(settings.pod_uid)} is passive"}
                    handover.done.set()
                    log.info("handed over to %s: passive, the DRA registration kept until SIGTERM",
                             handover.requester, extra={"EVENT": "handed-over"})
                    service.status(f"passive: handed over to {handover.requester}")
                    await stop.wait()
                    log.info("stopping")
                    service.stopping()
                    if dra.sockets is not None:
                        await dra.sockets.stop_passive()
                outer.cancel_scope.cancel()
        finally:
            if not passive:  # the next instance's files now: a passive one leaves them
                tell_lifecycle(handlers, (loop.config if loop is not None else config).pools, started=False)
                cdi.remove_all()
    log.info("stopped")


async def _active_part(task_status: trio.TaskStatus[tuple[trio.Nursery, trio.Event]]) -> None:
    """A nursery for the active part of the daemon, which a handover ends (its event set once
    everything in it has ended) while the process goes on."""
    ended = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            task_status.started((nursery, ended))
            await trio.sleep_forever()
    finally:
        ended.set()


async def _first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of ``waits`` returns."""
    async with trio.open_nursery() as nursery:
        for wait in waits:
            async def until(wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(until)


async def _stop_writing(handover: Handover, host_gate: WriteGate, dra: DraDriver) -> None:
    """A new pod asked for the state: no more grants or book writes here (the calls in flight
    end first), and the DRA sockets stay, passive, when the active part goes."""
    log.info("handing over to %s", handover.requester, extra={"EVENT": "handing-over"})
    reason = (f"this devplugd has handed over to {handover.requester}: try again (the kubelet's next call "
              f"goes to its newest registration, the control socket is the new one's)")
    drained = await host_gate.close(reason, DRAIN_TIMEOUT)
    if dra.sockets is not None:
        drained = await dra.sockets.go_passive(reason) and drained
    if not drained:
        log.warning("calls still in flight: handing over all the same (what they would write to the books is "
                    "refused)")


async def _announce_ready(loop: EventLoop, endpoints: Endpoints, settings: Settings, service: ServiceManager) -> None:
    """READY=1 once the first tree is served and, when a kubelet is there, every pool registered
    (waiting at most REGISTRATION_WAIT for a kubelet that does not answer: it is retried anyway)."""
    await loop.first_tree_published.wait()
    wait_for_kubelet = endpoints.mode == "kubelet" and settings.kubelet_socket.exists()
    with trio.move_on_after(REGISTRATION_WAIT):
        while not endpoints.settled(registered=wait_for_kubelet):
            await endpoints.wait_changed()
    # What start-up made (modules, the first tree) lives as long as the daemon: out of the
    # collector's generations, so each collection from now on walks only what came after.
    gc.freeze()
    service.ready()


def _inotify(settings: Settings, mode: str) -> InotifySource:
    """The one inotify source: our socket directories, the kubelet's checkpoint, the config."""
    socket_dirs = [settings.plugins_registry_dir if mode == "watcher" else settings.device_plugin_dir]
    if mode == "watcher":
        socket_dirs.append(settings.device_plugin_dir)
    socket_dirs[0].mkdir(mode=0o750, parents=True, exist_ok=True)
    return InotifySource(socket_dirs, settings.device_plugin_dir, settings.config_path)


async def _follow_kubelet(events: trio.MemoryReceiveChannel[Event], endpoints: Endpoints, dra: DraDriver) -> None:
    """The kubelet's restarts and removals of our sockets, to whoever serves those sockets."""
    async for event in events:
        endpoints.kubelet_event(event)
        if isinstance(event, PluginSocketRemoved):
            dra.socket_removed(event.path)


async def _start_sources(
    nursery: trio.Nursery, settings: Settings, handlers: Mapping[str, AnyHandler], inotify: InotifySource,
    send_channel: trio.MemorySendChannel[Event], kubelet_send: trio.MemorySendChannel[Event],
) -> None:
    nursery.start_soon(inotify.run, send_channel.clone(), kubelet_send)
    uevents = make_uevent_source(settings.uevent_source, uevent_subsystems(handlers))
    await nursery.start(uevents.run, send_channel.clone())
    log.info("uevents: %s", uevents.describe())
    if any(getattr(handler, "wants_links", False) for handler in handlers.values()):
        await nursery.start(LinkSource().run, send_channel.clone())


async def _serve_signals(send_channel: trio.MemorySendChannel[Event], stop: trio.Event, handover: Handover) -> None:
    """SIGHUP reloads the config (not once handing over: nothing is served to reload); SIGTERM or
    SIGINT sets ``stop``."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                if handover.requested.is_set():
                    log.info("received SIGHUP: passive, nothing to reload")
                else:
                    await send_channel.send(ConfigChanged("SIGHUP"))
                continue
            log.info("received %s", signal.Signals(signum).name)
            stop.set()
            return

"""inotify on the files the daemon follows: the kubelet's socket directories and the config file.

One inotify instance for the whole daemon (one per resource exhausted
``fs.inotify.max_user_instances`` for a peer). It reports:

* ``kubelet.sock`` created in the device-plugin directory: a kubelet (re)started (it deletes
  every socket there first, then listens again);
* a socket removed from a directory we serve in (these two go to the device-plugin endpoints);
* the kubelet's checkpoint (``kubelet_internal_checkpoint``, written to a temporary file and
  renamed into place) written, replaced or removed: the event loop may drop a vanished device it
  kept listed while a pod held it;
* the config file written, replaced, or swapped ConfigMap-style (the ``..data`` symlink in its
  directory renamed into place): reload it.

A watched directory that is deleted is watched for again through its parent. Nothing here
polls: the task sleeps in ``wait_readable`` until the kernel has something to say.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio
from inotify_simple import INotify
from inotify_simple import flags as in_flags

from daemon.checkpoint import CHECKPOINT_NAME
from daemon.core import Event
from daemon.core._events import CheckpointChanged, ConfigChanged, KubeletSocketCreated, PluginSocketRemoved
from daemon.settings import KUBELET_SOCKET_NAME

log = logging.getLogger("devplugd.inotify")

DIR_MASK = (
    in_flags.CREATE | in_flags.MOVED_TO | in_flags.DELETE | in_flags.MOVED_FROM
    | in_flags.DELETE_SELF | in_flags.CLOSE_WRITE
)
PARENT_MASK = in_flags.CREATE | in_flags.MOVED_TO
FILE_CHANGED = in_flags.CLOSE_WRITE | in_flags.MOVED_TO | in_flags.CREATE | in_flags.DELETE | in_flags.MOVED_FROM
CONFIGMAP_DATA_LINK = "..data"


class InotifySource:
    def __init__(self, socket_dirs: list[Path], kubelet_dir: Path | None, config_path: Path | None) -> None:
        self._kubelet_dir = kubelet_dir
        self._config_path = config_path
        self._directories = list(dict.fromkeys(
            [*socket_dirs, *([config_path.parent] if config_path is not None else [])]))
        self._socket_dirs = set(socket_dirs)
        self._inotify = INotify(nonblocking=True)
        self._watched: dict[int, Path] = {}
        self._parents: dict[int, Path] = {}
        for directory in self._directories:
            self._watch(directory)

    def _watch(self, directory: Path) -> None:
        try:
            self._watched[self._inotify.add_watch(directory, DIR_MASK)] = directory
        except OSError:
            # Not there (yet): wait for it to be created in its parent.
            parent = directory.parent
            parent.mkdir(parents=True, exist_ok=True)
            self._parents[self._inotify.add_watch(parent, PARENT_MASK)] = parent
            if directory.is_dir():
                self._watch(directory)

    def add_socket_dir(self, directory: Path) -> None:
        """Follow one more directory we serve sockets in (the DRA plugin's and the plugin
        registry, once a pool is served through DRA)."""
        if directory in self._socket_dirs:
            return
        self._directories.append(directory)
        self._socket_dirs.add(directory)
        if directory not in self._watched.values():
            self._watch(directory)

    def close(self) -> None:
        self._inotify.close()

    async def run(self, send: trio.MemorySendChannel[Event],
                  kubelet_send: trio.MemorySendChannel[Event] | None = None) -> None:
        """Send config and checkpoint changes on ``send`` (the bus) and the kubelet's socket events
        on ``kubelet_send`` (to the device-plugin endpoints; the bus too when it is ``None``)."""
        kubelet_channel = kubelet_send if kubelet_send is not None else send
        try:
            while True:
                await trio.lowlevel.wait_readable(self._inotify.fileno())
                for event in self._read():
                    kubelet_event = isinstance(event, (KubeletSocketCreated, PluginSocketRemoved))
                    await (kubelet_channel if kubelet_event else send).send(event)
        finally:
            self.close()

    def _read(self) -> list[Event]:
        events: list[Event] = []
        try:
            raw_events = self._inotify.read(timeout=0)
        except BlockingIOError:
            return events
        for raw in raw_events:
            if raw.wd in self._parents:
                self._directory_appeared(self._parents[raw.wd] / raw.name, events)
                continue
            directory = self._watched.get(raw.wd)
            if directory is None:
                continue
            if raw.mask & (in_flags.DELETE_SELF | in_flags.IGNORED):
                del self._watched[raw.wd]
                log.warning("%s was removed; waiting for it to come back", directory)
                self._watch(directory)
                continue
            path = directory / raw.name
            if self._config_path is not None and directory == self._config_path.parent and raw.name in (
                self._config_path.name, CONFIGMAP_DATA_LINK
            ):
                if raw.mask & (in_flags.CLOSE_WRITE | in_flags.MOVED_TO | in_flags.CREATE | in_flags.DELETE):
                    events.append(ConfigChanged(f"{path} changed"))
            if directory == self._kubelet_dir and raw.name == CHECKPOINT_NAME:
                if raw.mask & FILE_CHANGED:
                    events.append(CheckpointChanged(str(path)))
                continue  # not a socket of ours, nor the kubelet's
            if directory not in self._socket_dirs:
                continue
            if raw.mask & (in_flags.CREATE | in_flags.MOVED_TO):
                if raw.name == KUBELET_SOCKET_NAME and directory == self._kubelet_dir:
                    log.info("kubelet.sock created: the kubelet (re)started", extra={"EVENT": "kubelet-start"})
                    events.append(KubeletSocketCreated(str(path)))
            elif raw.mask & (in_flags.DELETE | in_flags.MOVED_FROM):
                events.append(PluginSocketRemoved(str(path)))
        return events

    def _directory_appeared(self, path: Path, events: list[Event]) -> None:
        if path not in self._directories or path in self._watched.values():
            return
        self._watch(path)
        if path == self._kubelet_dir and (path / KUBELET_SOCKET_NAME).exists():
            events.append(KubeletSocketCreated(str(path / KUBELET_SOCKET_NAME)))
        if path == self._kubelet_dir:
            events.append(CheckpointChanged(str(path / CHECKPOINT_NAME)))
        if self._config_path is not None and path == self._config_path.parent:
            events.append(ConfigChanged(f"{path} appeared"))

"""inotify on the kubelet's socket directories: a kubelet (re)start and removed sockets.

The kubelet, when it starts, deletes every socket in ``device-plugins/`` and then creates
``kubelet.sock``; both show up here within microseconds, with no polling. One inotify instance
serves all watched directories. A watched directory that is deleted is watched for again
through its parent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio
from inotify_simple import INotify
from inotify_simple import flags as in_flags

from daemon.core import Event, KubeletSocketCreated, PluginSocketRemoved
from daemon.core._settings import KUBELET_SOCKET_NAME

log = logging.getLogger("devplugd.inotify")

DIR_MASK = in_flags.CREATE | in_flags.MOVED_TO | in_flags.DELETE | in_flags.MOVED_FROM | in_flags.DELETE_SELF
PARENT_MASK = in_flags.CREATE | in_flags.MOVED_TO


class KubeletDirWatcher:
    def __init__(self, directories: list[Path], kubelet_dir: Path | None) -> None:
        self._directories = directories
        self._kubelet_dir = kubelet_dir
        self._inotify = INotify(nonblocking=True)
        self._watched: dict[int, Path] = {}
        self._parents: dict[int, Path] = {}
        for directory in directories:
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

    def close(self) -> None:
        self._inotify.close()

    async def run(self, send: trio.MemorySendChannel[Event]) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self._inotify.fileno())
                for event in self._read():
                    await send.send(event)
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
                parent = self._parents[raw.wd]
                if (parent / raw.name) in self._directories and (parent / raw.name) not in self._watched.values():
                    self._watch(parent / raw.name)
                    if (parent / raw.name) == self._kubelet_dir and (parent / raw.name / KUBELET_SOCKET_NAME).exists():
                        events.append(KubeletSocketCreated(str(parent / raw.name / KUBELET_SOCKET_NAME)))
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
            if raw.mask & (in_flags.CREATE | in_flags.MOVED_TO):
                if raw.name == KUBELET_SOCKET_NAME and directory == self._kubelet_dir:
                    log.info("kubelet.sock created: the kubelet (re)started", extra={"EVENT": "kubelet-start"})
                    events.append(KubeletSocketCreated(str(path)))
            elif raw.mask & (in_flags.DELETE | in_flags.MOVED_FROM):
                events.append(PluginSocketRemoved(str(path)))
        return events

"""The kubelet's own record of which pod holds which device: its device manager checkpoint,
``kubelet_internal_checkpoint`` in the device-plugin directory. Read only, never written.

``CheckpointReader`` is the one reader of the daemon: the event loop (a device that vanishes
while a pod holds it stays listed, Unhealthy; a DRA pool leaves out what pods hold), the host API
(who holds each device) and the metrics (which pod holds which device) all take its reading.
With many pods the file is large (megabytes), so it is parsed in a worker thread, never on the
event loop, and only again after it changed: inotify tells (``mark_changed``), and a reading is
also checked against the file's identity (inode, size, modification time), so a reader on
another thread (a scrape) never parses an unchanged file twice.

The kubelet writes the file to a temporary name and renames it into place, so a read sees the
old or the new file, never half of one. A file that cannot be read or parsed is a reading of its
own (``Reading.error``), told apart from an empty one: who holds what is then unknown.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import trio

from daemon.core._jsonpath import parse_json

log = logging.getLogger("devplugd.checkpoint")

CHECKPOINT_NAME = "kubelet_internal_checkpoint"

# (resource, device ID) -> ``pod <uid>/<container>``
Allocations = dict[tuple[str, str], str]
# (resource, device ID) -> (pod UID, container name)
PodDevices = dict[tuple[str, str], tuple[str, str]]
# what tells one version of the file from another: (inode, size, mtime in ns); None: no file
_Identity = tuple[int, int, int] | None


class CheckpointError(Exception):
    """The checkpoint exists but cannot be read or parsed."""


def read_holdings(device_plugin_dir: Path) -> PodDevices:
    """(resource, device ID) -> (pod UID, container) from the kubelet's checkpoint; ``{}`` when
    there is no checkpoint. Raises CheckpointError (not logged) when it cannot be read or parsed."""
    try:
        document = parse_json((device_plugin_dir / CHECKPOINT_NAME).read_bytes())
        entries = document["Data"]["PodDeviceEntries"] or []
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read the kubelet checkpoint in {device_plugin_dir}: {error}") from error
    held: PodDevices = {}
    try:
        for entry in entries:
            try:
                owner = (str(entry["PodUID"]), str(entry["ContainerName"]))
                ids = entry["DeviceIDs"]
                flat = [i for group in ids.values() for i in group] if isinstance(ids, dict) else list(ids)
                for device_id in flat:
                    held[(entry["ResourceName"], device_id)] = owner
            except (KeyError, TypeError, AttributeError):
                continue
    except TypeError as error:  # PodDeviceEntries is not a list
        raise CheckpointError(f"cannot read the kubelet checkpoint in {device_plugin_dir}: {error}") from error
    return held


@dataclass(frozen=True)
class Reading:
    """One reading of the checkpoint: who holds what, or why that is unknown (``error``)."""

    holdings: PodDevices = field(default_factory=dict)
    error: str | None = None
    exists: bool = False
    identity: _Identity = None

    @cached_property
    def allocations(self) -> Allocations | None:
        """``pod <uid>/<container>`` by (resource, device ID); ``None`` when it cannot be read."""
        if self.error is not None:
            return None
        return {key: f"pod {pod_uid}/{container}" for key, (pod_uid, container) in self.holdings.items()}


def _identity(path: Path) -> _Identity:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


def _read(device_plugin_dir: Path, identity: _Identity) -> Reading:
    try:
        holdings = read_holdings(device_plugin_dir)
    except CheckpointError as error:
        return Reading(error=str(error), exists=True, identity=identity)
    return Reading(holdings, exists=identity is not None, identity=identity)


class CheckpointReader:
    """The checkpoint as last read, read again (in a worker thread) once it changed.

    ``reading`` is the last reading and never blocks; ``current()`` (trio) reads again first if
    the file changed since; ``read_if_changed()`` does the same on the caller's own thread (the
    metrics server's). ``directory`` ``None``: no kubelet, nothing is ever held."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._changes = 1  # CheckpointChanged events so far; 1: never read
        self._read_at = 0  # the value of _changes the last reading started at
        self._reading = Reading()
        self._lock = threading.Lock()  # one read at a time, whichever thread asks
        self.reads = 0  # times the file was parsed (devplugd_kubelet_checkpoint_reads_total)

    @property
    def directory(self) -> Path | None:
        return self._directory

    @property
    def reading(self) -> Reading:
        return self._reading

    @property
    def stale(self) -> bool:
        """Whether the file may have changed since the last reading."""
        return self._directory is not None and self._read_at != self._changes

    def mark_changed(self) -> None:
        """inotify says the file was written, replaced or removed (on the trio thread)."""
        self._changes += 1

    async def current(self) -> Reading:
        """The reading of the file as it is now: the last one if nothing changed since."""
        if not self.stale:
            return self._reading
        return await trio.to_thread.run_sync(self.read_if_changed)

    def read_if_changed(self) -> Reading:
        """``current`` on the caller's thread (never the event loop's): parse the file only when
        it changed since the last reading."""
        if self._directory is None:
            return self._reading
        with self._lock:
            changes = self._changes
            identity = _identity(self._directory / CHECKPOINT_NAME)
            if identity != self._reading.identity:
                self._reading = _read(self._directory, identity)
                self.reads += 1
                if self._reading.error is not None:  # once per version of the file
                    log.warning("%s; who holds which device through the kubelet is unknown until it can be read",
                                self._reading.error)
            self._read_at = changes  # a change during the read is read next time
            return self._reading

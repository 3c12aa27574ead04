"""The Multus device-info files of netDevice pools (``<prefix>-<name>-<id>-device.json``, spec
1.1.0, mode 0444 as the NAD client writes them): written at Allocate, removed when the pool
starts or stops and when a DRA claim is unprepared, as upstream does.

Allocate runs on the event loop for every container, and most Allocates hand out a device whose
file is already there from its last Allocate. So each file keeps the identity it had when this
daemon wrote it, (inode, ctime, size), with its content: a file that still has that identity,
when the content wanted is the same, costs one ``stat`` instead of an unlink and a create.
Anything done to the file since (removed, written, chmod-ed, replaced) changes its identity, and
the file is written again. DRA prepares and unprepares in worker threads while the kubelet's
Allocate runs on the event loop: one lock keeps each check and its write together.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from daemon.handlers._functions import PCI_ADDRESS

from ._allocation import PciDetails, vdpa_node_path

DEVINFO_VERSION = "1.1.0"

# Immutable once made; json.dumps with options would make an encoder per call (every Allocate).
_COMPACT_ENCODER = json.JSONEncoder(separators=(",", ":"))

_Identity = tuple[int, int, int]  # (inode, ctime in ns, size)


def devinfo_file_name(resource: str, device_id: str) -> str:
    return f"{resource.replace('/', '-')}-{device_id.replace('/', '-')}-device.json"


def devinfo_document(details: PciDetails) -> bytes:
    if details.vdpa is not None:
        vdpa = {"parent-device": details.vdpa.name, "driver": details.vdpa.vdpa_type or ""}
        if path := vdpa_node_path(details.vdpa):
            vdpa["path"] = path
        vdpa["pci-address"] = details.device.address
        return _COMPACT_ENCODER.encode({"type": "vdpa", "version": DEVINFO_VERSION, "vdpa": vdpa}).encode()
    pci: dict[str, str] = {"pci-address": details.device.address}
    if details.rdma_device:
        pci["rdma-device"] = details.rdma_device
    document = {"type": "pci", "version": DEVINFO_VERSION, "pci": pci}
    return _COMPACT_ENCODER.encode(document).encode()


class DevinfoFiles:
    """The device-info files in one directory, and what this daemon last wrote to each."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        # (resource, PCI address) -> what was written: the file's identity after the write, the
        # content, and the record it was made from (the same record: the same content, not encoded again)
        self._written: dict[tuple[str, str], tuple[_Identity, bytes, PciDetails]] = {}
        self._lock = threading.Lock()

    def _path(self, resource: str, address: str) -> str:
        return os.path.join(self._directory, devinfo_file_name(resource, address))

    def write(self, resource: str, details: PciDetails) -> None:
        """Make the device's file say ``details`` (see the module docstring)."""
        key = (resource, details.device.address)
        with self._lock:
            known = self._written.pop(key, None)
            if known is not None and (known[2] is details or known[1] == devinfo_document(details)) \
                    and _identity(self._path(*key)) == known[0]:
                self._written[key] = (known[0], known[1], details)
                return
            document = devinfo_document(details)
            self._written[key] = (self._replace(self._path(*key), document), document, details)

    def remove(self, resource: str, addresses: Iterable[str]) -> None:
        """Remove the files of these functions of ``resource``."""
        for address in addresses:
            with self._lock:
                self._written.pop((resource, address), None)
                Path(self._path(resource, address)).unlink(missing_ok=True)

    def remove_pool(self, resource: str) -> int:
        """Remove every device-info file of ``resource`` (and no other pool's); return how many."""
        prefix = resource.replace("/", "-") + "-"
        removed = 0
        try:
            names = os.listdir(self._directory)
        except OSError:
            return 0
        for name in names:
            if not (name.startswith(prefix) and name.endswith("-device.json")):
                continue
            if PCI_ADDRESS.fullmatch(address := name[len(prefix):-len("-device.json")]):
                with self._lock:
                    self._written.pop((resource, address), None)
                    Path(self._directory, name).unlink(missing_ok=True)
                removed += 1
        return removed

    def _replace(self, path: str, document: bytes) -> _Identity:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        except FileNotFoundError:  # the directory is not there (yet, or any more): make it, once
            self._directory.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            os.write(descriptor, document)
            written = os.fstat(descriptor)
        finally:
            os.close(descriptor)
        return written.st_ino, written.st_ctime_ns, written.st_size


def _identity(path: str) -> _Identity | None:
    try:
        now = os.stat(path)
    except OSError:
        return None
    return now.st_ino, now.st_ctime_ns, now.st_size

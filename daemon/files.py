"""Writing files so that readers and crashes see the old content or the new, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def write_all(descriptor: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view:
        written = os.write(descriptor, view)
        view = view[written:]


def write_atomically(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data``: a temporary file in the same directory, renamed over it.

    ``durable`` adds the fsyncs (file, then directory) that make the new content survive a power
    loss; files on a tmpfs (CDI specs in /var/run) need only the rename. This blocks for as long
    as the disk takes: callers on the event loop run it in a worker thread. A write that fails
    (a full disk) leaves ``path`` as it was and no temporary file behind."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(descriptor, data)
            if durable:
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        sync_directory(path.parent)


def sync_directory(path: Path) -> None:
    """fsync the directory ``path``: the names made, renamed or removed in it survive a power loss."""
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Create ``path`` (FileExistsError if it is there) with ``data``, in place: no temporary
    file, no rename, one directory operation fewer than ``write_atomically``. Only for a file
    nobody reads before its writer says it is there, and that its writer checks and writes again
    after a crash (one cut short is left short)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        write_all(descriptor, data)
    finally:
        os.close(descriptor)

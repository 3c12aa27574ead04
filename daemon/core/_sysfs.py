"""Small, total readers for sysfs-shaped trees.

Each returns ``None`` (or an empty result) when the entry is missing, so a handler decides what a
missing file means. ``SysfsError`` is raised only for content that is there but unusable, with the
path in the message, so the caller can skip that one device and say why.
"""

from __future__ import annotations

import os
import sys
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


class SysfsError(Exception):
    """A sysfs entry exists but its content cannot be used. The message names the path."""


def read_text(path: PathLike) -> str | None:
    """The stripped content of ``path``, or ``None`` if it does not exist.

    Plain ``os.open``/``os.read``: a sysfs attribute is one small read, and a 4096-VF host means
    tens of thousands of them at start, where buffered file objects cost 4x more.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise SysfsError(f"{path}: cannot read: {error.strerror or error}") from error
    try:
        data = os.read(descriptor, 65536)
    except OSError as error:
        raise SysfsError(f"{path}: cannot read: {error.strerror or error}") from error
    finally:
        os.close(descriptor)
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError as error:
        raise SysfsError(f"{path}: content is not text") from error


def read_int(path: PathLike, base: int = 10) -> int | None:
    """An integer file (``base`` 16 accepts a ``0x`` prefix); ``None`` when missing."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError as error:
        raise SysfsError(f"{path}: expected an integer, found {text[:40]!r}") from error


def read_hex_id(path: PathLike, digits: int) -> str | None:
    """A ``0x``-prefixed hex ID (vendor, device, class) as ``digits`` lower-case hex digits."""
    text = read_text(path)
    if text is None:
        return None
    body = text[2:] if text[:2].lower() == "0x" else text
    if not body or len(body) > digits or any(c not in "0123456789abcdefABCDEF" for c in body):
        raise SysfsError(f"{path}: expected a hex ID, found {text[:40]!r}")
    return sys.intern(body.lower().rjust(digits, "0"))  # a few IDs, held by thousands of functions


def link_name(path: PathLike) -> str | None:
    """The last component of the symlink target at ``path`` (``None`` if it is not a symlink)."""
    try:
        target = os.readlink(path)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None
    # interned: a driver or a PF address is the same name for thousands of functions
    return sys.intern(target.rstrip("/").rpartition("/")[2]) or None


def list_dir(path: PathLike) -> list[str]:
    """Sorted entry names of directory ``path`` (empty when missing or not a directory)."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        raise SysfsError(f"{path}: cannot list: {error.strerror or error}") from error

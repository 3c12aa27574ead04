"""The kernel's uevent wire format, parsed into ``UEvent`` records.

The kernel multicasts every uevent on ``NETLINK_KOBJECT_UEVENT`` group 1 as one datagram::

    ACTION@DEVPATH\\0ACTION=...\\0DEVPATH=...\\0SUBSYSTEM=...\\0KEY=VALUE\\0...

Two sources read that format: the netlink socket (``--uevent-source kernel``) and the unix
datagram socket tests and tools write to (``unix:PATH``). Both go through
:func:`parse_kernel_uevent`, so what a test sends over the seam is checked exactly like what the
kernel sends. The parser never trusts its input: anything that is not a well-formed kernel
message raises :class:`UEventError` (a ``ValueError``), whose message says what is wrong and
shows a short, escaped preview of the bytes, safe to put in a log line.

udevd's own format (after its rules ran) starts with ``libudev\\0`` and a binary header; it is
read by libudev (the ``udev`` source), never by this parser.
"""

from __future__ import annotations

from types import MappingProxyType

from daemon.core import UEvent

KERNEL_ACTIONS = frozenset({"add", "remove", "change", "move", "online", "offline", "bind", "unbind"})
"""Every ``ACTION`` the kernel sends (``enum kobject_action`` in lib/kobject_uevent.c)."""

UDEV_MAGIC_PREFIX = b"libudev\0"
PREVIEW_BYTES = 64


class UEventError(ValueError):
    """A message that is not a well-formed kernel uevent.

    ``reason`` says what is wrong; ``str()`` adds a short escaped preview of the message.
    """

    def __init__(self, reason: str, data: bytes) -> None:
        super().__init__(f"{reason}: {preview(data)}")
        self.reason = reason


class UdevFormatError(UEventError):
    """A message in udevd's ``libudev\\0`` format: it belongs to libudev, not to this parser."""


def preview(data: bytes) -> str:
    """A short ``repr`` of ``data``: escaped (no raw control bytes), at most ~64 bytes shown."""
    if len(data) <= PREVIEW_BYTES:
        return repr(bytes(data))
    return f"{bytes(data[:PREVIEW_BYTES])!r}... ({len(data)} bytes)"


def parse_kernel_uevent(data: bytes) -> UEvent:
    """Parse one datagram in the kernel's format into a :class:`UEvent`.

    ``properties`` is a read-only mapping of every ``KEY=VALUE`` (``ACTION`` and ``DEVPATH``
    included; they are added from the header if a sender left them out). ``subsystem`` and
    ``devname`` are copied from ``SUBSYSTEM`` and ``DEVNAME``. Raises :class:`UEventError`.
    """
    if data.startswith(UDEV_MAGIC_PREFIX):
        raise UdevFormatError("udevd-format message (libudev header), not the kernel format", data)
    undecodable: UnicodeDecodeError | None = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A driver's name or a device's string with odd bytes must not cost the event: such
        # values keep U+FFFD for each bad byte; the header, keys and routing values must be clean.
        undecodable = exc
        text = data.decode("utf-8", "replace")
    header, _, body = text.partition("\0")
    if undecodable is not None and REPLACEMENT in header:
        raise UEventError(f"not UTF-8 (byte {undecodable.start})", data)
    action, devpath = _split_header(header, data)
    properties = _split_properties(body, data)
    if undecodable is not None and any(
            REPLACEMENT in key or (key in ROUTING_KEYS and REPLACEMENT in value) for key, value in properties.items()):
        raise UEventError(f"not UTF-8 (byte {undecodable.start})", data)
    _check_header_properties(properties, action, devpath, data)
    subsystem = properties.get("SUBSYSTEM")
    if not subsystem:
        raise UEventError("no SUBSYSTEM property", data)
    devname = properties.get("DEVNAME")
    if devname is not None:
        _check_devname(devname, data)
    return UEvent(action, devpath, subsystem, devname, MappingProxyType(properties))


REPLACEMENT = "\ufffd"
# the properties the daemon routes an event by: they must be exactly what the kernel sent
ROUTING_KEYS = frozenset({"ACTION", "DEVPATH", "SUBSYSTEM", "DEVNAME", "DEVTYPE", "DRIVER", "MAJOR", "MINOR"})


def _split_header(header: str, data: bytes) -> tuple[str, str]:
    action, at, devpath = header.partition("@")
    if not at:
        raise UEventError("no '@' in the ACTION@DEVPATH header", data)
    if action not in KERNEL_ACTIONS:
        raise UEventError(f"unknown action {action[:32]!r}", data)
    if not devpath:
        raise UEventError("empty devpath", data)
    if not devpath.startswith("/") or "/../" in devpath or devpath.endswith("/.."):
        raise UEventError("devpath is not an absolute path below the sysfs root", data)
    return action, devpath


def _split_properties(body: str, data: bytes) -> dict[str, str]:
    fields = body.split("\0")
    if fields[-1] == "":
        fields.pop()  # the kernel ends every field, the last one too, with a NUL
    try:
        properties = dict([field.split("=", 1) for field in fields])
    except ValueError:
        bad = next(field for field in fields if "=" not in field)
        raise UEventError(f"property without '=': {bad[:32]!r}", data) from None
    if len(properties) != len(fields):
        raise UEventError("duplicate property", data)
    if "" in properties:
        raise UEventError("property with an empty key", data)
    return properties


def _check_header_properties(properties: dict[str, str], action: str, devpath: str, data: bytes) -> None:
    if properties.setdefault("ACTION", action) != action:
        raise UEventError("ACTION property differs from the header", data)
    if properties.setdefault("DEVPATH", devpath) != devpath:
        raise UEventError("DEVPATH property differs from the header", data)


def _check_devname(devname: str, data: bytes) -> None:
    parts = devname.split("/")
    if not devname or devname.startswith("/") or ".." in parts:
        raise UEventError("DEVNAME is not a path inside /dev", data)

"""Uevent input: the kernel-format parser, and ``--uevent-source`` choosing a source."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.core import UEvent
from daemon.sources.udev_monitor import UdevUEventSource
from daemon.sources.uevent_wire import KERNEL_ACTIONS, UdevFormatError, UEventError, parse_kernel_uevent
from daemon.sources.uevents import KernelUEventSource, NullUEventSource, UnixUEventSource, make_uevent_source
from tests.uevents import BDI_ADD, BLOCK, ZRAM_ADD, ZRAM_CHANGE, kernel_message

# --- the parser ---------------------------------------------------------------------------------


def test_parses_a_real_block_add_with_devname() -> None:
    event = parse_kernel_uevent(ZRAM_ADD)
    assert event == UEvent(
        action="add",
        devpath="/devices/virtual/block/zram1",
        subsystem="block",
        devname="zram1",
        properties=event.properties,
    )
    assert dict(event.properties) == {
        "ACTION": "add",
        "DEVPATH": "/devices/virtual/block/zram1",
        "SUBSYSTEM": "block",
        "MAJOR": "253",
        "MINOR": "1",
        "DEVNAME": "zram1",
        "DEVTYPE": "disk",
        "DISKSEQ": "11",
        "SEQNUM": "861",
    }


def test_parses_a_message_without_devname() -> None:
    event = parse_kernel_uevent(BDI_ADD)
    assert (event.action, event.devpath, event.subsystem, event.devname) == (
        "add", "/devices/virtual/bdi/253:1", "bdi", None,
    )


def test_properties_are_read_only() -> None:
    event = parse_kernel_uevent(ZRAM_CHANGE)
    assert event.properties["SYNTH_UUID"] == "0"
    with pytest.raises(TypeError):
        event.properties["DEVNAME"] = "sda"  # type: ignore[index]


@pytest.mark.parametrize("action", sorted(KERNEL_ACTIONS))
def test_every_kernel_action_parses(action: str) -> None:
    assert parse_kernel_uevent(kernel_message(action, "/devices/x", SUBSYSTEM="misc")).action == action


def test_value_may_contain_equals_and_last_nul_is_optional() -> None:
    event = parse_kernel_uevent(b"change@/devices/x\0SUBSYSTEM=misc\0SYNTH_ARG_A=b=c")
    assert event.properties["SYNTH_ARG_A"] == "b=c"
    # A sender that left ACTION/DEVPATH out of the properties gets them from the header.
    assert event.properties["ACTION"] == "change"
    assert event.properties["DEVPATH"] == "/devices/x"


def test_devname_may_have_subdirectories() -> None:
    event = parse_kernel_uevent(kernel_message("add", "/devices/x/card0", SUBSYSTEM="drm", DEVNAME="dri/card0"))
    assert event.devname == "dri/card0"


MALFORMED = [
    (b"", "no '@'"),
    (b"add/devices/x\0SUBSYSTEM=block\0", "no '@'"),
    (b"add@\0SUBSYSTEM=block\0", "empty devpath"),
    (b"add@devices/x\0SUBSYSTEM=block\0", "not an absolute path"),
    (b"add@/devices/../../etc\0SUBSYSTEM=block\0", "not an absolute path"),
    (b"add@/devices/x\0SUBSYSTEM=bl\xffock\0", "not UTF-8"),
    (b"add@/devices/x\0SUBSYSTEM=block\0NOEQUALS\0", "property without '='"),
    (b"add@/devices/x\0SUBSYSTEM=block\0\0MAJOR=1\0", "property without '='"),
    (b"add@/devices/x\0ACTION=add\0MAJOR=1\0", "no SUBSYSTEM"),
    (b"add@/devices/x", "no SUBSYSTEM"),
    (b"add@/devices/x\0SUBSYSTEM=\0", "no SUBSYSTEM"),
    (b"explode@/devices/x\0SUBSYSTEM=block\0", "unknown action 'explode'"),
    (b"ADD@/devices/x\0SUBSYSTEM=block\0", "unknown action 'ADD'"),
    (b"@/devices/x\0SUBSYSTEM=block\0", "unknown action ''"),
    (b"add@/devices/x\0ACTION=remove\0SUBSYSTEM=block\0", "ACTION property differs"),
    (b"add@/devices/x\0DEVPATH=/devices/y\0SUBSYSTEM=block\0", "DEVPATH property differs"),
    (b"add@/devices/x\0SUBSYSTEM=block\0SUBSYSTEM=net\0", "duplicate property"),
    (b"add@/devices/x\0SUBSYSTEM=block\0=value\0", "empty key"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=/dev/sda\0", "DEVNAME is not a path inside /dev"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=../etc/passwd\0", "DEVNAME is not a path inside /dev"),
    (b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=\0", "DEVNAME is not a path inside /dev"),
]


@pytest.mark.parametrize(("data", "reason"), MALFORMED, ids=[reason for _, reason in MALFORMED])
def test_malformed_messages_raise_uevent_error(data: bytes, reason: str) -> None:
    with pytest.raises(UEventError) as caught:
        parse_kernel_uevent(data)
    assert isinstance(caught.value, ValueError)
    assert reason in caught.value.reason
    assert str(caught.value) == f"{caught.value.reason}: {data!r}"  # short messages are shown whole


def test_odd_bytes_in_a_device_string_keep_the_event() -> None:
    """An input device named with bytes that are not UTF-8 still arrives (each bad byte U+FFFD):
    losing its add would leave the device unlisted until the next rescan."""
    event = parse_kernel_uevent(b"add@/devices/virtual/input/input9\0SUBSYSTEM=input\0NAME=\"caf\xe9 pad\"\0"
                                b"PRODUCT=3/627/1/0\0")
    assert event.subsystem == "input" and event.properties["NAME"] == '"caf\ufffd pad"'
    assert event.properties["PRODUCT"] == "3/627/1/0"


@pytest.mark.parametrize("data", [
    b"add@/devices/x\0SUBSYSTEM=bl\xffock\0",
    b"add@/devices/x\0SUBSYSTEM=block\0DEVNAME=sd\xffa\0",
    b"add@/devices/x\0SUBSYSTEM=block\0K\xffEY=1\0",
    b"add@/devices/\xff\0SUBSYSTEM=block\0",
])
def test_odd_bytes_where_events_are_routed_refuse_it(data: bytes) -> None:
    with pytest.raises(UEventError, match="not UTF-8"):
        parse_kernel_uevent(data)


def test_udevd_format_is_refused_with_a_clear_error() -> None:
    data = b"libudev\0\xfe\xed\xca\xfe" + bytes(32) + b"ACTION=add\0"
    with pytest.raises(UdevFormatError, match="udevd-format message"):
        parse_kernel_uevent(data)


def test_error_preview_is_short_and_escaped() -> None:
    data = b"add@/devices/x\0SUBSYSTEM=block\0EVIL=\x1b[2J\nforged log line\0" + b"X" * 100_000 + b"\0"
    with pytest.raises(UEventError) as caught:
        parse_kernel_uevent(data)
    message = str(caught.value)
    assert len(message) < 200
    assert "\n" not in message and "\x1b" not in message and "\0" not in message
    assert message.endswith(f"... ({len(data)} bytes)")


# --- choosing a source --------------------------------------------------------------------------


def test_spec_names_the_source(tmp_path: Path) -> None:
    assert isinstance(make_uevent_source("kernel", BLOCK), KernelUEventSource)
    assert isinstance(make_uevent_source("udev", BLOCK), UdevUEventSource)
    assert isinstance(make_uevent_source("none", BLOCK), NullUEventSource)
    unix = make_uevent_source(f"unix:{tmp_path}/ue.sock", BLOCK)
    assert isinstance(unix, UnixUEventSource) and unix.path == tmp_path / "ue.sock"
    for source in (make_uevent_source(spec, BLOCK) for spec in ("kernel", "udev", "none")):
        assert source.describe()
    assert "block" in make_uevent_source("kernel", BLOCK).describe()
    assert "all" in make_uevent_source("kernel", frozenset()).describe()


def test_auto_follows_udevd(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert isinstance(make_uevent_source("auto", BLOCK, udev_control=control), KernelUEventSource)
    control.touch()
    assert isinstance(make_uevent_source("auto", BLOCK, udev_control=control), UdevUEventSource)


@pytest.mark.parametrize("spec", ["", "netlink", "Kernel", "unix:", "unix:/" + "x" * 120])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--uevent-source"):
        make_uevent_source(spec, BLOCK)

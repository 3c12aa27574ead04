"""devNode pools selected by udev properties (unit tests): a fake host with an FTDI serial
adapter, a keyboard and a storage stick behind an xHCI controller, udev's database and links as
systemd-udevd writes them (tests/usbtree.py)."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

import pytest

import daemon.handlers.devnode
from daemon.core import DeviceSpec, UEvent
from daemon.core._config import ConfigFileError
from tests.devnodes import DevNodes
from tests.fakesysfs import FakeHost
from tests.usbtree import Step, UsbTree, ftdi, keyboard, storage

TTY_BY_ID = "/dev/serial/by-id/usb-QEMU_QEMU_USB_SERIAL_FTDI0042-if00-port0"
TTY_BY_PATH = "/dev/serial/by-path/pci-0000:00:14.0-usb-0:2:1.0-port0"


def three_devices(host: FakeHost) -> UsbTree:
    usb = UsbTree(host)
    usb.attach(keyboard(), "1")  # bus 1 devnum 2: /dev/bus/usb/001/002, input/event0, hidraw0
    usb.attach(ftdi(), "2")  # bus 1 devnum 3: /dev/bus/usb/001/003, ttyUSB0
    usb.attach(storage(), "3")  # bus 2 devnum 2: /dev/bus/usb/002/002, bsg/0:0:0:0, sda, sda1
    return usb


@pytest.fixture
def tree(ram_host: FakeHost) -> UsbTree:
    return three_devices(ram_host)


@pytest.fixture
def nodes(tree: UsbTree) -> DevNodes:
    return DevNodes(tree.host, tree.udev_data)


@pytest.fixture
def seen(tree: UsbTree) -> DevNodes:
    """With udev's database (the ``udev`` or ``unix:`` source)."""
    return DevNodes(tree.host, tree.udev_data)


@pytest.fixture
def kernel_only(tree: UsbTree) -> DevNodes:
    """The tree seen without udev (``--uevent-source kernel``): the database is there but the
    handler must not read it."""
    return DevNodes(tree.host)


def udev_pool(name: str = "p", container_path: str | None = None, **udev: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"resourceName": name, "selectors": {"udev": udev}}
    if container_path is not None:
        entry["containerPath"] = container_path
    return entry


ALL_USB_NODES = {"bus_usb_001_001", "bus_usb_001_002", "bus_usb_001_003", "bus_usb_002_001", "bus_usb_002_002"}


@pytest.mark.parametrize(
    ("udev", "ids"),
    [
        ({"subsystems": ["tty"]}, {"ttyUSB0"}),
        ({"subsystems": ["block"]}, {"sda", "sda1"}),
        ({"subsystems": ["input"]}, {"input_event0"}),
        ({"subsystems": ["hidraw", "bsg"]}, {"hidraw0", "bsg_0:0:0:0"}),
        ({"subsystems": ["usb"]}, ALL_USB_NODES),
        ({"subsystems": ["video4linux"]}, set()),
        ({"properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "FTDI*"}}, {"ttyUSB0", "bus_usb_001_003"}),
        ({"subsystems": ["tty"], "properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "FTDI*"}}, {"ttyUSB0"}),
        ({"properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "KBD*"}}, set()),
        ({"properties": {"ID_SERIAL": "QEMU_QEMU_*"}, "subsystems": ["tty", "input", "block"]},
         {"ttyUSB0", "input_event0", "sda", "sda1"}),
        ({"properties": {"DEVTYPE": "partition"}}, {"sda1"}),
        ({"properties": {"ID_PART_ENTRY_NUMBER": "1"}}, {"sda1"}),
        ({"properties": {"ID_INPUT_KEYBOARD": "1"}, "subsystems": ["input"]}, {"input_event0"}),
        ({"properties": {"ID_VENDOR_ID": "04?3"}, "subsystems": ["tty"]}, {"ttyUSB0"}),
        ({"properties": {"ID_VENDOR_ID": "[0-9]403"}, "subsystems": ["tty"]}, {"ttyUSB0"}),
        ({"properties": {"ID_MODEL": "qemu_usb_serial"}}, set()),  # glob values are case-sensitive
        ({"properties": {"NO_SUCH_KEY": "*"}}, set()),
        ({"parentProperties": {"DRIVER": "ftdi_sio"}}, {"ttyUSB0"}),
        ({"parentProperties": {"DRIVER": "usbhid"}}, {"input_event0", "hidraw0"}),
        ({"parentProperties": {"DRIVER": "usb-storage", "DEVTYPE": "scsi_device"}}, {"bsg_0:0:0:0", "sda", "sda1"}),
        ({"parentProperties": {"DEVTYPE": "disk"}}, {"sda1"}),  # sda is not its own ancestor
        ({"parentProperties": {"SUBSYSTEM": "usb-serial"}}, {"ttyUSB0"}),
        ({"parentProperties": {"ID_VENDOR_ID": "46f4"}}, {"bsg_0:0:0:0", "sda", "sda1"}),
        ({"parentProperties": {"HID_UNIQ": "KBD0001"}, "subsystems": ["hidraw"]}, {"hidraw0"}),
        ({"parentProperties": {"DRIVER": "xhci_hcd", "PCI_CLASS": "C0330"}, "subsystems": ["tty", "block"]},
         {"ttyUSB0", "sda", "sda1"}),
        ({"properties": {"ID_VENDOR_ID": "0403"}, "parentProperties": {"DRIVER": "usbhid"}}, set()),
    ],
)
def test_udev_selectors_pick_nodes_by_subsystem_own_and_ancestor_properties(
        seen: DevNodes, udev: dict[str, Any], ids: set[str]) -> None:
    assert seen.ids(udev_pool(**udev)) == {"p": ids}


@pytest.mark.parametrize(
    ("selectors", "ids"),
    [
        ({"paths": ["/dev/tty*"], "udev": {"properties": {"ID_VENDOR_ID": "0403"}}}, {"ttyUSB0"}),
        ({"paths": ["/dev/sd*"], "udev": {"subsystems": ["tty"]}}, set()),
        ({"paths": ["/dev/sd*"], "udev": {"subsystems": ["block"], "properties": {"DEVTYPE": "disk"}}}, {"sda"}),
        ([{"paths": ["/dev/hidraw*"]}, {"udev": {"subsystems": ["tty"]}}], {"hidraw0", "ttyUSB0"}),
    ],
)
def test_paths_and_udev_in_one_selector_must_both_match(seen: DevNodes, selectors: Any, ids: set[str]) -> None:
    assert seen.ids({"resourceName": "p", "selectors": selectors}) == {"p": ids}


def test_an_earlier_pool_keeps_a_node_a_udev_pool_also_selects(seen: DevNodes) -> None:
    ids = seen.ids({"resourceName": "ttys", "selectors": {"paths": ["/dev/ttyUSB*"]}},
                    udev_pool("ftdi", properties={"ID_VENDOR_ID": "0403"}))
    assert ids == {"ttys": {"ttyUSB0"}, "ftdi": {"bus_usb_001_003"}}


@pytest.mark.parametrize(
    ("udev", "ids"),
    [
        ({"properties": {"ID_VENDOR_ID": "0403"}}, set()),
        ({"parentProperties": {"ID_VENDOR_ID": "46f4"}}, set()),
        ({"subsystems": ["tty"], "properties": {"ID_SERIAL_SHORT": "*"}}, set()),
        ({"parentProperties": {"DRIVER": "ftdi_sio"}}, {"ttyUSB0"}),
        ({"properties": {"DEVNAME": "ttyUSB*", "MAJOR": "188"}}, {"ttyUSB0"}),
        ({"properties": {"DEVTYPE": "partition"}}, {"sda1"}),
        ({"parentProperties": {"PRODUCT": "403/6001/600", "INTERFACE": "255/255/255"}}, {"ttyUSB0"}),
        ({"subsystems": ["input"]}, {"input_event0"}),
    ],
)
def test_with_kernel_properties_only_udev_keys_never_match(
        kernel_only: DevNodes, udev: dict[str, Any], ids: set[str]) -> None:
    assert kernel_only.ids(udev_pool(**udev)) == {"p": ids}


@pytest.mark.parametrize(
    ("container_path", "expected"),
    [
        (None, "/dev/ttyUSB0"),
        ("kernel", "/dev/ttyUSB0"),
        ("by-id", TTY_BY_ID),
        ("by-path", TTY_BY_PATH),
    ],
)
def test_container_path_is_the_kernel_node_or_its_udev_link(
        seen: DevNodes, container_path: str | None, expected: str) -> None:
    entry = udev_pool(subsystems=["tty"])
    if container_path is not None:
        entry["containerPath"] = container_path
    devices = seen.build(entry)["p"]
    assert devices["ttyUSB0"].specs == (DeviceSpec(expected, "/dev/ttyUSB0", "rw"),)


def test_by_id_takes_the_first_link_in_sorted_order(nodes: DevNodes, tree: UsbTree) -> None:
    """A SATA disk has several by-id links (``ata-…``, ``wwn-…``); the first in sorted order wins."""
    database = tree.udev_data / "b8:0"
    database.write_text("S:disk/by-id/wwn-0x5000c500a1b2c3d4\n" + database.read_text().replace(
        "S:disk/by-path", "S:disk/by-id/ata-QEMU_HARDDISK_STOR4242\nS:disk/by-path"))
    for link in ("disk/by-id/wwn-0x5000c500a1b2c3d4", "disk/by-id/ata-QEMU_HARDDISK_STOR4242"):
        (tree.host.dev / link).symlink_to("../../sda")
    devices = nodes.build(udev_pool(subsystems=["block"], container_path="by-id"))["p"]
    assert devices["sda"].specs == (DeviceSpec("/dev/disk/by-id/ata-QEMU_HARDDISK_STOR4242", "/dev/sda", "rw"),)
    assert devices["sda1"].specs == (
        DeviceSpec("/dev/disk/by-id/usb-QEMU_QEMU_HARDDISK_STOR4242-0:0-part1", "/dev/sda1", "rw"),)


def test_by_id_without_a_link_keeps_the_kernel_path(seen: DevNodes) -> None:
    """Not logged: builds run on every event, and the path the container sees is in the answer."""
    devices = seen.build(udev_pool(subsystems=["hidraw"], container_path="by-id"))["p"]
    assert devices["hidraw0"].specs == (DeviceSpec("/dev/hidraw0", "/dev/hidraw0", "rw"),)


def test_by_id_with_kernel_properties_only_keeps_the_kernel_path(kernel_only: DevNodes) -> None:
    devices = kernel_only.build(udev_pool(subsystems=["tty"], container_path="by-id"))["p"]
    assert devices["ttyUSB0"].specs == (DeviceSpec("/dev/ttyUSB0", "/dev/ttyUSB0", "rw"),)


def test_udev_pool_ids_are_the_kernel_node_names_with_count(seen: DevNodes) -> None:
    devices = seen.build(udev_pool(subsystems=["tty"], container_path="by-id") | {"count": 2})["p"]
    assert set(devices) == {"ttyUSB0-0", "ttyUSB0-1"}
    assert {info.specs[0].container_path for info in devices.values()} == {TTY_BY_ID}


# --- hotplug: folded uevents give what a fresh scan gives -----------------------------------------


def test_udev_events_bring_a_matching_node_in_and_take_it_out(ram_host: FakeHost) -> None:
    host = ram_host
    usb = UsbTree(host)
    nodes = DevNodes(host, usb.udev_data)
    entry = udev_pool(subsystems=["tty"], properties={"ID_VENDOR_ID": "0403"}, container_path="by-id")
    facts = nodes.handler.scan()
    plug = usb.plug(ftdi(), "2")
    for step in plug.steps:
        usb.apply(step)
        if step.sends:
            facts = nodes.handler.fold(facts, step.event(udev=True))
    (configured,) = nodes.configure(entry)
    folded = nodes.handler.build(facts, [configured])[configured.resource]
    scanned = nodes.handler.build(nodes.handler.scan(), [configured])[configured.resource]
    assert {i: (d.specs, d.numa_nodes) for i, d in folded.items()} == {
        i: (d.specs, d.numa_nodes) for i, d in scanned.items()}
    assert folded["ttyUSB0"].specs == (DeviceSpec(TTY_BY_ID, "/dev/ttyUSB0", "rw"),)
    for step in usb.unplug("1-2"):
        usb.apply(step)
        if step.sends:
            facts = nodes.handler.fold(facts, step.event(udev=True))
    assert nodes.handler.build(facts, [configured])[configured.resource] == {}
    assert not (host.dev / "ttyUSB0").exists() and not (usb.udev_data / "c188:0").exists()


def test_a_change_event_with_new_properties_reselects_the_node(nodes: DevNodes, tree: UsbTree) -> None:
    """After an event the node's properties are the event's own: a udev ``change`` that drops
    ID_MM_CANDIDATE takes the tty out of a pool selecting it."""
    entry = udev_pool(subsystems=["tty"], properties={"ID_MM_CANDIDATE": "1"})
    (configured,) = nodes.configure(entry)
    facts = nodes.handler.scan()
    assert set(nodes.handler.build(facts, [configured])[configured.resource]) == {"ttyUSB0"}
    tty = next(k for k in tree.plugs["1-2"].kobjs if k.subsystem == "tty")
    del tty.udev["ID_MM_CANDIDATE"]
    change = tree.apply(Step("change", tty))
    facts = nodes.handler.fold(facts, change.event(udev=True))
    assert nodes.handler.build(facts, [configured])[configured.resource] == {}


# --- bad input: refused selectors, broken database entries, odd bytes ----------------------------


@pytest.mark.parametrize(
    ("selectors", "json_path"),
    [
        ({}, "$.resourceList[0].selectors"),
        ({"udev": {}}, "$.resourceList[0].selectors.udev"),
        ({"udev": {"subsystems": []}}, "$.resourceList[0].selectors.udev"),
        ({"udev": {"properties": {}}}, "$.resourceList[0].selectors.udev"),
        ({"udev": {"parentProperties": {}}}, "$.resourceList[0].selectors.udev"),
        ({"udev": {"subsystems": [], "properties": {}, "parentProperties": {}}}, "$.resourceList[0].selectors.udev"),
        ({"udev": []}, "$.resourceList[0].selectors.udev"),
        ({"udev": {"subsystems": "tty"}}, "$.resourceList[0].selectors.udev.subsystems"),
        ({"udev": {"properties": {"ID_VENDOR_ID": 403}}}, "$.resourceList[0].selectors.udev.properties.ID_VENDOR_ID"),
        ({"udev": {"properties": ["ID_VENDOR_ID"]}}, "$.resourceList[0].selectors.udev.properties"),
        ([{"udev": {"subsystems": ["tty"]}}, {"udev": {}}], "$.resourceList[0].selectors[1].udev"),
        ({"paths": ["/dev/tty*"], "udev": {}}, "$.resourceList[0].selectors.udev"),
    ],
)
def test_refused_udev_selectors_name_the_json_path(seen: DevNodes, selectors: Any, json_path: str) -> None:
    with pytest.raises(ConfigFileError) as caught:
        seen.configure({"resourceName": "p", "selectors": selectors})
    assert caught.value.json_path.startswith(json_path), caught.value.json_path
    assert json_path in str(caught.value)


def test_an_unknown_container_path_is_refused(seen: DevNodes) -> None:
    with pytest.raises(ConfigFileError) as caught:
        seen.configure(udev_pool(subsystems=["tty"], container_path="by-uuid"))
    assert caught.value.json_path == "$.resourceList[0].containerPath"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"S:serial/by-id/usb-QEMU_QEMU_USB_SER",  # cut off mid-line, no E: lines at all
        b"\xff\xfe\x00\x01garbage\n\x00\x00\x00",
        b"E\nE:\nE:=0403\nE:NO_EQUALS_SIGN\nX:unknown\n:\n\n",
        bytes(range(256)) * 8,
    ],
)
def test_a_broken_database_entry_is_skipped_not_fatal(
        nodes: DevNodes, tree: UsbTree, content: bytes) -> None:
    (tree.udev_data / "c188:0").write_bytes(content)
    ids = nodes.ids(udev_pool("by_vendor", properties={"ID_VENDOR_ID": "0403"}, subsystems=["tty"]),
                    udev_pool("ttys", subsystems=["tty"]),
                    udev_pool("disks", properties={"ID_SERIAL_SHORT": "STOR*"}, subsystems=["block"]))
    assert ids == {"by_vendor": set(), "ttys": {"ttyUSB0"}, "disks": {"sda", "sda1"}}


def test_valid_lines_of_a_partly_broken_entry_still_count(nodes: DevNodes, tree: UsbTree) -> None:
    (tree.udev_data / "c188:0").write_bytes(b"S:serial/by-id/x\nE:=nothing\n\xff\xff\nE:ID_VENDOR_ID=0403\n"
                                            b"E:ID_FOO=a=b\nL:notanumber\nI:\nV:1\nE:ID_CUT_OF")
    assert nodes.ids(udev_pool(properties={"ID_VENDOR_ID": "0403", "ID_FOO": "a=b"}, subsystems=["tty"])) == {
        "p": {"ttyUSB0"}}


def test_a_database_entry_that_is_a_directory_is_skipped(nodes: DevNodes, tree: UsbTree) -> None:
    (tree.udev_data / "c188:0").unlink()
    (tree.udev_data / "c188:0").mkdir()
    assert nodes.ids(udev_pool(subsystems=["tty"])) == {"p": {"ttyUSB0"}}


def test_odd_bytes_in_values_neither_crash_nor_spoil_other_keys(nodes: DevNodes, tree: UsbTree) -> None:
    entry = tree.udev_data / "c188:0"
    entry.write_bytes(entry.read_bytes() + b"E:ID_MODEL_FROM_DATABASE=caf\xc3\xa9 \xff\xfe\x01\x7f\n"
                      b"E:ID_WEIRD=\x1b[31m\tred\r\n")
    assert nodes.ids(udev_pool(properties={"ID_SERIAL_SHORT": "FTDI0042"}, subsystems=["tty"])) == {
        "p": {"ttyUSB0"}}
    assert nodes.ids(udev_pool(properties={"ID_MODEL_FROM_DATABASE": "caf\u00e9 *"})) == {"p": {"ttyUSB0"}}
    assert nodes.ids(udev_pool(properties={"ID_WEIRD": "\x1b[31m\tred*"})) == {"p": {"ttyUSB0"}}


def test_an_event_with_odd_bytes_is_folded_without_a_crash(nodes: DevNodes, tree: UsbTree) -> None:
    entry = udev_pool(subsystems=["tty"], properties={"ID_SERIAL_SHORT": "FTDI0042"})
    (configured,) = nodes.configure(entry)
    facts = nodes.handler.scan()
    tty = next(k for k in tree.plugs["1-2"].kobjs if k.subsystem == "tty")
    tty.udev["ID_MODEL_FROM_DATABASE"] = "caf\u00e9 \x1b[31m\x01\x7f \u202e\ufffd"
    change = tree.apply(Step("change", tty))
    facts = nodes.handler.fold(facts, change.event(udev=True))
    assert set(nodes.handler.build(facts, [configured])[configured.resource]) == {"ttyUSB0"}


def test_without_udev_a_pool_says_which_of_its_keys_it_cannot_see(
        kernel_only: DevNodes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    kernel_only.configure(udev_pool("ftdi_tty", subsystems=["tty"], properties={"ID_VENDOR_ID": "0403"},
                                    parentProperties={"DRIVER": "ftdi_sio", "ID_PATH": "pci-*"}))
    (warning,) = [m for m in caplog.messages if "ID_VENDOR_ID" in m]
    assert "ID_PATH" in warning and "DRIVER" not in warning
    assert "ftdi_tty" in warning or "$.resourceList[0]" in warning


def test_with_udev_a_pool_using_its_keys_gives_no_warning(seen: DevNodes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    seen.configure(udev_pool("ftdi_tty", properties={"ID_VENDOR_ID": "0403"}))
    assert caplog.messages == []


FOLD_POOLS = [
    udev_pool("ftdi", container_path="by-id", subsystems=["tty"], properties={"ID_VENDOR_ID": "0403"}),
    udev_pool("named", properties={"DEVNAME": "ttyUSB*"}),
    udev_pool("hid", parentProperties={"DRIVER": "usbhid"}),
    udev_pool("parts", container_path="by-path", properties={"DEVTYPE": "partition"},
              parentProperties={"ID_SERIAL_SHORT": "STOR*"}),
    udev_pool("usb", subsystems=["usb"]),
]


@pytest.mark.parametrize("udev", [False, True], ids=["kernel", "udev"])
def test_after_every_event_of_a_hotplug_and_unplug_the_pools_equal_a_fresh_scan(
        ram_host: FakeHost, udev: bool) -> None:
    usb = UsbTree(ram_host, udev=udev)
    nodes = DevNodes(ram_host, usb.udev_data if udev else None)
    configured = nodes.configure(*FOLD_POOLS)
    facts = nodes.handler.scan()

    def seen_by_users(facts: Any) -> dict[str, dict[str, Any]]:
        return {resource: {i: (info.specs, info.numa_nodes, info.health) for i, info in devices.items()}
                for resource, devices in nodes.handler.build(facts, configured).items()}

    def check(facts: Any, step: Step) -> None:
        assert seen_by_users(facts) == seen_by_users(nodes.handler.scan()), step

    plugs = [usb.plug(keyboard(), "1"), usb.plug(ftdi(), "2"), usb.plug(storage(), "3")]
    for step in (step for plug in plugs for step in plug.steps):
        usb.apply(step)
        if step.sends:
            facts = nodes.handler.fold(facts, step.event(udev))
            check(facts, step)
    built = {pool.resource.split("/")[1]: set(devices) for pool, devices in
             zip(configured, nodes.handler.build(facts, configured).values())}
    assert built == {"ftdi": {"ttyUSB0"} if udev else set(), "named": set() if udev else {"ttyUSB0"},
                     "hid": {"input_event0", "hidraw0"}, "parts": {"sda1"} if udev else set(),
                     "usb": {"bus_usb_001_001", "bus_usb_001_002", "bus_usb_001_003", "bus_usb_002_001",
                             "bus_usb_002_002"}}
    for name in ("1-2", "2-3", "1-1"):
        for step in usb.unplug(name):
            usb.apply(step)
            if step.sends:
                facts = nodes.handler.fold(facts, step.event(udev))
                check(facts, step)
    assert {resource: set(devices) for resource, devices in nodes.handler.build(facts, configured).items()} == {
        pool.resource: {"bus_usb_001_001", "bus_usb_002_001"} if pool.resource.endswith("/usb") else set()
        for pool in configured}


@pytest.mark.parametrize(
    "properties",
    [{"DEVLINKS": "*/dev/serial/by-id/*"}, {"TAGS": "*:systemd:*"}, {"CURRENT_TAGS": "*:systemd:*"},
     {"USEC_INITIALIZED": "?*"}],
    ids=["DEVLINKS", "TAGS", "CURRENT_TAGS", "USEC_INITIALIZED"])
def test_a_node_selected_after_its_udev_event_is_selected_after_a_restart_too(
        ram_host: FakeHost, properties: dict[str, str]) -> None:
    """libudev gives a device read from the database ``DEVLINKS`` (its ``S:`` lines), ``TAGS``
    and ``CURRENT_TAGS`` (``G:``/``Q:``) and ``USEC_INITIALIZED`` (``I:``), as its events carry
    them: a pool selecting on them must not lose the node when the daemon restarts."""
    usb = UsbTree(ram_host)
    nodes = DevNodes(ram_host, usb.udev_data)
    (configured,) = nodes.configure(udev_pool(subsystems=["tty"], properties=properties))
    facts = nodes.handler.scan()
    for step in usb.plug(ftdi(), "2").steps:
        usb.apply(step)
        if step.sends:
            facts = nodes.handler.fold(facts, step.event(udev=True))
            after_event = set(nodes.handler.build(facts, [configured])[configured.resource])
            after_restart = set(nodes.handler.build(nodes.handler.scan(), [configured])[configured.resource])
            assert after_event == after_restart, step
    assert after_event == {"ttyUSB0"}


def test_without_a_readable_database_the_udev_events_properties_keep_selecting_the_node(
        ram_host: FakeHost) -> None:
    """A daemon whose container does not mount /run/udev still gets udev's events: the tty's
    ID_* properties come from its own events, and its parents' later bind events keep them."""
    usb = UsbTree(ram_host)
    nodes = DevNodes(ram_host, ram_host.root / "run" / "udev" / "not-mounted")
    (configured,) = nodes.configure(udev_pool(subsystems=["tty"], properties={"ID_SERIAL_SHORT": "FTDI0042"}))
    facts = nodes.handler.scan()
    selected_after: dict[str, set[str]] = {}
    for step in usb.plug(ftdi(), "2").steps:
        usb.apply(step)
        if step.sends:
            facts = nodes.handler.fold(facts, step.event(udev=True))
            selected_after[repr(step)] = set(nodes.handler.build(facts, [configured])[configured.resource])
    tty_add = next(name for name in selected_after if name.endswith("/tty/ttyUSB0"))
    later = list(selected_after)[list(selected_after).index(tty_add):]
    assert {name: selected_after[name] for name in later} == {name: {"ttyUSB0"} for name in later}


def test_a_pcie_error_report_of_a_device_above_nodes_reads_nothing(
        nodes: DevNodes, tree: UsbTree, monkeypatch: pytest.MonkeyPatch) -> None:
    """During a fatal reset the kernel holds the device locks below the port for seconds: the
    ``change`` uevents of PCIe error recovery (ERROR_EVENT) say nothing of a node's properties, so
    nothing is read for them (a plain ``change`` of the same controller reads its nodes again)."""
    facts = nodes.handler.scan()
    reads: list[str] = []
    real = daemon.handlers.devnode.read_record

    def counting(context: Any, relative: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(relative)
        return real(context, relative, *args, **kwargs)

    monkeypatch.setattr(daemon.handlers.devnode, "read_record", counting)
    devpath = f"/devices/pci0000:00/{tree.controller}"
    for error_event in ("BEGIN_RECOVERY", "FAILED_RECOVERY"):
        report = UEvent("change", devpath, "pci", None,
                        MappingProxyType({"ERROR_EVENT": error_event, "DEVICE_ONLINE": "0"}))
        assert nodes.handler.fold(facts, report) is facts
    assert reads == []
    nodes.handler.fold(facts, UEvent("change", devpath, "pci"))
    assert reads  # the nodes below the controller, read again

"""usbDevice pools (unit tests): whole USB devices with every node below their interfaces, on a
fake host laid out as Linux and udevd lay it out (tests/usbtree.py), driven as the daemon drives
the handler (tests/usbpools.py)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from typing import Any

import pytest

from daemon.core import DeviceSpec
from daemon.core._config import ConfigFileError
from tests.fakesysfs import FakeHost
from tests.usbpools import UsbPools, node_paths
from tests.usbtree import Plug, UsbModel, UsbTree, ft2232, ftdi, hub, keyboard, storage

HUB_SERIAL = "314159-0000:00:01.0-2"


@pytest.fixture
def tree(ram_host: FakeHost) -> UsbTree:
    return UsbTree(ram_host, numa_node=1)


@pytest.fixture
def usb(tree: UsbTree) -> UsbPools:
    return UsbPools(tree.host, tree.udev_data)


@pytest.fixture
def lab(tree: UsbTree) -> UsbTree:
    """A keyboard at 1-1, an FTDI adapter at 1-2, storage at 2-3, a hub at 1-4 with a keyboard
    without a serial behind it at 1-4.1."""
    tree.attach(keyboard(), "1")
    tree.attach(ftdi(), "2")
    tree.attach(storage(), "3")
    tree.attach(hub(), "4")
    tree.attach(keyboard(serial=None), "4.1")
    return tree


def pool(name: str = "p", selectors: Any = None, **fields: Any) -> dict[str, Any]:
    return {"resourceName": name, "selectors": selectors, **fields}


EVERYTHING = [{"vendors": [vendor]} for vendor in ("0403", "0627", "46f4", "0409", "1d6b")]


@pytest.mark.parametrize(
    ("selectors", "ids"),
    [
        ({"vendors": ["0403"]}, {"serial-FTDI0042"}),
        ({"vendors": ["0627"]}, {"serial-KBD0001", "port-1-4.1"}),
        ({"vendors": ["46F4"]}, {"serial-STOR4242"}),
        ({"vendors": ["0403", "46f4"]}, {"serial-FTDI0042", "serial-STOR4242"}),
        ({"products": ["55AA"]}, {f"serial-{HUB_SERIAL}"}),
        ({"products": ["0001"]}, {"serial-KBD0001", "port-1-4.1", "serial-STOR4242"}),
        ({"vendors": ["0627"], "products": ["6001"]}, set()),
        ({"serials": ["FT*"]}, {"serial-FTDI0042"}),
        ({"serials": ["KBD000?", "STOR[0-9]*"]}, {"serial-KBD0001", "serial-STOR4242"}),
        ({"serials": ["ftdi*"]}, set()),
        ({"ports": ["1-4*"]}, {f"serial-{HUB_SERIAL}", "port-1-4.1"}),
        ({"ports": ["1-4.*"]}, {"port-1-4.1"}),
        ({"ports": ["2-3"]}, {"serial-STOR4242"}),
        ({"ports": ["1-[12]"]}, {"serial-KBD0001", "serial-FTDI0042"}),
        ({"interfaceClasses": ["03"]}, {"serial-KBD0001", "port-1-4.1"}),
        ({"interfaceClasses": ["ff", "08"]}, {"serial-FTDI0042", "serial-STOR4242"}),
        ({"interfaceClasses": ["09"]}, {f"serial-{HUB_SERIAL}"}),  # the root hubs are never offered
        ({"drivers": ["usbhid"]}, {"serial-KBD0001", "port-1-4.1"}),
        ({"drivers": ["usb-storage"]}, {"serial-STOR4242"}),
        ({"drivers": ["ftdi_sio", "hub"]}, {"serial-FTDI0042", f"serial-{HUB_SERIAL}"}),
        ({"drivers": ["hid-generic"]}, set()),  # the hid device's driver, not an interface's
        ({"vendors": ["0627"], "ports": ["1-1"], "drivers": ["usbhid"], "interfaceClasses": ["03"]},
         {"serial-KBD0001"}),
        ([{"vendors": ["0403"]}, {"ports": ["2-3"]}], {"serial-FTDI0042", "serial-STOR4242"}),
        ({"vendors": ["1d6b"]}, set()),
        ({"ports": ["usb*"]}, set()),
    ],
)
def test_each_selector_key_picks_its_devices(lab: UsbTree, usb: UsbPools, selectors: Any, ids: set[str]) -> None:
    assert usb.ids(pool("p", selectors)) == {"p": ids}


def test_root_hubs_are_never_offered(lab: UsbTree, usb: UsbPools) -> None:
    ids = usb.ids(pool("all", EVERYTHING))
    assert ids == {"all": {"serial-KBD0001", "serial-FTDI0042", "serial-STOR4242", f"serial-{HUB_SERIAL}",
                           "port-1-4.1"}}


def test_a_device_claimed_by_an_earlier_pool_is_not_offered_by_a_later_one(lab: UsbTree, usb: UsbPools) -> None:
    ids = usb.ids(pool("kbd", {"ports": ["1-1"]}), pool("hid", {"interfaceClasses": ["03"]}),
                  pool("rest", EVERYTHING), pool("late", {"vendors": ["0403"]}))
    assert ids == {"kbd": {"serial-KBD0001"}, "hid": {"port-1-4.1"},
                   "rest": {"serial-FTDI0042", "serial-STOR4242", f"serial-{HUB_SERIAL}"}, "late": set()}


# --- device IDs -----------------------------------------------------------------------------------


def ids_and_warnings(usb: UsbPools, caplog: pytest.LogCaptureFixture) -> tuple[set[str], list[str]]:
    caplog.set_level(logging.WARNING)
    caplog.clear()
    ids = usb.ids(pool("all", EVERYTHING))["all"]
    return ids, [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_two_identical_devices_without_serials_are_told_apart_by_port(
        tree: UsbTree, usb: UsbPools, caplog: pytest.LogCaptureFixture) -> None:
    tree.attach(ftdi(serial=None), "3")
    tree.attach(ftdi(serial=None), "4")
    ids, warnings = ids_and_warnings(usb, caplog)
    assert ids == {"port-1-3", "port-1-4"}
    assert any("1-3" in w for w in warnings) and any("1-4" in w for w in warnings), warnings


def test_a_serial_two_devices_share_names_neither(tree: UsbTree, usb: UsbPools, caplog: pytest.LogCaptureFixture) -> None:
    tree.attach(ftdi(serial="FTDI0042"), "2")
    tree.attach(ftdi(serial="FTDI0042"), "3")
    tree.attach(keyboard(), "1")
    ids, warnings = ids_and_warnings(usb, caplog)
    assert ids == {"port-1-2", "port-1-3", "serial-KBD0001"}
    assert any("1-2" in w and "FTDI0042" in w for w in warnings), warnings


@pytest.mark.parametrize(
    ("serial", "device_id"),
    [
        ("A9x.b_c:d-e", "serial-A9x.b_c:d-e"),
        ("68284-0000:00:01.0-3", "serial-68284-0000:00:01.0-3"),  # QEMU's invented serials
        ("S" * 64, "serial-" + "S" * 64),
        ("S" * 65, "port-1-2"),
        ("", "port-1-2"),
        ("FT 42", "port-1-2"),
        ("FT/42", "port-1-2"),
        ("caf\u00e9", "port-1-2"),
        ("FT\t42", "port-1-2"),
        ("$(reboot)", "port-1-2"),
    ],
)
def test_a_serial_that_cannot_name_a_device_gives_its_port(
        tree: UsbTree, usb: UsbPools, caplog: pytest.LogCaptureFixture, serial: str, device_id: str) -> None:
    tree.attach(ftdi(serial=serial), "2")
    ids, warnings = ids_and_warnings(usb, caplog)
    assert ids == {device_id}
    if device_id.startswith("port-"):
        assert any("1-2" in w for w in warnings), warnings


def test_a_serial_with_odd_bytes_gives_its_port(tree: UsbTree, usb: UsbPools, caplog: pytest.LogCaptureFixture) -> None:
    plug = tree.attach(ftdi(serial="FTDI0042"), "2")
    (tree.host.sys / plug.devpath.lstrip("/") / "serial").write_bytes(b"FT\xff\xfe\x0042\n")
    ids, _ = ids_and_warnings(usb, caplog)
    assert ids == {"port-1-2"}


def test_a_replug_on_the_same_port_keeps_the_id_and_gets_new_nodes(tree: UsbTree, usb: UsbPools) -> None:
    first = tree.attach(ftdi(serial=None), "3")
    before = usb.scan_build(pool("p", {"vendors": ["0403"]}))["p"]
    tree.detach("1-3")
    second = tree.attach(ftdi(serial=None), "3")
    after = usb.scan_build(pool("p", {"vendors": ["0403"]}))["p"]
    assert set(before) == set(after) == {"port-1-3"}
    assert first.bus_node != second.bus_node  # devnum went up: never part of the ID
    assert node_paths(after["port-1-3"]) == [second.bus_node, "/dev/ttyUSB0"]


# --- nodes, specs, Allocate -------------------------------------------------------------------------


def test_each_device_has_its_own_node_then_those_below_its_interfaces(lab: UsbTree, usb: UsbPools) -> None:
    devices = usb.scan_build(pool("p", EVERYTHING, permissions="rw"))["p"]
    nodes = {device_id: node_paths(info) for device_id, info in devices.items()}
    plugs = lab.plugs
    assert nodes["serial-FTDI0042"] == [plugs["1-2"].bus_node, "/dev/ttyUSB0"]
    assert nodes["serial-KBD0001"][0] == plugs["1-1"].bus_node
    assert sorted(nodes["serial-KBD0001"][1:]) == ["/dev/hidraw0", "/dev/input/event0"]
    assert nodes["serial-STOR4242"][0] == plugs["2-3"].bus_node
    assert sorted(nodes["serial-STOR4242"][1:]) == ["/dev/bsg/0:0:0:0", "/dev/sda", "/dev/sda1"]
    # the hub's child is a device of its own: none of its nodes are the hub's
    assert nodes[f"serial-{HUB_SERIAL}"] == [plugs["1-4"].bus_node]
    assert nodes["port-1-4.1"][0] == plugs["1-4.1"].bus_node
    assert sorted(nodes["port-1-4.1"][1:]) == ["/dev/hidraw1", "/dev/input/event1"]
    for info in devices.values():
        assert all(spec.container_path == spec.host_path and spec.permissions == "rw" for spec in info.specs)
        assert info.health == "Healthy"


@pytest.mark.parametrize(("fields", "permissions"), [({}, "rw"), ({"permissions": "r"}, "r"),
                                                      ({"permissions": "rwm"}, "rwm")])
def test_specs_carry_the_pools_permissions(lab: UsbTree, usb: UsbPools, fields: dict, permissions: str) -> None:
    info = usb.scan_build(pool("p", {"vendors": ["0403"]}, **fields))["p"]["serial-FTDI0042"]
    assert info.specs == (DeviceSpec(lab.plugs["1-2"].bus_node, lab.plugs["1-2"].bus_node, permissions),
                          DeviceSpec("/dev/ttyUSB0", "/dev/ttyUSB0", permissions))


def test_numa_node_is_the_controllers_unless_topology_is_excluded(lab: UsbTree, usb: UsbPools) -> None:
    devices = usb.scan_build(pool("p", EVERYTHING))["p"]
    assert {info.numa_nodes for info in devices.values()} == {(1,)}
    devices = usb.scan_build(pool("p", EVERYTHING, excludeTopology=True))["p"]
    assert {info.numa_nodes for info in devices.values()} == {()}


def test_allocate_gives_every_node_and_the_usbdevice_envs(lab: UsbTree, usb: UsbPools) -> None:
    serial = usb.pool(pool("usb_serial", [{"vendors": ["0403"]}, {"ports": ["1-4.1"]}]))
    answer = usb.allocate(serial, ["serial-FTDI0042", "port-1-4.1"])
    ftdi_node, kbd_node = lab.plugs["1-2"].bus_node, lab.plugs["1-4.1"].bus_node
    assert [spec.host_path for spec in answer.specs][:2] == [ftdi_node, "/dev/ttyUSB0"]
    assert sorted(spec.host_path for spec in answer.specs[2:]) == sorted([kbd_node, "/dev/hidraw1",
                                                                          "/dev/input/event1"])
    assert answer.envs["USBDEVICE_INTEL_COM_USB_SERIAL"] == "serial-FTDI0042,port-1-4.1"
    info = json.loads(answer.envs["USBDEVICE_INTEL_COM_USB_SERIAL_INFO"])
    assert set(info) == {"serial-FTDI0042", "port-1-4.1"}
    assert info["serial-FTDI0042"] == {"vendor": "0403", "product": "6001", "serial": "FTDI0042", "port": "1-2",
                                       "nodes": [ftdi_node, "/dev/ttyUSB0"]}
    keyboard_info = info["port-1-4.1"]
    assert keyboard_info["nodes"][0] == kbd_node
    assert sorted(keyboard_info["nodes"][1:]) == ["/dev/hidraw1", "/dev/input/event1"]
    assert {k: v for k, v in keyboard_info.items() if k != "nodes"} == {
        "vendor": "0627", "product": "0001", "serial": None, "port": "1-4.1"}


def test_allocate_reads_the_nodes_present_now(tree: UsbTree, usb: UsbPools) -> None:
    """The disk's partition shows up after the pool was built: Allocate still hands it out."""
    plug = tree.plug(storage(), "3")
    usb_part = plug.steps[: next(i for i, s in enumerate(plug.steps) if s.action == "bind"
                                 and s.kobj is plug.usb_device) + 1]
    for step in usb_part:
        tree.apply(step)
    disks = usb.pool(pool("disks", {"drivers": ["usb-storage"]}))
    assert node_paths(disks.devices["serial-STOR4242"]) == [plug.bus_node]
    for step in plug.steps[len(usb_part):]:
        tree.apply(step)
    answer = usb.allocate(disks, ["serial-STOR4242"])
    assert answer.specs[0].host_path == plug.bus_node
    assert sorted(spec.host_path for spec in answer.specs[1:]) == ["/dev/bsg/0:0:0:0", "/dev/sda", "/dev/sda1"]
    info = json.loads(answer.envs["USBDEVICE_INTEL_COM_DISKS_INFO"])
    assert sorted(info["serial-STOR4242"]["nodes"][1:]) == ["/dev/bsg/0:0:0:0", "/dev/sda", "/dev/sda1"]


def test_a_dual_uart_adapter_is_one_device_with_the_ttys_of_both_interfaces(tree: UsbTree, usb: UsbPools) -> None:
    plug = tree.attach(ft2232(), "2")
    serial = usb.pool(pool("uarts", {"vendors": ["0403"], "products": ["6010"]}))
    assert set(serial.devices) == {"serial-FT2232A"}
    assert node_paths(serial.devices["serial-FT2232A"]) == [plug.bus_node, "/dev/ttyUSB0", "/dev/ttyUSB1"]
    info = json.loads(usb.allocate(serial, ["serial-FT2232A"]).envs["USBDEVICE_INTEL_COM_UARTS_INFO"])
    assert info["serial-FT2232A"]["nodes"] == [plug.bus_node, "/dev/ttyUSB0", "/dev/ttyUSB1"]


def test_dra_attributes_say_vendor_product_port_and_a_short_serial(tree: UsbTree, usb: UsbPools) -> None:
    tree.attach(ftdi(), "2")
    tree.attach(ftdi(serial=None), "3")
    tree.attach(keyboard(serial="K" * 65), "1")
    serial = usb.pool(pool("p", EVERYTHING))
    keys = ("vendor", "product", "port", "serial")

    def attributes(device_id: str) -> dict[str, Any]:
        described = usb.handler.dra_attributes(serial, device_id)
        return {key: described[key] for key in keys if key in described}

    assert attributes("serial-FTDI0042") == {"vendor": "0403", "product": "6001", "port": "1-2", "serial": "FTDI0042"}
    assert attributes("port-1-3") == {"vendor": "0403", "product": "6001", "port": "1-3"}
    assert attributes("port-1-1") == {"vendor": "0627", "product": "0001", "port": "1-1"}


# --- events -------------------------------------------------------------------------------------------

SETTLED_AFTER = {
    "serial": "bind@/devices/pci0000:00/0000:00:14.0/usb1/1-2/1-2:1.0",
    "dual": "bind@/devices/pci0000:00/0000:00:14.0/usb1/1-2/1-2:1.0",
    "keyboard": "bind@/devices/pci0000:00/0000:00:14.0/usb1/1-2/1-2:1.0",
    "storage": "bind@/devices/pci0000:00/0000:00:14.0/usb2/2-2/2-2:1.0",
}
MODELS = {"serial": ftdi(), "dual": ft2232(), "keyboard": keyboard(), "storage": storage()}


def device_of(usb: UsbPools, facts: Any) -> dict[str, Any]:
    return usb.build(facts, pool("p", EVERYTHING))["p"]


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("udev", [False, True], ids=["kernel", "udev"])
def test_offered_at_the_interface_bind_and_folds_equal_a_fresh_scan_from_then_on(
        tree: UsbTree, usb: UsbPools, kind: str, udev: bool) -> None:
    model: UsbModel = MODELS[kind]
    facts = usb.handler.scan()
    plug = tree.plug(model, "2")
    settled = False
    for step in plug.steps:
        tree.apply(step)
        if not step.sends:
            continue
        facts = usb.handler.fold(facts, step.event(udev))
        settled = settled or repr(step) == SETTLED_AFTER[kind]
        folded = device_of(usb, facts)
        if not settled:
            assert folded == {}, f"offered before settled, at {step}"
        else:
            assert folded == device_of(usb, usb.handler.scan()), f"fold differs from a scan after {step}"
            assert node_paths(next(iter(folded.values())))[0] == plug.bus_node
    assert settled
    assert set(node_paths(next(iter(device_of(usb, facts).values())))) == set(plug.nodes())


def test_a_scan_takes_a_device_whose_driver_is_bound_as_settled(tree: UsbTree, usb: UsbPools) -> None:
    plug = tree.plug(ftdi(), "2")
    probe = next(i for i, step in enumerate(plug.steps) if step.action == "probe")
    for step in plug.steps[:probe]:  # the usb_device and its endpoint 0: no driver yet
        tree.apply(step)
    assert device_of(usb, usb.handler.scan()) == {}
    tree.apply(plug.steps[probe])  # the generic driver probes it: its driver link is there
    assert set(device_of(usb, usb.handler.scan())) == {"serial-FTDI0042"}


def fold_steps(tree: UsbTree, usb: UsbPools, facts: Any, steps: list, udev: bool = False) -> Any:
    for step in steps:
        tree.apply(step)
        if step.sends:
            facts = usb.handler.fold(facts, step.event(udev))
    return facts


def test_remove_of_a_child_node_leaves_it_out_and_of_the_device_drops_it(tree: UsbTree, usb: UsbPools) -> None:
    tree.attach(keyboard(), "1")
    plug = tree.attach(ftdi(), "2")
    facts = usb.handler.scan()
    steps = tree.unplug("1-2")
    tty_gone = next(i for i, s in enumerate(steps) if s.action == "remove" and s.kobj.subsystem == "tty") + 1
    facts = fold_steps(tree, usb, facts, steps[:tty_gone])
    assert node_paths(device_of(usb, facts)["serial-FTDI0042"]) == [plug.bus_node]
    facts = fold_steps(tree, usb, facts, steps[tty_gone:])
    assert set(device_of(usb, facts)) == {"serial-KBD0001"}
    assert device_of(usb, facts) == device_of(usb, usb.handler.scan())


def test_unplugging_a_hub_drops_it_and_the_devices_behind_it(tree: UsbTree, usb: UsbPools) -> None:
    tree.attach(hub(), "4")
    tree.attach(keyboard(serial=None), "4.1")
    tree.attach(ftdi(), "2")
    facts = usb.handler.scan()
    assert set(device_of(usb, facts)) == {f"serial-{HUB_SERIAL}", "port-1-4.1", "serial-FTDI0042"}
    facts = fold_steps(tree, usb, facts, tree.unplug("1-4"), udev=True)
    assert set(device_of(usb, facts)) == {"serial-FTDI0042"}
    assert device_of(usb, facts) == device_of(usb, usb.handler.scan())


def test_a_device_behind_a_hub_plugged_later_folds_in_without_touching_the_hub(tree: UsbTree, usb: UsbPools) -> None:
    hub_plug = tree.attach(hub(), "4")
    facts = usb.handler.scan()
    facts = fold_steps(tree, usb, facts, tree.plug(keyboard(serial=None), "4.1").steps)
    devices = device_of(usb, facts)
    assert set(devices) == {f"serial-{HUB_SERIAL}", "port-1-4.1"}
    assert node_paths(devices[f"serial-{HUB_SERIAL}"]) == [hub_plug.bus_node]
    assert devices == device_of(usb, usb.handler.scan())


def test_a_second_device_with_the_same_serial_renames_both_to_ports_and_back(tree: UsbTree, usb: UsbPools) -> None:
    tree.attach(ftdi(serial="FTDI0042"), "2")
    facts = usb.handler.scan()
    facts = fold_steps(tree, usb, facts, tree.plug(ftdi(serial="FTDI0042"), "3").steps)
    assert set(device_of(usb, facts)) == {"port-1-2", "port-1-3"}
    facts = fold_steps(tree, usb, facts, tree.unplug("1-3"))
    assert set(device_of(usb, facts)) == {"serial-FTDI0042"}
    assert device_of(usb, facts) == device_of(usb, usb.handler.scan())


def test_events_of_other_devices_change_nothing(tree: UsbTree, usb: UsbPools) -> None:
    tree.attach(ftdi(), "2")
    facts = usb.handler.scan()
    before = device_of(usb, facts)
    plug = tree.plug(storage(), "3")
    bdi = next(s for s in plug.steps if s.kobj.subsystem == "bdi")
    for step in plug.steps[: plug.steps.index(bdi) + 1]:
        tree.apply(step)
    assert device_of(usb, usb.handler.fold(facts, bdi.event())) == before


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selectors", "json_path"),
    [
        ({}, "$.resourceList[0].selectors"),
        ([{"vendors": ["0403"]}, {}], "$.resourceList[0].selectors[1]"),
        ({"vendors": ["403"]}, "$.resourceList[0].selectors.vendors"),
        ({"vendors": ["0x0403"]}, "$.resourceList[0].selectors.vendors"),
        ({"vendors": ["04g3"]}, "$.resourceList[0].selectors.vendors"),
        ({"products": ["60011"]}, "$.resourceList[0].selectors.products"),
        ({"interfaceClasses": ["3"]}, "$.resourceList[0].selectors.interfaceClasses"),
        ({"interfaceClasses": ["fff"]}, "$.resourceList[0].selectors.interfaceClasses"),
        ({"interfaceClasses": ["zz"]}, "$.resourceList[0].selectors.interfaceClasses"),
        ({"vendors": "0403"}, "$.resourceList[0].selectors.vendors"),
        ({"serials": [42]}, "$.resourceList[0].selectors.serials"),
        (None, "$.resourceList[0].selectors"),
    ],
)
def test_a_bad_selector_is_refused_with_its_json_path(usb: UsbPools, selectors: Any, json_path: str) -> None:
    entry = {"resourceName": "p"} if selectors is None else pool("p", selectors)
    with pytest.raises(ConfigFileError) as caught:
        usb.configure(entry)
    assert caught.value.json_path.startswith(json_path), caught.value.json_path


def test_bad_permissions_are_refused(usb: UsbPools) -> None:
    with pytest.raises(ConfigFileError) as caught:
        usb.configure(pool("p", {"vendors": ["0403"]}, permissions="rwx"))
    assert caught.value.json_path == "$.resourceList[0].permissions"


@pytest.mark.parametrize("what", ["interface dir", "interface attribute", "driver link", "bus link", "device attrs"])
def test_a_half_gone_device_is_skipped_or_read_without_it(lab: UsbTree, usb: UsbPools, what: str) -> None:
    """What a reader racing an unplug can find: the pieces of 1-2 go in any order."""
    sys = lab.host.sys
    device_dir = sys / lab.plugs["1-2"].devpath.lstrip("/")
    interface = device_dir / "1-2:1.0"
    if what == "interface dir":
        shutil.rmtree(interface)
    elif what == "interface attribute":
        (interface / "bInterfaceClass").unlink()
        (interface / "uevent").unlink()
    elif what == "driver link":
        (sys / "bus" / "usb" / "drivers" / "ftdi_sio" / "1-2:1.0").unlink()
        shutil.rmtree(sys / "bus" / "usb" / "drivers" / "ftdi_sio")
    elif what == "bus link":
        shutil.rmtree(device_dir)  # /sys/bus/usb/devices/1-2 now dangles
    else:
        for name in ("idVendor", "idProduct", "serial", "busnum", "devnum"):
            (device_dir / name).unlink()
    devices = usb.scan_build(pool("p", EVERYTHING))["p"]
    others = {"serial-KBD0001", "serial-STOR4242", f"serial-{HUB_SERIAL}", "port-1-4.1"}
    assert others <= set(devices) <= others | {"serial-FTDI0042", "port-1-2"}
    assert devices["serial-KBD0001"] == usb.scan_build(pool("p", EVERYTHING))["p"]["serial-KBD0001"]


def test_interfaces_coming_and_going_during_scans_never_break_one(tree: UsbTree, usb: UsbPools) -> None:
    plug: Plug = tree.attach(ftdi(), "2")
    tree.attach(keyboard(), "1")
    steady = {"serial-KBD0001"}
    stop = threading.Event()
    errors: list[BaseException] = []
    interface_steps = [s for s in plug.steps if s.kobj is not plug.usb_device]

    def flap() -> None:
        try:
            while not stop.is_set():
                for step in tree.unplug("1-2")[:-2]:  # everything but the usb_device itself
                    tree.apply(step)
                tree.plugs["1-2"] = plug
                for step in interface_steps:
                    tree.apply(step)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        for _ in range(60):
            devices = usb.scan_build(pool("p", EVERYTHING))["p"]
            assert steady <= set(devices) <= steady | {"serial-FTDI0042"}
            for device_id, info in devices.items():
                assert node_paths(info)[0].startswith("/dev/bus/usb/001/"), (device_id, info)
    finally:
        stop.set()
        flapper.join()
    assert errors == []


def test_a_controller_without_a_numa_node_gives_no_topology(ram_host: FakeHost) -> None:
    tree = UsbTree(ram_host, numa_node=-1)
    tree.attach(ftdi(), "2")
    devices = UsbPools(ram_host, tree.udev_data).scan_build(pool("p", {"vendors": ["0403"]}))["p"]
    assert devices["serial-FTDI0042"].numa_nodes == ()

"""The real daemon serving usbDevice pools and udev-selected devNode pools to the kubelet
stand-in: USB hotplug and removal arrive through the unix seam as udevd passes them on (kernel
properties plus udev's), with ``--udev-data-dir`` on the fake database (tests/usbtree.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.daemonrun import DaemonProcess, control_cli
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import Seam
from tests.usbtree import Step, UsbTree, ftdi, keyboard, storage
from tests.waiting import wait_until

SERIAL, HID, DISKS, TTY = "intel.com/usb_serial", "intel.com/usb_hid", "intel.com/usb_disks", "intel.com/ftdi_tty"
CONFIG = {"resourceList": [
    {"resourceName": "usb_serial", "deviceType": "usbDevice", "selectors": {"vendors": ["0403"]}},
    {"resourceName": "usb_hid", "deviceType": "usbDevice", "selectors": {"interfaceClasses": ["03"]},
     "permissions": "r"},
    {"resourceName": "usb_disks", "deviceType": "usbDevice", "selectors": {"drivers": ["usb-storage"]}},
]}
TTY_BY_ID = "/dev/serial/by-id/usb-QEMU_QEMU_USB_SERIAL_FTDI0042-if00-port0"


@pytest.fixture
def tree(host: FakeHost) -> UsbTree:
    return UsbTree(host, numa_node=0)


def start(run_daemon: Callable[..., DaemonProcess], seam: Seam, tree: UsbTree,
          config: dict[str, Any] = CONFIG) -> DaemonProcess:
    """The daemon with the seam as its uevent source (standing in for udevd) and udev's
    database at the tree's; returns once it listens on the seam."""
    daemon = run_daemon(config, "--uevent-source", f"unix:{seam.path}", "--udev-data-dir", str(tree.udev_data))
    seam.wait_ready()
    return daemon


def udevd(seam: Seam) -> Callable[[Step], None]:
    """Passes each step's event on as udevd does (after its rules, with its properties)."""
    return lambda step: seam.send_message(step.message(udev=True))


def listed(kubelet: FakeKubelet, resource: str) -> dict[str, str]:
    return {device_id: health for device_id, (health, _) in kubelet.state(resource).devices.items()}


def wait_for_list(kubelet: FakeKubelet, resource: str, expected: dict[str, str]) -> None:
    """Until the stand-in lists exactly ``expected`` (ID -> health) for ``resource``: a pool
    that never had a device is not registered at all, so ``{}`` needs one that was."""
    kubelet.wait_for(lambda k: k.state(resource).connected and listed(k, resource) == expected,
                     what=f"{resource} listed as {expected}")


def allocated(kubelet: FakeKubelet, resource: str, device_ids: list[str]) -> tuple[list[tuple[str, str, str]],
                                                                                     dict[str, str]]:
    answer = kubelet.allocate(resource, device_ids).container_responses[0]
    specs = [(spec.host_path, spec.container_path, spec.permissions) for spec in answer.devices]
    return specs, dict(answer.envs)


def test_usb_devices_join_on_hotplug_with_all_their_nodes_and_leave_on_removal(
        tree: UsbTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam,
        short_tmp: Path) -> None:
    tree.attach(keyboard(), "1")
    start(run_daemon, seam, tree)
    wait_for_list(kubelet, HID, {"serial-KBD0001": "Healthy"})
    assert kubelet.state(SERIAL).registrations == 0  # nothing to offer yet
    plug = tree.hotplug(ftdi(), "2", udevd(seam))
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0042": "Healthy"})
    assert kubelet.state(SERIAL).devices["serial-FTDI0042"][1] == (0,)
    specs, envs = allocated(kubelet, SERIAL, ["serial-FTDI0042"])
    assert specs == [(plug.bus_node, plug.bus_node, "rw"), ("/dev/ttyUSB0", "/dev/ttyUSB0", "rw")]
    assert envs["USBDEVICE_INTEL_COM_USB_SERIAL"] == "serial-FTDI0042"
    assert json.loads(envs["USBDEVICE_INTEL_COM_USB_SERIAL_INFO"]) == {"serial-FTDI0042": {
        "vendor": "0403", "product": "6001", "serial": "FTDI0042", "port": "1-2",
        "nodes": [plug.bus_node, "/dev/ttyUSB0"]}}
    keyboard_node = tree.plugs["1-1"].bus_node
    specs, envs = allocated(kubelet, HID, ["serial-KBD0001"])
    assert specs[0] == (keyboard_node, keyboard_node, "r")
    assert sorted(specs[1:]) == [("/dev/hidraw0", "/dev/hidraw0", "r"), ("/dev/input/event0", "/dev/input/event0", "r")]
    assert envs["USBDEVICE_INTEL_COM_USB_HID"] == "serial-KBD0001"

    # a host lease takes the keyboard away from the kubelet with the same envs, until released
    control = short_tmp / "control.sock"
    lease = control_cli(control, "allocate", HID, "--device", "serial-KBD0001", "--owner", "vm", "-o", "json")
    assert lease.returncode == 0, lease.stderr
    granted = json.loads(lease.stdout)
    assert granted["envs"]["USBDEVICE_INTEL_COM_USB_HID"] == "serial-KBD0001"
    assert json.loads(granted["envs"]["USBDEVICE_INTEL_COM_USB_HID_INFO"])["serial-KBD0001"]["port"] == "1-1"
    wait_for_list(kubelet, HID, {})
    assert control_cli(control, "release", granted["lease"]).returncode == 0
    wait_for_list(kubelet, HID, {"serial-KBD0001": "Healthy"})

    tree.run(tree.unplug("1-2"), udevd(seam))
    wait_for_list(kubelet, SERIAL, {})
    assert listed(kubelet, HID) == {"serial-KBD0001": "Healthy"}
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(SERIAL, ["serial-FTDI0042"])


def test_a_replug_on_the_same_port_keeps_the_id_and_a_late_partition_is_allocated(
        tree: UsbTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam) -> None:
    start(run_daemon, seam, tree)
    first = tree.hotplug(ftdi(serial=None), "3", udevd(seam))
    wait_for_list(kubelet, SERIAL, {"port-1-3": "Healthy"})
    tree.run(tree.unplug("1-3"), udevd(seam))
    wait_for_list(kubelet, SERIAL, {})
    second = tree.hotplug(ftdi(serial=None), "3", udevd(seam))
    wait_for_list(kubelet, SERIAL, {"port-1-3": "Healthy"})
    assert first.bus_node != second.bus_node
    specs, envs = allocated(kubelet, SERIAL, ["port-1-3"])
    assert [host for host, _, _ in specs] == [second.bus_node, "/dev/ttyUSB0"]
    assert json.loads(envs["USBDEVICE_INTEL_COM_USB_SERIAL_INFO"])["port-1-3"]["serial"] is None

    # storage: offered once its interface is bound; the SCSI disk and its partition come later
    disk = tree.plug(storage(), "3")
    usb_part = next(i for i, s in enumerate(disk.steps) if s.action == "bind" and s.kobj is disk.usb_device) + 1
    tree.run(disk.steps[:usb_part], udevd(seam))
    wait_for_list(kubelet, DISKS, {"serial-STOR4242": "Healthy"})
    tree.run(disk.steps[usb_part:], udevd(seam))
    wait_until(lambda: (tree.host.dev / "sda1").exists(), 5, "sda1 made")
    specs, envs = allocated(kubelet, DISKS, ["serial-STOR4242"])
    assert specs[0][0] == disk.bus_node
    assert sorted(host for host, _, _ in specs[1:]) == ["/dev/bsg/0:0:0:0", "/dev/sda", "/dev/sda1"]
    nodes = json.loads(envs["USBDEVICE_INTEL_COM_USB_DISKS_INFO"])["serial-STOR4242"]["nodes"]
    assert nodes[0] == disk.bus_node and sorted(nodes[1:]) == ["/dev/bsg/0:0:0:0", "/dev/sda", "/dev/sda1"]


def cdi_devices(short_tmp: Path, resource: str) -> dict[str, list[str]]:
    spec = short_tmp / "cdi" / f"devplugd-{resource.replace('/', '-')}.json"
    if not spec.exists():
        return {}
    return {device["name"]: [node["path"] for node in device["containerEdits"].get("deviceNodes", [])]
            for device in json.loads(spec.read_text())["devices"]}


def host_api(short_tmp: Path, resource: str) -> dict[str, dict[str, Any]]:
    result = control_cli(short_tmp / "control.sock", "list", "-o", "json")
    if result.returncode != 0:
        return {}
    return {device["id"]: device for pool in json.loads(result.stdout) if pool["resource"] == resource
            for device in pool["devices"]}


def test_an_unplug_while_a_pod_holds_the_device_lists_it_unhealthy_until_released(
        tree: UsbTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam,
        short_tmp: Path) -> None:
    tree.attach(ftdi(), "2")
    other = tree.attach(ftdi(serial="FTDI0043"), "4")
    start(run_daemon, seam, tree)
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0042": "Healthy", "serial-FTDI0043": "Healthy"})

    # CDI and the host API come from the same tree: one CDI device per USB device, all its nodes
    first = tree.plugs["1-2"]
    wait_until(lambda: cdi_devices(short_tmp, SERIAL) == {
        "serial-FTDI0042": [first.bus_node, "/dev/ttyUSB0"], "serial-FTDI0043": [other.bus_node, "/dev/ttyUSB1"]},
        10, lambda: f"the CDI spec with both adapters: {cdi_devices(short_tmp, SERIAL)}")
    devices = host_api(short_tmp, SERIAL)
    assert {i: (d["health"], d["holder"], d["numa_nodes"]) for i, d in devices.items()} == {
        "serial-FTDI0042": ("Healthy", "free", [0]), "serial-FTDI0043": ("Healthy", "free", [0])}

    kubelet.allocate(SERIAL, ["serial-FTDI0042"])
    kubelet.write_checkpoint({SERIAL: ["serial-FTDI0042"]})
    tree.run(tree.unplug("1-2"), udevd(seam))
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0042": "Unhealthy", "serial-FTDI0043": "Healthy"})
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(SERIAL, ["serial-FTDI0042"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert host_api(short_tmp, SERIAL)["serial-FTDI0042"]["health"] == "Unhealthy"
    wait_until(lambda: set(cdi_devices(short_tmp, SERIAL)) == {"serial-FTDI0043"}, 10, "the CDI spec without it")

    # plugged back in on the same port while still held: the same ID, healthy again
    tree.hotplug(ftdi(), "2", udevd(seam))
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0042": "Healthy", "serial-FTDI0043": "Healthy"})
    tree.run(tree.unplug("1-2"), udevd(seam))
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0042": "Unhealthy", "serial-FTDI0043": "Healthy"})
    kubelet.write_checkpoint({})
    wait_for_list(kubelet, SERIAL, {"serial-FTDI0043": "Healthy"})


def test_a_udev_selector_picks_exactly_the_ftdi_tty_at_its_by_id_path(
        tree: UsbTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam) -> None:
    config = {"resourceList": [
        {"resourceName": "ftdi_tty", "deviceType": "devNode", "containerPath": "by-id",
         "selectors": {"udev": {"subsystems": ["tty"],
                                "properties": {"ID_VENDOR_ID": "0403", "ID_SERIAL_SHORT": "FTDI*"},
                                "parentProperties": {"DRIVER": "ftdi_sio"}}}},
    ]}
    tree.attach(ftdi(serial="OTHER01"), "4")  # an FTDI adapter whose serial does not match
    tree.attach(keyboard(), "1")
    start(run_daemon, seam, tree, config)
    tree.hotplug(ftdi(), "2", udevd(seam))  # ttyUSB1: ttyUSB0 is the other adapter's
    wait_for_list(kubelet, TTY, {"ttyUSB1": "Healthy"})
    specs, _ = allocated(kubelet, TTY, ["ttyUSB1"])
    assert specs == [("/dev/ttyUSB1", TTY_BY_ID, "rw")]
    tree.run(tree.unplug("1-2"), udevd(seam))
    wait_for_list(kubelet, TTY, {})


def test_without_udev_a_pool_of_udev_keys_selects_nothing_and_the_log_says_why(
        tree: UsbTree, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess]) -> None:
    config = {"resourceList": [
        {"resourceName": "ftdi_tty", "deviceType": "devNode",
         "selectors": {"udev": {"properties": {"ID_VENDOR_ID": "0403"}, "subsystems": ["tty"]}}},
        {"resourceName": "ttys", "deviceType": "devNode",
         "selectors": {"udev": {"parentProperties": {"DRIVER": "ftdi_sio"}}}},
    ]}
    tree.attach(ftdi(), "2")
    daemon = run_daemon(config, "--uevent-source", "none", "--udev-data-dir", str(tree.udev_data))
    wait_for_list(kubelet, "intel.com/ttys", {"ttyUSB0": "Healthy"})
    assert kubelet.state(TTY).registrations == 0  # the same tree had nothing for it
    warnings = [line for line in daemon.log.splitlines() if "ID_VENDOR_ID" in line]
    assert len(warnings) == 1 and "$.resourceList[0]" in warnings[0], warnings


@pytest.mark.parametrize(
    ("pool", "json_path"),
    [
        ({"resourceName": "ftdi_tty", "deviceType": "devNode", "selectors": {"udev": {}}},
         "$.resourceList[0].selectors.udev"),
        ({"resourceName": "usb", "deviceType": "usbDevice", "selectors": [{"vendors": ["0403"]}, {}]},
         "$.resourceList[0].selectors[1]"),
        ({"resourceName": "usb", "deviceType": "usbDevice", "selectors": {"vendors": ["04g3"]}},
         "$.resourceList[0].selectors.vendors"),
    ],
)
def test_a_bad_selector_makes_the_daemon_exit_2_naming_the_json_path(
        tree: UsbTree, run_daemon: Callable[..., DaemonProcess], pool: dict[str, Any], json_path: str) -> None:
    daemon = run_daemon({"resourceList": [pool]}, "--uevent-source", "none", "--udev-data-dir", str(tree.udev_data),
                        registration="none")
    assert daemon.process.wait(30) == 2
    assert json_path in daemon.log

"""The guest harness's host-side parts without booting anything (milliseconds): QEMU's argv for
each topology and for USB, the run script's udevd prelude, the USB disk image, and the monitor
relay against a stand-in QMP server, driven by the guest-side ``hmp`` and ``plug``/``unplug``
exactly as a guest script calls them."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.guest import BridgedNvme, GuestImage, MultifunctionNvme, SriovNvme, qemu_command
from tests.guest.listener import parse
from tests.guest.machine import _write_run_script, topology_document
from tests.guest.monitor import MonitorError, MonitorRelay, hmp, inject_aer
from tests.guest.usb import DISK, FTDI, FTDI_NO_SERIAL, KEYBOARD, UsbDevice, plug, unplug, write_disk_image

IMAGE = GuestImage(Path("/nonexistent"), {"kernel_version": "6.1.0-0-amd64"})


def devices(argv: list[str]) -> list[str]:
    return [argv[index + 1] for index, part in enumerate(argv) if part == "-device"]


def test_ports_are_pinned_named_and_listed_for_the_guest(tmp_path: Path) -> None:
    ports = [SriovNvme(2), MultifunctionNvme(3, slow_link=True), BridgedNvme(2)]
    argv = qemu_command(IMAGE, pfs=[4], ports=ports, share=tmp_path, console=tmp_path / "console")
    listed = devices(argv)
    roots = [device for device in listed if device.startswith("pcie-root-port")]
    assert roots == [
        "pcie-root-port,id=rp0,bus=pcie.0,addr=1.0,chassis=1,slot=1",
        "pcie-root-port,id=rp1,bus=pcie.0,addr=2.0,chassis=2,slot=2",
        "pcie-root-port,id=rp2,bus=pcie.0,addr=3.0,chassis=3,slot=3,x-speed=2_5,x-width=1",
        "pcie-root-port,id=rp3,bus=pcie.0,addr=4.0,chassis=4,slot=4",
    ]
    assert "nvme,bus=rp2,addr=00.0,multifunction=on,serial=devplugd2f0" in listed
    assert "nvme,bus=rp2,addr=00.2,serial=devplugd2f2" in listed
    assert "pcie-pci-bridge,id=ppb3,bus=rp3" in listed
    assert "nvme,bus=ppb3,addr=2,serial=devplugd3s2" in listed
    assert "-qmp" not in argv
    document = topology_document([SriovNvme(4), *ports])
    assert [(port["id"], port["address"], port["kind"], port["slow_link"]) for port in document] == [
        ("rp0", "0000:00:01.0", "sriov", False), ("rp1", "0000:00:02.0", "sriov", False),
        ("rp2", "0000:00:03.0", "multifunction", True), ("rp3", "0000:00:04.0", "bridge", False)]


def test_pfs_alone_give_the_same_argv_as_before(tmp_path: Path) -> None:
    argv = qemu_command(IMAGE, pfs=[4, 8], share=tmp_path, console=tmp_path / "console")
    assert devices(argv)[1:4] == [
        "pcie-root-port,id=rp0,bus=pcie.0,addr=1.0,chassis=1,slot=1",
        "nvme-subsys,id=nvmesubsys0,nqn=devplugd-subsys0",
        "nvme,bus=rp0,serial=devplugd0,subsys=nvmesubsys0,sriov_max_vfs=4,sriov_vq_flexible=8,"
        "sriov_vi_flexible=4,max_ioqpairs=10,msix_qsize=5",
    ]


def test_udevd_prelude_runs_before_the_command(tmp_path: Path) -> None:
    env = {"GUEST_SHARE": str(tmp_path), "PATH": "/bin"}
    _write_run_script(tmp_path, ["python3", "-c", "pass"], cwd=tmp_path, env=env, udevd=True)
    script = (tmp_path / "run.sh").read_text()
    assert script.index("/lib/systemd/systemd-udevd --resolve-names=never") < script.index("/run/udev/control") \
        < script.index("udevadm trigger --action=add --type=all") < script.index("udevadm settle") \
        < script.index("exec env -i")
    assert "SYSTEMD_IGNORE_CHROOT=1" in script.split("exec env -i", 1)[1]
    _write_run_script(tmp_path, ["true"], cwd=tmp_path, env=env)
    assert "systemd-udevd" not in (tmp_path / "run.sh").read_text()


def test_usb_gives_an_empty_xhci_and_asks_init_for_the_usb_modules(tmp_path: Path) -> None:
    argv = qemu_command(IMAGE, pfs=[2], share=tmp_path, console=tmp_path / "console", usb=True)
    assert "qemu-xhci,id=xhci,bus=pcie.0,addr=19.0" in devices(argv)
    assert not any(device.startswith("qemu-xhci") for device in devices(
        qemu_command(IMAGE, pfs=[2], share=tmp_path, console=tmp_path / "console")))
    env = {"GUEST_SHARE": str(tmp_path), "PATH": "/bin"}
    _write_run_script(tmp_path, ["true"], cwd=tmp_path, env=env, usb=True)
    assert "GUEST_USB=1" in (tmp_path / "guest.env").read_text().splitlines()
    _write_run_script(tmp_path, ["true"], cwd=tmp_path, env=env)
    assert "GUEST_USB" not in (tmp_path / "guest.env").read_text()


def test_the_usb_disk_image_has_an_mbr_with_one_linux_partition(tmp_path: Path) -> None:
    image = tmp_path / "disk.img"
    write_disk_image(image, size_mib=8)
    data = image.read_bytes()
    assert len(data) == 8 << 20 and data[510:512] == b"\x55\xaa"
    assert data[450] == 0x83  # the first entry's type: Linux
    assert int.from_bytes(data[454:458], "little") == 2048
    assert int.from_bytes(data[458:462], "little") == (8 << 20) // 512 - 2048
    assert data[462:510] == bytes(48)  # no other partition


class FakeQmp:
    """Speaks enough QMP: greeting, qmp_capabilities, human-monitor-command (with an event first)."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.commands: list[str] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        connection, _ = self.server.accept()
        with connection, connection.makefile("rwb") as stream:
            stream.write(b'{"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 22}}}}\r\n')
            stream.flush()
            for line in stream:
                message = json.loads(line)
                if message["execute"] == "qmp_capabilities":
                    stream.write(b'{"return": {}}\r\n')
                elif message["execute"] == "human-monitor-command":
                    command = message["arguments"]["command-line"]
                    self.commands.append(command)
                    stream.write(b'{"event": "X", "data": {}, "timestamp": {}}\r\n')
                    if command.startswith("pcie_aer_inject_error rp0"):
                        reply = {"return": "OK id: rp0 root bus: 0000:00, bus: 0 devfn: 1.0\r\n"}
                    elif command == "fail":
                        reply = {"error": {"class": "GenericError", "desc": "nope"}}
                    elif "port=9" in command:
                        reply = {"return": "usb port 9 (bus xhci.0) not found\r\n"}
                    elif command.startswith("drive_add"):
                        reply = {"return": "OK\r\n"}
                    elif command.split()[0] in ("device_add", "device_del", "chardev-add", "chardev-remove"):
                        reply = {"return": ""}
                    else:
                        reply = {"return": "invalid error status value\r\n"}
                    stream.write(json.dumps(reply).encode() + b"\r\n")
                stream.flush()


@pytest.fixture
def relay(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeQmp]:
    qmp = FakeQmp(short_tmp / "qmp.sock")
    control = short_tmp / "share" / ".guest"
    control.mkdir(parents=True)
    monkeypatch.setenv("GUEST_SHARE", str(short_tmp / "share"))
    running = MonitorRelay(short_tmp / "qmp.sock", control)
    running.start()
    yield qmp
    running.stop()
    qmp.server.close()


def test_the_relay_runs_guest_requests_in_order_and_answers_each(relay: FakeQmp, short_tmp: Path) -> None:
    assert hmp("info pci").text == "invalid error status value\r\n"
    reply = inject_aer("rp0", "UNSUP")
    assert reply.text.startswith("OK id: rp0") and reply.replied_at >= reply.requested_at
    with pytest.raises(MonitorError, match="did not inject"):
        inject_aer("rp1", "RXERR")
    with pytest.raises(MonitorError, match="GenericError: nope"):
        hmp("fail")
    assert relay.commands == ["info pci", "pcie_aer_inject_error rp0 UNSUP", "pcie_aer_inject_error rp1 RXERR", "fail"]
    requests = short_tmp / "share" / ".guest" / "req"
    assert sorted(path.name for path in requests.iterdir()) == [
        f"{number:04d}.{kind}" for number in range(4) for kind in ("cmd", "out")]
    assert "event X" in (short_tmp / "share" / ".guest" / "monitor.log").read_text()


def test_hmp_without_a_monitor_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUEST_SHARE", str(tmp_path))
    with pytest.raises(MonitorError, match="monitor=True"):
        hmp("info pci")


def test_the_listener_parses_kernel_and_libudev_messages() -> None:
    kernel = parse(b"change@/devices/pci0000:00/0000:00:01.0/0000:01:00.0\0ACTION=change\0"
                   b"DEVPATH=/devices/pci0000:00/0000:00:01.0/0000:01:00.0\0SUBSYSTEM=pci\0"
                   b"ERROR_EVENT=BEGIN_RECOVERY\0SEQNUM=7\0", 1.0)
    assert kernel is not None and (kernel.source, kernel.name, kernel.seqnum) == ("kernel", "0000:01:00.0", 7)
    properties = b"ACTION=bind\0DEVPATH=/devices/x/0000:01:00.1\0SUBSYSTEM=pci\0SEQNUM=9\0ID_PATH=pci-0000:01:00.1\0"
    header = b"libudev\0" + (0xFEEDCAFE).to_bytes(4, "big") + (40).to_bytes(4, "little") \
        + (40).to_bytes(4, "little") + len(properties).to_bytes(4, "little")
    udev = parse(header.ljust(40, b"\0") + properties, 2.0)
    assert udev is not None and (udev.source, udev.action, udev.properties["ID_PATH"]) == ("udev", "bind",
                                                                                            "pci-0000:01:00.1")


def test_usb_plug_and_unplug_send_the_recipes_hmp_commands(relay: FakeQmp, short_tmp: Path) -> None:
    guest = short_tmp / "share" / ".guest"
    for device in (KEYBOARD, FTDI, DISK, FTDI_NO_SERIAL):
        plug(device)
    unplug(FTDI)
    unplug(DISK)
    with pytest.raises(MonitorError, match="usb port 9"):
        plug(UsbDevice("kbd9", "usb-kbd", 9, None))
    assert relay.commands == [
        "device_add usb-kbd,bus=xhci.0,id=kbd1,port=1,serial=KBD0001",
        f"chardev-add file,id=ftdi1-chr,path={guest}/usb/ftdi1.out",
        "device_add usb-serial,bus=xhci.0,id=ftdi1,port=2,serial=FTDI0042,chardev=ftdi1-chr",
        f"drive_add 0 if=none,id=disk1-drive,format=raw,file={guest}/usb-disk.img",
        "device_add usb-storage,bus=xhci.0,id=disk1,port=3,serial=STOR4242,drive=disk1-drive",
        f"chardev-add file,id=ftdi2-chr,path={guest}/usb/ftdi2.out",
        "device_add usb-serial,bus=xhci.0,id=ftdi2,port=4,serial=,chardev=ftdi2-chr",  # no serial at all
        "device_del ftdi1", "chardev-remove ftdi1-chr",
        "device_del disk1",  # QEMU deletes the drive_add drive with its device
        "device_add usb-kbd,bus=xhci.0,id=kbd9,port=9",  # no serial=: QEMU makes one up
    ]

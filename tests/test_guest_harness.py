"""The guest harness's host-side parts without booting anything (milliseconds): QEMU's argv for
each topology, the run script's udevd prelude, and the monitor relay against a stand-in QMP
server, driven by the guest-side ``hmp`` exactly as a guest script calls it."""

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

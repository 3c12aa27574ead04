"""The fake PCI driver core (tests/fakedriver.py) does with the files an operator writes what
the kernel does: a VF moves from nvme to vfio-pci and back with the kernel's uevents in the
kernel's order, ``sriov_drivers_autoprobe`` 0 keeps a VF driverless unless driver_override is
set, ``/dev/vfio/<group>`` lives from a group's first vfio-pci bind to its last unbind, and what
the kernel refuses changes nothing and is logged with its errno."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.sources.uevent_wire import parse_kernel_uevent
from tests.daemonrun import DaemonProcess
from tests.fakedriver import FakeDriverCore, Uevent, to_seam
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.pci import NVME_CLASS, add_nvme_pf
from tests.seam import Seam, run_with_seam
from tests.waiting import wait_until

PF = "0000:04:00.0"
VF0, VF1, VF2 = "0000:04:00.1", "0000:04:00.2", "0000:04:00.3"  # groups 10, 11, 12
MULTI = ["0000:01:00.0", "0000:01:00.1", "0000:01:00.2"]  # one multifunction NVMe: group 8


def write(path: Path, text: str) -> None:
    """One write(2) on its own open, as an operator's ``echo`` and daemon/handlers/pci/_rebind.py do."""
    descriptor = os.open(path, os.O_WRONLY)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


def function_file(host: FakeHost, address: str, name: str) -> Path:
    return host.sys / "bus" / "pci" / "devices" / address / name


def driver_file(host: FakeHost, driver: str, name: str) -> Path:
    return host.sys / "bus" / "pci" / "drivers" / driver / name


def drivers_probe(host: FakeHost, address: str) -> None:
    write(host.sys / "bus" / "pci" / "drivers_probe", address)


def driver_of(host: FakeHost, address: str) -> str | None:
    try:
        return os.path.basename(os.readlink(function_file(host, address, "driver")))
    except FileNotFoundError:
        return None


def wait_for_driver(host: FakeHost, address: str, wanted: str | None, timeout: float = 2.0) -> None:
    wait_until(lambda: driver_of(host, address) == wanted, timeout, f"{address} on {wanted}", interval=0.001)


def briefs(events: list[Uevent]) -> list[tuple[str, str, str]]:
    return [(event.action, event.devpath, event.subsystem) for event in events]


def nvme_vfs(host: FakeHost, drivers: list[str | None]) -> None:
    """An emulated-NVMe PF on nvme with VFs 0000:04:00.1.. on ``drivers``, in groups 10.."""
    assert add_nvme_pf(host, PF, drivers, first_group=10) == [VF0, VF1, VF2][:len(drivers)]


def add_multifunction_nvme(host: FakeHost) -> None:
    """Three NVMe functions of one slot on nvme, all in IOMMU group 8 (no ACS between them)."""
    for address in MULTI:
        host.add_pci(address, vendor="1b36", device="0010", class_code=NVME_CLASS, driver="nvme",
                     bridge="0000:00:01.0")
        host.set_iommu_group(address, 8)


def test_driver_override_unbind_and_bind_move_a_vf_from_nvme_to_vfio_pci_with_the_kernels_uevents(
        host: FakeHost) -> None:
    nvme_vfs(host, ["nvme", "nvme"])
    seen: list[Uevent] = []
    with FakeDriverCore(host, on_uevent=seen.append, nvme_namespaces=True) as core:
        # the functions on nvme when it started have their controller and namespace (PF nvme0)
        namespace = host.device_dir(VF0) / "nvme" / "nvme1" / "nvme1n1"
        assert (namespace / "dev").read_text() == "259:1\n"
        assert (host.dev / "nvme1n1").exists() and (host.sys / "block" / "nvme1n1").resolve() == namespace
        assert function_file(host, VF0, "driver_override").read_text() == "(null)\n"
        write(function_file(host, VF0, "driver_override"), "vfio-pci\n")
        write(function_file(host, VF0, "driver") / "unbind", VF0)
        wait_for_driver(host, VF0, None)
        write(driver_file(host, "vfio-pci", "bind"), VF0)
        wait_for_driver(host, VF0, "vfio-pci")
        core.settle()
        assert briefs(core.uevents) == [
            ("remove", host.devpath(VF0, "nvme", "nvme1", "nvme1n1"), "block"),
            ("remove", host.devpath(VF0, "nvme", "nvme1"), "nvme"),
            ("unbind", host.devpath(VF0), "pci"),
            ("add", "/devices/virtual/vfio/10", "vfio"),
            ("bind", host.devpath(VF0), "pci"),
        ]
        assert seen == core.uevents
        removed_disk, _, unbind, group, bind = core.uevents
        assert dict(removed_disk.properties) == {"SUBSYSTEM": "block", "MAJOR": "259", "MINOR": "1",
                                                 "DEVNAME": "nvme1n1", "DEVTYPE": "disk", "DISKSEQ": "2",
                                                 "SEQNUM": "1"}
        assert "DRIVER" not in unbind.properties and bind.properties["DRIVER"] == "vfio-pci"
        assert bind.properties["PCI_SLOT_NAME"] == VF0 and list(bind.properties)[-1] == "SEQNUM"
        assert (group.properties["DEVNAME"], group.properties["MAJOR"]) == ("vfio/10", "242")
        assert (host.dev / "vfio" / "10").exists() and (host.dev / "vfio" / "vfio").exists()
        assert not namespace.exists() and not (host.dev / "nvme1n1").exists() and not (host.dev / "nvme1").exists()
        assert not (host.device_dir(VF0) / "nvme").exists()
        assert function_file(host, VF0, "driver_override").read_text() == "vfio-pci\n"
        assert [(w.path, w.errno) for w in core.writes] == [
            (f"bus/pci/devices/{VF0}/driver_override", 0), ("bus/pci/drivers/nvme/unbind", 0),
            ("bus/pci/drivers/vfio-pci/bind", 0)]


def test_a_cleared_override_unbind_and_drivers_probe_give_the_vf_back_to_nvme_with_its_namespace(
        host: FakeHost) -> None:
    nvme_vfs(host, ["vfio-pci", "nvme"])
    host.set_file(VF0, "driver_override", "vfio-pci\n")
    with FakeDriverCore(host, nvme_namespaces=True) as core:
        assert (host.dev / "vfio" / "10").exists()  # vfio-pci had made it before the start
        write(function_file(host, VF0, "driver_override"), "\n")
        write(function_file(host, VF0, "driver") / "unbind", VF0)
        drivers_probe(host, VF0)  # no driver_override: the driver whose ID table has 1B36:0010
        wait_for_driver(host, VF0, "nvme")
        core.settle()
        controller = host.device_dir(VF0) / "nvme" / "nvme2"  # nvme0 is the PF's, nvme1 VF1's
        assert briefs(core.uevents) == [
            ("remove", "/devices/virtual/vfio/10", "vfio"),
            ("unbind", host.devpath(VF0), "pci"),
            ("add", host.devpath(VF0, "nvme", "nvme2"), "nvme"),
            ("bind", host.devpath(VF0), "pci"),
            ("add", host.devpath(VF0, "nvme", "nvme2", "nvme2n1"), "block"),
        ]
        assert core.uevents[3].properties["DRIVER"] == "nvme"
        assert core.uevents[2].properties["NVME_TRTYPE"] == "pcie"
        assert not (host.dev / "vfio" / "10").exists()
        assert not (host.sys / "devices" / "virtual" / "vfio" / "10").exists()
        assert (controller / "nvme2n1" / "dev").exists() and (host.dev / "nvme2n1").exists()
        assert function_file(host, VF0, "driver_override").read_text() == "(null)\n"
        assert core.refused() == []


def test_with_autoprobe_0_a_vf_binds_only_through_driver_override(host: FakeHost) -> None:
    nvme_vfs(host, [None])
    with FakeDriverCore(host) as core:
        autoprobe = host.device_dir(PF) / "sriov_drivers_autoprobe"
        assert autoprobe.read_text() == "1\n"  # the kernel's default, made where FakeHost made none
        autoprobe.write_text("0\n")
        drivers_probe(host, VF0)
        write(driver_file(host, "nvme", "bind"), VF0)
        core.settle()
        assert driver_of(host, VF0) is None and core.uevents == []
        probe, bind = core.writes
        assert probe.errno == 0 and "sriov_drivers_autoprobe 0" in probe.note  # drivers_probe says nothing
        assert bind.refused and bind.errno == errno.ENODEV  # an explicit bind is refused too

        write(function_file(host, VF0, "driver_override"), "nvme")  # no O_TRUNC: "nvmel)\n" in the file
        drivers_probe(host, VF0)
        wait_for_driver(host, VF0, "nvme")
        assert function_file(host, VF0, "driver_override").read_text() == "nvme\n"
        core.settle()
        assert briefs(core.uevents) == [("bind", host.devpath(VF0), "pci")]  # no namespaces asked for


def test_a_groups_node_lives_from_its_first_vfio_bind_to_its_last_vfio_unbind(host: FakeHost) -> None:
    add_multifunction_nvme(host)
    group = ("/devices/virtual/vfio/8", "vfio")
    with FakeDriverCore(host) as core:
        for count, address in enumerate(MULTI, 1):
            write(function_file(host, address, "driver_override"), "vfio-pci")
            write(function_file(host, address, "driver") / "unbind", address)
            drivers_probe(host, address)
            wait_for_driver(host, address, "vfio-pci")
            core.settle()  # the link comes first, then what vfio-pci's probe makes
            assert (host.dev / "vfio" / "8").exists(), f"/dev/vfio/8 after {count} function(s) on vfio-pci"
        core.settle()
        assert [(action, path) for action, path, _ in briefs(core.uevents)].count(("add", group[0])) == 1
        assert briefs(core.uevents)[:2] == [("unbind", host.devpath(MULTI[0]), "pci"), ("add", *group)]

        del core.uevents[:]
        for address in MULTI:
            write(driver_file(host, "vfio-pci", "unbind"), address)
            wait_for_driver(host, address, None)
            core.settle()
            assert (host.dev / "vfio" / "8").exists() == (address != MULTI[-1])
        assert briefs(core.uevents) == [("unbind", host.devpath(MULTI[0]), "pci"),
                                        ("unbind", host.devpath(MULTI[1]), "pci"),
                                        ("remove", *group),
                                        ("unbind", host.devpath(MULTI[2]), "pci")]


def test_a_failing_probe_leaves_no_driver_link_and_sends_nothing(host: FakeHost) -> None:
    nvme_vfs(host, [None])
    with FakeDriverCore(host) as core:
        write(function_file(host, VF0, "driver_override"), "vfio-pci")
        core.fail_next_bind(VF0)
        core.fail_next_bind(VF0, errno.ENOMEM)
        write(driver_file(host, "vfio-pci", "bind"), VF0)
        drivers_probe(host, VF0)
        core.settle()
        assert driver_of(host, VF0) is None and core.uevents == [] and not (host.dev / "vfio" / "10").exists()
        bind, probe = core.writes[1:]
        assert (bind.errno, bind.note) == (errno.EIO, "probe with driver vfio-pci failed with error -5")
        assert probe.errno == 0 and "failed with error -12" in probe.note  # drivers_probe hides it
        drivers_probe(host, VF0)  # the failures are used up
        wait_for_driver(host, VF0, "vfio-pci")


@pytest.mark.parametrize(("setup", "path", "value", "error"), [
    ("vfio-pci", ("drivers", "vfio-pci", "bind"), VF0, errno.EBUSY),  # bound already (and it matches)
    (None, ("drivers", "vfio-pci", "bind"), VF1, errno.ENODEV),  # vfio-pci matches by driver_override only
    ("vfio-pci", ("drivers", "nvme", "bind"), VF1, errno.ENODEV),  # driver_override names another driver
    (None, ("drivers", "nvme", "unbind"), VF0, errno.ENODEV),  # not bound to nvme
    (None, ("drivers_probe",), "0000:ff:00.0", errno.ENODEV),  # no such function
    (None, ("drivers_probe",), "04:00.1", errno.ENODEV),  # not a device name
])
def test_what_the_kernel_refuses_changes_nothing_and_is_logged_with_its_errno(
        host: FakeHost, setup: str | None, path: tuple[str, ...], value: str, error: int) -> None:
    nvme_vfs(host, ["vfio-pci", None])
    if setup is not None:
        for address in (VF0, VF1):
            host.set_file(address, "driver_override", f"{setup}\n")
    with FakeDriverCore(host) as core:
        write(host.sys.joinpath("bus", "pci", *path), value)
        core.settle()
        assert [(w.path, w.value, w.errno) for w in core.refused()] == [("bus/pci/" + "/".join(path), value, error)]
        assert core.uevents == [] and (driver_of(host, VF0), driver_of(host, VF1)) == ("vfio-pci", None)


def test_vfio_pci_refuses_a_function_without_an_iommu_group(host: FakeHost) -> None:
    host.add_pci("0000:05:00.0", driver=None)
    with FakeDriverCore(host) as core:
        write(function_file(host, "0000:05:00.0", "driver_override"), "vfio-pci")
        write(driver_file(host, "vfio-pci", "bind"), "0000:05:00.0")
        core.settle()
        assert [(w.errno, w.note) for w in core.refused()] == [(errno.EINVAL, "vfio-pci: no IOMMU group")]


def test_a_held_unbind_takes_the_link_at_once_and_the_rest_waits_with_every_later_write(host: FakeHost) -> None:
    nvme_vfs(host, ["vfio-pci"])
    with FakeDriverCore(host, nvme_namespaces=True) as core:
        hold = core.hold_unbind(VF0)
        write(function_file(host, VF0, "driver") / "unbind", VF0)
        assert hold.started.wait(2)
        assert driver_of(host, VF0) is None  # as __device_release_driver: the link goes first
        write(function_file(host, VF0, "driver_override"), "\n")
        drivers_probe(host, VF0)
        core.settle()
        time.sleep(0.05)
        assert driver_of(host, VF0) is None and core.uevents == [] and (host.dev / "vfio" / "10").exists()
        hold.release()
        assert hold.finished.wait(2)
        wait_for_driver(host, VF0, "nvme")
        assert [action for action, _, _ in briefs(core.uevents)] == ["remove", "unbind", "add", "bind", "add"]
        assert [w.path.rsplit("/", 1)[1] for w in core.writes] == ["unbind", "driver_override", "drivers_probe"]


def test_a_hold_for_some_seconds_ends_by_itself(host: FakeHost) -> None:
    nvme_vfs(host, ["vfio-pci"])
    with FakeDriverCore(host) as core:
        core.hold_unbind(VF0, seconds=0.2)
        started = time.monotonic()
        write(driver_file(host, "vfio-pci", "unbind"), VF0)
        wait_until(lambda: len(core.uevents) == 2, 2, "the unbind's uevents", interval=0.001)
        assert 0.2 <= time.monotonic() - started < 1.0
        assert briefs(core.uevents) == [("remove", "/devices/virtual/vfio/10", "vfio"),
                                        ("unbind", host.devpath(VF0), "pci")]


def test_writes_made_back_to_back_are_each_handled_in_the_order_they_were_made(host: FakeHost) -> None:
    add_multifunction_nvme(host)
    with FakeDriverCore(host) as core:
        for address in MULTI:  # no waiting: the same files written again before the first is handled
            write(function_file(host, address, "driver_override"), "vfio-pci")
            write(driver_file(host, "nvme", "unbind"), address)
            drivers_probe(host, address)
        core.settle()
        assert [driver_of(host, address) for address in MULTI] == ["vfio-pci"] * 3
        assert [(w.path.rsplit("/", 1)[1], w.value) for w in core.writes] == [
            step for address in MULTI
            for step in (("driver_override", "vfio-pci"), ("unbind", address), ("drivers_probe", address))]
        assert core.refused() == []


def test_vfio_pci_makes_the_device_cdev_when_the_kernel_has_iommufd(host: FakeHost) -> None:
    nvme_vfs(host, [None])
    with FakeDriverCore(host, vfio_cdev=True) as core:
        write(function_file(host, VF0, "driver_override"), "vfio-pci")
        drivers_probe(host, VF0)
        wait_for_driver(host, VF0, "vfio-pci")
        write(driver_file(host, "vfio-pci", "unbind"), VF0)
        wait_until(lambda: len(core.uevents) == 6, 2, "the unbind's uevents", interval=0.001)
        cdev = host.devpath(VF0, "vfio-dev", "vfio0")
        assert briefs(core.uevents) == [
            ("add", "/devices/virtual/vfio/10", "vfio"), ("add", cdev, "vfio-dev"), ("bind", host.devpath(VF0), "pci"),
            ("remove", cdev, "vfio-dev"), ("remove", "/devices/virtual/vfio/10", "vfio"),
            ("unbind", host.devpath(VF0), "pci")]
        assert core.uevents[1].properties["DEVNAME"] == "vfio/devices/vfio0"
        assert not (host.dev / "vfio" / "devices" / "vfio0").exists() and (host.dev / "iommu").exists()


def test_a_noiommu_group_is_named_so(host: FakeHost) -> None:
    nvme_vfs(host, [None])
    host.set_iommu_group(VF0, 10, noiommu=True)
    with FakeDriverCore(host) as core:
        write(function_file(host, VF0, "driver_override"), "vfio-pci")
        drivers_probe(host, VF0)
        wait_until(lambda: (host.dev / "vfio" / "noiommu-10").exists(), 2, "/dev/vfio/noiommu-10", interval=0.001)
        core.settle()
        assert core.uevents[0].brief == "add@/devices/virtual/vfio/noiommu-10"


def test_a_function_added_while_it_runs_binds_by_the_id_table_it_was_given(host: FakeHost) -> None:
    with FakeDriverCore(host, drivers=("vfio-pci", "i40e"), id_table={"8086:1572": "i40e"}) as core:
        host.add_pci("0000:05:00.0", driver=None)  # an X710 port (8086:1572), on no driver
        override = function_file(host, "0000:05:00.0", "driver_override")
        wait_until(override.exists, 2, "its driver_override", interval=0.001)
        drivers_probe(host, "0000:05:00.0")
        wait_for_driver(host, "0000:05:00.0", "i40e")
        core.settle()
        assert override.read_text() == "(null)\n"
        assert [(e.brief, e.properties["DRIVER"]) for e in core.uevents] == [
            (f"bind@{host.devpath('0000:05:00.0')}", "i40e")]


def test_the_uevents_reach_a_seam_in_the_kernels_wire_format(host: FakeHost, short_tmp: Path) -> None:
    nvme_vfs(host, [None])
    seam = Seam(short_tmp / "uevents.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as daemon_end:
        daemon_end.bind(str(seam.path))
        daemon_end.settimeout(2)
        with FakeDriverCore(host, on_uevent=to_seam(seam)) as core:
            write(function_file(host, VF0, "driver_override"), "vfio-pci")
            drivers_probe(host, VF0)
            received = [parse_kernel_uevent(daemon_end.recv(16384)) for _ in range(2)]
        assert received == [event.event() for event in core.uevents]
        assert [(e.action, e.devname, e.properties.get("DRIVER")) for e in received] == [
            ("add", "vfio/10", None), ("bind", None, "vfio-pci")]


def test_the_daemon_follows_functions_the_emulator_rebinds(
        host: FakeHost, kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess], seam: Seam) -> None:
    nvme_vfs(host, ["vfio-pci", None, None])
    config = {"resourceList": [{"resourceName": "nvme", "deviceType": "pciDevice",
                                "selectors": {"drivers": ["vfio-pci"], "rootDevices": [PF]}}]}
    with FakeDriverCore(host, on_uevent=to_seam(seam)):
        run_with_seam(run_daemon, seam, config)
        assert kubelet.wait_for_devices("intel.com/nvme", 1).healthy == {VF0}
        write(function_file(host, VF2, "driver_override"), "vfio-pci")
        drivers_probe(host, VF2)
        assert kubelet.wait_for_devices("intel.com/nvme", 2).healthy == {VF0, VF2}
        write(function_file(host, VF0, "driver") / "unbind", VF0)
        assert kubelet.wait_for_devices("intel.com/nvme", 1).healthy == {VF2}


def test_stop_leaves_no_thread_and_plain_files_and_a_tree_removed_under_it_is_no_error(host: FakeHost) -> None:
    nvme_vfs(host, ["nvme"])
    before = set(threading.enumerate())
    with FakeDriverCore(host):
        assert stat.S_ISFIFO(os.lstat(driver_file(host, "nvme", "bind")).st_mode)
    assert set(threading.enumerate()) == before
    for path in (driver_file(host, "nvme", "bind"), driver_file(host, "vfio-pci", "unbind"),
                 host.sys / "bus" / "pci" / "drivers_probe"):
        assert stat.S_ISREG(os.lstat(path).st_mode)
        write(path, VF0)  # no reader needed any more: nothing blocks

    with FakeDriverCore(host) as core:
        write(function_file(host, VF0, "driver_override"), "vfio-pci")
        shutil.rmtree(host.root)
        core.settle()
    assert set(threading.enumerate()) == before

"""vfio-pci on demand in the real daemon: the kubelet stand-in's DRA calls over real unix
sockets, the API server stand-in over real HTTP, a fake sysfs whose writes the fake PCI driver
core (``tests/fakedriver.py``) carries out, its uevents reaching the daemon through the uevent
seam. The device stays in its slice while it moves; a daemon killed between two functions' binds
gives everything back at its next start."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.dra import device_name
from tests import test_dra_daemon as daemon_tests
from tests.apiserver import ApiServer
from tests.books import book_document
from tests.daemonrun import DaemonProcess
from tests.fakedriver import FakeDriverCore, Uevent, to_seam
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.pci import add_nvme_pf
from tests.seam import Seam
from tests.test_dra_daemon import DRIVER, NODE, published, wait_published
from tests.test_iommu_groups import MULTI, add_multifunction_nvme

api, dra_kubelet, start_dra = daemon_tests.api, daemon_tests.dra_kubelet, daemon_tests.start_dra

PF = "0000:04:00.0"
VFS = ["0000:04:00.1", "0000:04:00.2"]
POOL = f"{NODE}/example.com/nvme"
CONFIG = {"resourceList": [{"resourceName": "nvme", "resourcePrefix": "example.com", "deviceType": "pciDevice",
                            "allocationApi": "dra", "vfioOnDemand": True,
                            "selectors": {"drivers": ["nvme"], "vendors": ["1b36"]}}]}
VFIO_CONFIG = [{"source": "FromClass", "requests": ["vm"], "opaque": {
    "driver": DRIVER, "parameters": {"apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig"}}}]


@pytest.fixture
def core(host: FakeHost, seam: Seam) -> Iterator[FakeDriverCore]:
    add_nvme_pf(host, PF, ["nvme", "nvme"])
    add_multifunction_nvme(host, ["nvme", "nvme", "nvme"])
    with FakeDriverCore(host, on_uevent=to_daemon(seam), drivers=("vfio-pci", "nvme"), id_table={"1b36:0010": "nvme"},
                        nvme_namespaces=True) as started:
        yield started


def to_daemon(seam: Seam) -> Callable[[Uevent], None]:
    """The kernel's uevents to the daemon's seam; those sent while it is down are lost, as the
    kernel's are (the daemon scans at start)."""
    send = to_seam(seam)

    def sent(event: Uevent) -> None:
        with contextlib.suppress(ConnectionRefusedError):
            send(event)
    return sent


def drivers(core: FakeDriverCore, *addresses: str) -> list[str | None]:
    core.settle()
    return [link.resolve().name if (link := core.host.device_dir(a) / "driver").is_symlink() else None
            for a in addresses]


def vm_claim(api: ApiServer, name: str, address: str) -> tuple[str, str, str]:
    results = [{"request": "vm", "driver": DRIVER, "pool": POOL, "device": device_name(address)}]
    return ("default", api.put_claim("default", name, results=results, config=VFIO_CONFIG), name)


def test_a_claim_has_its_vf_on_vfio_pci_while_it_stays_in_its_slice(
    api: ApiServer, core: FakeDriverCore, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vf = VFS[0]
    start_dra(CONFIG)
    wait_published(api, {device_name(a) for a in (*VFS, MULTI[0])}, pool=POOL)
    dra_kubelet.wait_for_dra(DRIVER)
    ref = vm_claim(api, "vm", vf)
    (device,) = dra_kubelet.prepare([ref])[ref[1]].devices
    assert drivers(core, vf) == ["vfio-pci"]
    assert [i.partition("=")[0] for i in device.cdi_device_ids] == [f"{DRIVER}/claim", f"{DRIVER}/metadata"]
    spec = json.loads((short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").read_text())
    assert [node["path"] for node in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/vfio/vfio", "/dev/vfio/10"]
    # the slice follows the binding, the device never leaves it
    api.wait_until(lambda: published(api, POOL).get(device_name(vf), {}).get("driver") == {"string": "vfio-pci"},
                   10, "the slice saying vfio-pci")
    dra_kubelet.unprepare([ref])
    assert drivers(core, vf) == ["nvme"]
    api.wait_until(lambda: published(api, POOL).get(device_name(vf), {}).get("driver") == {"string": "nvme"},
                   10, "the slice saying nvme again")
    assert core.refused() == []


def test_a_daemon_killed_between_two_binds_gives_the_group_back_at_start(
    api: ApiServer, core: FakeDriverCore, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    daemon = start_dra(CONFIG)
    wait_published(api, {device_name(a) for a in (*VFS, MULTI[0])}, pool=POOL)
    dra_kubelet.wait_for_dra(DRIVER)
    ref = vm_claim(api, "vm", MULTI[0])
    hold = core.hold_unbind(MULTI[1])  # the second function's unbind waits: the daemon is between two binds
    answers: list[Any] = []
    call = threading.Thread(target=lambda: answers.append(_prepare_or_error(dra_kubelet, ref)), daemon=True)
    call.start()
    assert hold.started.wait(15), daemon.log
    assert drivers(core, MULTI[0]) == ["vfio-pci"]
    checkpoint = book_document(short_tmp / "state" / "dra-claims.json")["claims"]
    assert [entry.get("pending") for entry in checkpoint] == [True]  # the loan is on disk before the first unbind
    daemon.stop(signal.SIGKILL)
    hold.release()
    call.join(30)
    assert drivers(core, *MULTI) != ["nvme"] * 3

    daemon = start_dra(CONFIG)
    daemon.wait_for_log("its Prepare was cut short")
    assert drivers(core, *MULTI) == ["nvme"] * 3
    assert book_document(short_tmp / "state" / "dra-claims.json")["claims"] == []
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    dra_kubelet.unprepare([ref])  # the kubelet's Unprepare of the claim it was never answered for
    assert drivers(core, *MULTI) == ["nvme"] * 3
    assert dra_kubelet.prepare([ref])[ref[1]].devices  # or its Prepare again: the whole group goes over
    assert drivers(core, *MULTI) == ["vfio-pci"] * 3
    dra_kubelet.unprepare([ref])
    assert drivers(core, *MULTI) == ["nvme"] * 3


def test_a_function_a_claim_holds_on_vfio_pci_is_never_offered_to_the_kubelet_across_a_restart(
    api: ApiServer, core: FakeDriverCore, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    """A device-plugin pool that selects functions on vfio-pci beside the vfioOnDemand pool: the
    VF a claim holds on vfio-pci is the claim's, in the first tree after a restart too (before
    the DRA driver has restored its claims). The pool has nothing else, and a pool with no devices
    is never registered with the kubelet."""
    vfio_pool = {"resourceName": "vfio", "resourcePrefix": "example.com", "deviceType": "pciDevice",
                 "selectors": {"drivers": ["vfio-pci"], "vendors": ["1b36"]}}
    pools = {"resourceList": [*CONFIG["resourceList"], vfio_pool]}
    daemon = start_dra(pools)
    wait_published(api, {device_name(a) for a in (*VFS, MULTI[0])}, pool=POOL)
    dra_kubelet.wait_for_dra(DRIVER)
    ref = vm_claim(api, "vm", VFS[0])
    assert dra_kubelet.prepare([ref])[ref[1]].devices and drivers(core, VFS[0]) == ["vfio-pci"]
    assert daemon.stop() == 0
    daemon = start_dra(pools)
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)  # the claims restored
    first_tree = next(line for line in daemon.log.splitlines() if "example.com/vfio: " in line)
    assert "example.com/vfio: 0 devices" in first_tree, daemon.log
    assert dra_kubelet.state("example.com/vfio").registrations == 0, dra_kubelet.state("example.com/vfio").messages
    dra_kubelet.unprepare([ref])
    assert drivers(core, VFS[0]) == ["nvme"]


def _prepare_or_error(kubelet: FakeKubelet, ref: tuple[str, str, str]) -> Any:
    try:
        return kubelet.prepare([ref], timeout=20)
    except Exception as error:  # the daemon is killed under the call
        return error

"""vfio-pci on demand through DRA: a claim with a ``VfioConfig`` has its device's whole IOMMU group
taken from its host driver at Prepare and given back at Unprepare, through the sysfs files an
operator writes, with the checks first, the checkpoint before the first unbind, and a restart
that finds a Prepare cut short or a claim whose functions a reboot gave back.

The preparer runs against the real pci handler on a fake sysfs laid out as Linux lays out NVMe
VFs and a multifunction NVMe, and a fake PCI driver core (``tests/fakedriver.py``) does what the
kernel does with the writes; its uevents and the preparer's ``Lent`` events are folded into the
handler's facts, from which every tree is built, as the daemon's event loop does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.core import Lent, Loan, ResourcePool
from daemon.core._handler import Hooks
from daemon.core._tree import DRA_ROAD, DeviceTree
from daemon.dra import pool_name
from daemon.dra._claims import ClaimRef
from daemon.dra._names import device_name
from daemon.dra._orphans import OrphanSweeper
from daemon.dra._prepare import ClaimPreparer, PrepareResult
from daemon.dra._prepared import CLAIMS_FILE, ClaimBook, PreparedClaim, PreparedDevice
from daemon.handlers.pci._facts import PciFacts
from daemon.metrics import Metrics
from tests import trees
from tests.books import book_document
from tests.fakedriver import FakeDriverCore, Uevent
from tests.fakesysfs import FakeHost
from tests.pci import Pci, add_nvme_pf
from tests.test_dra_prepare import DRIVER, NODE, FakeApi, claim_json, uid
from tests.test_iommu_groups import MULTI, add_multifunction_nvme

PF = "0000:04:00.0"
NVME = "example.com/nvme"
VFIO = "example.com/vfio"
ON_DEMAND: dict[str, Any] = {"resourceName": "nvme", "resourcePrefix": "example.com", "deviceType": "pciDevice",
                             "allocationApi": "dra", "vfioOnDemand": True,
                             "selectors": {"drivers": ["nvme"], "vendors": ["1b36"]}}
VFIO_POOL: dict[str, Any] = {"resourceName": "vfio", "resourcePrefix": "example.com", "deviceType": "pciDevice",
                             "allocationApi": "dra", "selectors": {}}
VFIO_CONFIG = {"apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig"}


class Rig:
    """The pci handler's facts, folded from the fake kernel's uevents and the preparer's Lent
    events; the tree of the pools built from them; the preparer and its book on real files."""

    def __init__(self, root: Path, host: FakeHost, pci: Pci, *, vfio_cdev: bool = False) -> None:
        self.root, self.host, self.pci = root, host, pci
        self.vfs = add_nvme_pf(host, PF, ["nvme", "nvme", "nvme"])
        if vfio_cdev:  # a kernel with IOMMUFD: the vfio-dev class and /dev/iommu are there once loaded
            (host.sys / "class" / "vfio-dev").mkdir(parents=True, exist_ok=True)
            host.add_dev_node("iommu")
        add_multifunction_nvme(host, ["nvme", "nvme", "nvme"])
        self.configured = pci.configure(ON_DEMAND, VFIO_POOL)
        self._lock = threading.Lock()
        self.facts: PciFacts = pci.handler.scan()
        self.lent: list[Lent] = []
        self.api = FakeApi()
        self.core = FakeDriverCore(host, on_uevent=self._uevent, drivers=("vfio-pci", "nvme"),
                                   id_table={"1b36:0010": "nvme"}, nvme_namespaces=True, vfio_cdev=vfio_cdev)
        self.restart()

    def restart(self) -> None:
        """A new book and preparer on the same files, as after a daemon restart."""
        self.book = ClaimBook(self.root / "state")
        self.book.load()
        self.metrics = Metrics()
        self.preparer = ClaimPreparer(DRIVER, NODE, self.root / "cdi", self.book, self.tree,
                                      {"pci": Hooks.of(self.pci.handler)}, self.api.get_claim, lambda reason: None,
                                      post=self._post, metrics=self.metrics)

    def _uevent(self, event: Uevent) -> None:
        with self._lock:
            self.facts = self.pci.handler.fold(self.facts, event.event())

    def _post(self, event: Lent) -> None:
        self.lent.append(event)
        with self._lock:
            self.facts = self.pci.handler.fold(self.facts, event)

    def pools(self) -> dict[str, ResourcePool]:
        self.core.settle()
        with self._lock:
            built = self.pci.handler.build(self.facts, self.configured)
        return {p.resource: trees.pool(p, built[p.resource], road=DRA_ROAD) for p in self.configured}

    def tree(self) -> DeviceTree:
        return trees.tree(*self.pools().values())

    def claim(self, n: int, *devices: tuple[str, str], config: list[dict[str, Any]] | None = None) -> ClaimRef:
        results = [{"request": "vm", "driver": DRIVER, "pool": pool_name(NODE, resource),
                    "device": device_name(device_id)} for resource, device_id in devices]
        return self.api.add(claim_json(n, f"vm-{n}", results, config=config))

    async def prepare(self, ref: ClaimRef) -> PrepareResult:
        return (await self.preparer.prepare([ref]))[ref.uid]

    def drivers(self, *addresses: str) -> list[str | None]:
        self.core.settle()
        return [link.resolve().name if (link := self.host.device_dir(a) / "driver").is_symlink() else None
                for a in addresses]

    def overrides(self, *addresses: str) -> list[str]:
        return [(self.host.device_dir(a) / "driver_override").read_text().strip() for a in addresses]

    def checkpoint(self) -> list[dict[str, Any]]:
        claims: list[dict[str, Any]] = book_document(self.root / "state" / CLAIMS_FILE)["claims"]
        return claims

    def spec(self, claim_uid: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads((self.root / "cdi" / f"devplugd-claim-{claim_uid}.json").read_text())
        return document

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def namespaces(self) -> list[str]:
        return sorted(path.name for path in self.host.dev.glob("nvme*n1"))


@pytest.fixture
def rig(short_tmp: Path, host: FakeHost, pci: Pci) -> Iterator[Rig]:
    built = Rig(short_tmp, host, pci)
    with built.core:
        yield built


def vfio_config(source: str = "FromClaim", **fields: str) -> list[dict[str, Any]]:
    return [{"source": source, "requests": ["vm"], "opaque": {"driver": DRIVER,
                                                              "parameters": {**VFIO_CONFIG, **fields}}}]


def container_edits(spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    (device,) = spec["devices"]
    edits = device["containerEdits"]
    return [node["path"] for node in edits["deviceNodes"]], dict(e.split("=", 1) for e in edits["env"])


async def test_a_vf_goes_to_vfio_pci_for_the_claim_and_back_to_nvme_after(rig: Rig) -> None:
    vf = rig.vfs[0]
    namespaces = rig.namespaces()
    ref = rig.claim(1, (NVME, vf), config=vfio_config())
    answer = await rig.prepare(ref)
    assert answer.error is None
    assert rig.drivers(vf) == ["vfio-pci"] and rig.overrides(vf) == ["vfio-pci"]
    paths, env = container_edits(rig.spec(uid(1)))
    assert paths == ["/dev/vfio/vfio", "/dev/vfio/10"]
    assert env["PCIDEVICE_EXAMPLE_COM_NVME"] == vf and env["PCI_RESOURCE_EXAMPLE_COM_NVME"] == vf
    (entry,) = rig.checkpoint()
    assert entry["loans"] == [{"handler": "pci", "resource": NVME, "device_id": vf,
                               "parts": [{"part": vf, "driver": "nvme"}]}] and "pending" not in entry
    # the same device of the same pool, its driver as it is now; never in the pool of vfio-pci functions
    pools = rig.pools()
    assert sorted(pools[NVME].devices) == sorted([*rig.vfs, MULTI[0]]) and pools[VFIO].devices == {}
    assert pools[NVME].devices[vf].details.device.driver == "vfio-pci"
    assert len(rig.namespaces()) == len(namespaces) - 1  # its namespace went with nvme
    assert rig.metric("devplugd_dra_vfio_lent_functions") == 1
    assert rig.metric("devplugd_dra_vfio_rebinds_total", direction="to_vfio", outcome="done") == 1

    assert await rig.preparer.unprepare([ref]) == {uid(1): None}
    assert rig.drivers(vf) == ["nvme"] and rig.overrides(vf) == ["(null)"]
    assert rig.namespaces() == namespaces
    assert rig.checkpoint() == [] and rig.lent[-1] == Lent("pci", (), rig.lent[-1].reason)
    assert rig.pools()[NVME].devices[vf].details.device.driver == "nvme"
    assert rig.core.refused() == []  # every write one a real kernel takes
    assert rig.metric("devplugd_dra_vfio_lent_functions") == 0
    assert rig.metric("devplugd_dra_vfio_rebinds_total", direction="back", outcome="done") == 1


async def test_a_claim_from_the_vfio_class_gets_the_whole_group_and_gives_it_back(rig: Rig) -> None:
    ref = rig.claim(1, (NVME, MULTI[0]), config=vfio_config("FromClass"))
    assert (await rig.prepare(ref)).error is None
    assert rig.drivers(*MULTI) == ["vfio-pci"] * 3
    paths, env = container_edits(rig.spec(uid(1)))
    assert paths == ["/dev/vfio/vfio", "/dev/vfio/8"]
    assert env["PCIDEVICE_EXAMPLE_COM_NVME"] == ",".join(MULTI)
    assert list(rig.pools()[NVME].devices).count(MULTI[0]) == 1
    assert await rig.preparer.unprepare([ref]) == {uid(1): None}
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.overrides(*MULTI) == ["(null)"] * 3
    # all three off vfio-pci before the first goes back to nvme
    moves = [(e.action, e.devpath.rpartition("/")[2]) for e in rig.core.uevents if e.subsystem == "pci"]
    unbinds = [index for index, (action, address) in enumerate(moves) if action == "unbind"]
    binds_back = [index for index, (action, _) in enumerate(moves) if action == "bind"][3:]
    assert max(unbinds[3:]) < min(binds_back)


async def test_a_claim_without_vfio_config_gets_the_device_on_its_host_driver(rig: Rig) -> None:
    ref = rig.claim(1, (NVME, rig.vfs[1]))
    assert (await rig.prepare(ref)).error is None
    assert rig.drivers(rig.vfs[1]) == ["nvme"] and rig.core.writes == []
    assert "loans" not in rig.checkpoint()[0]


async def test_a_mounted_namespace_is_refused_before_anything_moves(rig: Rig) -> None:
    vf = rig.vfs[2]
    (namespace,) = [p for p in rig.host.device_dir(vf).glob("nvme/nvme*/nvme*n1")]
    numbers = (namespace / "dev").read_text().strip()
    (rig.host.proc / "1").mkdir(exist_ok=True)
    (rig.host.proc / "1" / "mountinfo").write_text(f"36 25 {numbers} / /data rw - ext4 /dev/{namespace.name} rw\n")
    ref = rig.claim(1, (NVME, vf), config=vfio_config())
    answer = await rig.prepare(ref)
    assert answer.error == (f"claim default/vm-1: device {device_name(vf)!r} ({vf} of {NVME}) cannot go to vfio-pci: "
                            f"{vf}: its block device {namespace.name} ({numbers}) is mounted or used as swap")
    assert rig.drivers(vf) == ["nvme"] and rig.core.writes == []  # drivers() lets the core settle first
    assert not (rig.root / "state" / CLAIMS_FILE).exists() and rig.book.holders() == {}


async def test_a_failed_bind_gives_back_what_moved_and_names_the_function(rig: Rig) -> None:
    rig.core.fail_next_bind(MULTI[1])
    ref = rig.claim(1, (NVME, MULTI[0]), config=vfio_config())
    answer = await rig.prepare(ref)
    assert answer.error is not None
    assert answer.error.startswith(f"claim default/vm-1: device {device_name(MULTI[0])!r} ({MULTI[0]} of {NVME}) "
                                   f"could not go to vfio-pci: {MULTI[1]}: still bound to no driver after")
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.overrides(*MULTI) == ["(null)"] * 3
    assert rig.checkpoint() == [] and rig.book.holders() == {}
    assert rig.metric("devplugd_dra_vfio_rebinds_total", direction="to_vfio", outcome="failed") == 1
    assert (await rig.prepare(ref)).error is None  # the kubelet asks again
    assert rig.drivers(*MULTI) == ["vfio-pci"] * 3


async def test_a_pool_without_vfio_on_demand_refuses_the_config(rig: Rig) -> None:
    rig.configured = rig.pci.configure({**ON_DEMAND, "vfioOnDemand": False}, VFIO_POOL)
    ref = rig.claim(1, (NVME, rig.vfs[0]), config=vfio_config())
    assert (await rig.prepare(ref)).error == (
        f"claim default/vm-1: device {device_name(rig.vfs[0])!r} asks for vfio-pci (VfioConfig), but pool {NVME} "
        "does not take its devices to vfio-pci on demand (vfioOnDemand is not set)")
    assert rig.drivers(rig.vfs[0]) == ["nvme"] and rig.core.writes == []


async def test_a_prepare_cut_short_between_two_binds_is_given_back_at_start(rig: Rig) -> None:
    """What a SIGKILL between the group's first and second bind leaves: the pending entry, one
    function on vfio-pci, one unbound, one on nvme."""
    await _left_half_moved(rig)
    assert rig.drivers(*MULTI) == ["vfio-pci", None, "nvme"]

    rig.restart()
    await rig.preparer.restore()
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.overrides(*MULTI) == ["(null)"] * 3
    assert rig.checkpoint() == []
    assert rig.lent[0].parts == tuple((address, "nvme") for address in MULTI)  # told before anything moved
    assert rig.lent[-1].parts == ()


async def test_the_kubelets_unprepare_of_a_claim_left_pending_gives_its_functions_back(rig: Rig) -> None:
    """A Prepare whose giving back failed too leaves its pending entry (one function on
    vfio-pci, one unbound): the kubelet's Unprepare, when the pod goes, tries again."""
    await _left_half_moved(rig)
    assert rig.book.holders() != {}
    assert await rig.preparer.unprepare([ClaimRef("default", uid(1), "vm-1")]) == {uid(1): None}
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.overrides(*MULTI) == ["(null)"] * 3
    assert rig.checkpoint() == [] and rig.book.holders() == {}


async def test_the_kubelets_retry_of_a_claim_left_pending_keeps_every_functions_own_driver(rig: Rig) -> None:
    """The kubelet asks again for the claim whose Prepare and giving back both failed: the
    group goes over whole, the checkpoint still has each function's own driver (the first one
    is on vfio-pci already, the second on none), and Unprepare puts every function back on nvme."""
    await _left_half_moved(rig)
    rig.preparer._loans.announce("the failed Prepare")  # as its take() had
    ref = rig.claim(1, (NVME, MULTI[0]), config=vfio_config())
    assert (await rig.prepare(ref)).error is None
    assert rig.drivers(*MULTI) == ["vfio-pci"] * 3
    (entry,) = rig.checkpoint()
    assert sorted((p["part"], p["driver"]) for loan in entry["loans"] for p in loan["parts"]) == [
        (address, "nvme") for address in MULTI]
    assert await rig.preparer.unprepare([ref]) == {uid(1): None}
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.checkpoint() == []


async def test_a_claim_left_pending_whose_resourceclaim_is_gone_is_given_back_by_the_sweep(rig: Rig) -> None:
    loan = Loan("pci", NVME, MULTI[0], tuple((address, "nvme") for address in MULTI))
    await rig.book.add(_pending(loan))
    (rig.host.device_dir(MULTI[0]) / "driver_override").write_text("vfio-pci\n")
    (rig.host.device_dir(MULTI[0]) / "driver" / "unbind").write_text(MULTI[0])
    rig.core.settle()
    (rig.host.sys / "bus" / "pci" / "drivers" / "vfio-pci" / "bind").write_text(MULTI[0])
    await OrphanSweeper(rig.book, rig.api.get_claim, rig.preparer.release_orphans).sweep()  # vm-1 is not there
    assert rig.drivers(*MULTI) == ["nvme"] * 3 and rig.checkpoint() == []


async def test_unprepare_after_a_restart_gives_back_and_a_reboot_is_made_whole_again(rig: Rig) -> None:
    ref = rig.claim(1, (NVME, rig.vfs[0]), config=vfio_config())
    assert (await rig.prepare(ref)).error is None
    # a reboot: the kernel binds nvme again; the kubelet still counts the claim prepared
    (rig.host.device_dir(rig.vfs[0]) / "driver" / "unbind").write_text(rig.vfs[0])
    rig.core.settle()
    (rig.host.device_dir(rig.vfs[0]) / "driver_override").write_text("\n")
    (rig.host.sys / "bus" / "pci" / "drivers_probe").write_text(rig.vfs[0])
    assert rig.drivers(rig.vfs[0]) == ["nvme"]
    rig.restart()
    await rig.preparer.restore()
    assert rig.drivers(rig.vfs[0]) == ["vfio-pci"]
    assert await rig.preparer.unprepare([ref]) == {uid(1): None}
    assert rig.drivers(rig.vfs[0]) == ["nvme"] and rig.checkpoint() == []


async def _left_half_moved(rig: Rig) -> None:
    """The multifunction device's pending entry in the checkpoint, and its group as a Prepare
    cut short leaves it: the first function on vfio-pci, the second unbound, the third on nvme."""
    loan = Loan("pci", NVME, MULTI[0], tuple((address, "nvme") for address in MULTI))
    await rig.book.add(_pending(loan))
    for address, driver in ((MULTI[0], "vfio-pci"), (MULTI[1], None)):
        (rig.host.device_dir(address) / "driver_override").write_text("vfio-pci\n")
        (rig.host.device_dir(address) / "driver" / "unbind").write_text(address)
        rig.core.settle()
        if driver is not None:
            (rig.host.sys / "bus" / "pci" / "drivers" / driver / "bind").write_text(address)


def _pending(loan: Loan) -> PreparedClaim:
    device = PreparedDevice(NVME, MULTI[0], pool_name(NODE, NVME), device_name(MULTI[0]), ("vm",), False,
                            f"devplugd.io/claim={uid(1)}-{device_name(MULTI[0])}")
    return PreparedClaim(uid(1), "default", "vm-1", (device,), loans=(loan,), pending=True)


async def test_a_vf_goes_back_to_nvme_under_a_pf_that_does_not_autoprobe(rig: Rig) -> None:
    (rig.host.device_dir(PF) / "sriov_drivers_autoprobe").write_text("0\n")
    ref = rig.claim(1, (NVME, rig.vfs[1]), config=vfio_config())
    assert (await rig.prepare(ref)).error is None
    assert await rig.preparer.unprepare([ref]) == {uid(1): None}
    assert rig.drivers(rig.vfs[1]) == ["nvme"] and rig.overrides(rig.vfs[1]) == ["(null)"]
    assert rig.core.refused() == []


@pytest.mark.parametrize(("backend", "cdev", "nodes"), [
    ("iommufd", True, ["/dev/vfio/devices/vfio0", "/dev/iommu"]),
    ("preferIommufd", True, ["/dev/vfio/devices/vfio0", "/dev/iommu"]),
    ("preferIommufd", False, ["/dev/vfio/vfio", "/dev/vfio/10"]),
    ("legacy", True, ["/dev/vfio/vfio", "/dev/vfio/10"]),
])
async def test_the_backend_a_claim_asks_for_decides_the_device_nodes(
        short_tmp: Path, host: FakeHost, pci: Pci, backend: str, cdev: bool, nodes: list[str]) -> None:
    rig = Rig(short_tmp, host, pci, vfio_cdev=cdev)
    with rig.core:
        ref = rig.claim(1, (NVME, rig.vfs[0]), config=vfio_config(backend=backend))
        assert (await rig.prepare(ref)).error is None
        paths, _ = container_edits(rig.spec(uid(1)))
        assert paths == nodes
        assert await rig.preparer.unprepare([ref]) == {uid(1): None}
        assert rig.drivers(rig.vfs[0]) == ["nvme"]


async def test_iommufd_on_a_kernel_without_vfio_device_nodes_is_refused_and_the_vf_given_back(rig: Rig) -> None:
    ref = rig.claim(1, (NVME, rig.vfs[0]), config=vfio_config(backend="iommufd"))
    answer = await rig.prepare(ref)
    assert answer.error is not None and (f"{rig.vfs[0]}: the claim asks for iommufd, but the kernel gives "
                                         f"{rig.vfs[0]} no VFIO device node (vfio-dev/vfioN)") in answer.error
    assert rig.drivers(rig.vfs[0]) == ["nvme"] and rig.checkpoint() == []

"""A ``vfioOnDemand`` pool (through DRA) takes functions on their host drivers; a function a claim
holds on vfio-pci stays the same device of the same pool, whatever the rebinding leaves it on for
a moment; a group of several functions is one device when all of it is in the pool; and the
checks before a loan refuse, naming the function and the reason, what must not leave its driver.
On the fake sysfs, laid out as Linux lays out NVMe VFs and a multifunction NVMe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from daemon.core import AllocationError, Lent, Resync, UEvent
from daemon.core._config import ConfigFileError
from daemon.handlers.pci._facts import PciFacts
from tests.fakesysfs import FakeHost, relative_link, write_file
from tests.pci import NVME_CLASS, Pci, add_nvme_pf
from tests.test_iommu_groups import MULTI, add_multifunction_nvme

PF = "0000:04:00.0"
ON_DEMAND: dict[str, Any] = {"resourceName": "nvme", "deviceType": "pciDevice", "allocationApi": "dra",
                             "vfioOnDemand": True, "selectors": {"drivers": ["nvme"], "vendors": ["1b36"]}}
VFIO_POOL: dict[str, Any] = {"resourceName": "vfio", "deviceType": "pciDevice", "selectors": {}}


def build(pci: Pci, facts: PciFacts, *entries: dict[str, Any]) -> dict[str, list[str]]:
    configured = pci.configure(*entries)
    built = pci.handler.build(facts, configured)
    return {resource: sorted(devices) for resource, devices in built.items()}


def lent(*parts: tuple[str, str | None]) -> Lent:
    return Lent("pci", tuple(parts), "test")


@pytest.mark.parametrize(("change", "message"), [
    ({"allocationApi": "devicePlugin"}, "only a pool served through DRA"),
    ({"deviceType": "netDevice"}, "deviceType netDevice cannot bind to vfio-pci on demand"),
    ({"selectors": {"vendors": ["1b36"]}}, "must name the host drivers"),
    ({"vfioOnDemand": "yes"}, "vfioOnDemand"),
])
def test_check_config_refuses_a_vfio_on_demand_pool_that_cannot_be_one(pci: Pci, change: dict[str, Any],
                                                                       message: str) -> None:
    with pytest.raises(ConfigFileError) as refused:
        pci.configure({**ON_DEMAND, **change})
    assert message in str(refused.value)
    assert "vfioOnDemand" in str(refused.value) or "drivers" in str(refused.value)


def test_the_pool_takes_functions_on_their_host_driver_and_keeps_one_a_claim_rebound(pci: Pci,
                                                                                    host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme", "vfio-pci"])
    facts = pci.handler.scan()
    assert build(pci, facts, ON_DEMAND, VFIO_POOL) == {"intel.com/nvme": vfs[:2], "intel.com/vfio": vfs[2:]}

    # the claim's loan is told first, then the rebinding: unbound, then on vfio-pci
    facts = pci.handler.fold(facts, lent((vfs[0], "nvme")))
    for action in ("unbind", "bind"):
        if action == "unbind":
            host.unbind(vfs[0])
        else:
            host.bind(vfs[0], "vfio-pci")
        facts = pci.handler.fold(facts, UEvent(action, host.devpath(vfs[0]), "pci"))
        assert build(pci, facts, ON_DEMAND, VFIO_POOL) == {"intel.com/nvme": vfs[:2], "intel.com/vfio": vfs[2:]}
    pools = pci.pools(ON_DEMAND, VFIO_POOL)  # a fresh scan knows nothing of the loan: the vfio pool gets it
    assert sorted(pools["intel.com/vfio"].devices) == [vfs[0], vfs[2]]

    built = pci.handler.build(facts, pci.configure(ON_DEMAND, VFIO_POOL))
    device = built["intel.com/nvme"][vfs[0]]
    assert device.details.device.driver == "vfio-pci"  # the slice's driver attribute follows the binding
    assert [spec.host_path for spec in device.specs] == ["/dev/vfio/vfio", "/dev/vfio/10"]

    # given back: the loan ends, the function is on nvme again, in the same pool
    host.bind(vfs[0], "nvme")
    facts = pci.handler.fold(facts, UEvent("bind", host.devpath(vfs[0]), "pci"))
    facts = pci.handler.fold(facts, lent())
    assert build(pci, facts, ON_DEMAND, VFIO_POOL) == {"intel.com/nvme": vfs[:2], "intel.com/vfio": vfs[2:]}


def test_a_rescan_keeps_what_the_claims_hold(pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme"])
    facts = pci.handler.fold(pci.handler.scan(), lent((vfs[1], "nvme")))
    host.bind(vfs[1], "vfio-pci")
    facts = pci.handler.fold(facts, Resync("pci", "test"))
    assert dict(facts.lent) == {vfs[1]: "nvme"}
    assert build(pci, facts, ON_DEMAND, VFIO_POOL) == {"intel.com/nvme": vfs, "intel.com/vfio": []}


def test_a_group_is_one_device_of_the_pool_only_when_all_of_it_is_in_the_pool(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["nvme", "nvme", "nvme"])
    facts = pci.handler.scan()
    assert build(pci, facts, ON_DEMAND) == {"intel.com/nvme": [MULTI[0]]}
    device = pci.handler.build(facts, pci.configure(ON_DEMAND))["intel.com/nvme"][MULTI[0]]
    assert [record.device.address for record in device.details.functions] == MULTI

    # half-way through the loan (two on vfio-pci, one still on nvme) it is the same one device
    facts = pci.handler.fold(facts, lent(*((address, "nvme") for address in MULTI)))
    for address in MULTI[:2]:
        host.bind(address, "vfio-pci")
        facts = pci.handler.fold(facts, UEvent("bind", host.devpath(address), "pci"))
        assert build(pci, facts, ON_DEMAND) == {"intel.com/nvme": [MULTI[0]]}

    host2 = FakeHost(host.root.parent / "other")
    other = Pci(host2, host2.root / "devinfo")
    add_multifunction_nvme(host2, ["nvme", "nvme", "xhci_hcd"])  # one function the pool does not take
    assert other.pool(ON_DEMAND).devices == {}


def test_a_function_with_the_default_route_or_a_mounted_namespace_is_refused_before_anything_moves(
        pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme", "nvme"])
    (host.sys / "bus" / "pci" / "drivers" / "vfio-pci").mkdir()  # loaded, with nothing bound
    pool = pci.pool(ON_DEMAND)
    assert pci.handler.plan_loan(pool, vfs[0]).parts == ((vfs[0], "nvme"),)

    host.add_netdev(vfs[1], "ens9")
    host.add_default_route("ens9")
    with pytest.raises(AllocationError, match=f"{vfs[1]} carries the host's default route \\(interface ens9\\)"):
        pci.handler.check_loan(pci.handler.plan_loan(pool, vfs[1]))

    namespace = add_namespace(host, vfs[2], "nvme2", "259:7")
    (host.proc / "1").mkdir(exist_ok=True)
    (host.proc / "1" / "mountinfo").write_text("36 25 259:7 / /data rw,relatime shared:1 - ext4 /dev/nvme2n1 rw\n")
    with pytest.raises(AllocationError, match=f"{vfs[2]}: its block device nvme2n1 \\(259:7\\) is mounted"):
        pci.handler.check_loan(pci.handler.plan_loan(pool, vfs[2]))
    (host.proc / "1" / "mountinfo").write_text("")
    (namespace / "holders" / "dm-0").mkdir(parents=True)
    with pytest.raises(AllocationError, match=f"{vfs[2]}: its block device nvme2n1 is held by dm-0"):
        pci.handler.check_loan(pci.handler.plan_loan(pool, vfs[2]))
    assert [os.readlink(host.device_dir(vf) / "driver").rpartition("/")[2] for vf in vfs] == ["nvme"] * 3


def test_a_group_that_gained_a_function_since_the_pool_was_built_is_refused(pci: Pci, host: FakeHost) -> None:
    add_multifunction_nvme(host, ["nvme", "nvme", "nvme"])
    pool = pci.pool(ON_DEMAND)
    host.add_pci("0000:01:00.3", vendor="1b36", device="0010", class_code=NVME_CLASS, driver="nvme",
                 bridge="0000:00:01.0")
    host.set_iommu_group("0000:01:00.3", 8)
    with pytest.raises(AllocationError, match=r"its IOMMU group 8 also holds 0000:01:00\.3"):
        pci.handler.plan_loan(pool, MULTI[0])


def add_namespace(host: FakeHost, address: str, controller: str, numbers: str) -> Path:
    """An NVMe namespace block device below the function, as the kernel nests it
    (``<function>/nvme/<controller>/<controller>n1``, ``subsystem`` -> ``class/block``)."""
    block = host.device_dir(address) / "nvme" / controller / f"{controller}n1"
    block.mkdir(parents=True)
    write_file(block / "dev", numbers + "\n")
    (host.sys / "class" / "block").mkdir(parents=True, exist_ok=True)
    relative_link(block / "subsystem", host.sys / "class" / "block")
    return block


def test_a_loan_is_refused_while_vfio_pci_is_not_loaded_and_a_device_on_vfio_pci_already_needs_none(
        pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "vfio-pci"])
    pool = pci.pool({**ON_DEMAND, "selectors": {"drivers": ["nvme", "vfio-pci"]}})
    loan = pci.handler.plan_loan(pool, vfs[0])
    (host.sys / "bus" / "pci" / "drivers" / "vfio-pci").rename(host.root / "unloaded")
    with pytest.raises(AllocationError, match=r"vfio-pci is not loaded on this host .* load it \(modprobe vfio-pci\)"):
        pci.handler.check_loan(loan)
    (host.root / "unloaded").rename(host.sys / "bus" / "pci" / "drivers" / "vfio-pci")
    already = pci.handler.plan_loan(pool, vfs[1])
    assert already.parts == ()  # nothing to move, nothing to give back: an operator's binding stays as it is
    pci.handler.check_loan(already)


def test_explain_says_what_the_build_does_with_a_function_a_claim_has_on_vfio_pci(pci: Pci, host: FakeHost) -> None:
    vfs = add_nvme_pf(host, PF, ["nvme", "nvme"])
    configured = pci.configure(VFIO_POOL, ON_DEMAND)  # the vfio pool first: it would win a vfio-pci function
    facts = pci.handler.fold(pci.handler.scan(), lent((vfs[0], "nvme")))
    host.bind(vfs[0], "vfio-pci")
    facts = pci.handler.fold(facts, UEvent("bind", host.devpath(vfs[0]), "pci"))
    built = pci.handler.build(facts, configured)
    explanation = pci.handler.explain(facts, configured, vfs[0], built)
    assert explanation is not None
    verdicts = {verdict.resource: verdict for verdict in explanation.verdicts}
    assert verdicts["intel.com/vfio"].reason == ("a DRA claim has it on vfio-pci (its own driver: nvme): it stays in "
                                                 "its vfioOnDemand pool")
    assert verdicts["intel.com/nvme"].outcome == "took" and verdicts["intel.com/nvme"].device_id == vfs[0]

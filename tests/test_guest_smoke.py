"""The guest harness works: a real kernel with two NVMe SR-IOV PFs (4 and 8 VFs) and VT-d.

One boot (about 15-20 s under TCG, plus a one-time ~13 s image build): a Python script in the
guest, run by the repo's venv from the read-only host root, creates every VF with autoprobe off,
checks the sysfs links and one IOMMU group per VF, binds a VF to vfio-pci the way the doc says
works (``driver_override`` + ``drivers_probe``), checks ``/dev/vfio/<group>``, imports the
project, grpc, trio and pyudev (whose libudev is loaded through ctypes), and writes what it saw
to the share as JSON; the assertions are made here, on the host.
Needs root, QEMU and the image build tools (.ci/run installs them); a missing one fails the test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import report_line
from tests.guest import GuestResult, guest_python

PF_VFS = [4, 8]  # sriov_totalvfs of the two PFs (8 > 7: the second PF's last VF needs ARI)

SCENARIO = r'''
import json, os, sys, time
from pathlib import Path

started = time.monotonic()
import daemon, grpc, trio  # the project and what it needs, from the host's venv, on the guest kernel
import_seconds = time.monotonic() - started
import pyudev  # the one that loads a C library by name at run time (libudev, through ctypes)
pyudev.Context()
more_import_seconds = time.monotonic() - started - import_seconds
from tests.waiting import wait_until

PCI = Path("/sys/bus/pci/devices")


def read(path):
    return path.read_text().strip()


def link_name(path):
    return os.readlink(path).rsplit("/", 1)[-1]


def pf_report(pf):
    (pf / "sriov_drivers_autoprobe").write_text("0")  # else nvme grabs each VF and fails on it
    total = int(read(pf / "sriov_totalvfs"))
    (pf / "sriov_numvfs").write_text(str(total))
    vfs = [link_name(pf / f"virtfn{index}") for index in range(total)]
    return {
        "driver": link_name(pf / "driver"), "totalvfs": total, "numvfs": int(read(pf / "sriov_numvfs")),
        "group": link_name(pf / "iommu_group"), "vfs": vfs,
        "physfn": [link_name(PCI / vf / "physfn") for vf in vfs],
        "vf_groups": [link_name(PCI / vf / "iommu_group") for vf in vfs],
        "vf_drivers": [link_name(PCI / vf / "driver") if (PCI / vf / "driver").exists() else None for vf in vfs],
    }


def bind_vfio(vf):
    (PCI / vf / "driver_override").write_text("vfio-pci")
    Path("/sys/bus/pci/drivers_probe").write_text(vf)
    group = link_name(PCI / vf / "iommu_group")
    try:  # reported either way: the test checks dev_vfio
        wait_until(Path(f"/dev/vfio/{group}").exists, 5, interval=0.01)
    except AssertionError:
        pass
    return {"vf": vf, "driver": link_name(PCI / vf / "driver"), "group": group,
            "dev_vfio": sorted(os.listdir("/dev/vfio"))}


pfs = sorted(device.name for device in PCI.iterdir()
             if read(device / "class") == "0x010802" and not (device / "physfn").exists())
report = {"pfs": {pf: pf_report(PCI / pf) for pf in pfs}}
report["vfio"] = bind_vfio(report["pfs"][pfs[-1]]["vfs"][-1])
report["modules"] = sorted(path.name for path in Path("/sys/module").iterdir())
report["versions"] = {"python": sys.version.split()[0], "grpc": grpc.__version__, "trio": trio.__version__,
                      "daemon": daemon.__version__, "pyudev": pyudev.__version__, "kernel": os.uname().release}
report["import_seconds"] = round(import_seconds, 2)
report["more_import_seconds"] = round(more_import_seconds, 2)
report["script_seconds"] = round(time.monotonic() - started, 2)
(Path(os.environ["GUEST_SHARE"]) / "result.json").write_text(json.dumps(report, indent=1))
print("guest smoke: done")
'''




def _result_json(result: GuestResult) -> dict[str, Any]:
    path = result.share / "result.json"
    assert path.exists(), f"the guest script wrote no result.json\n{result.describe()}"
    seen: dict[str, Any] = json.loads(path.read_text())
    return seen


def test_guest_has_real_sriov_vfio_and_the_project_imports(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest, qemu_guest: Callable[..., GuestResult],
) -> None:
    assert os.geteuid() == 0, "the guest tests need root (image cache in /var/cache, 9p export of /)"
    share = tmp_path_factory.mktemp("guest")
    (share / "smoke.py").write_text(SCENARIO)

    result = qemu_guest(guest_python(share / "smoke.py"), pfs=PF_VFS, share=share, timeout=150)
    seen = _result_json(result)
    report_line(request, f"guest: boot to command {result.boot_seconds:.1f} s, command {result.command_seconds:.1f} s "
                     f"(import daemon, grpc, trio {seen['import_seconds']:.1f} s, then pyudev "
                     f"{seen['more_import_seconds']:.1f} s), "
                     f"QEMU wall {result.wall_seconds:.1f} s, kernel {seen['versions']['kernel']}")

    pfs = seen["pfs"]
    assert [pf["totalvfs"] for pf in pfs.values()] == PF_VFS, result.describe()
    all_groups: list[str] = []
    for address, pf in pfs.items():
        assert pf["driver"] == "nvme"
        assert pf["numvfs"] == pf["totalvfs"] == len(pf["vfs"])
        assert pf["physfn"] == [address] * len(pf["vfs"])
        assert pf["vf_drivers"] == [None] * len(pf["vfs"]), "autoprobe 0: no VF is bound by itself"
        all_groups += [pf["group"], *pf["vf_groups"]]
    assert len(set(all_groups)) == len(all_groups), f"one IOMMU group per function: {all_groups}"

    vfio = seen["vfio"]
    assert vfio["driver"] == "vfio-pci"
    assert vfio["group"] in vfio["dev_vfio"], f"/dev/vfio/{vfio['group']} missing: {vfio['dev_vfio']}"
    assert {"vfio_pci", "vfio_iommu_type1", "nvme"} <= set(seen["modules"])
    assert all(seen["versions"][name] for name in ("daemon", "grpc", "trio", "pyudev"))
    assert "guest smoke: done" in result.output

"""vfio-pci on demand for DRA claims, on a real kernel (issue 23, part 5).

A QEMU guest (TCG) with an SR-IOV NVMe PF whose 2 VFs run on ``nvme``, each with its own
namespace block device (tests/guest/nvme_virt.py: NVMe Virtualization Management through the
PF's admin queue), and a 3-function multifunction NVMe (one IOMMU group) on ``nvme``;
tests/guest/scenario_vfio.py runs devplugd with two ``vfioOnDemand`` DRA pools, the API server
stand-in and the kubelet stand-in's DRA side in the guest, and records every step. What must hold
(docs: shared/docs/real-kernel-devices.md section 5; the interface of issue 23):

- first, under Debian's default native NVMe multipath: with the shared namespace's head used as
  swap, the daemon's in-use check (what Prepare runs before unbinding for vfio-pci) refuses the
  PF and each VF, naming the head and the function's own hidden path to it, and lets the
  multifunction functions (no namespace) go; with swap off it lets every function go; the VFs
  removed again and swap off before the reload to ``multipath=N``;
- the setup: each VF on nvme with its ``/dev/nvmeXn1`` and its own IOMMU group; the three
  functions in one group;
- a claim with a ``VfioConfig`` on a VF: Prepare puts it on vfio-pci (its namespace gone), its
  ``/dev/vfio/<group>`` opens and is viable, the CDI spec hands out the container and the group
  node, the KEP-5304 metadata file read as KubeVirt reads it names the VF's address, the slice
  keeps the device in its pool with ``driver`` vfio-pci; Unprepare puts it back on nvme with its
  block device, ``driver_override`` cleared, the files gone, the slice saying nvme again;
- the multifunction group claimed: all three on vfio-pci, the group viable; released: all on nvme;
- the daemon killed with SIGKILL between two functions' binds, started again, the claim
  unprepared: every function back on nvme;
- at the end no function is on vfio-pci (no claim holds any), no group node is left.

The Prepare-with-rebind p50 (one VF, over the rounds) is reported, not asserted: TCG.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import report_line
from tests.guest import GuestResult, MultifunctionNvme, SriovNvme, guest_python

PORTS = [SriovNvme(2, namespace_mib=64), MultifunctionNvme(3)]
DRIVER = "devplugd.io"
VFIO_CONTAINER = "/dev/vfio/vfio"
METADATA_API_VERSION = "metadata.resource.k8s.io/v1alpha1"
CLEARED = {"", "(null)"}  # driver_override read back when empty


def boot(qemu_guest: Callable[..., GuestResult], share: Path, *, flows: bool) -> tuple[GuestResult, dict[str, Any]]:
    share.mkdir()
    guest = qemu_guest(guest_python("-m", "tests.guest.scenario_vfio"), ports=PORTS, share=share,
                       env={"VFIO_FLOWS": "1" if flows else "0"}, timeout=900 if flows else 180)
    return guest, json.loads((share / "result.json").read_text())


def check_multipath_in_use(record: dict[str, Any], pf: str, mf: list[str]) -> None:
    """A namespace the host uses through its native-multipath head keeps every function with a path
    to it from vfio-pci, on the real kernel's layout (daemon/handlers/pci/_inuse.py).

    What Debian's 6.1.0-57 kernel showed: nvme_core.multipath=Y; the head nvme0n1 (259:N) at
    /sys/devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1 with no ``multipath/`` directory (links
    arrived in 6.15), so the head is matched by the path's name; the VFs' hidden paths nvme0c4n1 and
    nvme0c5n1 (the PF's nvme0c0n1) below each function's controller, with no ``dev`` attribute and
    no /dev node; the multifunction functions each in a subsystem of their own with no namespace."""
    assert record["multipath"], f"{record['kernel']}: nvme_core.multipath is off, nothing to check: {record}"
    head, numbers, functions = record["head"], record["head_numbers"], record["functions"]
    assert {entry["head"] for entry in functions.values()} == {head}, functions  # one shared namespace
    assert len({entry["path"] for entry in functions.values()}) == len(functions), functions  # a path each
    assert record["head_dir"].startswith("/sys/devices/virtual/nvme-subsystem/"), record
    assert not record["path_node"], record  # the path is hidden: nothing to open, nothing to mount
    everything = [*functions, *mf]
    assert record["before"] == {address: None for address in everything}, record["before"]
    swap = record["swap"]
    assert swap["swapon"].get("exit") == 0 and swap["swaps_on"] == [f"/dev/{head}"], swap
    for address, entry in functions.items():
        assert record["in_use"][address] == (
            f"{address}: its block device {head} ({numbers}; NVMe multipath, through its path {entry['path']}) "
            "is mounted or used as swap"), record["in_use"]
    assert all(record["in_use"][address] is None for address in mf), record["in_use"]
    assert swap["swapoff"]["exit"] == 0 and swap["swaps_off"] == [], swap
    assert record["after"] == {address: None for address in everything}, record["after"]
    left = record["left"]  # as found: no VFs, no swap, autoprobe on, the PF's path alone to the head
    assert left["vfs"] == [] and left["swaps"] == [] and left["autoprobe"] == "1", left
    assert set(left["drivers"].values()) == {"nvme"}, left
    assert sorted(name for name in left["block"] if name.startswith("nvme")) == sorted([head, functions[pf]["path"]]), left


def check_setup(setup: dict[str, Any]) -> None:
    vfs, mf, groups = setup["vfs"], setup["mf"], setup["groups"]
    check_multipath_in_use(setup["multipath_in_use"], setup["pf"], mf)
    assert not setup["multipath"], setup
    assert len(vfs) == 2 and setup["autoprobe"] == "1", setup
    assert all(setup["drivers"][f] == "nvme" for f in [setup["pf"], *vfs, *mf]), setup["drivers"]
    assert sorted(setup["blocks"].values()) == sorted(f"/dev/{setup['controllers'][vf]}n1" for vf in vfs), setup
    assert len({groups[f] for f in [setup["pf"], *vfs]}) == 3, groups  # PF and each VF: a group of its own
    assert all(setup["group_members"][vf] == [vf] for vf in vfs), setup["group_members"]
    assert len({groups[f] for f in mf}) == 1 and setup["group_members"][mf[0]] == mf, setup
    by_hand = setup["by_hand"]
    assert by_hand["block_while_vfio"] is None and by_hand["group_open"]["open"] == "ok", by_hand
    assert by_hand["back_s"] is not None and by_hand["block_after"] == setup["blocks"][vfs[0]], by_hand


def cdi_edits(specs: dict[str, Any]) -> tuple[set[str], list[str]]:
    """The device node paths and env entries of the claim's device specs (not its metadata's)."""
    nodes: set[str] = set()
    env: list[str] = []
    for spec in specs.values():
        if spec.get("kind") == f"{DRIVER}/metadata":
            continue
        for device in spec.get("devices", []):
            edits = device.get("containerEdits", {})
            nodes |= {node["path"] for node in edits.get("deviceNodes", [])}
            env += edits.get("env", [])
    return nodes, env


def check_metadata(metadata: dict[str, Any], address: str) -> None:
    """KubeVirt's reader: exactly one file, a supported apiVersion, the one device's pciBusID; the
    CDI mount puts it at a container path its glob (``*-metadata.json``) finds."""
    assert len(metadata["files"]) == 1, metadata
    assert metadata["api_versions"][0] == METADATA_API_VERSION, metadata
    assert metadata["pci_bus_id"] == address, metadata
    (mount,) = metadata["mounts"]
    assert mount["hostPath"] == f"{metadata['directory']}/{metadata['files'][0]}", mount
    assert mount["containerPath"].endswith(f"/vm/{DRIVER}-metadata.json") and "ro" in mount["options"], mount


def test_nvme_vfs_run_on_nvme_with_their_namespaces_and_go_to_vfio_and_back_by_hand(
    short_tmp: Path, request: pytest.FixtureRequest, qemu_guest: Callable[..., GuestResult],
) -> None:
    guest, result = boot(qemu_guest, short_tmp / "share", flows=False)
    setup = result["setup"]
    in_use = setup["multipath_in_use"]
    report_line(request, f"guest in-use check under native multipath ({in_use['kernel']}): head {in_use.get('head')} "
                         f"as swap, VF {in_use.get('vf')} through {in_use.get('path')}, head multipath/ links "
                         f"{in_use.get('head_multipath_links')}; {in_use['seconds']} s")
    report_line(request, f"guest NVMe VFs on nvme: boot {guest.boot_seconds:.1f} s, nvme reload {setup['reload_s']} s, "
                         f"2 VFs up {setup['enable_s']} s, by hand to vfio-pci {setup['by_hand']['to_vfio_s']} s, "
                         f"back with its namespace {setup['by_hand']['back_total_s']} s; command "
                         f"{guest.command_seconds:.1f} s, QEMU wall {guest.wall_seconds:.1f} s")
    check_setup(setup)


def test_a_claim_takes_nvme_functions_to_vfio_pci_and_gives_them_back_even_after_a_sigkill(
    short_tmp: Path, request: pytest.FixtureRequest, qemu_guest: Callable[..., GuestResult],
) -> None:
    share = short_tmp / "share"
    guest, result = boot(qemu_guest, share, flows=True)
    logs = {path.name: path.read_text(errors="replace") for path in sorted(share.glob("daemon-*.log"))}
    context = f"{guest.describe()}\n" + "".join(f"--- {name} (tail) ---\n{text[-3000:]}\n" for name, text in logs.items())
    assert result["errors"] == [], f"{result['errors']}\n{context}"
    setup = result["setup"]
    check_setup(setup)
    vfs, mf = setup["vfs"], setup["mf"]
    vf, rounds, group, killed = result["vf"], result["rounds"], result["group"], result["sigkill"]
    report_line(request, f"guest vfio on demand: boot {guest.boot_seconds:.1f} s, VFs up {setup['enable_s']} s, "
                         f"daemon READY {result['ready_s']} s, published {result['published_s']} s; Prepare with "
                         f"rebind of one VF p50 {result['prepare_p50_s']} s over "
                         f"{', '.join(str(r['prepare_s']) for r in rounds)}, Unprepare p50 {result['unprepare_p50_s']} s; "
                         f"group of 3 Prepare {group['prepare_s']} s, Unprepare {group['unprepare_s']} s; command "
                         f"{guest.command_seconds:.1f} s, QEMU wall {guest.wall_seconds:.1f} s")

    # Both pools published on the host driver; the group is one device, named by its lowest address.
    published = result["published"]
    vf_devices = [name for name, entry in published.items() if entry["pciBusID"]["string"] in vfs]
    assert len(vf_devices) == 2 and len({published[name]["pool"] for name in vf_devices}) == 1, published
    groups = [entry for entry in published.values() if entry["pciBusID"]["string"] in mf]
    assert [entry["pciBusID"]["string"] for entry in groups] == [mf[0]], published
    assert all(entry["driver"] == {"string": "nvme"} for entry in published.values()), published

    # One VF: to vfio-pci for the claim, and back.
    assert vf["prepare"].get("error") == "", f"{vf['prepare']}\n{context}"
    (device,) = vf["prepare"]["devices"]
    assert device["device"] == vf["device"] and any(i.startswith(f"{DRIVER}/metadata=") for i in device["cdi_ids"]), vf
    prepared = vf["prepared"]
    assert prepared["driver"] == "vfio-pci" and prepared["override"] == "vfio-pci", prepared
    assert prepared["block"] is None, prepared  # its namespace went with nvme
    assert prepared["group_open"] == {"node": f"/dev/vfio/{vf['group']}", "open": "ok", "viable": True}, prepared
    nodes, env = cdi_edits(prepared["cdi_specs"])
    assert nodes == {VFIO_CONTAINER, f"/dev/vfio/{vf['group']}"}, prepared["cdi_specs"]
    assert any(entry.startswith("PCIDEVICE_") and entry.endswith(f"={vf['vf']}") for entry in env), env
    check_metadata(prepared["metadata"], vf["vf"])
    assert vf["held_published_s"] is not None, vf["held"]  # the slice says vfio-pci while the claim holds it
    assert vf["held"] == {"pool": published[vf["device"]]["pool"], "driver": "vfio-pci"}, vf["held"]
    assert vf["unprepare"] == {"error": ""}, vf["unprepare"]
    unprepared = vf["unprepared"]
    assert vf["nvme_back_s"] is not None and unprepared["driver"] == "nvme", unprepared
    assert unprepared["override"] in CLEARED and unprepared["block"] == setup["blocks"][vf["vf"]], unprepared
    assert f"{vf['group']}" not in unprepared["vfio_nodes"], unprepared
    assert unprepared["cdi_specs"] == [] and unprepared["metadata_files"] == [], unprepared
    assert vf["released"] == {"pool": published[vf["device"]]["pool"], "driver": "nvme"}, vf["released"]

    # The timed rounds (one of them with the config from the DeviceClass) all went there and back.
    for entry in rounds:
        assert entry["prepare"].get("error") == "" and entry["driver_prepared"] == "vfio-pci", entry
        assert entry["unprepare"] == {"error": ""} and entry["driver_unprepared"] == "nvme", entry
        assert entry["nvme_back_s"] is not None, entry
    assert {entry["source"] for entry in rounds} == {"FromClaim", "FromClass"}, rounds

    # The multifunction group: all three functions over, and all three back.
    assert group["prepare"].get("error") == "", f"{group['prepare']}\n{context}"
    assert group["prepared"]["drivers"] == {f: "vfio-pci" for f in mf}, group["prepared"]
    assert group["prepared"]["group_open"]["open"] == "ok" and group["prepared"]["group_open"]["viable"], group
    nodes, env = cdi_edits(group["prepared"]["cdi_specs"])
    assert nodes == {VFIO_CONTAINER, f"/dev/vfio/{group['group']}"}, group["prepared"]["cdi_specs"]
    assert any(entry.startswith("PCIDEVICE_") and entry.endswith("=" + ",".join(mf)) for entry in env), env
    check_metadata(group["prepared"]["metadata"], mf[0])
    assert group["unprepare"] == {"error": ""} and group["nvme_back_s"] is not None, group
    assert group["unprepared"]["drivers"] == {f: "nvme" for f in mf}, group["unprepared"]
    assert group["group"] not in group["unprepared"]["vfio_nodes"], group["unprepared"]

    # SIGKILL between two functions' binds; started again; Unprepare: every function on nvme.
    at_kill = killed.get("at_kill")
    assert at_kill is not None, f"the daemon was never seen binding the group: {killed}\n{context}"
    assert at_kill[mf[0]] == "vfio-pci" and any(at_kill[f] != "vfio-pci" for f in mf[1:]), killed
    assert killed["exit"] == -9, killed
    # at start the daemon finishes the cut-short Prepare or gives it back: never half a group
    assert set(killed["after_restart"].values()) in ({"nvme"}, {"vfio-pci"}), killed
    assert killed["unprepare"] == {"error": ""}, f"{killed}\n{context}"
    assert killed["nvme_back_s"] is not None, killed
    assert killed["unprepared"]["drivers"] == {f: "nvme" for f in mf}, killed
    assert all(value in CLEARED for value in killed["unprepared"]["overrides"].values()), killed

    # Nothing left on vfio-pci without a claim.
    final = result["final"]
    assert final["drivers"] == {f: "nvme" for f in [setup["pf"], *vfs, *mf]}, final
    assert final["vfio_nodes"] == ["vfio"], final
    assert all(value in CLEARED for value in final["overrides"].values()), final
    assert final["claims_book"] == [], final
    assert final["daemon_alive"] and result["daemon_exit"] == 0, context
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"

"""The guest harness's newer pieces work: topologies, a real udevd, the monitor relay, AER.

One boot (about 30 s under TCG) of a guest with an SR-IOV NVMe PF (rp0), a 3-function
multifunction NVMe on a 2.5GT/s x1 root port (rp1), two NVMe behind a pcie-pci-bridge on a
default root port (rp2), ``udevd=True`` and ``monitor=True``; tests/guest/scenario_devices.py
drives it with the guest-side helpers (tests/guest/devices.py, listener.py, monitor.py) and
writes what it saw; the assertions are here. What must hold (shared/docs/real-kernel-devices.md,
sections 1, 2 and 4):

- the relay runs HMP commands the guest writes into the share (``info pci`` names our ports);
- the multifunction slot is one IOMMU group of its 3 functions; the bridge and its 2 NVMe are one
  group; binding the 3 functions to vfio-pci gives one ``/dev/vfio/<group>`` (from the first
  bind on), gone once all are unbound;
- a non-fatal error on rp0 gives BEGIN_RECOVERY then SUCCESSFUL_RECOVERY on the PF and both
  VFs (PF first: bus-walk order), from the kernel and again from udev (udevd really runs and
  adds its properties, e.g. ``ID_PATH``); a fatal one on the slow-link port recovers, on the
  default port it fails (FAILED_RECOVERY).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import report_line
from tests.guest import BridgedNvme, GuestResult, MultifunctionNvme, SriovNvme, guest_python

PORTS = [SriovNvme(2), MultifunctionNvme(3, slow_link=True), BridgedNvme(2)]


def outcome(aer: dict[str, Any], error_event: str, source: str) -> list[str]:
    return [event["name"] for event in aer["events"]
            if event["error_event"] == error_event and event["source"] == source]


def test_topologies_udevd_monitor_relay_and_aer_recovery_uevents(
    short_tmp: Path, request: pytest.FixtureRequest, qemu_guest: Callable[..., GuestResult],
) -> None:
    share = short_tmp / "share"
    share.mkdir()
    result = qemu_guest(guest_python("-m", "tests.guest.scenario_devices"), ports=PORTS, share=share,
                          udevd=True, monitor=True, timeout=180)
    seen = json.loads((share / "result.json").read_text())
    lags = seen["all_lags_ms"]
    report_line(request, f"guest devices: boot {result.boot_seconds:.1f} s, udevd start+trigger+settle "
                         f"{result.udevd_seconds:.1f} s, command {result.command_seconds:.1f} s, QEMU wall "
                         f"{result.wall_seconds:.1f} s; HMP round trip {seen['info_pci']['round_trip_ms']} ms; "
                         f"kernel->udev lag median {statistics.median(lags):.1f} ms max {max(lags):.1f} ms "
                         f"over {len(lags)} events")
    describe = result.describe()

    assert seen["udev_control"], describe
    assert 'id "rp0"' in seen["info_pci"]["text"] and 'id "rp2"' in seen["info_pci"]["text"], seen["info_pci"]

    groups = seen["groups"]
    mf = groups["rp1"]
    assert len(mf["below"]) == 3 and len(set(mf["groups"].values())) == 1, mf
    assert all(members == mf["below"] for members in mf["group_members"].values()), mf
    bridge = groups["rp2"]
    assert len(bridge["below"]) == 3 and len(set(bridge["groups"].values())) == 1, bridge
    assert bridge["drivers"][bridge["below"][0]] is None, "the pcie-pci-bridge has no driver"
    sriov = groups["rp0"]
    assert len(sriov["below"]) == 3 and len(set(sriov["groups"].values())) == 3, sriov  # PF + 2 VFs, own groups

    vfio = seen["multifunction_vfio"]
    group = vfio["group"]
    assert group not in vfio["before"]
    assert all(nodes == sorted([*vfio["before"], group]) for nodes in vfio["after_each"]), vfio
    assert vfio["drivers_bound"] == ["vfio-pci"] * 3 and vfio["drivers_after"] == ["nvme"] * 3, vfio
    assert not vfio["node_exists_after_unbind"] and group not in vfio["after_unbind"], vfio

    non_fatal, fatal_slow, fatal_default = seen["aer"]
    for aer in seen["aer"]:
        assert aer["reply"].startswith(f"OK id: {aer['port']}"), aer
        assert not aer["timed_out"], aer
    functions = sriov["below"]
    # The kernel sends them in bus-walk order, PF first; udev keeps each device's own order but
    # reorders across devices (one worker per device: 01:00.1's copy can come before 01:00.0's)
    # and lags, by over a second for a device whose config space is being reset.
    assert outcome(non_fatal, "BEGIN_RECOVERY", "kernel") == functions, non_fatal
    assert outcome(non_fatal, "SUCCESSFUL_RECOVERY", "kernel") == functions, non_fatal
    for source in ("kernel", "udev"):
        assert sorted(outcome(non_fatal, "BEGIN_RECOVERY", source)) == functions, non_fatal
        assert sorted(outcome(non_fatal, "SUCCESSFUL_RECOVERY", source)) == functions, non_fatal
        assert sorted(outcome(fatal_slow, "SUCCESSFUL_RECOVERY", source)) == mf["below"], fatal_slow
        assert not outcome(fatal_slow, "FAILED_RECOVERY", source), fatal_slow
        assert set(outcome(fatal_default, "FAILED_RECOVERY", source)) >= set(bridge["below"][1:]), fatal_default
        assert not outcome(fatal_default, "SUCCESSFUL_RECOVERY", source), fatal_default
        for aer in seen["aer"]:
            for function in {event["name"] for event in aer["events"]
                             if event["source"] == source and event["error_event"]}:
                kinds = [event["error_event"] for event in aer["events"]
                         if event["source"] == source and event["name"] == function and event["error_event"]]
                assert kinds[0] == "BEGIN_RECOVERY" and len(kinds) == 2, (source, function, aer)
    assert seen["udev_id_path"] == f"pci-{functions[0]}", "udev's properties are on its copy of the uevents"
    assert seen["overflows"] == 0
    assert "guest devices: done" in result.output

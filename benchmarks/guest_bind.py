"""A real kernel's ``bind``/``unbind`` uevent -> the kubelet stand-in receiving the changed list.

Boots the QEMU guest of tests/guest (TCG, one emulated NVMe SR-IOV PF behind an emulated VT-d)
and, inside it, runs devplugd (``--uevent-source kernel``) and the kubelet stand-in against the
guest's own ``/sys`` and ``/dev``. Two VFs are created; VF 0 stays bound to vfio-pci (the pool is
never empty); VF 1 is bound (``driver_override`` + ``drivers_probe``) and unbound ``--cycles``
times, with ``--gap`` between changes.

Clock start: a separate stamper process (benchmarks._stamper, on the uevent group the daemon
reads) stamps the kernel's ``bind``/``unbind`` uevent when ``select`` wakes for it. Clock stop:
the stand-in's arrival stamp of the first ListAndWatch message with VF 1 added / removed.

Everything runs under TCG (no KVM here): the guest's CPU is emulated, several times slower than
the host's, so these figures are an upper bound of what real hardware gives, not a comparison
with the host benchmarks. Prints p50/p90/p99/max, never asserts.

    .venv/bin/python -m benchmarks.guest_bind [--cycles 100] [--gap 0.05] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import machine_line
from benchmarks._events import KernelEventStamper, latency_row


def _inside(cycles: int, warmup: int, gap: float, share: Path) -> None:
    """In the guest: the daemon, the stand-in, the stamper, and the bind/unbind cycles."""
    from tests.guest.scenario_sriov import (
        PCI_DEVICES,
        Scenario,
        bind_vfio,
        nvme_pfs,
        set_num_vfs,
        unbind,
        vfs_of,
        write,
    )

    pf = nvme_pfs()[0]
    write(PCI_DEVICES / pf / "sriov_drivers_autoprobe", "0")
    set_num_vfs(pf, 2)
    anchor, cycled = vfs_of(pf)[:2]
    bind_vfio(anchor)
    scenario = Scenario(share, [pf])
    resource = scenario.resources[pf]
    samples: dict[str, list[float]] = {"bind": [], "unbind": []}
    with scenario.daemon():
        kubelet = scenario.kubelet
        kubelet.wait_for(lambda k: anchor in k.state(resource).devices, 60, f"{resource} with {anchor}")
        stamper = KernelEventStamper(None, sys.executable)
        try:
            write(PCI_DEVICES / cycled / "driver_override", "vfio-pci")
            for cycle in range(warmup + cycles):
                for action in ("bind", "unbind"):
                    state = kubelet.state(resource)
                    first_new = len(state.messages)
                    before = time.monotonic()
                    if action == "bind":
                        write(Path("/sys/bus/pci/drivers_probe"), cycled)
                    else:
                        unbind(cycled)
                    stamp = stamper.first(before, ("uevent", action, "pci", None), wait=10)
                    if stamp is None:
                        raise RuntimeError(f"no {action} uevent for {cycled} within 10 s")
                    wanted = action == "bind"
                    kubelet.wait_for(
                        lambda k: any((cycled in m) == wanted for m in k.state(resource).messages[first_new:]),
                        30, f"{resource} {'with' if wanted else 'without'} {cycled}")
                    index = next(i for i in range(first_new, len(state.messages))
                                 if (cycled in state.messages[i]) == wanted)
                    if cycle >= warmup:
                        samples[action].append(state.received_at[index] - stamp)
                    stamper.forget_before(before)
                    time.sleep(gap)
        finally:
            stamper.close()
    (share / "result.json").write_text(json.dumps({"samples": samples, "ready_s": scenario.ready_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between changes")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.inside:
        _inside(arguments.cycles, arguments.warmup, arguments.gap, Path(os.environ["GUEST_SHARE"]))
        return

    from tests.guest import guest_python, run_in_guest

    print(machine_line())
    print(f"guest_bind: {arguments.cycles} bind/unbind cycles of one VF in a QEMU TCG guest (emulated CPU)")
    with tempfile.TemporaryDirectory(prefix="dpgb", dir="/tmp") as directory:
        share = Path(directory)
        started = time.monotonic()
        run_in_guest(guest_python("-m", "benchmarks.guest_bind", "--inside", "--cycles", str(arguments.cycles),
                                  "--warmup", str(arguments.warmup), "--gap", str(arguments.gap)),
                     pfs=[2], share=share, timeout=120 + arguments.cycles * 3)
        result = json.loads((share / "result.json").read_text())
    print(f"  guest run {time.monotonic() - started:.1f} s; daemon start to READY=1 in the guest "
          f"{result['ready_s']:.1f} s (imports over 9p, emulated CPU)")
    print("kernel uevent -> kubelet stand-in has the changed list (TCG guest: slower than real hardware)")
    for action, values in result["samples"].items():
        print(latency_row(f"{action} uevent -> list", values))


if __name__ == "__main__":
    main()

"""A burst of 256 VF add uevents through the unix seam: how many ListAndWatch lists, how soon the
final one.

Each repetition builds a fresh fake host, starts the daemon (``--uevent-source unix:PATH``,
registered with a fresh kubelet stand-in) and runs three bursts of 256 VFs bound to vfio-pci, one
pool each, then tears everything down:

1. **new pool** (the brief's case): PF ``ens0f0`` has 0 VFs, so its pool
   ``intel.com/burst_new`` is empty and not registered (an empty pool never is). All 256 VFs are
   created in the fake sysfs (``sriov_numvfs`` = 256), then their 256 ``add`` uevents are sent
   as fast as the socket takes them. The pool gets registered during the burst; every message of
   its stream counts.
2. **open stream**: the same, on PF ``ens2f0`` (0 VFs), whose pool ``intel.com/burst_open`` also
   holds PF ``ens1f0``'s one VF, so the stream is open before the burst (final list: 257).
3. **open stream, one by one**: pool ``intel.com/burst_paced`` (PF ``ens3f0`` with one VF, PF
   ``ens4f0`` with 0): each VF is created in sysfs and its uevent sent at once, VF after VF, as
   the kernel makes them. The daemon then sees a sysfs that grows during the burst.

In 1 and 2 every VF is already in sysfs when the first uevent arrives, and the daemon's fold of
a new VF reads every VF of that PF it does not know yet: the first list can already be complete,
before the last uevent is even sent (a negative "last uevent -> final list").

Reported per burst: messages on the pool's stream for the burst (counted 300 ms after the final
list, so a late extra would show), time from the last ``sendto`` returning to the stand-in
receiving the final list (all VFs, all Healthy), from the first ``sendto``, and how long the
sending took (the seam's datagram queue holds 10: the sender waits for the daemon to read).
Never asserts timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks._common import (
    Daemon,
    DaemonFailure,
    bytecode_env,
    check_exit,
    host_tmp,
    machine_line,
    median,
    netdevice_config,
    report_failure,
    short_tmp,
    wait_kubelet,
)
from benchmarks._events import Seam, clean_up, revision_line, uevent_payload, wait_message
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

VFS = 256
PREFIX = "intel.com"
SETTLE = 0.3
TARGET_MESSAGES = 5
TARGET_FINAL = 0.100
BURSTS = ("new", "open", "paced")
LABELS = {"new": "1 new pool (0 -> 256, registered by the burst)",
          "open": "2 open stream (1 -> 257)",
          "paced": "3 open stream, VFs appear one by one (1 -> 257)"}


def pf_address(pf: int) -> str:
    return f"0000:{0x10 * (pf + 1):02x}:00.0"


def vf_address(pf: int, vf: int) -> str:
    """256 VFs need their own bus (devfn 0..255) next to the PF's."""
    return f"0000:{0x10 * (pf + 1) + 1:02x}:{vf >> 3:02x}.{vf & 7}"


def config() -> dict:
    return netdevice_config([("burst_new", ["ens0f0"]), ("burst_open", ["ens1f0", "ens2f0"]),
                             ("burst_paced", ["ens3f0", "ens4f0"])])


def build_host(root: Path) -> FakeHost:
    host = FakeHost(root)
    for pf in range(5):
        host.add_pf(pf_address(pf), netdev=f"ens{pf}f0", total_vfs=VFS, numa_node=pf % 2,
                    bridge=f"0000:00:{pf + 1:02x}.0")
    for pf in (1, 3):  # the anchors: one VF each
        host.add_vfs(pf_address(pf), [vf_address(pf, 0)], driver="vfio-pci", iommu_groups=[1000 * pf],
                     numa_node=pf % 2)
    return host


def add_vf(host: FakeHost, pf: int, vf: int) -> str:
    """VF ``vf`` of ``pf`` in sysfs, bound to vfio-pci, as ``add_vfs`` makes it (one VF at a time)."""
    address = vf_address(pf, vf)
    pf_dir = host.device_dir(pf_address(pf))
    vf_dir = host.add_pci(address, device="154c", driver=None, numa_node=pf % 2, bridge=pf_dir.parent.name)
    (vf_dir / "physfn").symlink_to(f"../{pf_address(pf)}")
    (pf_dir / f"virtfn{vf}").symlink_to(f"../{address}")
    host.set_iommu_group(address, 1000 * pf + 1 + vf)
    host.bind(address, "vfio-pci")
    (pf_dir / "sriov_numvfs").write_text(f"{vf + 1}\n")
    return address


def run_burst(kind: str, host: FakeHost, seam: Seam, kubelet: FakeKubelet, daemon: Daemon,
              timeout: float) -> dict[str, float]:
    pf = {"new": 0, "open": 2, "paced": 4}[kind]
    resource = f"{PREFIX}/burst_{kind}"
    state = kubelet.state(resource)
    expected = {vf_address(pf, vf) for vf in range(VFS)}
    if kind != "new":
        expected.add(vf_address(pf - 1, 0))
    before = len(state.messages)
    registrations = state.registrations
    if kind == "paced":
        first = last = 0.0
        for vf in range(VFS):
            address = add_vf(host, pf, vf)
            sent = seam.send_payload(uevent_payload("add", host.devpath(address), "pci", PCI_SLOT_NAME=address))
            first = first or sent
        last = time.monotonic()
    else:
        addresses = [add_vf(host, pf, vf) for vf in range(VFS)]
        payloads = [uevent_payload("add", host.devpath(a), "pci", PCI_SLOT_NAME=a) for a in addresses]
        first = time.monotonic()
        for payload in payloads:
            seam.socket.sendto(payload, str(seam.path))
        last = time.monotonic()
    index = wait_message(kubelet, daemon, resource, before,
                         lambda m: set(m) == expected and all(h == "Healthy" for h, _ in m.values()),
                         timeout, f"{resource} listed with all {len(expected)} devices")
    final = state.received_at[index]
    time.sleep(SETTLE)
    messages = state.messages[before:]
    sizes = [len(m) for m in messages]
    repeats = sum(1 for a, b in zip(messages, messages[1:]) if a == b)
    return {
        "messages": len(messages),
        "after_final": len(messages) - (index - before) - 1,
        "last_to_final": final - last,
        "first_to_final": final - first,
        "sending": last - first,
        "registrations": state.registrations - registrations,
        "repeats": repeats,
        "sizes": sizes,  # type: ignore[dict-item]
    }


def one_repetition(index: int, base: Path, host_dir: Path, env: dict[str, str], timeout: float) -> dict[str, dict]:
    workdir = base / f"r{index}"
    workdir.mkdir()
    host = build_host(host_dir / f"host{index}")
    seam = Seam(workdir / "uevents.sock")
    kubelet = FakeKubelet(workdir / "device-plugins")
    kubelet.start()
    daemon = Daemon(workdir, host, config(), env=env)
    daemon.arguments += ["--uevent-source", seam.argument]
    try:
        daemon.start()
        seam.wait_ready(daemon)
        wait_kubelet(kubelet, daemon, lambda k: all(
            k.state(f"{PREFIX}/burst_{kind}").connected and len(k.state(f"{PREFIX}/burst_{kind}").devices) == 1
            for kind in ("open", "paced")), 30, "the two anchored pools listed with their one VF")
        time.sleep(0.1)
        if kubelet.state(f"{PREFIX}/burst_new").registrations:
            print("  note: the empty pool burst_new was registered before its burst")
        results = {kind: run_burst(kind, host, seam, kubelet, daemon, timeout) for kind in BURSTS}
        code, _ = daemon.stop()
        check_exit(code, daemon.log)
        return results
    finally:
        clean_up(daemon.kill, kubelet.close, seam.close)


def sizes_text(sizes: list[int]) -> str:
    """The device counts of the messages, shortened when there are many."""
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{sizes[0]}, {sizes[1]}, {sizes[2]}, ..., {sizes[-2]}, {sizes[-1]}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    arguments = parser.parse_args(argv)

    print(f"burst: {VFS} VF add uevents through the unix seam, 3 bursts per repetition, "
          f"{arguments.repetitions} repetitions (fresh host, stand-in and daemon each)", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    results: list[dict[str, dict]] = []
    with short_tmp() as base, host_tmp() as host_dir:
        env = bytecode_env(base)
        try:
            for index in range(arguments.repetitions):
                result = one_repetition(index, base, host_dir, env, arguments.timeout)
                results.append(result)
                print(f"rep {index + 1:2d}: " + "   ".join(
                    f"{kind}: {r['messages']} msgs {sizes_text(r['sizes'])} last->final "
                    f"{r['last_to_final'] * 1000:6.1f} ms (send {r['sending'] * 1000:5.0f} ms)"
                    for kind, r in result.items()), flush=True)
        except DaemonFailure as error:
            report_failure(error)
            return 1

    print(f"\nsummary over {len(results)} repetitions:")
    for kind in BURSTS:
        rows = [r[kind] for r in results]
        messages = [r["messages"] for r in rows]
        last = [r["last_to_final"] for r in rows]
        first = [r["first_to_final"] for r in rows]
        sending = [r["sending"] for r in rows]
        print(f"  {LABELS[kind]}")
        print(f"    messages for the burst: min {min(messages)}, median {median(messages):g}, max {max(messages)}; "
              f"after the final list: {sum(r['after_final'] for r in rows)}; identical consecutive lists: "
              f"{sum(r['repeats'] for r in rows)}; registrations: {sorted({r['registrations'] for r in rows})}")
        print(f"    last uevent sent -> final list: median {median(last) * 1000:6.1f} ms, max {max(last) * 1000:6.1f} ms, "
              f"min {min(last) * 1000:6.1f} ms")
        print(f"    first uevent sent -> final list: median {median(first) * 1000:6.1f} ms, "
              f"max {max(first) * 1000:6.1f} ms;  sending the 256: median {median(sending) * 1000:5.1f} ms")
    print(f"\ntargets: <= {TARGET_MESSAGES} messages per burst; final list <= {TARGET_FINAL * 1000:.0f} ms after the "
          f"last uevent")
    for kind in BURSTS:
        rows = [r[kind] for r in results]
        worst_messages = max(r["messages"] for r in rows)
        worst_final = max(r["last_to_final"] for r in rows)
        print(f"  {LABELS[kind]:<52} max {worst_messages} messages "
              f"({'within target' if worst_messages <= TARGET_MESSAGES else 'OVER target'}), max "
              f"{worst_final * 1000:.1f} ms ({'within target' if worst_final <= TARGET_FINAL else 'OVER target'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""USB ``device_add`` in a real kernel -> the device in the kubelet stand-in's list, udev path vs kernel path.

Boots the QEMU guest of tests/guest with an empty qemu-xhci, a real systemd-udevd and QEMU's
monitor (``run_in_guest(udevd=True, monitor=True, usb=True)``) and, inside it, two devplugd side
by side, each with its own kubelet stand-in, state and socket directories and one usbDevice
pool ``usb_serial`` (0403:6001): one with ``--uevent-source udev`` (libudev's monitor: the events
after udevd's rules ran), one with ``--uevent-source kernel`` (the kernel's own netlink group).
An FTDI usb-serial with serial FTDI0042 is hot-added on port 2 and removed again, ``--replugs``
times after ``--warmup`` not counted (tests/guest/usb.py).

Clock start: the guest's ``device_add`` (``device_del``) request to the monitor relay. Clock stop:
each stand-in's arrival stamp of the first list with ``serial-FTDI0042`` (without it). Also shown
from the event each daemon acts on, as a listener on both netlink groups stamps it: the
interface's ``bind`` (a device is offered once an interface is bound), and the first ``remove``
below the device, each from the daemon's own source (the kernel's message, or udev's copy).

Everything runs under TCG (no KVM here): the guest's CPU is emulated, many times slower than the
host's, so these figures are an upper bound of what real hardware gives, not a comparison with
the host benchmarks. Prints p50/p90/p99/max, never asserts.

    .venv/bin/python -m benchmarks.guest_usb [--replugs 8] [--warmup 1] [--gap 0.3] [--sources udev kernel]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

POOL = {"usb_serial": {"deviceType": "usbDevice", "selectors": {"vendors": ["0403"], "products": ["6001"]}}}
DEVICE_ID = "serial-FTDI0042"
SOURCES = ("udev", "kernel")


def _inside(replugs: int, warmup: int, gap: float, share: Path, sources: list[str]) -> None:
    """In the guest: both daemons and stand-ins, a uevent listener, and the replugs."""
    from tests.guest.listener import KERNEL, UDEV, UeventListener
    from tests.guest.scenario_usb import UsbScenario
    from tests.guest.usb import FTDI, plug, unplug, usb_sysfs_name, wait_bound, wait_gone

    scenarios = {source: UsbScenario(share, uevent_source=source, name=f"bench-{source}", pools=POOL)
                 for source in sources}
    daemons = {source: scenario.daemon() for source, scenario in scenarios.items()}
    samples: dict[str, list[float]] = {}

    def sample(label: str, value: float) -> None:
        samples.setdefault(label, []).append(value)

    name = usb_sysfs_name(FTDI)
    device_path, interface_path = f"/usb{FTDI.bus}/{name}", f"/usb{FTDI.bus}/{name}/{name}:1.0"
    with ThreadPoolExecutor(len(scenarios)) as pool:  # both import and start at once: READY costs tens of seconds each
        list(pool.map(lambda manager: manager.__enter__(), daemons.values()))
    try:
        with UeventListener(KERNEL | UDEV) as listener:
            for cycle in range(warmup + replugs):
                for present in (True, False):
                    starts = {source: len(s.kubelet.state(s.resources["usb_serial"]).messages)
                              for source, s in scenarios.items()}
                    events_from = len(listener.snapshot())
                    reply = plug(FTDI) if present else unplug(FTDI)
                    (wait_bound if present else wait_gone)(FTDI)
                    arrivals: dict[str, float] = {}
                    for source, scenario in scenarios.items():
                        def shown(_: object, scenario: UsbScenario = scenario, source: str = source) -> bool:
                            at = scenario.first_message("usb_serial", starts[source], DEVICE_ID,
                                                        "Healthy" if present else None)
                            if at is not None:
                                arrivals[source] = at
                            return at is not None
                        scenario.kubelet.wait_for(shown, 30, f"{source}: usb_serial {'with' if present else 'without'} {DEVICE_ID}")
                    if cycle < warmup:
                        time.sleep(gap)
                        continue
                    action = "device_add" if present else "device_del"
                    events = listener.snapshot()[events_from:]
                    for source in sources:
                        sample(f"{action} -> {source} daemon's list", arrivals[source] - reply.requested_at)
                    for source in sources:  # offered at the interface's bind; dropped from the first remove on
                        if present:
                            label = "interface bind uevent"
                            stamps = [e.received for e in events if e.source == source and e.action == "bind"
                                      and e.devpath.endswith(interface_path)]
                        else:
                            label = "first remove uevent"
                            stamps = [e.received for e in events if e.source == source and e.action == "remove"
                                      and device_path in e.devpath]
                        if stamps:
                            sample(f"{source} {label} -> {source} daemon", arrivals[source] - stamps[0])
                    time.sleep(gap)
    finally:
        for manager in daemons.values():
            manager.__exit__(None, None, None)
    (share / "result.json").write_text(json.dumps({"samples": samples,
                                                   "ready_s": {s: sc.ready_s for s, sc in scenarios.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replugs", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between plug and unplug")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                        help="the daemons to run (one alone: no CPU shared with the other)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.inside:
        _inside(arguments.replugs, arguments.warmup, arguments.gap, Path(os.environ["GUEST_SHARE"]), arguments.sources)
        return

    from benchmarks._common import machine_line
    from benchmarks._events import latency_row
    from tests.guest import guest_python, run_in_guest

    print(machine_line())
    print(f"guest_usb: {arguments.replugs} replugs of an FTDI usb-serial in a QEMU TCG guest (emulated CPU), "
          f"daemons side by side: {', '.join(arguments.sources)} source")
    with tempfile.TemporaryDirectory(prefix="dpgu", dir="/tmp") as directory:
        share = Path(directory)
        started = time.monotonic()
        run_in_guest(guest_python("-m", "benchmarks.guest_usb", "--inside", "--replugs", str(arguments.replugs),
                                  "--warmup", str(arguments.warmup), "--gap", str(arguments.gap),
                                  "--sources", *arguments.sources),
                     share=share, udevd=True, monitor=True, usb=True,
                     timeout=180 + (arguments.replugs + arguments.warmup) * 15)
        result = json.loads((share / "result.json").read_text())
    ready = ", ".join(f"{source} {seconds:.1f} s" for source, seconds in result["ready_s"].items())
    print(f"  guest run {time.monotonic() - started:.1f} s; daemons' start to READY=1 in the guest: {ready} "
          "(imports over 9p, emulated CPU, both at once)")
    print("USB hotplug -> the kubelet stand-in's list (TCG guest: slower than real hardware)")
    for label, values in result["samples"].items():
        print(latency_row(label, values, width=46))


if __name__ == "__main__":
    main()

"""USB hotplug on a fake host: each uevent of an FTDI's plug and unplug -> the changed lists.

The fake USB tree is ``tests/usbtree.py``'s (an xHCI controller with its two root hubs, laid out
on tmpfs as the ``ram_host`` fixture does), with a QEMU keyboard (KBD0001) already plugged on
port 1 before the daemon starts. The daemon runs with ``--uevent-source unix:PATH`` and two pools:

* ``intel.com/usb_serial``: ``usbDevice``, ``vendors: ["0403"]``: the FTDI as ``serial-FTDI0042``;
* ``intel.com/ftdi_tty``: ``devNode``, a udev selector (``subsystems: [tty]``, ``ID_VENDOR_ID=0403``),
  ``containerPath: by-id``: the FTDI's ``ttyUSB0``.

Each cycle plugs an FTDI FT232 (serial FTDI0042) in on port 2 and takes it out again, with the
steps and uevents of ``UsbTree.plug`` and ``UsbTree.unplug`` in the real kernel's order: each
step's sysfs (and udev database) change is made, then its uevent is sent at once, the next step
right after, with no pause (``--step-gap`` adds one). Clocks (this process's ``time.monotonic()``,
just before ``sendto``; the stand-in stamps every ListAndWatch message on arrival):

* (a) the interface's ``bind`` (a USB device is offered once an interface is bound) -> the first
  list of usb_serial with ``serial-FTDI0042``;
* (b) the tty's ``add`` -> the first list of ftdi_tty with the tty;
* (c) the first ``remove`` of the unplug (the tty's) -> the first list of usb_serial without it.

Two sources, one daemon each: **udev** (each step's message as udevd passes it on: the kernel's
properties plus udev's; ``--udev-data-dir`` on the fake database) and **kernel** (the kernel's
own messages, a tree without udev's database and links, ``--udev-data-dir`` a directory that
does not exist: with a ``unix:`` source the daemon reads the database when the directory is
there). On the kernel path the ftdi_tty pool selects nothing (no udev properties): (b) is not
measured there. ``--gap`` (50 ms, past the streams' 20 ms coalescing window) after the plug's
lists and after the removal's. Never asserts; prints p50/p90/p99/max and the daemon's CPU.
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
    report_failure,
    short_tmp,
)
from benchmarks._events import (
    Seam,
    clean_up,
    cpu_by_thread_name,
    latency_row,
    revision_line,
    thread_cpu_ns,
    wait_message,
)
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.usbtree import Plug, Step, UsbTree, ftdi, keyboard

SERIAL, TTY = "intel.com/usb_serial", "intel.com/ftdi_tty"
DEVICE_ID = "serial-FTDI0042"
PORT = "2"
CONFIG = {"resourceList": [
    {"resourceName": "usb_serial", "deviceType": "usbDevice", "selectors": {"vendors": ["0403"]}},
    {"resourceName": "ftdi_tty", "deviceType": "devNode",
     "selectors": {"udev": {"subsystems": ["tty"], "properties": {"ID_VENDOR_ID": "0403"}}},
     "containerPath": "by-id"},
]}
SOURCES = ("udev", "kernel")
KEYS = ("bind", "tty", "remove", "plug_first", "plug_spread", "unplug_last", "tty_gone")


def tty_step(plug: Plug) -> Step:
    return next(s for s in plug.steps if s.action == "add" and s.kobj.subsystem == "tty")


def interface_bind(plug: Plug) -> Step:
    return next(s for s in plug.steps if s.action == "bind" and s.kobj.head.get("DEVTYPE") == "usb_interface")


def run_steps(tree: UsbTree, steps: list[Step], seam: Seam, udev: bool, step_gap: float) -> dict[int, float]:
    """Apply each step and send its uevent right after (as the kernel does); ``id(step)`` -> the
    time just before its ``sendto``."""
    sent: dict[int, float] = {}
    for step in steps:
        tree.apply(step)
        if step.sends:
            sent[id(step)] = seam.send_payload(step.message(udev=udev))
            if step_gap:
                time.sleep(step_gap)
    return sent


def run_source(source: str, base: Path, env: dict[str, str], arguments: argparse.Namespace) -> dict[str, object]:
    udev = source == "udev"
    workdir = base / source
    workdir.mkdir()
    with host_tmp() as host_dir:
        host = FakeHost(host_dir / "host")
        tree = UsbTree(host, numa_node=0, udev=udev)
        tree.attach(keyboard(), "1")
        seam = Seam(workdir / "uevents.sock")
        kubelet = FakeKubelet(workdir / "device-plugins")
        kubelet.start()
        daemon = Daemon(workdir, host, CONFIG, env=env, name=source)
        udev_dir = tree.udev_data if udev else workdir / "no-udev-data"
        daemon.arguments += ["--uevent-source", seam.argument, "--udev-data-dir", str(udev_dir)]
        samples: dict[str, list[float]] = {key: [] for key in KEYS}
        try:
            daemon.start()
            seam.wait_ready(daemon)
            time.sleep(0.5)  # past the first scan: the keyboard is in no pool, nothing is registered yet
            daemon.check_alive()
            cpu_before = None
            messages_before = 0
            total = arguments.warmup + arguments.replugs
            for cycle in range(total):
                timed = cycle >= arguments.warmup
                if cycle == arguments.warmup:
                    cpu_before = thread_cpu_ns(daemon.pid)
                    messages_before = sum(len(kubelet.state(r).messages) for r in (SERIAL, TTY))
                serial_state, tty_state = kubelet.state(SERIAL), kubelet.state(TTY)
                serial_start, tty_start = len(serial_state.messages), len(tty_state.messages)
                plug = tree.plug(ftdi(), PORT)
                tty, bind = tty_step(plug), interface_bind(plug)
                tty_name = tty.kobj.name
                sent = run_steps(tree, plug.steps, seam, udev, arguments.step_gap)
                first_sent, last_sent = min(sent.values()), max(sent.values())
                index = wait_message(kubelet, daemon, SERIAL, serial_start, lambda m: DEVICE_ID in m,
                                     arguments.timeout, f"{SERIAL}: {DEVICE_ID} after plug {cycle}")
                listed = kubelet.state(SERIAL).received_at[index]
                if timed:
                    samples["bind"].append(listed - sent[id(bind)])
                    samples["plug_first"].append(listed - first_sent)
                    samples["plug_spread"].append(last_sent - first_sent)
                if udev:
                    index = wait_message(kubelet, daemon, TTY, tty_start, lambda m, n=tty_name: n in m,
                                         arguments.timeout, f"{TTY}: {tty_name} after plug {cycle}")
                    if timed:
                        samples["tty"].append(kubelet.state(TTY).received_at[index] - sent[id(tty)])
                time.sleep(arguments.gap)

                serial_start, tty_start = len(kubelet.state(SERIAL).messages), len(kubelet.state(TTY).messages)
                steps = tree.unplug(plug.name)
                sent = run_steps(tree, steps, seam, udev, arguments.step_gap)
                first_remove = next(sent[id(s)] for s in steps if s.action == "remove" and s.sends)
                last_sent = max(sent.values())
                index = wait_message(kubelet, daemon, SERIAL, serial_start, lambda m: DEVICE_ID not in m,
                                     arguments.timeout, f"{SERIAL}: {DEVICE_ID} gone after unplug {cycle}")
                gone = kubelet.state(SERIAL).received_at[index]
                if timed:
                    samples["remove"].append(gone - first_remove)
                    samples["unplug_last"].append(gone - last_sent)
                if udev:
                    index = wait_message(kubelet, daemon, TTY, tty_start, lambda m, n=tty_name: n not in m,
                                         arguments.timeout, f"{TTY}: {tty_name} gone after unplug {cycle}")
                    if timed:
                        samples["tty_gone"].append(kubelet.state(TTY).received_at[index] - first_remove)
                time.sleep(arguments.gap)
            assert cpu_before is not None
            used = cpu_by_thread_name(cpu_before, thread_cpu_ns(daemon.pid), daemon.pid)
            messages = sum(len(kubelet.state(r).messages) for r in (SERIAL, TTY)) - messages_before
            tty_registrations = kubelet.state(TTY).registrations
            code, _ = daemon.stop()
            check_exit(code, daemon.log)
            complaints = [line for line in daemon.log.splitlines() if " WARNING " in line or " ERROR " in line]
        finally:
            clean_up(daemon.kill, kubelet.close, seam.close)
    return {"samples": samples, "cpu": used, "messages": messages, "tty_registrations": tty_registrations,
            "complaints": complaints,
            "steps": (sum(s.sends for s in plug.steps), sum(s.sends for s in steps))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replugs", type=int, default=50, help="timed plug + unplug cycles (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed cycles first; the first also registers "
                        "the pools (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds after each change's lists (default: "
                        "%(default)s)")
    parser.add_argument("--step-gap", type=float, default=0.0, help="seconds between the uevents of one plug or "
                        "unplug (default: %(default)s: back to back)")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--timeout", type=float, default=10.0, help="per wait, seconds (default: %(default)s)")
    arguments = parser.parse_args(argv)
    arguments.warmup = max(arguments.warmup, 1)
    arguments.replugs = max(arguments.replugs, 1)

    print(f"usb_hotplug: an FTDI (0403:6001, FTDI0042) plugged and unplugged on port {PORT} {arguments.replugs} "
          f"times after {arguments.warmup} untimed, through the unix seam; sources {' '.join(arguments.sources)}; "
          f"uevents of a plug {'back to back' if not arguments.step_gap else f'{arguments.step_gap * 1000:.0f} ms apart'}"
          f", gap {arguments.gap * 1000:.0f} ms", flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    results: dict[str, dict[str, object]] = {}
    with short_tmp() as base:
        env = bytecode_env(base)
        for source in arguments.sources:
            started = time.monotonic()
            try:
                results[source] = run_source(source, base, env, arguments)
            except DaemonFailure as error:
                report_failure(error)
                return 1
            print(f"{source}: done in {time.monotonic() - started:.1f} s", flush=True)

    for source, result in results.items():
        samples: dict[str, list[float]] = result["samples"]  # type: ignore[assignment]
        plug_sends, unplug_sends = result["steps"]  # type: ignore[misc]
        print(f"\n{source} source ({plug_sends} uevents a plug, {unplug_sends} an unplug; sendto -> list received):")
        print(latency_row("(a) interface bind -> usb_serial", samples["bind"], width=42))
        if source == "udev":
            print(latency_row("(b) tty add -> ftdi_tty", samples["tty"], width=42))
        else:
            print(f"  {'(b) tty add -> ftdi_tty':<42} not measured: no udev properties, the pool selects nothing "
                  f"(registered {result['tty_registrations']} times)")
        print(latency_row("(c) first remove -> gone from usb_serial", samples["remove"], width=42))
        print(latency_row("    plug's first uevent -> usb_serial", samples["plug_first"], width=42))
        print(latency_row("    plug's first -> last sendto", samples["plug_spread"], width=42))
        print(latency_row("    unplug's last uevent -> gone", samples["unplug_last"], width=42))
        if source == "udev":
            print(latency_row("    first remove -> gone from ftdi_tty", samples["tty_gone"], width=42))
        used: dict[str, int] = result["cpu"]  # type: ignore[assignment]
        cycles = len(samples["bind"])
        parts = ", ".join(f"{name} {ns / cycles / 1e6:.2f}" for name, ns in sorted(used.items(), key=lambda i: -i[1])
                          if ns / cycles >= 1e5)
        print(f"  daemon CPU per plug + unplug cycle: {sum(used.values()) / cycles / 1e6:.2f} ms ({parts} ms by "
              f"thread; the gaps' idle time included); ListAndWatch messages per cycle "
              f"{result['messages'] / cycles:.1f}")  # type: ignore[operator]
        complaints: list[str] = result["complaints"]  # type: ignore[assignment]
        print(f"  daemon log: {len(complaints)} WARNING/ERROR lines" + "".join(f"\n    {line}" for line in complaints[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark in turn, each in its own process, and say how each ended.

``python -m benchmarks.run_all [--only NAME ...]`` from the repository root. Output of each
benchmark is passed through as it comes. Exit status: 0 if every benchmark ran to the end (a
missed target is not a failure: the benchmarks print numbers and never assert), 1 otherwise.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from benchmarks._common import PYTHON, REPO_ROOT

# name -> the module (benchmarks.<module>) and the arguments run_all gives it (idle watches 20 s
# here instead of its default 60 s)
BENCHMARKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cold_start": ("cold_start", ()),
    "allocate_latency": ("allocate_latency", ()),
    "reregister": ("reregister", ()),
    "event_latency": ("event_latency", ()),
    "seam_latency": ("seam_latency", ()),
    "checkpoint_load": ("checkpoint_load", ()),
    "explain_latency": ("explain_latency", ()),
    "burst": ("burst", ()),
    "idle": ("idle", ("--seconds", "20")),
    "usb_hotplug": ("usb_hotplug", ()),
    "auxnet_sfs": ("auxnet_sfs", ()),
    "metrics_scrape": ("metrics_scrape", ()),
    "guest_bind": ("guest_bind", ()),
    "guest_aer": ("guest_aer", ()),
    "guest_aer_fatal": ("guest_aer", ("--fatal",)),
    "guest_usb": ("guest_usb", ()),
    "dra_slices": ("dra_slices", ()),
    "dra_prepare": ("dra_prepare", ()),
    "dra_stack": ("dra_stack", ()),
    "dra_publish_4096": ("dra_publish_4096", ()),
    "dra_taints": ("dra_taints", ()),
}
TIMEOUT = 300.0


def run_one(name: str) -> int:
    """Run ``benchmarks.<name>``; past TIMEOUT, SIGTERM it (the benchmarks turn SIGTERM into
    SystemExit, so their ``finally`` blocks kill the daemon and remove temp dirs), then SIGKILL."""
    module, arguments = BENCHMARKS[name]
    process = subprocess.Popen([PYTHON, "-m", f"benchmarks.{module}", *arguments], cwd=REPO_ROOT)
    try:
        return process.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"benchmarks.{name}: did not finish within {TIMEOUT:.0f} s; stopping it", flush=True)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return -1
    except BaseException:
        process.send_signal(signal.SIGTERM)
        process.wait()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these")
    arguments = parser.parse_args(argv)
    outcomes = []
    for name in arguments.only or BENCHMARKS:
        print(f"\n===== benchmarks.{name} =====", flush=True)
        started = time.monotonic()
        code = run_one(name)
        outcomes.append((name, code, time.monotonic() - started))
    print("\n===== summary =====")
    for name, code, seconds in outcomes:
        status = "ran" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:<18} {status:<20} {seconds:6.1f} s")
    return 0 if all(code == 0 for _, code, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

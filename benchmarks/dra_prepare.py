"""NodePrepareResources / NodeUnprepareResources of one device, through the kubelet stand-in.

The daemon runs as a DRA driver against the API server stand-in (``tests/apiserver.py``,
subclassed in ``benchmarks/dra_common.py`` to stamp requests and slice writes) with one DRA pool,
``intel.com/sriov_vfs``: one PF with 64 vfio-pci VFs (``--vfs N``: N, 64 per PF). The kubelet stand-in (``tests/kubelet.py``)
registers the driver through ``plugins_registry`` and calls it over the real ``dra.sock``, as the
kubelet does (v1 DRAPlugin, 45 s deadline). CDI specs and the device-info files go to tmpfs
(``/var/run`` in production); the claim checkpoint and the device metadata files (KEP-5304) to
the disk-backed ``/tmp`` (``/var/lib`` in production: the checkpoint's write is one in-place
write and ``fdatasync``, ``daemon/holdings/_slots.py``).

Each of ``--claims`` rounds (after ``--warmup``) puts a fresh claim on the stand-in (new name and
UID, one result: request ``vf``, the next VF of the pool in turn). Every other round makes its
two calls with grpc-go instead (``benchmarks/_go_kubelet.py``: the kubelet is a grpc-go client,
the stand-in a Python one, whose own costs are in its figures), timed inside the Go process, over
the same socket; that is the figure the target is read against (the stand-in's when Go and
Debian's grpc-go are not installed: the reason is printed). After each such round the Go client
makes the same two calls, for a claim of its own (``ref-N``), to a reference driver in Go
(``benchmarks/go_driver/main.go``: the same GET, device-info file, CDI spec, device metadata
and checkpoint write, on the same filesystems, with grpc-go and no Python): what the path costs
on this machine whatever the driver is written in. A stand-in round:

1. **prepare**: ``kubelet.prepare([claim])``, timed as the kubelet's gRPC client sees it (the
   stand-in's stub call to its answer, on its loop: ``DraDriverState.call_seconds``), and around
   the call in this thread, which adds the hop into the stand-in's loop and back; the daemon reads
   the claim from the stand-in (one GET), checks it, allocates the VF, writes the CDI spec, the
   device metadata and the checkpoint;
2. a short ``--gap`` (a prepared device stays in its slice: no slice is written);
3. **unprepare**, timed the same way; ``--gap``, and the claim is deleted from the stand-in.

Slice writes during the rounds are counted (there should be none); the claim's status writes
(``status.devices``, a GET and a PUT after each call, in the background) are among the API
requests listed, not in the prepare's split. The time around ``kubelet.prepare`` includes the
hop into the stand-in's asyncio thread and back (measured alone and printed), which the
kubelet's own call does not have. The claim GET is split out with the stand-in's request stamps:
call -> GET handler starts, the stand-in's own handling of it, its answer written -> the call
returns.
For comparison a direct GET of a claim with the same client the daemon uses
(``daemon.dra._kube.Kube``) is timed in this process, back to back and ``--gap`` apart, calls
with no claims back to back and ``--gap`` apart (the floor of the path the rounds take, with
every thread on it idle when the call comes, as in the rounds), and, on the same filesystem, the
checkpoint's write beside the write it replaced (a temporary file renamed over the old one, two
fsyncs) and a claim's two device metadata directories and file made (as the Go helper's layout
has them). Never asserts timings.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    DaemonFailure,
    check_exit,
    host_tmp,
    machine_line,
    percentile,
    report_failure,
    short_tmp,
)
from benchmarks._common import vf_address as sriov_vf_address
from benchmarks._events import Seam, clean_up, cpu_by_thread_name, latency_row, revision_line, thread_cpu_ns
from benchmarks._go_kubelet import GoBuildError, GoDriver, GoKubelet, build
from benchmarks.dra_common import (
    DRIVER,
    NODE,
    POOL,
    TOKEN,
    StampedApiServer,
    build_dra_host,
    dra_bytecode_env,
    dra_config,
    dra_daemon,
    kinds_text,
    requests_by_kind,
    wait_generation,
)
from daemon.dra import device_name
from tests.kubelet import DraCallError, FakeKubelet

DEFAULT_VFS = 64
TARGET_PREPARE_P50 = 0.005
NAMESPACE = "default"
WIDTH = 42


def time_hop(kubelet: FakeKubelet, count: int = 200) -> list[float]:
    """The stand-in's thread hop alone: ``_call`` of a coroutine that does nothing."""
    async def nothing() -> None:
        return None

    times = []
    for _ in range(count):
        started = time.monotonic()
        kubelet._call(nothing())
        times.append(time.monotonic() - started)
    return times


def time_empty_calls(kubelet: FakeKubelet, count: int = 200, gap: float = 0.0) -> tuple[list[float], list[float]]:
    """NodePrepareResources and NodeUnprepareResources with no claims: the same path through the
    stand-in, gRPC and the daemon's servicer, with nothing to do; ``gap`` seconds before each call
    (as the rounds have: every thread on the way is idle when the call comes), as the stand-in's
    gRPC client sees them."""
    prepare, unprepare = [], []
    seen = kubelet.dra_state(DRIVER).call_seconds
    for _ in range(count):
        time.sleep(gap)
        kubelet.prepare([])
        prepare.append(seen[-1][1])
        time.sleep(gap)
        kubelet.unprepare([])
        unprepare.append(seen[-1][1])
    return prepare, unprepare


def go_round(go_kubelet: GoKubelet, ref: tuple[str, str, str], device: str, gap: float) -> tuple[float, float] | None:
    """One round through a Go client: prepare ``ref``, ``gap``, unprepare, ``gap``; the two
    calls' seconds as grpc-go timed them, or None (printed) when an answer was not the device."""
    namespace, uid, claim_name = ref
    prepared, answer = go_kubelet.prepare(ref)
    claim = (answer.get("claims") or {}).get(uid) or {}
    devices = [(d.get("poolName"), d.get("deviceName")) for d in claim.get("devices") or ()]
    time.sleep(gap)
    unprepared, unprepare_answer = go_kubelet.unprepare(ref)
    time.sleep(gap)
    unprepare_error = ((unprepare_answer.get("claims") or {}).get(uid) or {}).get("error")
    if devices != [(POOL, device)] or "grpcError" in unprepare_answer or unprepare_error:
        print(f"  unexpected answer (Go client) for {namespace}/{claim_name}: {answer}; unprepare: {unprepare_answer}")
        return None
    return prepared, unprepared


def time_go_empty_calls(go_kubelet: GoKubelet, count: int = 200, gap: float = 0.0) -> list[float]:
    """NodePrepareResources of no claims through the Go client, ``gap`` seconds apart."""
    for _ in range(20):
        go_kubelet.prepare(None)
    seconds = []
    for _ in range(count):
        time.sleep(gap)
        seconds.append(go_kubelet.prepare(None)[0])
    return seconds


def time_direct_get(api: StampedApiServer, kubeconfig: Path, count: int = 200,
                    gap: float = 0.0) -> tuple[list[float], list[float]]:
    """A claim GET with ``daemon.dra._kube.Kube`` from this process, ``gap`` seconds after the
    last: client-side and stand-in-side times."""
    from daemon.dra._kube import Kube

    api.put_claim(NAMESPACE, "direct-get", results=[{"request": "vf", "driver": DRIVER, "pool": POOL,
                                                     "device": device_name(sriov_vf_address(0, 0))}])
    kube = Kube.connect(kubeconfig)
    try:
        for _ in range(20):
            kube.get_claim(NAMESPACE, "direct-get")
        client: list[float] = []
        server: list[float] = []
        for _ in range(count):
            time.sleep(gap)
            with api._cond:
                before = len(api.handled)
            started = time.monotonic()
            kube.get_claim(NAMESPACE, "direct-get")
            client.append(time.monotonic() - started)
            with api._cond:
                handled = api.handled[before:]
            server += [r.end - r.start for r in handled if r.path.endswith("/resourceclaims/direct-get")]
    finally:
        kube.close()
        api.delete_claim(NAMESPACE, "direct-get")
    return client, server


def time_metadata_dirs(directory: Path, count: int = 50) -> list[float]:
    """A claim's device metadata made on ``directory``'s filesystem as the Go helper's layout
    needs it (``<namespace>_<claim>/<request>/`` and a new 1 KB file in it), 20 ms after the last
    claim's were removed, as a Prepare after an Unprepare makes them."""
    times: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory) as where:
        request = Path(where) / "default_claim" / "vf"
        for _ in range(count):
            started = time.monotonic()
            request.mkdir(parents=True)
            (request / "metadata.json").write_bytes(b"m" * 1024)
            times.append(time.monotonic() - started)
            time.sleep(0.02)
            (request / "metadata.json").unlink()
            request.rmdir()
            request.parent.rmdir()
            time.sleep(0.02)
    return times


def time_checkpoint_writes(directory: Path, count: int = 50) -> tuple[list[float], list[float]]:
    """A 2 KB book written ``count`` times on ``directory``'s filesystem, 20 ms apart (as
    Prepares come): as the claim book writes it (``TwinSlots``: in place, ``fdatasync``), and as
    it wrote it before (``write_atomically``: a temporary file, fsync, rename, fsync of the
    directory)."""
    from daemon.files import write_atomically
    from daemon.holdings._slots import TwinSlots

    in_place: list[float] = []
    renamed: list[float] = []
    document = {"version": 1, "claims": ["x" * 2000]}
    with tempfile.TemporaryDirectory(dir=directory) as where:
        slots = TwinSlots(Path(where) / "claims.json")
        for _ in range(count):
            started = time.monotonic()
            slots.write(document)
            in_place.append(time.monotonic() - started)
            time.sleep(0.02)
            started = time.monotonic()
            write_atomically(Path(where) / "renamed.json", b"x" * 2048)
            renamed.append(time.monotonic() - started)
            time.sleep(0.02)
    return in_place, renamed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=200, help="timed prepare+unprepare rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--gap", type=float, default=0.02, help="seconds after each slice write (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=20.0, help="per wait, seconds (default: %(default)s)")
    parser.add_argument("--vfs", type=int, default=DEFAULT_VFS,
                        help="VFs in the pool, 64 per PF (default: %(default)s; 1024: 8 slices rewritten per call)")
    parser.add_argument("--vfio-config", action="store_true",
                        help="the pool sets vfioOnDemand (drivers: vfio-pci) and each claim carries a VfioConfig: "
                             "the devices are on vfio-pci already, so nothing is rebound")
    arguments = parser.parse_args(argv)
    vfs = arguments.vfs
    config = dra_config()
    claim_config: list[dict[str, Any]] = []
    if arguments.vfio_config:
        (pool,) = config["resourceList"]
        pool.update(deviceType="pciDevice", vfioOnDemand=True)
        claim_config = [{"source": "FromClass", "requests": ["vf"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig"}}}]

    print(f"dra_prepare: one DRA pool of {vfs} vfio-pci VFs; {arguments.claims} fresh claims of one device, each "
          f"prepared then unprepared through the kubelet stand-in over dra.sock ({arguments.warmup} warm-up rounds)"
          + ("; vfioOnDemand pool, each claim with a VfioConfig (FromClass)" if arguments.vfio_config else ""),
          flush=True)
    print(machine_line(), flush=True)
    print(revision_line(), flush=True)
    with short_tmp() as base, host_tmp() as host_dir, contextlib.ExitStack() as stack:
        env = dra_bytecode_env(base)
        go_binary: Path | str
        go_driver_binary: Path | None = None
        try:
            go_binary = build(base / "go")
        except GoBuildError as error:
            go_binary = str(error)
        else:
            try:
                go_driver_binary = build(base / "go", "go_driver")
            except GoBuildError as error:  # the Go client's rounds go on without the reference
                print(f"no reference driver in Go: {error}", flush=True)
        go_kubelet: GoKubelet | None = None
        go_prepare: list[float] = []  # as the Go client (grpc-go, the kubelet's) sees them
        go_unprepare: list[float] = []
        go_idle: list[float] = []
        reference: tuple[GoDriver, GoKubelet] | None = None  # the Go driver, and a Go client of it
        reference_prepare: list[float] = []
        reference_unprepare: list[float] = []
        reference_idle: list[float] = []
        host, _, per_pf = build_dra_host(host_dir / "host", vfs)
        api = StampedApiServer().start()
        api.add_node(NODE)
        seam = Seam(base / "uevents.sock")
        kubelet = FakeKubelet(base / "device-plugins", base / "plugins_registry")
        kubelet.start()
        daemon = dra_daemon(base, host, config, api, seam, env)
        cdi_dir = host_dir / "cdi"  # tmpfs, as /var/run/cdi
        daemon.arguments[daemon.arguments.index("--cdi-dir") + 1] = str(cdi_dir)
        daemon.arguments[daemon.arguments.index("--devinfo-dir") + 1] = str(host_dir / "devinfo")
        try:
            daemon.start()
            seam.wait_ready(daemon)
            wait_generation(api, daemon, 0, lambda g: len(g.names) == vfs, 60, f"the pool published with {vfs} VFs")
            kubelet.wait_for_dra(DRIVER, timeout=30)
            if isinstance(go_binary, Path):
                go_kubelet = GoKubelet(go_binary, kubelet.dra_state(DRIVER).endpoint)
            if go_driver_binary is not None:
                driver_log = stack.enter_context((base / "go-driver.log").open("w"))
                go_driver = GoDriver(go_driver_binary, base / "go-driver.sock", api.url, TOKEN, DRIVER, host_dir / "go-cdi",
                                     host_dir / "go-devinfo", base / "go-state", driver_log)
                assert isinstance(go_binary, Path)  # the driver is built only after the client
                reference = (go_driver, GoKubelet(go_binary, str(base / "go-driver.sock")))
            print(f"driver registered with the kubelet stand-in and the pool published "
                  f"{time.monotonic() - daemon.started_mono:.2f} s after Popen", flush=True)
            time.sleep(0.3)
            prepare: list[float] = []  # as the kubelet's gRPC client sees them
            unprepare: list[float] = []
            prepare_here: list[float] = []  # around the call in this thread
            unprepare_here: list[float] = []
            to_get: list[float] = []
            get_server: list[float] = []
            after_get: list[float] = []
            slice_puts: list[int] = []
            wrong = 0
            cpu_before = None
            timed_from = 0
            for number in range(arguments.warmup + arguments.claims):
                timed = number >= arguments.warmup
                if number == arguments.warmup:
                    cpu_before = thread_cpu_ns(daemon.pid)
                    with api._cond:
                        timed_from = len(api.handled)
                address = sriov_vf_address(*divmod(number % vfs, per_pf))
                name = device_name(address)
                claim_name = f"bench-{number}"
                results = [{"request": "vf", "driver": DRIVER, "pool": POOL, "device": name}]
                uid = api.put_claim(NAMESPACE, claim_name, results=results, config=claim_config)
                ref = (NAMESPACE, uid, claim_name)
                if go_kubelet is not None and number % 2:  # every other round: the Go client's
                    go_rounds = [(go_kubelet, ref, go_prepare, go_unprepare)]
                    if reference is not None:  # then the same, for a claim of its own, with the reference driver
                        own = f"ref-{number}"
                        own_uid = api.put_claim(NAMESPACE, own, results=results, config=claim_config)
                        go_rounds.append((reference[1], (NAMESPACE, own_uid, own), reference_prepare, reference_unprepare))
                    for client, go_ref, prepared_seconds, unprepared_seconds in go_rounds:
                        seconds = go_round(client, go_ref, name, arguments.gap)
                        api.delete_claim(NAMESPACE, go_ref[2])
                        if seconds is None:
                            wrong += 1
                        elif timed:
                            prepared_seconds.append(seconds[0])
                            unprepared_seconds.append(seconds[1])
                    continue
                with api._cond:
                    handled_before = len(api.handled)
                started = time.monotonic()
                try:
                    answer = kubelet.prepare([ref])[uid]
                except DraCallError as error:
                    raise DaemonFailure(f"prepare of {claim_name} ({address}): {error}", daemon.log) from None
                returned = time.monotonic()
                method, seen_by_kubelet = kubelet.dra_state(DRIVER).call_seconds[-1]
                assert method == "NodePrepareResources"
                devices = [(d.pool_name, d.device_name) for d in answer.devices]
                if devices != [(POOL, name)]:
                    wrong += 1
                    print(f"  unexpected answer for {claim_name}: {devices}, error {answer.error!r}")
                time.sleep(arguments.gap)
                with api._cond:
                    # Prepare's read of the claim is the first; the status writer's (status.devices,
                    # in the background once the answer is out) come after it
                    gets = sorted((r for r in api.handled[handled_before:]
                                   if r.method == "GET" and r.path.endswith(f"/resourceclaims/{claim_name}")),
                                  key=lambda r: r.start)[:1]
                    puts = [r for r in api.handled[handled_before:]
                            if r.method == "PUT" and "/resourceslices/" in r.path]
                unprepare_started = time.monotonic()
                kubelet.unprepare([ref])
                unprepare_returned = time.monotonic()
                unprepare_seen = kubelet.dra_state(DRIVER).call_seconds[-1][1]
                time.sleep(arguments.gap)
                api.delete_claim(NAMESPACE, claim_name)
                if not timed:
                    continue
                prepare.append(seen_by_kubelet)
                unprepare.append(unprepare_seen)
                prepare_here.append(returned - started)
                unprepare_here.append(unprepare_returned - unprepare_started)
                slice_puts.append(len(puts))
                if len(gets) == 1:
                    (get,) = gets
                    to_get.append(get.start - started)
                    get_server.append(get.end - get.start)
                    after_get.append(returned - get.end)
                else:
                    print(f"  {claim_name}: {len(gets)} GETs of the claim")
            assert cpu_before is not None
            used = cpu_by_thread_name(cpu_before, thread_cpu_ns(daemon.pid), daemon.pid)
            with api._cond:
                requests = requests_by_kind([r for r in api.handled[timed_from:]
                                             if not r.watch and "/resourceclaims/ref-" not in r.path])
            hop = time_hop(kubelet)
            empty_prepare, empty_unprepare = time_empty_calls(kubelet)
            idle_prepare, _ = time_empty_calls(kubelet, gap=arguments.gap)
            if go_kubelet is not None:
                go_idle = time_go_empty_calls(go_kubelet, gap=arguments.gap)
            if reference is not None:
                reference_idle = time_go_empty_calls(reference[1], gap=arguments.gap)
            direct_client, direct_server = time_direct_get(api, base / "kubeconfig")
            idle_get, _ = time_direct_get(api, base / "kubeconfig", gap=arguments.gap)
            code, stop_seconds = daemon.stop()
            check_exit(code, daemon.log)
            errors = list(api.internal_errors)
        except DaemonFailure as error:
            report_failure(error)
            return 1
        finally:
            clean_up(daemon.kill, kubelet.close, api.close, seam.close,
                     *([go_kubelet.close] if go_kubelet is not None else []),
                     *([reference[1].close, reference[0].close] if reference is not None else []))
        in_place, renamed = time_checkpoint_writes(base)
        metadata_dirs = time_metadata_dirs(base)

    rounds = len(prepare) + len(go_prepare)
    if go_prepare:
        print(f"\nround trips as a grpc-go client (the kubelet's) times them, every other round "
              f"({arguments.warmup} warm-up rounds not counted):")
        print(latency_row("NodePrepareResources (1 claim)", go_prepare, width=WIDTH))
        print(latency_row("NodeUnprepareResources", go_unprepare, width=WIDTH))
        print(latency_row(f"NodePrepareResources of no claims, {arguments.gap * 1000:g} ms apart", go_idle,
                          width=WIDTH))
    else:
        print(f"\nno grpc-go client: {go_binary}")
    if reference_prepare:
        print("  the same steps by the reference driver in Go (benchmarks/go_driver), after each of those rounds:")
        print(latency_row("  NodePrepareResources (1 claim)", reference_prepare, width=WIDTH))
        print(latency_row("  NodeUnprepareResources", reference_unprepare, width=WIDTH))
        print(latency_row(f"  NodePrepareResources of no claims, {arguments.gap * 1000:g} ms apart", reference_idle,
                          width=WIDTH))
    print(f"\nround trips through the kubelet stand-in{', the other rounds' if go_prepare else ''} "
          f"({arguments.warmup} warm-up rounds not counted), as its (Python) gRPC client sees them:")
    print(latency_row("NodePrepareResources (1 claim)", prepare, width=WIDTH))
    print(latency_row("NodeUnprepareResources", unprepare, width=WIDTH))
    print("  around the call in this thread (+ the hop into the stand-in's loop and back):")
    print(latency_row("  NodePrepareResources (1 claim)", prepare_here, width=WIDTH))
    print(latency_row("  NodeUnprepareResources", unprepare_here, width=WIDTH))
    print("  prepare (in this thread), split by the stand-in's stamps of the claim GET:")
    print(latency_row("  call -> GET handler starts", to_get, width=WIDTH))
    print(latency_row("  the stand-in handling the GET", get_server, width=WIDTH))
    print(latency_row("  GET answered -> call returns", after_get, width=WIDTH))
    print("  for comparison, in this process:")
    print(latency_row("  a claim GET with daemon's Kube client", direct_client, width=WIDTH))
    print(latency_row("    of which the stand-in handling it", direct_server, width=WIDTH))
    print(latency_row(f"    the same, {arguments.gap * 1000:g} ms apart", idle_get, width=WIDTH))
    print(latency_row("  the stand-in's thread hop alone", hop, width=WIDTH))
    print(latency_row("  NodePrepareResources of no claims", empty_prepare, width=WIDTH))
    print(latency_row("  NodeUnprepareResources of no claims", empty_unprepare, width=WIDTH))
    print(latency_row(f"  the same, {arguments.gap * 1000:g} ms apart", idle_prepare, width=WIDTH))
    print(latency_row("  checkpoint write, in place (/tmp)", in_place, width=WIDTH))
    print(latency_row("    temp file + rename, 2 fsyncs (/tmp)", renamed, width=WIDTH))
    print(latency_row("  a claim's metadata dirs and file (/tmp)", metadata_dirs, width=WIDTH))
    print(f"  slice PUTs during the prepares: {sum(slice_puts)} in {len(slice_puts)} rounds "
          f"(a prepared device stays in its slice)")
    print(f"  API requests over the {rounds} timed rounds: {kinds_text(requests)}")
    print(f"  wrong answers: {wrong}; stand-in internal errors: {len(errors)}")
    parts = ", ".join(f"{n} {ns / rounds / 1000:.0f}" for n, ns in sorted(used.items(), key=lambda i: -i[1])
                      if ns / rounds >= 1000)
    print(f"  daemon CPU per round (prepare, unprepare and the two slice writes): "
          f"{sum(used.values()) / rounds / 1000:.0f} us ({parts} us by thread)")
    print(f"  SIGTERM -> exit {stop_seconds * 1000:.0f} ms, exit code {code}")
    kubelets_view, unprepare_view, whose = (
        (go_prepare, go_unprepare, "a grpc-go client's view, as the kubelet's") if go_prepare
        else (prepare, unprepare, "the Python stand-in's view"))
    p50 = percentile(kubelets_view, 50)
    print(f"\ntarget: prepare p50 <= {TARGET_PREPARE_P50 * 1000:.0f} ms: p50 {p50 * 1000:.2f} ms, "
          f"p90 {percentile(kubelets_view, 90) * 1000:.2f} ms, p99 {percentile(kubelets_view, 99) * 1000:.2f} ms "
          f"({'within target' if p50 <= TARGET_PREPARE_P50 else 'OVER target'}; {whose}); through the Python "
          f"stand-in p50 {percentile(prepare, 50) * 1000:.2f} ms; unprepare p50 "
          f"{percentile(unprepare_view, 50) * 1000:.2f} ms")
    if reference_prepare:
        p50 = percentile(reference_prepare, 50)
        print(f"        the same steps by a Go driver on this machine: prepare p50 {p50 * 1000:.2f} ms, "
              f"p90 {percentile(reference_prepare, 90) * 1000:.2f} ms "
              f"({'within target' if p50 <= TARGET_PREPARE_P50 else 'OVER target'}); unprepare p50 "
              f"{percentile(reference_unprepare, 50) * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared pieces of the DRA benchmarks (``dra_slices``, ``dra_prepare``, ``dra_publish_4096``,
``dra_taints``); not a benchmark itself.

* ``StampedApiServer``: the API server stand-in of ``tests/apiserver.py``, subclassed here (the
  stand-in itself is unchanged) to add listeners:

  * every stored ResourceSlice write (create, update, delete) is stamped with
    ``time.monotonic()`` inside ``_commit``, under the stand-in's lock, right after the object is
    stored and offered to the watches. No polling: the stamp is taken by the thread that stores;
  * each time the stored slices of a pool form one complete generation (every slice of the pool
    has the same ``spec.pool.generation`` and there are as many as its ``resourceSliceCount``)
    that is new or holds other devices than the last one recorded (a change in place keeps the
    generation), its device names are recorded with the stamp of the write that completed it.
    A consumer that reads the pool then sees exactly these devices;
  * each stretch of time a pool was incomplete (its stored slices not one complete generation:
    the allocator allocates nothing from it then) is recorded, from the write that broke it to
    the write that made it whole again;
  * every HTTP request is stamped when the stand-in's handler starts (request line and headers
    read) and when its answer is written.

  Options go to ``tests.apiserver.ApiServer`` as they are (``feature_gates={"DRADeviceTaints"}``:
  the server keeps device taints and validates them as 1.37 does).

* ``dra_daemon``: ``benchmarks._common.Daemon`` with the DRA flags (``--node-name``,
  ``--kubeconfig`` for the stand-in, ``--dra-plugin-dir``), the uevent seam and its own control
  socket.
* fake-host helpers: VFs made and removed one at a time in the fake sysfs, as the kernel would.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks._common import PYTHON, REPO_ROOT, Daemon, DaemonFailure, build_sriov_host, bytecode_env, pf_address
from benchmarks._common import vf_address as sriov_vf_address
from benchmarks._events import Seam
from tests.apiserver import ApiServer
from tests.fakesysfs import FakeHost

DRIVER = "devplugd.io"
NODE = "node1"
TOKEN = "bench-token"
RESOURCE_NAME = "sriov_vfs"  # intel.com/sriov_vfs
POOL = f"{NODE}/intel.com/sriov-vfs"  # its ResourceSlice pool (daemon.dra.pool_name)
VFS_PER_PF = 64
SLICE_DEVICES = 128  # devices per slice (daemon.dra._slices.MAX_DEVICES_PER_SLICE)
TAINTED_SLICE_DEVICES = 64  # of a pool that may carry taints (MAX_TAINTED_DEVICES_PER_SLICE)


class SliceWrite(NamedTuple):
    stamp: float
    kind: str  # ADDED, MODIFIED, DELETED
    name: str
    pool: str
    generation: int
    devices: int
    names: frozenset[str] = frozenset()  # the slice's device names (none for a delete)
    taints: frozenset[tuple[str, str, str]] = frozenset()  # (device name, taint key, effect) of each taint


class Incomplete(NamedTuple):
    """A stretch of time a pool's stored slices were not one complete generation."""

    pool: str
    start: float  # the stamp of the write that made it incomplete
    end: float | None  # the stamp of the write that made it complete again (None: not yet)


class PoolGeneration(NamedTuple):
    """A pool's slices forming one complete generation, at the stamp of the write that made it so."""

    stamp: float
    pool: str
    generation: int
    slices: int
    names: frozenset[str]
    write_index: int  # the completing write, in ``StampedApiServer.writes``


class Handled(NamedTuple):
    start: float  # the stand-in's handler starts (request line and headers read)
    end: float  # its answer is written
    method: str
    path: str  # without the query
    watch: bool


class StampedApiServer(ApiServer):
    """The stand-in, with every stored slice write, every complete pool generation and every
    request stamped (see the module docstring). Read the lists under ``wait_until`` or after the
    daemon is idle: they grow under the stand-in's lock."""

    def __init__(self, **options: Any) -> None:
        super().__init__(token=TOKEN, **options)
        self.writes: list[SliceWrite] = []
        self.generations: list[PoolGeneration] = []
        self.handled: list[Handled] = []
        self._pool_slices: dict[str, dict[str, tuple[int, int, frozenset[str]]]] = {}
        self._complete: dict[str, tuple[int, frozenset[str]]] = {}
        self.incomplete: list[Incomplete] = []
        self._incomplete_at: dict[str, int] = {}  # pool -> its open entry in ``incomplete``

    def _commit(self, kind: str, obj: dict[str, Any], previous: Any) -> Any:
        stored = super()._commit(kind, obj, previous)
        stamp = time.monotonic()
        spec = stored.obj.get("spec") or {}
        pool_spec = spec.get("pool") or {}
        pool = str(pool_spec.get("name", ""))
        generation = int(pool_spec.get("generation", 0))
        devices = spec.get("devices") or []
        names = frozenset(device["name"] for device in devices) if kind != "DELETED" else frozenset()
        taints = frozenset((device["name"], str(taint.get("key", "")), str(taint.get("effect", "")))
                           for device in devices for taint in device.get("taints") or []) if kind != "DELETED" \
            else frozenset()
        self.writes.append(SliceWrite(stamp, kind, stored.name, pool, generation, len(devices), names, taints))
        slices = self._pool_slices.setdefault(pool, {})
        if kind == "DELETED":
            slices.pop(stored.name, None)
        else:
            slices[stored.name] = (generation, int(pool_spec.get("resourceSliceCount", 0)), names)
        generations = {g for g, _, _ in slices.values()}
        counts = {c for _, c, _ in slices.values()}
        complete = bool(slices) and len(generations) == 1 and counts == {len(slices)}
        if complete and pool in self._incomplete_at:
            index = self._incomplete_at.pop(pool)
            self.incomplete[index] = self.incomplete[index]._replace(end=stamp)
        elif not complete and pool not in self._incomplete_at and slices:
            self._incomplete_at[pool] = len(self.incomplete)
            self.incomplete.append(Incomplete(pool, stamp, None))
        if complete:
            (complete,) = generations
            names = frozenset().union(*(n for _, _, n in slices.values()))
            if self._complete.get(pool) != (complete, names):  # a new generation, or a change in place
                self._complete[pool] = (complete, names)
                self.generations.append(PoolGeneration(stamp, pool, complete, len(slices), names,
                                                       len(self.writes) - 1))
        return stored

    def _handle(self, handler: Any, method: str) -> None:
        start = time.monotonic()
        try:
            super()._handle(handler, method)
        finally:
            end = time.monotonic()
            with self._cond:
                path, _, query = str(handler.path).partition("?")
                self.handled.append(Handled(start, end, method, path, "watch=true" in query.lower()))


def incomplete_seconds(api: StampedApiServer, pool: str, start: float, end: float) -> float:
    """How long ``pool`` was incomplete between ``start`` and ``end`` (read under the lock or
    once the daemon is idle; a stretch still open counts up to ``end``)."""
    total = 0.0
    for stretch in api.incomplete:
        if stretch.pool == pool:
            total += max(0.0, min(end, stretch.end if stretch.end is not None else end) - max(start, stretch.start))
    return total


def wait_api(api: ApiServer, daemon: Daemon, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``api.wait_until(predicate)`` while watching that the daemon stays alive; its result."""
    deadline = time.monotonic() + timeout
    while True:
        daemon.check_alive()
        try:
            return api.wait_until(predicate, timeout=min(0.25, max(deadline - time.monotonic(), 0.001)), what=what)
        except AssertionError as error:
            if time.monotonic() >= deadline:
                raise DaemonFailure(f"timed out after {timeout:.1f}s waiting for {what}; {error}", daemon.log) from None


def wait_generation(api: StampedApiServer, daemon: Daemon, start: int, check: Callable[[PoolGeneration], bool],
                    timeout: float, what: str, pool: str = POOL) -> PoolGeneration:
    """The first complete generation of ``pool`` recorded at index ``start`` or later for which
    ``check`` holds, waiting for it."""
    def found() -> PoolGeneration | None:
        for generation in api.generations[start:]:
            if generation.pool == pool and check(generation):
                return generation
        return None
    result: PoolGeneration = wait_api(api, daemon, found, timeout, what)
    return result


# -- the daemon -------------------------------------------------------------------------------
def dra_config(*, pf_names: Sequence[str] | None = None) -> dict[str, Any]:
    """One DRA pool, ``intel.com/sriov_vfs``: every vfio-pci function (or those of ``pf_names``)."""
    selectors: dict[str, Any] = {"drivers": ["vfio-pci"]}
    if pf_names is not None:
        selectors["pfNames"] = list(pf_names)
    return {"resourceList": [{"resourceName": RESOURCE_NAME, "allocationApi": "dra", "selectors": selectors}]}


def dra_daemon(workdir: Path, host: FakeHost, config: dict[str, Any], api: ApiServer, seam: Seam,
               env: dict[str, str] | None = None) -> Daemon:
    """The daemon (not started) as a DRA driver of ``NODE`` against ``api``, uevents from ``seam``."""
    daemon = Daemon(workdir, host, config, env=env)
    kubeconfig = api.kubeconfig(workdir / "kubeconfig")
    daemon.arguments += ["--uevent-source", seam.argument, "--node-name", NODE, "--kubeconfig", str(kubeconfig),
                         "--dra-plugin-dir", str(workdir / "plugins"), "--control-socket",
                         str(workdir / "control.sock")]
    return daemon


def dra_bytecode_env(base: Path) -> dict[str, str]:
    """``bytecode_env`` (a warmed .pyc prefix outside the tree), warmed also with the
    ``kubernetes`` client modules the DRA driver imports (they are compiled into the prefix
    once here, not by the first timed start)."""
    env = bytecode_env(base)
    subprocess.run([PYTHON, "-c", "import daemon.dra._kube, kubernetes.config, kubernetes.client.api_client, "
                    "kubernetes.client.api.core_v1_api, kubernetes.client.api.resource_v1_api, "
                    "kubernetes.watch.watch, kubernetes.client.exceptions"], cwd=REPO_ROOT, env=env, check=False)
    return env


# -- the fake host ----------------------------------------------------------------------------
def build_dra_host(root: Path, vfs: int) -> tuple[FakeHost, int, int]:
    """``vfs`` vfio-pci VFs on ``ceil(vfs / 64)`` i40e PFs (``benchmarks._common.build_sriov_host``'s
    layout); returns (host, PFs, VFs per PF)."""
    pfs = max(1, math.ceil(vfs / VFS_PER_PF))
    per_pf = vfs // pfs
    if per_pf * pfs != vfs:
        raise ValueError(f"{vfs} VFs do not split evenly over {pfs} PFs")
    return build_sriov_host(root, pfs, per_pf), pfs, per_pf


def iommu_group(pf: int, vf: int, per_pf: int) -> int:
    return 1000 + pf * per_pf + vf  # as build_sriov_host numbers them


def add_vf(host: FakeHost, pf: int, vf: int, group: int, *, address: str | None = None,
           pf_pci: str | None = None) -> str:
    """VF ``vf`` of PF ``pf`` made in sysfs and bound to vfio-pci, as ``add_vfs`` makes one;
    ``sriov_numvfs`` follows. Its PCI address."""
    address = address or sriov_vf_address(pf, vf)
    pf_pci = pf_pci or pf_address(pf)
    pf_dir = host.device_dir(pf_pci)
    vf_dir = host.add_pci(address, device="154c", driver=None, numa_node=pf % 2, bridge=pf_dir.parent.name)
    (vf_dir / "physfn").symlink_to(f"../{pf_pci}")
    (pf_dir / f"virtfn{vf}").symlink_to(f"../{address}")
    host.set_iommu_group(address, group)
    host.bind(address, "vfio-pci")
    (pf_dir / "sriov_numvfs").write_text(f"{sum(1 for _ in pf_dir.glob('virtfn*'))}\n")
    return address


def remove_vf(host: FakeHost, pf: int, vf: int, group: int, *, address: str | None = None,
              pf_pci: str | None = None) -> str:
    """VF ``vf`` of PF ``pf`` taken out of sysfs (its ``virtfn`` and IOMMU group links too);
    the uevent DEVPATH it had."""
    address = address or sriov_vf_address(pf, vf)
    pf_dir = host.device_dir(pf_pci or pf_address(pf))
    devpath = host.devpath(address)
    (pf_dir / f"virtfn{vf}").unlink()
    (host.sys / "kernel" / "iommu_groups" / str(group) / "devices" / address).unlink(missing_ok=True)
    host.remove_pci(address)
    (pf_dir / "sriov_numvfs").write_text(f"{sum(1 for _ in pf_dir.glob('virtfn*'))}\n")
    return devpath


def request_kind(request: Handled) -> str:
    """``PUT slice``, ``POST slices``, ``LIST slices``, ``WATCH slices``, ``GET claim``, ``GET node``..."""
    parts = request.path.strip("/").split("/")
    for plural, singular in (("resourceslices", "slice"), ("resourceclaims", "claim"), ("nodes", "node")):
        if plural in parts:
            if parts[-1] != plural:
                return f"{request.method} {singular}"
            method = ("WATCH" if request.watch else "LIST") if request.method == "GET" else request.method
            return f"{method} {singular}s"
    return f"{request.method} {request.path}"


def requests_by_kind(handled: Sequence[Handled]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in handled:
        kind = request_kind(request)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def kinds_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]))


# -- where a publish's time goes, measured in this process --------------------------------------
def in_process_slice_costs(host: FakeHost, workdir: Path, repeats: int = 5) -> dict[str, float]:
    """Median seconds, in this process, of the daemon's own steps for one write of the pool
    (``dra_config()`` on ``host``): ``slice_devices`` of the whole pool (redone on every change:
    its cache is per ResourcePool), ``slice_bodies``; and for the first slice (up to 128 devices)
    the client's ``sanitize_for_serialization`` of the body, ``json.dumps`` of it, and
    ``json.loads`` of the same JSON (the answer to the write, and each watch event of it, is
    parsed once more). Also ``devices`` (the pool's size) and ``body_bytes``."""
    import json
    import statistics
    from types import MappingProxyType

    from kubernetes.client.api_client import ApiClient

    from daemon import app
    from daemon.core import ResourcePool
    from daemon.core._handler import Hooks
    from daemon.core._tree import DRA_ROAD
    from daemon.dra._devices import slice_devices
    from daemon.dra._slices import slice_bodies
    from daemon.settings import Settings

    config_path = workdir / "inproc-config.json"
    config_path.write_text(json.dumps(dra_config()))
    settings = Settings(config_path=config_path, sysfs_root=host.sys, dev_root=host.dev, proc_root=host.proc,
                        devinfo_dir=workdir / "inproc-devinfo")
    handlers, config = app.load(settings)
    handler = handlers["pci"]
    (configured,) = config.pools_of("pci")
    built = handler.build(handler.scan(), [configured])
    pool = ResourcePool(configured.resource, "pci", configured, MappingProxyType(dict(built[configured.resource])),
                        road=DRA_ROAD)
    describer = Hooks.of(handler).describer
    client = ApiClient()
    times: dict[str, list[float]] = {key: [] for key in ("slice_devices", "slice_bodies", "sanitize", "dumps",
                                                         "loads")}
    devices: list[dict[str, Any]] = []
    text = ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        devices = slice_devices(pool, DRIVER, describer)
        t1 = time.perf_counter()
        bodies = slice_bodies(driver=DRIVER, node_name=NODE, node_uid="uid", pool_name=POOL, generation=2,
                              devices=devices)
        t2 = time.perf_counter()
        sanitized = client.sanitize_for_serialization(bodies[0])
        t3 = time.perf_counter()
        text = json.dumps(sanitized)
        t4 = time.perf_counter()
        json.loads(text)
        t5 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[key].append(value)
    client.close()
    result = {key: statistics.median(values) for key, values in times.items()}
    result["devices"] = len(devices)
    result["body_bytes"] = len(text)
    return result


def kubernetes_import_seconds(env: dict[str, str]) -> float:
    """Importing what the DRA driver imports of the ``kubernetes`` client, in a fresh process
    with the daemon's environment (warmed bytecode): part of the time to the first slice."""
    code = ("import time; t = time.perf_counter(); import daemon.dra._kube, kubernetes.config, "
            "kubernetes.client.api_client, kubernetes.client.api.core_v1_api, kubernetes.client.api.resource_v1_api, "
            "kubernetes.watch.watch; print(time.perf_counter() - t)")
    done = subprocess.run([PYTHON, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    try:
        return float(done.stdout.strip())
    except ValueError:
        return float("nan")

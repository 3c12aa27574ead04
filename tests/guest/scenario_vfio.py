"""Run inside the QEMU guest (tests/test_real_kernel_vfio.py boots it): vfio-pci on demand for DRA
claims (issue 23) on a real kernel, with devplugd, the API server stand-in and the kubelet
stand-in's DRA side all in the guest.

The guest has an SR-IOV NVMe PF with a shared namespace (rp0) and a 3-function multifunction
NVMe (rp1, one IOMMU group). First, under Debian's default native NVMe multipath
(``multipath_in_use``): the PF's VFs up on ``nvme``, the shared namespace's head ``nvme0n1`` used as
swap, and the daemon's in-use check (``daemon.handlers.pci._inuse.check_unused``, what Prepare
runs before unbinding a function for vfio-pci) asked about each function: a function with only
the hidden path ``nvme0c<C>n1`` to the head must be refused while the head is in use, and let go
once it is not; then swap off and the VFs gone again. Setup (tests/guest/nvme_virt.py): nvme
reloaded without multipath,
the PF's VFs brought up on ``nvme``, each with its ``/dev/nvmeXn1``; one VF taken to vfio-pci and
back by hand (the kernel's own figures). Then ``devplugd run`` with two DRA ``pciDevice`` pools
with ``"vfioOnDemand": true``, both selecting functions on ``nvme``: ``nvme_vfs`` (the PF's
VFs, by ``rootDevices``) and ``nvme_mf`` (the multifunction slot, by ``pciAddresses``). The flows:

1. ``vf``: a claim on the first VF with a ``VfioConfig`` (from the claim): Prepare; the VF's
   driver, its group node opened, the KEP-5304 metadata file read as KubeVirt reads it, the CDI
   specs, the slice's ``driver`` attribute while held; Unprepare; the VF back on nvme with its
   block device, the files gone;
2. ``rounds``: Prepare and Unprepare of one VF, alternating VFs, each timed (a ``FromClass``
   config in one of them, as the generated ``-vfio`` DeviceClass gives it);
3. ``group``: the multifunction slot claimed: all three functions on vfio-pci, the group viable;
   released: all three on nvme;
4. ``sigkill``: the group claimed again and the daemon killed with SIGKILL once the first function
   is on vfio-pci (a thread polling sysfs kills it as soon as it sees the first bind: under TCG
   the next function's bind is tens of milliseconds later; the record says where each function
   was at the kill), the daemon started again, the claim unprepared: every function back on nvme.

It asserts nothing: every step goes to ``result.json`` in the share (rewritten after each flow),
the daemons' logs to ``daemon-<n>.log``. ``VFIO_FLOWS=0`` in the environment stops after the
setup (the part that needs no daemon).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from daemon.core import AllocationError
from daemon.dra import device_name
from daemon.handlers.pci._inuse import check_unused, mounted_devices
from tests.apiserver import ApiServer
from tests.books import book_document
from tests.guest.devices import (
    NVME_DRIVER,
    PCI_DEVICES,
    VFIO_DRIVER,
    bind,
    driver_of,
    functions_below,
    iommu_group_of,
    ports,
    set_num_vfs,
    vfio_node,
    vfs_of,
)
from tests.guest.nvme_virt import (
    controller_of,
    controller_state,
    enable_vfs_on_nvme,
    multipath,
    namespace_block,
    reload_nvme_without_multipath,
    wait_on_nvme,
)
from tests.guest.scenario_health import VFIO_GROUP_FLAGS_VIABLE, VFIO_GROUP_GET_STATUS
from tests.kubelet import FakeKubelet
from tests.notify import NotifySocket
from tests.waiting import wait_until

PREFIX = "devplugd.test"
DRIVER = "devplugd.io"
NODE = "guest"
TOKEN = "guest-token"
NAMESPACE = "default"
REQUEST = "vm"
VF_COUNT = 2
ROUNDS = 6
FROM_CLASS_ROUND = 1  # this round's config comes from the DeviceClass (source FromClass)
VFIO_CONFIG = {"apiVersion": "devplugd.io/v1alpha1", "kind": "VfioConfig", "backend": "legacy"}
METADATA_API_VERSIONS = ("metadata.resource.k8s.io/v1alpha1",)  # what a reader supports, newest first
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
READY_TIMEOUT = 240.0  # the daemon's imports (grpc, trio, the kubernetes client) over 9p under TCG
PUBLISH_TIMEOUT = 90.0
STEP_TIMEOUT = 60.0
CALL_TIMEOUT = 120.0  # one DRA call under TCG (the kubelet's own is 45 s)
KILL_POLL = 0.0005
WORK = Path("/tmp/devplugd-vfio")
LOG = "scenario_vfio"


def say(text: str) -> None:
    print(f"{LOG}: {text}", flush=True)


def loopback_up() -> None:
    """The API server stand-in listens on 127.0.0.1: busybox's /init leaves ``lo`` down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP


def drivers(functions: list[str]) -> dict[str, str | None]:
    return {function: driver_of(function) for function in functions}


def blocks(functions: list[str]) -> dict[str, str | None]:
    return {function: namespace_block(function) for function in functions}


def vfio_nodes() -> list[str]:
    try:
        return sorted(os.listdir("/dev/vfio"))
    except FileNotFoundError:
        return []


def open_group(group: str) -> dict[str, Any]:
    """Open ``/dev/vfio/<group>`` read-write as a VMM would, ask whether it is viable, close."""
    record: dict[str, Any] = {"node": str(vfio_node(group))}
    try:
        fd = os.open(vfio_node(group), os.O_RDWR)
    except OSError as error:
        record["open"] = errno.errorcode.get(error.errno or 0, str(error))
        return record
    try:
        record["open"] = "ok"
        status = fcntl.ioctl(fd, VFIO_GROUP_GET_STATUS, struct.pack("=II", 8, 0))
        record["viable"] = bool(struct.unpack("=II", status)[1] & VFIO_GROUP_FLAGS_VIABLE)
    finally:
        os.close(fd)
    return record


def on_nvme(functions: list[str], with_block: bool, timeout: float = STEP_TIMEOUT) -> float | None:
    """Seconds until every function is on nvme, its controller live (and, ``with_block``, its
    namespace's node there); None when that did not come within ``timeout``."""
    started = time.monotonic()
    try:
        for function in functions:
            if with_block:
                wait_on_nvme(function, max(0.1, timeout - (time.monotonic() - started)))
            else:
                def live(function: str = function) -> bool:
                    controller = controller_of(function)
                    return (driver_of(function) == NVME_DRIVER and controller is not None
                            and controller_state(controller) == "live")
                wait_until(live, max(0.1, timeout - (time.monotonic() - started)), f"{function} live on nvme")
    except AssertionError:
        return None
    return round(time.monotonic() - started, 3)


def read_stream(data: bytes) -> list[Any]:
    """A metadata file's concatenated JSON documents, as a reader decodes them."""
    text, decoder, at = data.decode(), json.JSONDecoder(), 0
    documents: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        if at >= len(text):
            return documents
        document, at = decoder.raw_decode(text, at)
        documents.append(document)


def answer_record(answer: Any) -> dict[str, Any]:
    return {"error": answer.error,
            "devices": [{"requests": list(d.request_names), "pool": d.pool_name, "device": d.device_name,
                         "cdi_ids": list(d.cdi_device_ids)} for d in answer.devices]}


def error_text(error: BaseException) -> str:
    details = getattr(error, "details", None)
    return f"{type(error).__name__}: {details() if callable(details) else error}"


class VfioScenario:
    """The API server stand-in, the kubelet stand-in and ``devplugd run`` (restartable) in the guest."""

    def __init__(self, share: Path, pf: str, vfs: list[str], mf: list[str]) -> None:
        self.share, self.pf, self.vfs, self.mf = share, pf, vfs, mf
        self.api = ApiServer(token=TOKEN)
        self.kubelet = FakeKubelet(WORK / "device-plugins", WORK / "plugins_registry")
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.ready_s: list[float] = []
        self.pools: dict[str, str] = {}  # device name -> pool name, as published
        self._notify: NotifySocket | None = None

    # -- the daemon ----------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {"resourceList": [
            {"resourceName": "nvme_vfs", "resourcePrefix": PREFIX, "deviceType": "pciDevice", "allocationApi": "dra",
             "vfioOnDemand": True, "selectors": {"drivers": [NVME_DRIVER], "rootDevices": [self.pf]}},
            {"resourceName": "nvme_mf", "resourcePrefix": PREFIX, "deviceType": "pciDevice", "allocationApi": "dra",
             "vfioOnDemand": True, "selectors": {"drivers": [NVME_DRIVER], "pciAddresses": self.mf}},
        ]}

    @contextmanager
    def stand_ins(self) -> Iterator[None]:
        WORK.mkdir(parents=True, exist_ok=True)
        (WORK / "config.json").write_text(json.dumps(self.config()))
        loopback_up()
        self.api.start()
        self.api.add_node(NODE)
        self.api.kubeconfig(WORK / "kubeconfig")
        self.kubelet.start()
        try:
            yield
        finally:
            self.stop_daemon(signal.SIGTERM)
            self.kubelet.close()
            self.api.close()

    def start_daemon(self) -> float:
        """Start ``devplugd run``; seconds until its READY=1."""
        self.starts += 1
        notify_path = WORK / f"notify-{self.starts}.sock"
        notify = NotifySocket(notify_path)  # read in a thread, as systemd does: the daemon never blocks
        self._notify = notify
        log = open(self.share / f"daemon-{self.starts}.log", "wb")
        spawned = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daemon", "run", "--config", str(WORK / "config.json"),
             "--device-plugin-dir", str(WORK / "device-plugins"),
             "--plugins-registry-dir", str(WORK / "plugins_registry"), "--devinfo-dir", str(WORK / "devinfo"),
             "--control-socket", str(WORK / "control.sock"), "--cdi-dir", str(WORK / "cdi"),
             "--state-dir", str(WORK / "state"), "--nfd-features-dir", str(WORK / "nfd"),
             "--dra-plugin-dir", str(WORK / "plugins"), "--dra-driver", DRIVER, "--node-name", NODE,
             "--kubeconfig", str(WORK / "kubeconfig"), "--uevent-source", "kernel", "--registration", "kubelet",
             "--log-level", "debug"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
        log.close()

        def ready(messages: list[str]) -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the daemon exited with {self.process.returncode} before READY=1")
            return any("READY=1" in message.split("\n") for message in messages)
        notify.wait_for(ready, READY_TIMEOUT, "READY=1 from the daemon")
        ready_s = round(time.monotonic() - spawned, 2)
        self.ready_s.append(ready_s)
        return ready_s

    def stop_daemon(self, signum: int) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signum)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        return process.returncode

    # -- the API server's view ------------------------------------------------------------------
    def published(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """Device name -> (pool, attributes) of every device our slices publish."""
        return {device["name"]: (item["spec"]["pool"]["name"], device.get("attributes", {}))
                for item in self.api.slices(driver=DRIVER) for device in item["spec"].get("devices", [])}

    def wait_published(self, wanted: Callable[[dict[str, tuple[str, dict[str, Any]]]], bool],
                       timeout: float = PUBLISH_TIMEOUT) -> float | None:
        started = time.monotonic()
        try:
            self.api.wait_until(lambda: wanted(self.published()), timeout, "slices")
        except AssertionError:
            return None
        return round(time.monotonic() - started, 3)

    def driver_attribute(self, device: str) -> str | None:
        entry = self.published().get(device)
        return entry[1].get("driver", {}).get("string") if entry is not None else None

    # -- claims -----------------------------------------------------------------------------------
    def claim(self, name: str, address: str, source: str = "FromClaim") -> tuple[str, str, str]:
        device = device_name(address)
        result = {"request": REQUEST, "driver": DRIVER, "pool": self.pools[device], "device": device}
        config = [{"source": source, "requests": [REQUEST], "opaque": {"driver": DRIVER, "parameters": VFIO_CONFIG}}]
        uid = self.api.put_claim(NAMESPACE, name, results=[result], config=config)
        return (NAMESPACE, uid, name)

    def prepare(self, ref: tuple[str, str, str]) -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        try:
            answers = self.kubelet.prepare([ref], driver=DRIVER, timeout=CALL_TIMEOUT, fail_on_claim_error=False)
        except Exception as error:
            return {"call_error": error_text(error)}, time.monotonic() - started
        return answer_record(answers[ref[1]]), time.monotonic() - started

    def unprepare(self, ref: tuple[str, str, str]) -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        try:
            answers = self.kubelet.unprepare([ref], driver=DRIVER, timeout=CALL_TIMEOUT, fail_on_claim_error=False)
        except Exception as error:
            return {"call_error": error_text(error)}, time.monotonic() - started
        return {"error": answers[ref[1]].error}, time.monotonic() - started

    def cdi_specs(self, uid: str) -> dict[str, Any]:
        """Every CDI spec of the claim (its file name holds the UID), parsed."""
        specs: dict[str, Any] = {}
        for path in sorted((WORK / "cdi").glob(f"*{uid}*")):
            try:
                specs[path.name] = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                specs[path.name] = {"unreadable": str(error)}
        return specs

    def metadata(self, name: str, specs: dict[str, Any]) -> dict[str, Any]:
        """The request's metadata as KubeVirt reads it: the one ``*metadata.json`` of the request's
        directory (on the host: the plugin data dir's dra-device-metadata/<ns>_<name>/<request>/),
        the first document of a supported apiVersion, its one device's pciBusID; and the CDI
        mount of it (KubeVirt's glob ``*-metadata.json`` applies to its container path)."""
        directory = WORK / "plugins" / DRIVER / "dra-device-metadata" / f"{NAMESPACE}_{name}" / REQUEST
        files = sorted(directory.glob("*metadata.json")) if directory.is_dir() else []
        record: dict[str, Any] = {"directory": str(directory), "files": [f.name for f in files]}
        mounts = [mount for spec in specs.values() if isinstance(spec, dict) and spec.get("kind") == f"{DRIVER}/metadata"
                  for device in spec.get("devices", []) for mount in device.get("containerEdits", {}).get("mounts", [])]
        record["mounts"] = mounts
        if len(files) != 1:
            return record
        documents = read_stream(files[0].read_bytes())
        record["api_versions"] = [document.get("apiVersion") for document in documents]
        chosen = next((d for d in documents if d.get("apiVersion") in METADATA_API_VERSIONS), None)
        if chosen is None:
            return record
        record["document"] = chosen
        devices = [device for request in chosen.get("requests", []) for device in request.get("devices", [])]
        if len(devices) == 1:
            record["pci_bus_id"] = devices[0].get("attributes", {}).get(PCI_BUS_ID, {}).get("string")
        return record


def kill_at_first_bind(scenario: VfioScenario, functions: list[str], record: dict[str, Any],
                       stop: threading.Event) -> None:
    """SIGKILL the daemon as soon as the first of ``functions`` shows vfio-pci (sysfs, polled)."""
    process = scenario.process
    assert process is not None
    while not stop.is_set():
        if driver_of(functions[0]) == VFIO_DRIVER:
            record["at_kill"] = drivers(functions)
            os.kill(process.pid, signal.SIGKILL)
            record["right_after_kill"] = drivers(functions)
            return
        if process.poll() is not None:
            record["daemon_exited_first"] = process.returncode
            return
        time.sleep(KILL_POLL)


def run_tool(argv: list[str]) -> dict[str, Any]:
    """Run a tool of the host's root (util-linux's mkswap, swapon, swapoff); its exit and output."""
    tool = shutil.which(argv[0])
    if tool is None:
        return {"argv": argv, "missing": True}
    done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)
    return {"argv": argv, "exit": done.returncode, "output": (done.stdout + done.stderr).strip()}


def swap_devices() -> list[str]:
    return [line.split()[0] for line in Path("/proc/swaps").read_text().splitlines()[1:] if line.split()]


def in_use_refusal(address: str) -> str | None:
    """What the daemon's in-use check says before a Prepare unbinds ``address`` for vfio-pci (the
    host's mount table and swaps read as the daemon reads them): None when it lets the function
    go, its refusal otherwise."""
    try:
        check_unused(sysfs_root="/sys", address=address, routes=frozenset(), mounted=mounted_devices("/proc"))
    except AllocationError as error:
        return str(error)
    return None


@contextmanager
def used_as_swap(node: str, record: dict[str, Any]) -> Iterator[None]:
    """The block device ``node`` used as swap (the host's mkswap and swapon), swapped off at the end.

    Swap, not a mount: the 6.1 guest kernel has no block filesystem built in (its
    /proc/filesystems lists only nodev ones; ext4 is a module the initramfs does not carry), and
    ``mounted_devices`` reads /proc/swaps as it reads the mount table. The namespace is QEMU's
    null-co (writes dropped, reads give zeros): mkswap's header lives only in the device's page
    cache, which the kernel drops at the block device's last close (blkdev_put: kill_bdev; seen:
    ``swapon: read swap header failed`` after mkswap had exited). So a descriptor is held from
    before mkswap until after swapoff; once it is closed the header goes with the cache and the
    namespace reads zeros again, as before. Nothing is swapped out in practice (1 GiB, little of it
    used); what would be would come back as zeros."""
    holder = os.open(node, os.O_RDONLY)
    try:
        record["mkswap"] = run_tool(["mkswap", node])
        record["swapon"] = run_tool(["swapon", node])
        record["swaps_on"] = swap_devices()
        yield
    finally:
        if node in swap_devices():
            record["swapoff"] = run_tool(["swapoff", node])
        record["swaps_off"] = swap_devices()
        os.close(holder)


def multipath_in_use(pf: str, mf: list[str], record: dict[str, Any]) -> None:
    """Under Debian's default native NVMe multipath (before the reload): the PF's VFs on nvme, each
    with only a hidden path ``nvme<S>c<C>n1`` to the shared namespace's head ``nvme<S>n1`` (in
    devices/virtual/nvme-subsystem/, below no function); the head used as swap; the daemon's
    in-use check asked about every function before, during and after (the multifunction
    functions, with no namespace, must pass throughout); then swap off and the VFs removed, the
    guest as it was for the reload. Records the kernel's layout: the head's and the path's sysfs
    directories, the head's ``multipath/`` links (Linux 6.15 on; None when the head has no such
    directory), whether the path has a device number or a node."""
    started = time.monotonic()
    record.update(kernel=os.uname().release, multipath=multipath())
    if not record["multipath"]:
        return
    try:
        on = enable_vfs_on_nvme(pf, VF_COUNT, hidden_paths=True)
        functions = {pf: wait_on_nvme(pf, hidden_path=True), **on}
        record["functions"] = {address: {"controller": found.controller, "path": found.path,
                                         "head": os.path.basename(found.block)} for address, found in functions.items()}
        vf = next(iter(on))
        node, path = on[vf].block, on[vf].path
        head = os.path.basename(node)
        head_dir, path_dir = os.path.realpath(f"/sys/block/{head}"), os.path.realpath(f"/sys/block/{path}")
        rdev = os.stat(node).st_rdev
        links = (None if not os.path.isdir(f"{head_dir}/multipath") else
                 {name: os.path.realpath(f"{head_dir}/multipath/{name}")
                  for name in sorted(os.listdir(f"{head_dir}/multipath"))})
        record.update(vf=vf, head=head, path=path, head_numbers=f"{os.major(rdev)}:{os.minor(rdev)}",
                      head_dir=head_dir, path_dir=path_dir, head_multipath_links=links,
                      path_dev=(Path(path_dir) / "dev").read_text().strip() if (Path(path_dir) / "dev").exists() else None,
                      path_node=os.path.exists(f"/dev/{path}"))
        everything = [*functions, *mf]
        record["before"] = {address: in_use_refusal(address) for address in everything}
        swap: dict[str, Any] = {}
        record["swap"] = swap
        with used_as_swap(node, swap):
            record["in_use"] = {address: in_use_refusal(address) for address in everything}
        record["after"] = {address: in_use_refusal(address) for address in everything}
    finally:
        if vfs_of(pf):
            set_num_vfs(pf, 0)
        record["left"] = {"vfs": vfs_of(pf), "swaps": swap_devices(), "drivers": drivers([pf, *mf]),
                          "autoprobe": (PCI_DEVICES / pf / "sriov_drivers_autoprobe").read_text().strip(),
                          "block": sorted(os.listdir("/sys/block"))}
        record["seconds"] = round(time.monotonic() - started, 3)


def run(share: Path) -> None:
    report: dict[str, Any] = {"errors": []}
    result = share / "result.json"

    def save() -> None:
        result.write_text(json.dumps(report, indent=1, default=str))

    topology = {port["kind"]: port for port in ports()}
    pf = functions_below(topology["sriov"]["address"])[0]
    mf = functions_below(topology["multifunction"]["address"])
    setup: dict[str, Any] = {"pf": pf, "mf": mf}
    report["setup"] = setup
    in_use: dict[str, Any] = {}
    setup["multipath_in_use"] = in_use
    try:
        multipath_in_use(pf, mf, in_use)
    finally:
        save()
    say(f"native multipath, {in_use.get('head')} as swap: {in_use.get('in_use')}")
    started = time.monotonic()
    reload_nvme_without_multipath()
    setup["reload_s"] = round(time.monotonic() - started, 3)
    setup["multipath"] = multipath()
    started = time.monotonic()
    on = enable_vfs_on_nvme(pf, VF_COUNT)
    setup["enable_s"] = round(time.monotonic() - started, 3)
    vfs = list(on)
    setup.update(vfs=vfs, controllers={vf: f.controller for vf, f in on.items()},
                 blocks={vf: f.block for vf, f in on.items()}, drivers=drivers([pf, *vfs, *mf]),
                 groups={f: iommu_group_of(f) for f in [pf, *vfs, *mf]},
                 group_members={f: sorted(os.listdir(f"/sys/kernel/iommu_groups/{iommu_group_of(f)}/devices"))
                                for f in [*vfs, mf[0]]},
                 autoprobe=(PCI_DEVICES / pf / "sriov_drivers_autoprobe").read_text().strip())
    say(f"VFs on nvme: {setup['blocks']}, groups {setup['groups']}")
    # by hand, the kernel's own figures: a VF to vfio-pci and back
    vf = vfs[0]
    by_hand: dict[str, Any] = {}
    started = time.monotonic()
    bind(vf, VFIO_DRIVER)
    by_hand["to_vfio_s"] = round(time.monotonic() - started, 3)
    by_hand["block_while_vfio"] = namespace_block(vf)
    by_hand["group_open"] = open_group(iommu_group_of(vf))
    started = time.monotonic()
    (PCI_DEVICES / vf / "driver_override").write_text("\n")
    (PCI_DEVICES / vf / "driver" / "unbind").write_text(vf)
    (PCI_DEVICES.parent / "drivers" / NVME_DRIVER / "bind").write_text(vf)
    by_hand["back_s"] = on_nvme([vf], with_block=True)
    by_hand["back_total_s"] = round(time.monotonic() - started, 3)
    by_hand["block_after"] = namespace_block(vf)
    setup["by_hand"] = by_hand
    save()
    if os.environ.get("VFIO_FLOWS", "1") == "0":
        say("setup only: done")
        return

    everything = [pf, *vfs, *mf]
    scenario = VfioScenario(share, pf, vfs, mf)
    with scenario.stand_ins():
        try:
            flows(scenario, report, save)
        except Exception:
            report["errors"].append(traceback.format_exc())
            say(f"failed:\n{traceback.format_exc()}")
        finally:
            report["final"] = {"drivers": drivers(everything), "blocks": blocks(vfs), "vfio_nodes": vfio_nodes(),
                               "overrides": {f: (PCI_DEVICES / f / "driver_override").read_text().strip()
                                             for f in everything},
                               "claims_book": _claims_book(),
                               "daemon_alive": scenario.process is not None and scenario.process.poll() is None}
            report["ready_s"] = scenario.ready_s
            report["daemon_exit"] = scenario.stop_daemon(signal.SIGTERM)
            save()
    say("done")


def _claims_book() -> Any:
    try:
        return book_document(WORK / "state" / "dra-claims.json").get("claims")
    except (OSError, ValueError, AssertionError) as error:
        return f"unreadable: {error}"


def flows(scenario: VfioScenario, report: dict[str, Any], save: Callable[[], None]) -> None:
    vfs, mf = scenario.vfs, scenario.mf
    say("starting the daemon")
    report["ready_s"] = scenario.start_daemon()
    wanted = {device_name(vf) for vf in vfs} | {device_name(mf[0])}
    report["published_s"] = scenario.wait_published(lambda seen: wanted <= set(seen))
    published = scenario.published()
    report["published"] = {name: {"pool": pool, "driver": attributes.get("driver"),
                                  "pciBusID": attributes.get(PCI_BUS_ID)} for name, (pool, attributes) in published.items()}
    scenario.pools = {name: pool for name, (pool, _) in published.items()}
    scenario.kubelet.wait_for_dra(DRIVER, timeout=STEP_TIMEOUT)
    save()
    if report["published_s"] is None:
        raise RuntimeError(f"the pools were not published: {sorted(published)}")
    say(f"published in {report['published_s']} s: {sorted(published)}")

    report["vf"] = one_vf(scenario, vfs[0])
    save()
    report["rounds"] = rounds(scenario)
    prepares = [r["prepare_s"] for r in report["rounds"] if r.get("driver_prepared") == VFIO_DRIVER]
    report["prepare_p50_s"] = round(statistics.median(prepares), 3) if prepares else None
    unprepares = [r["unprepare_s"] for r in report["rounds"] if r.get("driver_unprepared") == NVME_DRIVER]
    report["unprepare_p50_s"] = round(statistics.median(unprepares), 3) if unprepares else None
    save()
    report["group"] = group(scenario)
    save()
    report["sigkill"] = sigkill(scenario)
    save()


def one_vf(scenario: VfioScenario, vf: str) -> dict[str, Any]:
    """A claim with VfioConfig on ``vf``: Prepare, what the host and the files show, Unprepare."""
    group_number = iommu_group_of(vf)
    device = device_name(vf)
    record: dict[str, Any] = {"vf": vf, "device": device, "group": group_number,
                              "before": {"driver": driver_of(vf), "block": namespace_block(vf)}}
    ref = scenario.claim("vm-vf", vf)
    record["uid"] = ref[1]
    answer, seconds = scenario.prepare(ref)
    record.update(prepare=answer, prepare_s=round(seconds, 3))
    say(f"vf: prepared in {seconds:.3f} s: {answer}")
    specs = scenario.cdi_specs(ref[1])
    record["prepared"] = {"driver": driver_of(vf), "override": (PCI_DEVICES / vf / "driver_override").read_text().strip(),
                          "block": namespace_block(vf), "vfio_nodes": vfio_nodes(), "group_open": open_group(group_number),
                          "cdi_specs": specs, "metadata": scenario.metadata("vm-vf", specs)}
    record["held_published_s"] = scenario.wait_published(
        lambda seen: device in seen and seen[device][1].get("driver", {}).get("string") == VFIO_DRIVER, STEP_TIMEOUT)
    record["held"] = {"pool": scenario.published().get(device, (None,))[0], "driver": scenario.driver_attribute(device)}
    answer, seconds = scenario.unprepare(ref)
    record.update(unprepare=answer, unprepare_s=round(seconds, 3))
    say(f"vf: unprepared in {seconds:.3f} s: {answer}")
    record["nvme_back_s"] = on_nvme([vf], with_block=True)
    record["unprepared"] = {"driver": driver_of(vf), "override": (PCI_DEVICES / vf / "driver_override").read_text().strip(),
                            "block": namespace_block(vf), "vfio_nodes": vfio_nodes(),
                            "cdi_specs": sorted(scenario.cdi_specs(ref[1])),
                            "metadata_files": scenario.metadata("vm-vf", {})["files"]}
    record["released_published_s"] = scenario.wait_published(
        lambda seen: device in seen and seen[device][1].get("driver", {}).get("string") == NVME_DRIVER, STEP_TIMEOUT)
    record["released"] = {"pool": scenario.published().get(device, (None,))[0],
                          "driver": scenario.driver_attribute(device)}
    return record


def rounds(scenario: VfioScenario) -> list[dict[str, Any]]:
    """Prepare and Unprepare of one VF, ROUNDS times, alternating VFs; each timed."""
    records = []
    for index in range(ROUNDS):
        vf = scenario.vfs[index % len(scenario.vfs)]
        source = "FromClass" if index == FROM_CLASS_ROUND else "FromClaim"
        ref = scenario.claim(f"round-{index}", vf, source)
        record: dict[str, Any] = {"vf": vf, "source": source}
        answer, seconds = scenario.prepare(ref)
        record.update(prepare=answer, prepare_s=round(seconds, 3), driver_prepared=driver_of(vf))
        answer, seconds = scenario.unprepare(ref)
        record.update(unprepare=answer, unprepare_s=round(seconds, 3), driver_unprepared=driver_of(vf))
        record["nvme_back_s"] = on_nvme([vf], with_block=True)
        records.append(record)
        say(f"round {index}: prepare {record['prepare_s']} s, unprepare {record['unprepare_s']} s, "
            f"{record['driver_prepared']} -> {record['driver_unprepared']}")
    return records


def group(scenario: VfioScenario) -> dict[str, Any]:
    """The multifunction slot (one IOMMU group) claimed with VfioConfig, then released."""
    mf = scenario.mf
    group_number = iommu_group_of(mf[0])
    record: dict[str, Any] = {"functions": mf, "group": group_number, "before": drivers(mf)}
    ref = scenario.claim("vm-group", mf[0])
    record["uid"] = ref[1]
    answer, seconds = scenario.prepare(ref)
    record.update(prepare=answer, prepare_s=round(seconds, 3))
    say(f"group: prepared in {seconds:.3f} s: {answer}")
    specs = scenario.cdi_specs(ref[1])
    record["prepared"] = {"drivers": drivers(mf), "group_open": open_group(group_number), "cdi_specs": specs,
                          "metadata": scenario.metadata("vm-group", specs)}
    answer, seconds = scenario.unprepare(ref)
    record.update(unprepare=answer, unprepare_s=round(seconds, 3))
    say(f"group: unprepared in {seconds:.3f} s: {answer}")
    record["nvme_back_s"] = on_nvme(mf, with_block=False)
    record["unprepared"] = {"drivers": drivers(mf), "vfio_nodes": vfio_nodes()}
    return record


def sigkill(scenario: VfioScenario) -> dict[str, Any]:
    """The group claimed, the daemon killed between two functions' binds, started again, the claim
    unprepared: every function back on nvme."""
    mf = scenario.mf
    record: dict[str, Any] = {"functions": mf, "before": drivers(mf)}
    ref = scenario.claim("vm-killed", mf[0])
    record["uid"] = ref[1]
    stop = threading.Event()
    killer = threading.Thread(target=kill_at_first_bind, args=(scenario, mf, record, stop), daemon=True)
    killer.start()
    answer, seconds = scenario.prepare(ref)
    record.update(prepare=answer, prepare_s=round(seconds, 3))
    stop.set()
    killer.join(10)
    process = scenario.process
    assert process is not None
    record["exit"] = scenario.stop_daemon(signal.SIGKILL)
    record["after_kill"] = drivers(mf)
    say(f"sigkill: {record.get('at_kill')} at the kill, prepare said {answer}, exit {record['exit']}")
    record["ready_again_s"] = scenario.start_daemon()
    scenario.kubelet.wait_for_dra(DRIVER, registrations=2, timeout=STEP_TIMEOUT)
    record["after_restart"] = drivers(mf)
    answer, seconds = scenario.unprepare(ref)
    record.update(unprepare=answer, unprepare_s=round(seconds, 3))
    record["nvme_back_s"] = on_nvme(mf, with_block=False)
    record["unprepared"] = {"drivers": drivers(mf), "vfio_nodes": vfio_nodes(),
                            "overrides": {f: (PCI_DEVICES / f / "driver_override").read_text().strip() for f in mf}}
    say(f"sigkill: after the restart {record['after_restart']}, unprepare said {answer}, "
        f"then {record['unprepared']['drivers']}")
    return record


if __name__ == "__main__":
    run(Path(os.environ["GUEST_SHARE"]))

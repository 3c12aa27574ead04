"""The real daemon as a DRA driver: the API server stand-in (real HTTP through the official
client), the kubelet stand-in's DRA side over real unix sockets, the fake sysfs and uevents.

What a user of a DRA pool sees: its devices published as ResourceSlices the moment the kernel
says so, republished when the kubelet wipes them, claims prepared into CDI specs, and a pool
moved between the two APIs without ever being offered twice.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon.dra import device_name
from tests.apiserver import SLICES_PATH, ApiServer
from tests.books import plant_book
from tests.daemonrun import DaemonProcess, control_cli, wait_for_control
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import PF, Seam, create_vfs, remove_vf

DRIVER = "devplugd.io"
NODE = "node1"
TOKEN = "node1-token"
RESOURCE = "intel.com/sriov_vfs"
POOL = f"{NODE}/intel.com/sriov-vfs"
NET_POOL = f"{NODE}/intel.com/sriov-net"


def config(api: str = "dra", *, kvm: bool = True) -> dict[str, Any]:
    pools: list[dict[str, Any]] = [{"resourceName": "sriov_vfs", "allocationApi": api,
                                    "selectors": {"drivers": ["vfio-pci"]}}]
    if kvm:
        pools.append({"resourceName": "kvm", "deviceType": "devNode", "selectors": {"paths": ["/dev/kvm"]}})
    return {"resourceList": pools}


def add_kvm(host: FakeHost) -> None:
    """The PF of the VFs, and a real /dev/kvm node (under the fake dev root) for a devNode pool."""
    host.add_pf(PF, netdev="ens1f0")
    host.dev.mkdir(parents=True, exist_ok=True)
    os.mknod(host.dev / "kvm", 0o600 | stat.S_IFCHR, os.makedev(10, 232))


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(token=TOKEN) as server:
        server.add_node(NODE)
        yield server
    assert server.internal_errors == []


@pytest.fixture
def dra_kubelet(short_tmp: Path) -> Iterator[FakeKubelet]:
    stand_in = FakeKubelet(short_tmp / "device-plugins", short_tmp / "plugins_registry")
    stand_in.start()
    yield stand_in
    stand_in.close()


@pytest.fixture
def start_dra(run_daemon: Callable[..., DaemonProcess], seam: Seam, api: ApiServer, host: FakeHost,
              short_tmp: Path) -> Callable[..., DaemonProcess]:
    add_kvm(host)

    def start(pools: dict[str, Any] | None = None, *extra: str) -> DaemonProcess:
        kubeconfig = api.kubeconfig(short_tmp / "kubeconfig")
        return dra_daemon(run_daemon, seam, short_tmp, pools or config(), "--kubeconfig", str(kubeconfig), *extra)
    return start


def dra_daemon(run_daemon: Callable[..., DaemonProcess], seam: Seam, short_tmp: Path, pools: dict[str, Any],
               *extra: str) -> DaemonProcess:
    """The daemon with uevents from ``seam``, this node's name and a DRA plugin directory."""
    daemon = run_daemon(pools, "--uevent-source", f"unix:{seam.path}", "--node-name", NODE,
                        "--dra-plugin-dir", str(short_tmp / "plugins"), *extra, registration="kubelet")
    seam.wait_ready()
    return daemon


def published(api: ApiServer, pool: str = POOL) -> dict[str, dict[str, Any]]:
    """Device name -> attributes of the pool's newest generation on the API server, checking that
    every slice of it says the same generation and slice count."""
    slices = [s for s in api.slices(driver=DRIVER, node=NODE) if s["spec"]["pool"]["name"] == pool]
    if not slices:
        return {}
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    assert len(generations) == 1, f"slices of {pool} with generations {generations}"
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    return {d["name"]: d.get("attributes", {}) for s in slices for d in s["spec"]["devices"]}


def wait_published(api: ApiServer, names: set[str], pool: str = POOL, timeout: float = 10) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        devices = published(api, pool)
        return devices if set(devices) == names and api.slices(driver=DRIVER) else None
    result: dict[str, Any] = api.wait_until(ready, timeout, f"pool {pool} with {sorted(names)}")
    return result


def names(*addresses: str) -> set[str]:
    return {device_name(address) for address in addresses}


def claim(api: ApiServer, name: str, *addresses: str, pool: str = POOL, **options: Any) -> tuple[str, str, str]:
    results = [{"request": "vf", "driver": DRIVER, "pool": pool, "device": device_name(a)} for a in addresses]
    uid = api.put_claim("default", name, results=results, **options)
    return ("default", uid, name)


def test_a_dra_pool_is_published_with_its_attributes_and_a_hotplugged_vf_joins_it(
    api: ApiServer, host: FakeHost, seam: Seam, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    start_dra()
    devices = wait_published(api, names(*vfs))
    first = devices[device_name(vfs[0])]
    assert first["id"] == {"string": vfs[0]}
    assert first["resourceName"] == {"string": RESOURCE}
    assert first["resource.kubernetes.io/pciBusID"] == {"string": vfs[0]}
    assert first["vendor"] == {"string": "8086"} and first["driver"] == {"string": "vfio-pci"}
    assert first["vfIndex"] == {"int": 0} and first["pfPciAddress"] == {"string": PF}
    (owner,) = api.slices(driver=DRIVER)[0]["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Node", NODE, True)
    # the DRA pool is not offered to the kubelet's device manager; the devNode pool is
    dra_kubelet.wait_for_devices("intel.com/kvm", 1)
    assert RESOURCE not in dra_kubelet.resources
    added = create_vfs(host, seam, 2, 1)
    wait_published(api, names(*vfs, *added))
    remove_vf(host, seam, 0)
    wait_published(api, names(vfs[1], *added))


def test_unchanged_pools_are_not_written_again(
    api: ApiServer, host: FakeHost, seam: Seam, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    pools = config()  # and a second DRA pool after the first, for VFs bound to iavf (none yet)
    pools["resourceList"].insert(1, {"resourceName": "sriov_net", "allocationApi": "dra",
                                     "selectors": {"drivers": ["iavf"]}})
    start_dra(pools)
    wait_published(api, names(*vfs))

    def writes() -> list[str]:
        return [f"{r.method} {r.path}" for r in api.requests if r.method in ("POST", "PUT", "DELETE")]

    # a slice is visible before its POST is logged (the stand-in logs a request as it answers)
    api.wait_until(lambda: len(writes()) == 2, what="both POSTs logged")
    before = writes()
    seam.send("change", host.devpath(vfs[0]), "pci", PCI_SLOT_NAME=vfs[0])  # nothing a slice shows changes
    # then a change of the second pool: the publisher writes the pools of a tree one after the
    # other in config order, so once it shows, a write the first change caused has been made
    net = create_vfs(host, seam, 2, 1, driver="iavf")
    wait_published(api, names(*net), pool=NET_POOL)
    (net_slice,) = [s["metadata"]["name"] for s in api.slices(driver=DRIVER) if s["spec"]["pool"]["name"] == NET_POOL]
    assert writes()[len(before):] == [f"PUT {SLICES_PATH}/{net_slice}"]
    added = create_vfs(host, seam, 3, 1)  # and a change that shows: one PUT of the pool's one slice
    wait_published(api, names(*vfs, *added))
    (vf_slice,) = [s["metadata"]["name"] for s in api.slices(driver=DRIVER) if s["spec"]["pool"]["name"] == POOL]
    assert writes()[len(before) + 1:] == [f"PUT {SLICES_PATH}/{vf_slice}"]


def test_slices_wiped_by_the_kubelet_are_published_again(
    api: ApiServer, host: FakeHost, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    start_dra()
    wait_published(api, names(*vfs))
    assert api.wipe(NODE) == 1
    wait_published(api, names(*vfs))


def test_an_api_server_down_at_start_is_retried_and_device_plugin_pools_are_served_meanwhile(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    api.down()
    daemon = start_dra()
    dra_kubelet.wait_for_devices("intel.com/kvm", 1)
    wait_for_control(short_tmp / "control.sock")
    daemon.wait_for_log("unreachable")
    daemon.wait_until(lambda: sum(" DEBUG " in line and "unreachable" in line and "retrying in" in line
                                  for line in daemon.log.splitlines()) >= 3, "three retries")  # 0.2, 0.4, 0.8 s
    errors = [line for line in daemon.log.splitlines() if " ERROR " in line and "unreachable" in line]
    assert len(errors) == 1, daemon.log  # one clear line, not one per retry (those are debug lines)
    api.up()
    wait_published(api, names(*vfs), timeout=15)  # the backoff is capped at 10 s


def test_a_missing_kubeconfig_is_one_error_line_and_the_rest_is_served(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, run_daemon: Callable[..., DaemonProcess],
    seam: Seam, short_tmp: Path
) -> None:
    add_kvm(host)
    create_vfs(host, None, 0, 1)
    daemon = dra_daemon(run_daemon, seam, short_tmp, config(), "--kubeconfig", str(short_tmp / "nowhere.conf"))
    dra_kubelet.wait_for_devices("intel.com/kvm", 1)
    daemon.wait_for_log("no API server credentials from kubeconfig")
    assert str(short_tmp / "nowhere.conf") in daemon.log


def test_a_claim_is_prepared_into_a_cdi_spec_and_unprepared(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    start_dra()
    wait_published(api, names(*vfs))
    dra_kubelet.wait_for_dra(DRIVER)
    ref = claim(api, "vf-claim", vfs[1])
    answer = dra_kubelet.prepare([ref])[ref[1]]
    (device,) = answer.devices
    assert (device.pool_name, device.device_name) == (POOL, device_name(vfs[1]))
    assert list(device.cdi_device_ids) == [f"{DRIVER}/claim={ref[1]}-{device_name(vfs[1])}",
                                           f"{DRIVER}/metadata={ref[1]}_vf"]  # its request's device metadata
    spec = json.loads((short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert f"PCIDEVICE_INTEL_COM_SRIOV_VFS={vfs[1]}" in edits["env"]
    assert {n["path"] for n in edits["deviceNodes"]} == {"/dev/vfio/vfio", "/dev/vfio/201"}
    assert dra_kubelet.prepare([ref])[ref[1]].devices[0].device_name == device_name(vfs[1])  # idempotent
    listing = json.loads(control_cli(short_tmp / "control.sock", "list", "-o", "json").stdout)
    (pool,) = [p for p in listing if p["resource"] == RESOURCE]
    held = {d["id"]: (d["holder"], d.get("owner")) for d in pool["devices"]}
    assert pool["allocation_api"] == "dra" and held[vfs[1]] == ("claim", "default/vf-claim")
    refused = control_cli(short_tmp / "control.sock", "allocate", RESOURCE, "--device", vfs[1])
    assert refused.returncode != 0 and "DRA claim default/vf-claim" in refused.stderr
    dra_kubelet.unprepare([ref])
    assert not (short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").exists()


def test_prepared_claims_survive_a_restart(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    ref = claim(api, "kept", vfs[0])
    dra_kubelet.prepare([ref])
    wait_published(api, names(*vfs))
    assert daemon.stop() == 0
    assert set(published(api)) == names(*vfs)  # slices stay at SIGTERM
    start_dra()
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    other = claim(api, "other", vfs[0])
    refused = dra_kubelet.prepare([other], fail_on_claim_error=False)[other[1]]
    assert "prepared for claim default/kept" in refused.error
    dra_kubelet.unprepare([ref])
    assert dra_kubelet.prepare([other])[other[1]].devices


def test_a_kubelet_restart_gets_both_dra_sockets_served_again(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    create_vfs(host, None, 0, 1)
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    removed = dra_kubelet.restart_dra()
    assert len(removed) == 2
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    assert daemon.process.poll() is None


def test_moving_a_pool_to_dra_and_back_never_offers_a_device_twice(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vfs = create_vfs(host, None, 0, 3)
    daemon = start_dra(config("devicePlugin"))
    dra_kubelet.wait_for_devices(RESOURCE, 3)
    dra_kubelet.write_checkpoint({RESOURCE: [vfs[0]]})  # a pod holds a VF through the device plugin
    config_path = short_tmp / "config-0.json"
    config_path.write_text(json.dumps(config("dra")))
    daemon.process.send_signal(signal.SIGHUP)
    # the kubelet's registration ends, and the slice leaves out what the pod still holds
    dra_kubelet.wait_for(lambda k: not k.state(RESOURCE).connected, 5, f"{RESOURCE} disconnected")
    wait_published(api, names(vfs[1], vfs[2]))
    dra_kubelet.write_checkpoint({})  # the pod is gone
    wait_published(api, names(*vfs))
    dra_kubelet.wait_for_dra(DRIVER)
    ref = claim(api, "during-dra", vfs[2])
    dra_kubelet.prepare([ref])
    # the way back: slices deleted first, then the kubelet gets the pool, less the prepared VF
    config_path.write_text(json.dumps(config("devicePlugin")))
    daemon.process.send_signal(signal.SIGHUP)
    state = dra_kubelet.wait_for_devices(RESOURCE, 2)
    assert published(api) == {}
    assert set(state.devices) == {vfs[0], vfs[1]}
    dra_kubelet.unprepare([ref])
    dra_kubelet.wait_for_devices(RESOURCE, 3)


def test_bad_driver_and_node_names_exit_2_with_the_reason(
    run_daemon: Callable[..., DaemonProcess], host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad_driver = run_daemon(config(), "--dra-driver", "Not_A_DNS_Name")
    assert bad_driver.process.wait(20) == 2
    assert "--dra-driver 'Not_A_DNS_Name'" in bad_driver.log
    bad_flag = run_daemon(config(), "--node-name", "node_1")
    assert bad_flag.process.wait(20) == 2
    assert "node name 'node_1'" in bad_flag.log
    monkeypatch.setenv("NODE_NAME", "Bad_Node")  # from the environment: checked because a pool uses DRA
    bad_node = run_daemon(config())
    assert bad_node.process.wait(20) == 2
    assert "node name 'Bad_Node'" in bad_node.log and "DRA pools" in bad_node.log
    without_dra = run_daemon(config("devicePlugin"))
    without_dra.wait_for_log("pools")
    assert without_dra.process.poll() is None


def test_health_reaches_the_kubelet_and_a_prepared_vf_that_vanishes_stays_unhealthy_until_unprepared(
    api: ApiServer, host: FakeHost, seam: Seam, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 2)
    start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    dra_kubelet.watch_health()
    keys = {(POOL, name) for name in names(*vfs)}
    dra_kubelet.wait_for_health(lambda health: set(health) == keys and all(
        state == "Healthy" for state, _ in health.values()), what="both VFs Healthy")
    ref = claim(api, "in-use", vfs[0])
    dra_kubelet.prepare([ref])
    remove_vf(host, seam, 0)  # the VF goes while its pod runs
    health = dra_kubelet.wait_for_health(lambda h: h.get((POOL, device_name(vfs[0])), ("",))[0] == "Unhealthy",
                                         what="the vanished VF Unhealthy")
    assert health[(POOL, device_name(vfs[1]))][0] == "Healthy"
    wait_published(api, names(vfs[1]))  # and nobody can be given it
    dra_kubelet.unprepare([ref])
    # the next full list no longer has it (the kubelet lets an unreported device time out)
    dra_kubelet.wait_for(lambda k: set(k.dra_state(DRIVER).health_messages[-1]) == {(POOL, device_name(vfs[1]))},
                         what="a health list without the gone VF")


def published_with_a_claim(api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet,
                           start_dra: Callable[..., DaemonProcess], name: str,
                           index: int) -> tuple[DaemonProcess, list[str], tuple[str, str, str]]:
    """Two VFs published, and VF ``index`` prepared for claim ``name``."""
    vfs = create_vfs(host, None, 0, 2)
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    wait_published(api, names(*vfs))
    ref = claim(api, name, vfs[index])
    dra_kubelet.prepare([ref])
    return daemon, vfs, ref


def test_a_kubelet_allocate_naming_a_device_a_claim_holds_is_refused_by_the_claims_name(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    """A pool moved back to the device-plugin API while a claim holds one of its VFs: the list
    leaves it out, and an Allocate naming it anyway (a stale list, a kubelet restart) is refused
    with the claim's name, never granted."""
    daemon, vfs, _ = published_with_a_claim(api, host, dra_kubelet, start_dra, "holds-it", 1)
    config_path = short_tmp / "config-0.json"
    config_path.write_text(json.dumps(config("devicePlugin")))
    daemon.process.send_signal(signal.SIGHUP)
    assert set(dra_kubelet.wait_for_devices(RESOURCE, 1).devices) == {vfs[0]}
    with pytest.raises(grpc.RpcError) as refused:
        dra_kubelet.allocate(RESOURCE, [vfs[1]])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{vfs[1]}' is held by the DRA claim default/holds-it" in refused.value.details()
    assert dra_kubelet.allocate(RESOURCE, [vfs[0]]).container_responses[0].envs


def test_a_lost_claim_book_holds_the_dra_devices_until_its_claims_are_unprepared_or_it_is_cleared(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    """The claim checkpoint is unreadable and the claims' CDI specs say two were prepared: the
    kubelet prepares the one it knows again (its devices are known then), but which devices the
    other holds is unknown, so the DRA pool publishes none and no lease gets one, until the
    operator says they are free."""
    daemon, vfs, ref = published_with_a_claim(api, host, dra_kubelet, start_dra, "before", 0)
    assert daemon.stop() == 0
    plant_book(short_tmp / "state" / "dra-claims.json", b"\xff{ torn")
    spec = short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json"
    (short_tmp / "cdi" / "devplugd-claim-0c1a1m00-0000-4000-8000-00000000dead.json").write_bytes(spec.read_bytes())
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    # no device offered anew: the pool is there, empty
    api.wait_until(lambda: api.slices(driver=DRIVER) and published(api) == {}, 10, "the pool published empty")
    socket = short_tmp / "control.sock"
    wait_for_control(socket)
    listed = control_cli(socket, "list", "-o", "json")
    (pool,) = [p for p in json.loads(listed.stdout) if p["resource"] == RESOURCE]
    assert {d["holder"] for d in pool["devices"]} == {"lost-claim-book"}
    assert "LOST BOOK: the claim book" in listed.stderr
    refused = control_cli(socket, "allocate", RESOURCE, "--device", vfs[1])
    assert refused.returncode == 1 and "is held by the lost claim book" in refused.stderr
    other = claim(api, "after", vfs[1])
    assert "not prepared" in dra_kubelet.prepare([other], fail_on_claim_error=False)[other[1]].error
    assert "Traceback" not in daemon.log
    assert control_cli(socket, "clear-lost", "claims").returncode == 0
    wait_published(api, names(*vfs))
    assert dra_kubelet.prepare([other])[other[1]].devices

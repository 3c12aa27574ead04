"""The real daemon's claims as the API server sees them: each prepared claim's ``status.devices``
(KEP-4817), and as a container sees them: its device metadata (KEP-5304). The API server
stand-in over real HTTP, the kubelet stand-in's DRA side over real unix sockets, the fake sysfs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.dra import device_name
from tests import test_dra_daemon as daemon_tests
from tests.apiserver import ApiServer
from tests.books import book_document
from tests.daemonrun import DaemonProcess
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import Seam, create_vfs
from tests.test_dra_daemon import DRIVER, NODE, POOL, TOKEN, add_kvm, claim, config, dra_daemon, names, wait_published
from tests.test_dra_metadata import CONTAINER_DIR, POD_CLAIM_NAME, container_with, json_stream, kubevirt_pci_address
from tests.waiting import wait_until

# the DRA daemon tests' fixtures: the API server, the kubelet stand-in, the daemon against both
api, dra_kubelet, start_dra = daemon_tests.api, daemon_tests.dra_kubelet, daemon_tests.start_dra

NET_POOL = f"{NODE}/intel.com/sriov-net"
MAC = "3c:fd:fe:a0:0b:07"


def with_net_pool() -> dict[str, Any]:
    """The VFs on vfio-pci (sriov_vfs), and those on iavf, with their netdevs (sriov_net)."""
    document = config()
    document["resourceList"].append({"resourceName": "sriov_net", "allocationApi": "dra",
                                     "selectors": {"drivers": ["iavf"]}})
    return document


def status_devices(api: ApiServer, name: str) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = api.claim("default", name)["status"].get("devices", [])
    return devices


def test_a_prepared_claim_lists_its_devices_in_its_status_until_unprepared(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfio = create_vfs(host, None, 0, 1)
    (net,) = create_vfs(host, None, 1, 1, driver="iavf")
    host.add_netdev(net, "ens1f0v1")
    (host.sys / "class" / "net" / "ens1f0v1" / "address").write_text(f"{MAC}\n")
    start_dra(with_net_pool())
    wait_published(api, names(net), pool=NET_POOL)
    dra_kubelet.wait_for_dra(DRIVER)
    other = {"request": "gpu", "driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0"}
    results = [other, {"request": "nic/fast", "driver": DRIVER, "pool": NET_POOL, "device": device_name(net)},
               {"request": "dpdk", "driver": DRIVER, "pool": POOL, "device": device_name(vfio[0])}]
    ref = ("default", api.put_claim("default", "vfs", results=results), "vfs")
    theirs = {"driver": "gpu.example.com", "pool": "gpus", "device": "gpu-0", "data": {"uuid": "GPU-1"}}
    api.write_claim_status("default", "vfs", [theirs])
    assert dra_kubelet.prepare([ref])[ref[1]].devices
    ours = [{"driver": DRIVER, "pool": NET_POOL, "device": device_name(net),
             "networkData": {"interfaceName": "ens1f0v1", "hardwareAddress": MAC}},
            {"driver": DRIVER, "pool": POOL, "device": device_name(vfio[0])}]
    api.wait_until(lambda: status_devices(api, "vfs") == [theirs, *ours], 10, "our entries beside theirs")
    dra_kubelet.unprepare([ref])
    api.wait_until(lambda: status_devices(api, "vfs") == [theirs], 10, "only theirs left")


def test_status_writes_failing_never_fail_prepare_and_are_retried(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess]
) -> None:
    vfs = create_vfs(host, None, 0, 1)
    daemon = start_dra()
    wait_published(api, names(*vfs))
    dra_kubelet.wait_for_dra(DRIVER)
    api.fail_next("PUT", "/resourceclaims/vf/status$", 403, count=2,
                  message='resourceclaims.resource.k8s.io "vf" is forbidden: User "node1" cannot update resource '
                          '"resourceclaims/driver" with verb "associated-node:update"')
    ref = claim(api, "vf", vfs[0])
    answer = dra_kubelet.prepare([ref])[ref[1]]
    assert answer.error == "" and answer.devices
    api.wait_until(lambda: status_devices(api, "vf") == [{"driver": DRIVER, "pool": POOL,
                                                          "device": device_name(vfs[0])}], 10, "the status written")
    warnings = [line for line in daemon.log.splitlines() if " WARNING " in line and "status.devices" in line]
    assert len(warnings) == 1  # one line for the two failures (the second at debug level)
    assert "associated-node:update" in daemon.log


# -- claims the kubelet will never unprepare ---------------------------------------------------


def test_a_claim_deleted_while_the_daemon_was_down_is_unprepared_at_start_and_its_vf_is_free(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vfs = create_vfs(host, None, 0, 1)
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    ref = claim(api, "orphan", vfs[0])
    dra_kubelet.prepare([ref])
    assert daemon.stop() == 0
    api.delete_claim("default", "orphan")  # its pod went while the daemon was down; the kubelet forgot it
    daemon = start_dra()
    daemon.wait_for_log(f"unprepared claim default/orphan (UID {ref[1]}), which the kubelet will never unprepare: "
                        "its ResourceClaim is gone from the API server")
    assert not (short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").exists()
    assert book_document(short_tmp / "state" / "dra-claims.json")["claims"] == []
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    after = claim(api, "after", vfs[0])
    assert dra_kubelet.prepare([after])[after[1]].devices  # the VF is free again


def test_no_claim_is_unprepared_at_start_while_the_api_server_cannot_be_reached(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    vfs = create_vfs(host, None, 0, 1)
    daemon = start_dra()
    dra_kubelet.wait_for_dra(DRIVER)
    ref = claim(api, "kept", vfs[0])
    dra_kubelet.prepare([ref])
    assert daemon.stop() == 0
    api.delete_claim("default", "kept")
    api.down()
    daemon = start_dra()
    daemon.wait_for_log(f"claim default/kept (UID {ref[1]}): cannot tell whether it is still on the API server")
    assert (short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").exists()
    assert "will never unprepare" not in daemon.log
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    dra_kubelet.unprepare([ref])  # the kubelet's word still counts
    assert not (short_tmp / "cdi" / f"devplugd-claim-{ref[1]}.json").exists()


# -- shared devices (KEP-5075) -----------------------------------------------------------------


def test_a_devnode_pool_with_count_is_one_shared_device_two_claims_hold_at_once(
    run_daemon: Callable[..., DaemonProcess], seam: Seam, host: FakeHost, dra_kubelet: FakeKubelet,
    short_tmp: Path
) -> None:
    """A 1.36 API server (consumable capacity on): /dev/kvm offered 4 times is one device with 4
    shares; two claims allocated a share each are both prepared, each answered with its share ID,
    and each claim's status names the device and its share."""
    add_kvm(host)
    document = config(kvm=False)
    document["resourceList"].append({"resourceName": "kvm", "deviceType": "devNode", "allocationApi": "dra",
                                     "count": 4, "selectors": {"paths": ["/dev/kvm"]}})
    kvm_pool = f"{NODE}/intel.com/kvm"
    with ApiServer(token=TOKEN, feature_gates={"DRADeviceTaints", "DRAConsumableCapacity"}) as api:
        api.add_node(NODE)
        dra_daemon(run_daemon, seam, short_tmp, document, "--kubeconfig", str(api.kubeconfig(short_tmp / "kc")))
        (device,) = wait_published(api, {"kvm"}, pool=kvm_pool).values()
        (stored,) = [d for s in api.slices(driver=DRIVER) for d in s["spec"]["devices"] if d["name"] == "kvm"]
        assert stored["allowMultipleAllocations"] is True and stored["capacity"]["shares"]["value"] == "4"
        dra_kubelet.wait_for_dra(DRIVER)
        # the kubelet finds the device's health under the name the claims' results give it
        wait_until(lambda: dra_kubelet.dra_state(DRIVER).current_health().get((kvm_pool, "kvm")) == ("Healthy", ""),
                   10, "the shared device's health under its published name")
        assert not any(device.startswith("kvm-") for pool, device in dra_kubelet.dra_state(DRIVER).current_health()
                       if pool == kvm_pool)
        refs = []
        for name, share_id in (("vm-a", "a1b2"), ("vm-b", "c3d4")):
            result = {"request": "kvm", "driver": DRIVER, "pool": kvm_pool, "device": "kvm", "shareID": share_id}
            refs.append(("default", api.put_claim("default", name, results=[result]), name))
        answers = dra_kubelet.prepare(refs)
        assert [[(d.device_name, d.share_id) for d in answers[ref[1]].devices] for ref in refs] == [
            [("kvm", "a1b2")], [("kvm", "c3d4")]]
        for ref, share_id in zip(refs, ("a1b2", "c3d4")):
            api.wait_until(lambda: status_devices(api, ref[2]) == [
                {"driver": DRIVER, "pool": kvm_pool, "device": "kvm", "shareID": share_id}], 10, "the share's status")
        dra_kubelet.unprepare(refs[:1])
        api.wait_until(lambda: status_devices(api, "vm-a") == [], 10, "the first share's status gone")
        assert [r for r in api.requests if r.status == 422] == []
        assert api.internal_errors == []
        assert device["id"] == {"string": "kvm"}


# -- device metadata (KEP-5304) ----------------------------------------------------------------


def test_a_kubevirt_reader_in_the_container_finds_the_vfs_pci_address_in_its_device_metadata(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    """A claim KubeVirt's virt-launcher pod got from a template: the answer's CDI devices mount
    the request's metadata file where the pod's name for the claim says, and a reader that
    follows KubeVirt's rule finds the VF's PCI address there, with the attributes its slice has."""
    vfs = create_vfs(host, None, 0, 1)
    start_dra()
    slice_attributes = wait_published(api, names(*vfs))[device_name(vfs[0])]
    dra_kubelet.wait_for_dra(DRIVER)
    name = "virt-launcher-vm1-hostdev-8xk2q"
    results = [{"request": "hostdev", "driver": DRIVER, "pool": POOL, "device": device_name(vfs[0])}]
    uid = api.put_claim("default", name, results=results, annotations={POD_CLAIM_NAME: "vf"})
    (device,) = dra_kubelet.prepare([("default", uid, name)])[uid].devices
    metadata_ids = [i for i in device.cdi_device_ids if i.startswith(f"{DRIVER}/metadata=")]
    assert metadata_ids == [f"{DRIVER}/metadata={uid}_hostdev"]
    container = container_with(short_tmp / "container", short_tmp / "cdi", metadata_ids)
    request_dir = f"{CONTAINER_DIR}/resourceclaimtemplates/vf/hostdev"
    assert kubevirt_pci_address(container, request_dir) == vfs[0]
    (document,) = json_stream((container / request_dir.lstrip("/") / f"{DRIVER}-metadata.json").read_text())
    assert document["metadata"] == {"name": name, "namespace": "default", "uid": uid, "generation": 1}
    assert document["requests"][0]["devices"][0]["attributes"] == slice_attributes
    host_file = short_tmp / "plugins" / DRIVER / "dra-device-metadata" / f"default_{name}" / "hostdev" / "metadata.json"
    assert host_file.exists()
    dra_kubelet.unprepare([("default", uid, name)])
    assert not host_file.exists() and not (short_tmp / "cdi" / f"{DRIVER}_metadata_{uid}_hostdev.json").exists()


def test_device_metadata_has_the_vfs_network_data_and_is_written_again_after_a_reboot(
    api: ApiServer, host: FakeHost, dra_kubelet: FakeKubelet, start_dra: Callable[..., DaemonProcess],
    short_tmp: Path
) -> None:
    (net,) = create_vfs(host, None, 1, 1, driver="iavf")
    host.add_netdev(net, "ens1f0v1")
    (host.sys / "class" / "net" / "ens1f0v1" / "address").write_text(f"{MAC}\n")
    daemon = start_dra(with_net_pool())
    wait_published(api, names(net), pool=NET_POOL)
    dra_kubelet.wait_for_dra(DRIVER)
    results = [{"request": "nic", "driver": DRIVER, "pool": NET_POOL, "device": device_name(net)}]
    ref = ("default", api.put_claim("default", "vf", results=results), "vf")
    dra_kubelet.prepare([ref])
    host_file = short_tmp / "plugins" / DRIVER / "dra-device-metadata" / "default_vf" / "nic" / "metadata.json"
    (document,) = json_stream(host_file.read_text())
    assert document["requests"][0]["devices"][0]["networkData"] == {"interfaceName": "ens1f0v1",
                                                                   "hardwareAddress": MAC}
    spec = short_tmp / "cdi" / f"{DRIVER}_metadata_{ref[1]}_nic.json"
    written = spec.read_bytes()
    assert daemon.stop() == 0
    spec.unlink()  # /var/run is a tmpfs
    start_dra(with_net_pool())
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    assert spec.read_bytes() == written  # at restore, before dra.sock was served
    dra_kubelet.unprepare([ref])
    assert not spec.exists() and not host_file.exists()

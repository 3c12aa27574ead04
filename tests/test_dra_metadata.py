"""Device metadata for containers (KEP-5304): each prepared claim's metadata file per request,
the CDI spec that mounts it, and how a reader inside the container (KubeVirt) finds its device.
The preparer of ``test_dra_prepare`` on its fake host (real PCI and devNode pools, real files),
with the daemon's metadata writer; the daemon over gRPC is in ``test_dra_claims_daemon``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from daemon.dra import device_name, pool_name, slice_devices
from daemon.dra._metadata import DeviceMetadataFiles
from daemon.dra._prepared import PreparedClaim
from daemon.dra._status import ClaimStatusWriter
from tests.books import plant_book
from tests.fakesysfs import FakeHost
from tests.pci import Pci
from tests.test_dra_prepare import (
    DPDK,
    DRIVER,
    KVM,
    NET,
    NET_VFS,
    NODE,
    VFIO_VFS,
    Node,
    claim_json,
    claim_labels,
    result,
    share,
    uid,
)

V1ALPHA1 = "metadata.resource.k8s.io/v1alpha1"
KUBEVIRT_VERSIONS = (V1ALPHA1,)  # the versions the reader knows
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
MAC = "3c:fd:fe:a0:0b:07"


# -- what a container and its reader see -------------------------------------------------------


def json_stream(text: str) -> list[Any]:
    """The documents of a concatenated JSON stream, as Go's json.Decoder reads them one by one."""
    decoder, documents, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
    return documents


def cdi_devices(cdi_dir: Path) -> dict[str, dict[str, Any]]:
    """Every CDI device of every spec in ``cdi_dir`` by its ID (``<kind>=<name>``), as a runtime
    resolves the IDs the kubelet passes it."""
    devices = {}
    for path in cdi_dir.glob("*.json"):
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            devices[f"{spec['kind']}={device['name']}"] = device
    return devices


def container_with(root: Path, cdi_dir: Path, cdi_ids: Sequence[str]) -> Path:
    """A container's file system (under ``root``) with the mounts of ``cdi_ids`` made, each
    file copied where its bind mount would show it; the mounts must be read-only binds."""
    devices = cdi_devices(cdi_dir)
    for cdi_id in cdi_ids:
        for mount in devices[cdi_id]["containerEdits"].get("mounts", []):
            assert mount["options"] == ["ro", "bind"]
            target = root / mount["containerPath"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(mount["hostPath"], target)
    return root


def kubevirt_pci_address(container: Path, request_dir: str) -> str:
    """What KubeVirt does in the container: glob ``*-metadata.json`` in the request's
    directory, want exactly one file, take the first document of a version it supports, want
    exactly one device, read its ``resource.kubernetes.io/pciBusID``."""
    (path,) = (container / request_dir.lstrip("/")).glob("*-metadata.json")
    document = next(d for d in json_stream(path.read_text()) if d.get("apiVersion") in KUBEVIRT_VERSIONS)
    (request,) = document["requests"]
    (device,) = request["devices"]
    address: str = device["attributes"][PCI_BUS_ID]["string"]
    return address


# -- the node: test_dra_prepare's, with the daemon's metadata writer ---------------------------------


async def no_api() -> Any:
    raise AssertionError("the claim status is not written here")


class MetadataNode(Node):
    """``Node`` whose preparer writes device metadata in ``plugin_dir`` (as the daemon wires it:
    hardware addresses read as the claim status reads them)."""

    def __init__(self, root: Path, host: FakeHost, pci: Pci) -> None:
        self.host = host
        self.plugin_dir = root / "plugins" / DRIVER
        super().__init__(root, host, pci)

    def restart(self, **options: Any) -> None:
        status = ClaimStatusWriter(DRIVER, no_api, self.tree, self.hooks, self.host.sys)
        self.metadata = DeviceMetadataFiles(DRIVER, self.plugin_dir, self.cdi_dir, self.hooks,
                                            hardware_addresses=status.read_addresses)
        super().restart(metadata=self.metadata, **options)

    def metadata_path(self, name: str, request: str, namespace: str = "default") -> Path:
        return self.plugin_dir / "dra-device-metadata" / f"{namespace}_{name}" / request / "metadata.json"

    def metadata_documents(self, name: str, request: str) -> list[Any]:
        return json_stream(self.metadata_path(name, request).read_text())

    def metadata_spec_path(self, claim_uid: str, request: str) -> Path:
        return self.cdi_dir / f"{DRIVER}_metadata_{claim_uid}_{request}.json"

    def published_attributes(self, resource: str, name: str) -> dict[str, Any]:
        """The attributes of device ``name`` in the pool's slices, as the publisher makes them."""
        pool = self.pools[resource]
        hooks = self.hooks[pool.handler]
        shares = hooks.sharer.shares(pool) if hooks.sharer is not None else {}
        (entry,) = [e for e in slice_devices(pool, DRIVER, hooks.describer, shares=shares) if e["name"] == name]
        attributes: dict[str, Any] = entry["attributes"]
        return attributes


@pytest.fixture
def node(short_tmp: Path, host: FakeHost, pci: Pci) -> MetadataNode:
    return MetadataNode(short_tmp, host, pci)


# -- the file ------------------------------------------------------------------------------------


async def test_each_request_gets_a_metadata_file_with_its_devices_as_the_slices_publish_them(
        node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk"), result(NET, NET_VFS[1], "net")]))
    assert (await node.prepare_one(ref)).error is None
    documents = node.metadata_documents("vfs", "dpdk")
    assert documents == [{
        "kind": "DeviceMetadata",
        "apiVersion": V1ALPHA1,
        "metadata": {"name": "vfs", "namespace": "default", "uid": uid(1), "generation": 1},
        "requests": [{"name": "dpdk", "devices": [{
            "driver": DRIVER, "pool": pool_name(NODE, DPDK), "name": device_name(VFIO_VFS[0]),
            "attributes": node.published_attributes(DPDK, device_name(VFIO_VFS[0])),
        }]}],
    }]
    assert documents[0]["requests"][0]["devices"][0]["attributes"][PCI_BUS_ID] == {"string": VFIO_VFS[0]}
    (net,) = node.metadata_documents("vfs", "net")[0]["requests"][0]["devices"]
    assert (net["name"], net["attributes"][PCI_BUS_ID]) == (device_name(NET_VFS[1]), {"string": NET_VFS[1]})
    assert "podClaimName" not in documents[0]


async def test_a_device_with_a_netdev_has_its_network_data(node: MetadataNode) -> None:
    (node.host.sys / "class" / "net" / "ens1f0v0" / "address").write_text(f"{MAC}\n")
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "nic"), result(DPDK, VFIO_VFS[0], "dpdk")]))
    await node.prepare_one(ref)
    (nic,) = node.metadata_documents("vfs", "nic")[0]["requests"][0]["devices"]
    assert nic["networkData"] == {"interfaceName": "ens1f0v0", "hardwareAddress": MAC}
    (vfio,) = node.metadata_documents("vfs", "dpdk")[0]["requests"][0]["devices"]
    assert "networkData" not in vfio  # no interface on the host


async def test_a_shared_device_is_described_as_its_one_published_device(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vm", [share("kvm", "s-1")]))
    await node.prepare_one(ref)
    (device,) = node.metadata_documents("vm", "kvm")[0]["requests"][0]["devices"]
    assert (device["pool"], device["name"]) == (pool_name(NODE, KVM), "kvm")
    assert device["attributes"] == node.published_attributes(KVM, "kvm")
    assert device["attributes"]["id"] == {"string": "kvm"}  # the shared device's, not its share's


async def test_a_subrequest_is_named_in_the_file_and_left_out_of_its_path(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "nic/fast"), result(NET, NET_VFS[1], "nic/fast")]))
    answer = await node.prepare_one(ref)
    (request,) = node.metadata_documents("vfs", "nic")[0]["requests"]
    assert request["name"] == "nic/fast"
    assert [d["name"] for d in request["devices"]] == [device_name(NET_VFS[0]), device_name(NET_VFS[1])]
    assert [d.metadata_cdi_ids for d in answer.devices] == [(f"{DRIVER}/metadata={uid(1)}_nic",), ()]


# -- the CDI spec and the answer -------------------------------------------------------------------


async def test_the_cdi_spec_mounts_the_file_read_only_where_the_helper_puts_it(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk")]))
    await node.prepare_one(ref)
    assert json.loads(node.metadata_spec_path(uid(1), "dpdk").read_text()) == {
        "cdiVersion": "0.5.0",
        "kind": f"{DRIVER}/metadata",
        "devices": [{"name": f"{uid(1)}_dpdk", "containerEdits": {"mounts": [{
            "hostPath": str(node.metadata_path("vfs", "dpdk")),
            "containerPath": f"{CONTAINER_DIR}/resourceclaims/vfs/dpdk/{DRIVER}-metadata.json",
            "options": ["ro", "bind"],
        }]}}],
    }


async def test_the_answer_names_each_requests_metadata_on_its_first_device(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "a"), result(NET, NET_VFS[1], "a"),
                                             result(DPDK, VFIO_VFS[0], "b")]))
    answer = await node.prepare_one(ref)
    assert [d.cdi_ids for d in answer.devices] == [
        (f"{DRIVER}/claim={uid(1)}-{device_name(NET_VFS[0])}", f"{DRIVER}/metadata={uid(1)}_a"),
        (f"{DRIVER}/claim={uid(1)}-{device_name(NET_VFS[1])}",),
        (f"{DRIVER}/claim={uid(1)}-{device_name(VFIO_VFS[0])}", f"{DRIVER}/metadata={uid(1)}_b"),
    ]
    assert set(cdi_devices(node.cdi_dir)) >= {cdi_id for d in answer.devices for cdi_id in d.cdi_ids}


async def test_a_claim_from_a_template_is_found_under_the_pods_name_for_it(node: MetadataNode, tmp_path: Path) -> None:
    claim = claim_json(1, "virt-launcher-vm1-gpu-x7k2p", [result(DPDK, VFIO_VFS[1], "hostdev")])
    claim["metadata"]["annotations"] = {POD_CLAIM_NAME: "gpu", "other": "x"}
    ref = node.api.add(claim)
    answer = await node.prepare_one(ref)
    (document,) = node.metadata_documents("virt-launcher-vm1-gpu-x7k2p", "hostdev")
    assert document["podClaimName"] == "gpu"
    assert list(document) == ["kind", "apiVersion", "metadata", "podClaimName", "requests"]
    container = container_with(tmp_path, node.cdi_dir, answer.devices[0].cdi_ids)
    assert kubevirt_pci_address(container, f"{CONTAINER_DIR}/resourceclaimtemplates/gpu/hostdev") == VFIO_VFS[1]


async def test_a_kubevirt_reader_finds_each_pci_devices_address(node: MetadataNode, tmp_path: Path) -> None:
    ref = node.api.add(claim_json(1, "vm", [result(DPDK, VFIO_VFS[0], "hostdev1"), result(NET, NET_VFS[0], "nic1"),
                                            share("kvm")]))
    answer = await node.prepare_one(ref)
    container = container_with(tmp_path, node.cdi_dir, [i for d in answer.devices for i in d.cdi_ids])
    assert kubevirt_pci_address(container, f"{CONTAINER_DIR}/resourceclaims/vm/hostdev1") == VFIO_VFS[0]
    assert kubevirt_pci_address(container, f"{CONTAINER_DIR}/resourceclaims/vm/nic1") == NET_VFS[0]


# -- unprepare, restart ----------------------------------------------------------------------------


async def test_unprepare_removes_the_files_their_specs_and_the_claims_directories_left_empty(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk"), result(NET, NET_VFS[0], "net")]))
    other = node.api.add(claim_json(2, "other", [result(NET, NET_VFS[1], "net")]))
    await node.prepare(ref, other)
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert not node.metadata_spec_path(uid(1), "dpdk").exists() and not node.metadata_spec_path(uid(1), "net").exists()
    assert not node.metadata_path("vfs", "dpdk").parent.parent.exists()
    assert node.metadata_path("other", "net").exists() and node.metadata_spec_path(uid(2), "net").exists()
    await node.preparer.unprepare([other])
    assert list((node.plugin_dir / "dra-device-metadata").iterdir()) == []  # kept for the next claim
    assert list(node.cdi_dir.iterdir()) == []


async def test_unprepare_leaves_the_file_of_a_newer_claim_of_the_same_name(node: MetadataNode) -> None:
    old = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "net")]))
    await node.prepare_one(old)
    new = node.api.add(claim_json(2, "vfs", [result(NET, NET_VFS[1], "net")]))  # deleted and made again
    await node.prepare_one(new)
    assert await node.preparer.unprepare([old]) == {uid(1): None}
    assert node.metadata_documents("vfs", "net")[0]["metadata"]["uid"] == uid(2)
    assert node.metadata_spec_path(uid(2), "net").exists() and not node.metadata_spec_path(uid(1), "net").exists()


async def test_files_and_specs_gone_at_a_restart_are_written_again_byte_for_byte(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk")]))
    first = await node.prepare_one(ref)
    spec, file = node.metadata_spec_path(uid(1), "dpdk"), node.metadata_path("vfs", "dpdk")
    written = spec.read_bytes(), file.read_bytes()
    spec.unlink()  # a reboot emptied /var/run
    file.write_text("")  # a write the power cut short
    node.restart()
    await node.preparer.restore()
    assert (spec.read_bytes(), file.read_bytes()) == written
    spec.unlink()
    assert await node.prepare_one(ref) == first  # an idempotent prepare writes it again too
    assert spec.read_bytes() == written[0]


async def test_metadata_of_a_claim_the_checkpoint_does_not_have_is_removed_at_start(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk")]))
    await node.prepare_one(ref)
    kept = node.metadata_spec_path(uid(1), "dpdk")
    crashed = node.metadata_spec_path(uid(2), "dpdk")  # a prepare that crashed before its checkpoint
    crashed.write_text(kept.read_text().replace(uid(1), uid(2)).replace("default_vfs", "default_gone"))
    file = node.metadata_path("gone", "dpdk")
    file.parent.mkdir(parents=True)
    file.write_text(node.metadata_path("vfs", "dpdk").read_text().replace(uid(1), uid(2)))
    node.restart()
    await node.preparer.restore()
    assert not crashed.exists() and not file.parent.parent.exists()
    assert kept.exists() and node.metadata_path("vfs", "dpdk").exists()


async def test_a_metadata_file_whose_spec_was_never_written_is_removed_at_start(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(DPDK, VFIO_VFS[0], "dpdk")]))
    await node.prepare_one(ref)
    kept = node.metadata_path("vfs", "dpdk")
    lone = node.metadata_path("gone", "dpdk")  # a crash between the file and its spec, before the checkpoint
    lone.parent.mkdir(parents=True)
    lone.write_text(kept.read_text().replace(uid(1), uid(2)))
    torn = node.metadata_path("cut", "dpdk")  # cut short by the crash: no UID to read
    torn.parent.mkdir(parents=True)
    torn.write_text('{"apiVersion": "metadata.resource.k8s.io/v1')
    node.restart()
    await node.preparer.restore()
    assert not lone.parent.parent.exists() and not torn.parent.parent.exists()
    assert kept.exists() and node.metadata_spec_path(uid(1), "dpdk").exists()
    assert node.metadata_documents("vfs", "dpdk")[0]["metadata"]["uid"] == uid(1)


async def test_a_checkpoint_of_an_earlier_version_loads_and_its_claims_unprepare(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0])]))
    await node.prepare_one(ref)
    document = node.checkpoint()
    assert document["claims"][0]["device_metadata"]["req"][0]["metadata"]["uid"] == uid(1)
    del document["sha256"], document["sequence"]
    for claim in document["claims"]:  # as an earlier version wrote it
        del claim["device_metadata"]
        for device in claim["devices"]:
            del device["metadata_cdi_ids"]
    plant_book(node.state_dir / "dra-claims.json", json.dumps(document))
    node.restart()
    (claim,) = node.book.claims.values()
    assert claim.device_metadata is None and claim.devices[0].cdi_ids == (claim.devices[0].cdi_id,)
    assert await node.preparer.unprepare([ref]) == {uid(1): None}
    assert not node.metadata_path("vfs", "req").exists()


def test_a_prepared_claim_reads_back_from_its_checkpoint_entry_as_it_was() -> None:
    document = {"kind": "DeviceMetadata", "apiVersion": V1ALPHA1, "metadata": {"name": "c", "uid": "u"}}
    claim = PreparedClaim("u", "default", "c", (), pod_claim_name="gpu", device_metadata={"r": [document]})
    assert PreparedClaim.from_json(json.loads(json.dumps(claim.to_json()))) == claim


# -- what fails ------------------------------------------------------------------------------------


async def test_metadata_that_cannot_be_written_fails_the_claim_and_undoes_it(node: MetadataNode) -> None:
    node.plugin_dir.mkdir(parents=True)
    (node.plugin_dir / "dra-device-metadata").write_text("")  # a file where the directory should be
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "net")]))
    answer = await node.prepare_one(ref)
    assert answer.error is not None and answer.error.startswith(
        f"claim default/vfs: cannot write its device metadata {node.metadata_path('vfs', 'net')}: ")
    assert not node.spec_path(uid(1)).exists() and not node.metadata_spec_path(uid(1), "net").exists()
    assert node.devinfo_files() == []
    assert node.book.prepared(uid(1)) is None and claim_labels(node) == {}


async def test_a_metadata_spec_that_cannot_be_written_fails_the_claim_and_removes_its_file(
        node: MetadataNode) -> None:
    node.cdi_dir.mkdir()
    node.metadata_spec_path(uid(1), "net").mkdir()  # a directory where the spec should be
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "net")]))
    answer = await node.prepare_one(ref)
    assert answer.error is not None and answer.error.startswith(
        f"claim default/vfs: cannot write its device metadata CDI spec {node.metadata_spec_path(uid(1), 'net')}: ")
    assert not node.metadata_path("vfs", "net").exists() and not node.spec_path(uid(1)).exists()
    assert node.book.prepared(uid(1)) is None


@pytest.mark.parametrize(("annotations", "error"), [
    ({POD_CLAIM_NAME: "../escape"}, f"its annotation {POD_CLAIM_NAME} is '../escape', not the name of a claim "
                                    "in a pod spec (a DNS label)"),
    ({POD_CLAIM_NAME: 7}, f"its annotation {POD_CLAIM_NAME} is 7, not the name of a claim"),
    (["not", "an", "object"], "malformed claim from the API server: metadata.annotations is not an object"),
])
async def test_a_claim_with_odd_annotations_is_refused_naming_it_and_why(
        node: MetadataNode, annotations: Any, error: str) -> None:
    claim = claim_json(1, "vfs", [result(NET, NET_VFS[0])])
    claim["metadata"]["annotations"] = annotations
    answer = await node.prepare_one(node.api.add(claim))
    assert answer.error is not None and answer.error.startswith(f"claim default/vfs: {error}")
    assert node.book.prepared(uid(1)) is None and not node.spec_path(uid(1)).exists()


async def test_a_request_that_cannot_name_a_file_is_refused(node: MetadataNode) -> None:
    ref = node.api.add(claim_json(1, "vfs", [result(NET, NET_VFS[0], "..")]))
    assert (await node.prepare_one(ref)).error == (
        "claim default/vfs: request '..' is not a request name (a DNS label), so it cannot name its device "
        "metadata file")
    assert not (node.plugin_dir / "dra-device-metadata").exists()

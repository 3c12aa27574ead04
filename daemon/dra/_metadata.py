"""Device metadata for containers (KEP-5304): for each request of a prepared claim, a file that
tells the workload which devices it got, and a CDI spec that bind-mounts it into the container.

Laid out as the Go helper writes them (``k8s.io/dynamic-resource-allocation``,
``kubeletplugin/metadata.go`` and ``api/metadata``, read at commit 3d036712, 2026-07-01), which
is what a reader of the files (KubeVirt) is built against:

* the file ``<plugin data dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``,
  the plugin data dir being ``--dra-plugin-dir``/<driver> (where ``dra.sock`` is) and
  ``<request>`` the main request (a prioritized list's subrequest stripped);
* its CDI spec ``<cdi dir>/<driver>_metadata_<claim UID>_<request>.json``: cdiVersion 0.5.0, kind
  ``<driver>/metadata``, one device ``<claim UID>_<request>`` that mounts the file read-only
  (``ro``, ``bind``) at ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/
  <request>/<driver>-metadata.json``, or under ``resourceclaimtemplates/<pod claim name>/`` for a
  claim made from a template (its annotation ``resource.kubernetes.io/pod-claim-name``: the
  claim's name is generated, the pod spec knows only its own name for it);
* the file holds a stream of concatenated JSON documents, one ``DeviceMetadata`` per supported
  version, newest first (only ``metadata.resource.k8s.io/v1alpha1`` today): the claim's name,
  namespace, UID and ``generation`` 1 (the document's own count of writes, as the helper starts
  it, not the claim's), ``podClaimName``, and the request (named as the allocation names it:
  ``nic/fast``) with its devices: driver, pool, name, the attributes of the device's entry in
  its ResourceSlice (``slice_devices``, the one rule that makes them) and, for a device with a
  network interface on the host, ``networkData`` (its ``netdev`` attribute as
  ``interfaceName``, the claim status's ``hardwareAddress``);
* the request's metadata CDI device ID goes with the first device of the request in the
  kubelet's answer (as the helper does), so a container that takes the request gets the mount.

Written in the worker thread that writes the claim's CDI spec; the documents are kept in the
claim's checkpoint entry, so a file or spec gone or changed (``/var/run`` is a tmpfs) is written
again byte for byte. A new metadata file is written in place (``write_new``: it is on the disk
of the kubelet's plugin directory, where a rename costs), since nothing reads it before the
answer names its spec and a file a crash cut short is written again at the kubelet's next
Prepare; a file written again, and every spec, is replaced atomically. Unprepare removes the
specs, the files (not one another claim of the same name wrote since) and the claim's
directories left empty; ``dra-device-metadata`` itself stays, as the helper leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.cdi import cdi_kind
from daemon.core import ResourcePool
from daemon.core._handler import Hooks
from daemon.core._jsonpath import parse_json
from daemon.files import write_atomically, write_new

from ._claims import AllocationResult, ClaimRef, ClaimRefused
from ._claimspecs import Chosen
from ._devices import pool_shares, slice_devices
from ._metadocs import API_VERSIONS, Document, device_entry, netdev_of, new_document, read_stream, stream
from ._prepared import PreparedClaim

log = logging.getLogger("devplugd.dra")

METADATA_DIR = "dra-device-metadata"  # under the plugin data directory
FILE_NAME = "metadata.json"
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"  # a claim's annotation, set for one made from a template
CDI_VERSION = "0.5.0"  # as the helper writes it
# any effect: an Unhealthy device gets its entry too (its taint is no attribute)
_EVERY_DEVICE = "NoSchedule"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
# a spec's file name after ``<driver>_metadata_``: a request name has no ``_``, a UID may
_SPEC_NAME = re.compile(r"(?P<uid>[A-Za-z0-9][A-Za-z0-9_.:-]*)_(?P<request>[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)\.json")

# (worker thread) each network interface's hardware address, as the claim status reads it
HardwareAddresses = Callable[[Sequence[str]], Mapping[str, str]]


@dataclass(frozen=True)
class ClaimMetadata:
    """What a claim's metadata needs of the claim besides its devices: the pod's name for it
    (``None``: not made from a template) and its main requests -> each as the allocation names
    it (``nic`` -> ``nic/fast``)."""

    pod_claim_name: str | None
    requests: Mapping[str, str]


class MetadataStays(Exception):
    """A claim's metadata file or spec could not be removed; the message says which and why."""


class DeviceMetadataFiles:
    """The metadata files and their CDI specs of one driver (see the module docstring)."""

    def __init__(self, driver: str, plugin_dir: Path, cdi_dir: Path, hooks: Mapping[str, Hooks],
                 hardware_addresses: HardwareAddresses | None = None) -> None:
        self._driver = driver
        self._root = plugin_dir / METADATA_DIR
        self._cdi_dir = cdi_dir
        self._hooks = hooks
        self._hardware_addresses = hardware_addresses
        self.kind = cdi_kind(f"{driver}/metadata")
        self._seen_problems: set[str] = set()  # attribute problems logged already (the slices log them too)

    # -- names -----------------------------------------------------------------------------------
    def file_path(self, namespace: str, name: str, request: str) -> Path:
        return self._root / f"{namespace}_{name}" / request / FILE_NAME

    def spec_path(self, uid: str, request: str) -> Path:
        return self._cdi_dir / f"{self._driver}_metadata_{uid}_{request}.json"

    def cdi_id(self, uid: str, request: str) -> str:
        return f"{self.kind}={uid}_{request}"

    def container_path(self, name: str, pod_claim_name: str | None, request: str) -> str:
        """Where a container finds the file: under the pod's name for the claim when it was made
        from a template, else under the claim's."""
        if pod_claim_name:
            return f"{CONTAINER_DIR}/{TEMPLATES_SUBDIR}/{pod_claim_name}/{request}/{self._driver}-metadata.json"
        return f"{CONTAINER_DIR}/{CLAIMS_SUBDIR}/{name}/{request}/{self._driver}-metadata.json"

    # -- prepare ---------------------------------------------------------------------------------
    def plan(self, claim: Mapping[str, Any], ref: ClaimRef, results: Sequence[AllocationResult]) -> ClaimMetadata:
        """What the metadata of ``claim`` (as the API server returns it) needs, checked: every
        name that becomes part of a path must be one the API allows there (ClaimRefused says which
        is not)."""
        if not _DNS_LABEL.fullmatch(ref.namespace) or not _DNS_SUBDOMAIN.fullmatch(ref.name):
            raise ClaimRefused(f"{ref.label}: {ref.namespace!r} and {ref.name!r} are not a namespace and a claim "
                               "name (a DNS label and a DNS subdomain), so they cannot name its device metadata")
        requests: dict[str, str] = {}
        for result in results:
            if not all(_DNS_LABEL.fullmatch(part) for part in result.request.split("/")):
                raise ClaimRefused(f"{ref.label}: request {result.request!r} is not a request name (a DNS label), "
                                   "so it cannot name its device metadata file")
            requests.setdefault(result.main_request, result.request)
        return ClaimMetadata(_pod_claim_name(claim, ref), requests)

    def made(self, claim: PreparedClaim, chosen: Sequence[Chosen], plan: ClaimMetadata) -> PreparedClaim:
        """(worker thread) Write the metadata file and spec of each request of ``claim`` (its
        devices are those of ``chosen``, in that order), and return the claim with them: the
        documents, and each request's CDI ID on its first device. ClaimRefused names the file
        that could not be written (what was written stays for the caller's ``remove``)."""
        attributes = self._published_attributes(chosen)
        addresses = self._addresses(attributes.values())
        documents: dict[str, list[Document]] = {}
        devices = []
        for device in claim.devices:
            new = [request for request in device.request_names if request not in documents]
            published = attributes.get((device.resource, device.device_name))
            if published is None:
                log.warning("%s: device %s of %s is in no slice entry to take attributes from; its device "
                            "metadata has none", claim.label, device.device_id, device.resource)
            entry = device_entry(self._driver, device.pool_name, device.device_name, published, addresses)
            for request in device.request_names:
                if request not in documents:
                    named = plan.requests.get(request, request)  # as the allocation names it: nic/fast
                    documents[request] = [new_document(version, claim, plan.pod_claim_name, named)
                                          for version in API_VERSIONS]
                for document in documents[request]:
                    document["requests"][0]["devices"].append(entry)
            ids = tuple(self.cdi_id(claim.uid, request) for request in new)
            devices.append(dataclasses.replace(device, metadata_cdi_ids=ids) if ids else device)
        made = dataclasses.replace(claim, devices=tuple(devices), pod_claim_name=plan.pod_claim_name,
                                   device_metadata=documents)
        self._write(made, documents, again="")
        return made

    def _published_attributes(self, chosen: Sequence[Chosen]) -> dict[tuple[str, str], Mapping[str, Any]]:
        """(resource, device name) -> the attributes of the device's ``devices[]`` entry (a
        shared device's: the one entry its shares are published as), made by ``slice_devices``
        for its pool narrowed to the chosen devices, as published were nothing else holding them
        (the claim holds them)."""
        by_pool: dict[str, tuple[ResourcePool, set[str]]] = {}
        for item in chosen:
            by_pool.setdefault(item.pool.resource, (item.pool, set()))[1].add(item.device.device_id)
        attributes: dict[tuple[str, str], Mapping[str, Any]] = {}
        for resource, (pool, device_ids) in by_pool.items():
            hooks = self._hooks.get(pool.handler)
            describer = hooks.describer if hooks is not None else None
            every_share = pool_shares(self._hooks, pool)
            shares = {shared: held for shared, ids in every_share.items()
                      if (held := [i for i in ids if i in device_ids])}
            narrowed = dataclasses.replace(pool, devices={i: pool.devices[i] for i in device_ids if i in pool.devices},
                                           leased=frozenset(), kubelet_held=frozenset(), lost_book="")
            for entry in slice_devices(narrowed, self._driver, describer, taint_effect=_EVERY_DEVICE, shares=shares,
                                       seen=self._seen_problems):
                attributes[(resource, entry["name"])] = entry.get("attributes", {})
        return attributes

    def _addresses(self, attributes: Iterable[Mapping[str, Any]]) -> Mapping[str, str]:
        """Each netdev's hardware address, as the claim status has it (none without its reader)."""
        netdevs = sorted({netdev for each in attributes if (netdev := netdev_of(each)) is not None})
        if not netdevs or self._hardware_addresses is None:
            return {}
        return self._hardware_addresses(netdevs)

    def _write(self, claim: PreparedClaim, documents: Mapping[str, Sequence[Mapping[str, Any]]], *,
               again: str) -> list[Path]:
        """Write each request's file and spec that does not say what it should already; the
        paths written. ClaimRefused names the claim and the file that could not be written."""
        written = []
        for request, request_documents in documents.items():
            path = self.file_path(claim.namespace, claim.name, request)
            spec_path = self.spec_path(claim.uid, request)
            spec = self._spec(claim, request, path)
            for target, content in ((path, stream(request_documents)), (spec_path, spec)):
                try:
                    present = _content(target)
                    if present == content:
                        continue
                    if not target.parent.is_dir():  # a mkdir of a directory that is there costs one too
                        target.parent.mkdir(parents=True, exist_ok=True)
                    if present is None and target == path:  # nobody reads it before the answer names it
                        write_new(target, content, mode=0o644)
                    else:  # a CDI spec (the runtimes watch their directory), or a file written again
                        write_atomically(target, content, mode=0o644, durable=False)
                except OSError as error:
                    what = "device metadata" if target == path else "device metadata CDI spec"
                    raise ClaimRefused(f"{claim.label}: cannot write its {what} {target}{again}: {error}") from error
                written.append(target)
        return written

    def _spec(self, claim: PreparedClaim, request: str, path: Path) -> bytes:
        """The CDI spec that mounts ``path`` (the request's file) read-only in the container."""
        mount = {"hostPath": str(path), "containerPath": self.container_path(claim.name, claim.pod_claim_name, request),
                 "options": ["ro", "bind"]}
        spec = {"cdiVersion": CDI_VERSION, "kind": self.kind,
                "devices": [{"name": f"{claim.uid}_{request}", "containerEdits": {"mounts": [mount]}}]}
        return json.dumps(spec, indent=2).encode()

    # -- restart ---------------------------------------------------------------------------------
    def rewrite(self, claim: PreparedClaim) -> list[Path]:
        """(worker thread) Write again the files and specs of ``claim`` that are missing or say
        something else (a reboot emptied ``/var/run``); the paths written. ClaimRefused names
        the file that could not be written."""
        if not claim.device_metadata:
            return []
        return self._write(claim, claim.device_metadata, again=" again")

    def remove_stale(self, known: Mapping[str, PreparedClaim]) -> list[Path]:
        """(worker thread) Remove our metadata specs (kind ``<driver>/metadata``) of claims not
        in ``known`` (by UID: a prepare that crashed before its checkpoint), and the files they
        mount, then the files no spec mounts (``_remove_lone_files``); the specs and lone files
        removed. One that cannot be is logged and left."""
        removed = []
        for spec_path, uid in self._spec_files():
            if uid in known:
                continue
            try:
                spec = parse_json(spec_path.read_bytes())
                if spec.get("kind") != self.kind:
                    continue
                host_path = Path(spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"])
            except (OSError, ValueError, AttributeError, LookupError, TypeError):
                continue
            errors: list[str] = []
            if host_path.parent.parent.parent == self._root and host_path.name == FILE_NAME:
                self._remove_file(host_path, uid, errors)
            _unlink(spec_path, "device metadata CDI spec", errors)
            if errors:
                log.error("cannot remove the device metadata of claim UID %s, which the checkpoint does not have: %s",
                          uid, "; ".join(errors), extra={"EVENT": "restore"})
                continue
            removed.append(spec_path)
        return removed + self._remove_lone_files(known)

    def _remove_lone_files(self, known: Mapping[str, PreparedClaim]) -> list[Path]:
        """The metadata files of claims not in ``known`` that no spec mounts (a crash between
        writing a file and its spec), removed with their directories left empty. A file that
        cannot be read as one stays in a known claim's directory: its next Prepare writes it again."""
        claim_dirs = {f"{claim.namespace}_{claim.name}" for claim in known.values()}
        removed = []
        for path in sorted(self._root.glob(f"*/*/{FILE_NAME}")):
            uid = _claim_uid(path)
            if uid in known or (uid is None and path.parent.parent.name in claim_dirs):
                continue
            errors: list[str] = []
            self._remove_file(path, uid or "", errors)
            if errors:
                log.error("cannot remove the device metadata of claim UID %s, which the checkpoint does not have: %s",
                          uid, "; ".join(errors), extra={"EVENT": "restore"})
                continue
            removed.append(path)
        return removed

    # -- unprepare -------------------------------------------------------------------------------
    def remove(self, namespace: str, name: str, uid: str, requests: Iterable[str] | None = None) -> None:
        """(worker thread) Remove the metadata specs and files of claim ``uid`` (of ``requests``;
        ``None``: whichever there are), and the directories left empty; gone already is fine.
        Whatever can be removed is; MetadataStays says what could not be and why."""
        errors: list[str] = []
        if requests is None:
            spec_paths = [path for path, spec_uid in self._spec_files() if spec_uid == uid]
            try:
                requests = sorted(os.listdir(self._root / f"{namespace}_{name}"))
            except FileNotFoundError:
                requests = []
            except OSError as error:
                requests = []
                errors.append(f"cannot read its device metadata directory: {error}")
        else:
            requests = list(requests)
            spec_paths = [self.spec_path(uid, request) for request in requests]
        for spec_path in spec_paths:
            _unlink(spec_path, "device metadata CDI spec", errors)
        for request in requests:
            self._remove_file(self.file_path(namespace, name, request), uid, errors)
        if errors:
            raise MetadataStays("; ".join(errors))

    def _remove_file(self, path: Path, uid: str, errors: list[str]) -> None:
        """Remove the metadata file at ``path`` if claim ``uid`` wrote it (another claim of the
        same name may have since), and its directories left empty; what fails is added to
        ``errors``."""
        try:
            written_by = _claim_uid(path)
        except OSError as error:
            errors.append(f"cannot read its device metadata {path}: {error}")
            return
        if written_by in (uid, None) and not _unlink(path, "device metadata", errors):
            return
        for directory in (path.parent, path.parent.parent):  # the root stays, as the helper leaves it
            try:
                directory.rmdir()
            except OSError:  # not empty (or gone): it stays
                return

    def _spec_files(self) -> list[tuple[Path, str]]:
        """Our metadata spec files in the CDI directory, each with the claim UID its name says."""
        prefix = f"{self._driver}_metadata_"
        try:
            names = os.listdir(self._cdi_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in sorted(names):
            if name.startswith(prefix) and (named := _SPEC_NAME.fullmatch(name[len(prefix):])) is not None:
                found.append((self._cdi_dir / name, named["uid"]))
        return found


def _pod_claim_name(claim: Mapping[str, Any], ref: ClaimRef) -> str | None:
    """The claim's annotation ``resource.kubernetes.io/pod-claim-name`` (``None`` when it has
    none), checked: a name a pod spec can give a claim (a DNS label), or empty, which the helper
    takes for none (and writes as it is)."""
    metadata = claim.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if annotations is None:
        return None
    if not isinstance(annotations, Mapping):
        raise ClaimRefused(f"{ref.label}: malformed claim from the API server: metadata.annotations is not an object")
    value = annotations.get(POD_CLAIM_NAME)
    if value is None:
        return None
    if not isinstance(value, str) or (value and not _DNS_LABEL.fullmatch(value)):
        raise ClaimRefused(f"{ref.label}: its annotation {POD_CLAIM_NAME} is {value!r}, not the name of a claim in a "
                           "pod spec (a DNS label), so its devices' metadata has no place in the container")
    return value


def _unlink(path: Path, what: str, errors: list[str]) -> bool:
    """Remove ``path`` (gone already is fine); whether it is gone, else why not in ``errors``."""
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        errors.append(f"cannot remove its {what} {path}: {error}")
        return False
    return True


def _content(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _claim_uid(path: Path) -> str | None:
    """The claim UID the metadata file at ``path`` names (``None``: gone, or unreadable as one)."""
    try:
        documents = read_stream(path.read_bytes())
        uid = documents[0]["metadata"]["uid"]
    except FileNotFoundError:
        return None
    except (ValueError, LookupError, TypeError):
        return None
    return uid if isinstance(uid, str) else None

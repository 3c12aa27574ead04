"""The documents of a device metadata file (KEP-5304): one ``DeviceMetadata`` per supported
version, newest first, as the Go helper's ``api/metadata`` types lay them out, and the file's
content, a stream of concatenated JSON documents (``stream``, ``read_stream``). Where they are
written is ``_metadata.py``'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ._prepared import PreparedClaim

KIND = "DeviceMetadata"
API_VERSIONS = ("metadata.resource.k8s.io/v1alpha1",)  # newest first; each has v1alpha1's fields today
GENERATION = 1  # a document's first write
_JSON_SPACE = re.compile(r"[ \t\n\r]*")

Document = dict[str, Any]


def stream(documents: Sequence[Mapping[str, Any]]) -> bytes:
    """A metadata file's content: the documents, each indented as the helper's encoder does
    and followed by a newline, one after the other."""
    return "".join(json.dumps(document, indent=2, ensure_ascii=False) + "\n" for document in documents).encode()


def read_stream(data: bytes) -> list[Any]:
    """The documents of a metadata file, in their order (ValueError: not a JSON stream)."""
    text, decoder = data.decode(), json.JSONDecoder()
    documents: list[Any] = []
    at = _after_space(text, 0)
    while at < len(text):
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
        at = _after_space(text, at)
    return documents


def _after_space(text: str, at: int) -> int:
    """Where the JSON whitespace from ``at`` on ends."""
    space = _JSON_SPACE.match(text, at)
    return space.end() if space is not None else at


def new_document(api_version: str, claim: PreparedClaim, pod_claim_name: str | None, request: str) -> Document:
    """One request's ``DeviceMetadata`` in ``api_version`` (``request`` named as the allocation
    names it), its devices to add; keys in the order the helper's types give them."""
    document: Document = {
        "kind": KIND,
        "apiVersion": api_version,
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid, "generation": GENERATION},
    }
    if pod_claim_name is not None:
        document["podClaimName"] = pod_claim_name
    document["requests"] = [{"name": request, "devices": []}]
    return document


def device_entry(driver: str, pool: str, name: str, attributes: Mapping[str, Any] | None,
                  addresses: Mapping[str, str]) -> Document:
    """A device of a request: where it comes from, its published attributes (sorted, as Go
    writes a map), its network interface."""
    entry: Document = {"driver": driver, "pool": pool, "name": name}
    if attributes:
        entry["attributes"] = {key: attributes[key] for key in sorted(attributes)}
    if (netdev := netdev_of(attributes or {})) is not None:
        network = {"interfaceName": netdev}
        if (address := addresses.get(netdev)) is not None:
            network["hardwareAddress"] = address
        entry["networkData"] = network
    return entry


def netdev_of(attributes: Mapping[str, Any]) -> str | None:
    """The device's network interface on the host: its ``netdev`` attribute, as the claim
    status's ``networkData`` takes it."""
    value = attributes.get("netdev")
    netdev = value.get("string") if isinstance(value, Mapping) else None
    return netdev if isinstance(netdev, str) and netdev else None

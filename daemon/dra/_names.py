"""DRA names: the ResourceSlice pool of a resource on this node, and a device's name in it.

A device's name is derived from its device-plugin ID alone, so it is the same after a restart
and on every node: a PCI address ``0000:3b:02.1`` is ``0000-3b-02-1`` (as the SR-IOV DRA driver
names VFs; the mapping is one-to-one for PCI addresses), an ID that already is a DNS label
(``kvm-3``) is itself, and any other ID is made a DNS label (lower case, other characters as
``-``) with 8 hex digits of its SHA-256 after it, so that two IDs that differ only in what was
replaced (``A_1``, ``a.1``) still get two names.
"""

from __future__ import annotations

import hashlib
import re

from daemon.core._names import dra_pool_part

DNS_LABEL_MAX = 63
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PCI_ADDRESS = re.compile(r"([0-9a-f]{4,}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_HASH_LENGTH = 8


def pool_name(node_name: str, resource: str) -> str:
    """``<node>/<resource made valid>``: ``node1/intel.com/sriov-vfs`` for ``intel.com/sriov_vfs``."""
    return f"{node_name}/{dra_pool_part(resource)}"


def device_name(device_id: str) -> str:
    """The DNS label a device is published under (see the module docstring)."""
    if pci := _PCI_ADDRESS.fullmatch(device_id):
        return "-".join(pci.groups())
    if _DNS_LABEL.fullmatch(device_id):
        return device_id
    digest = hashlib.sha256(device_id.encode()).hexdigest()[:_HASH_LENGTH]
    stem = _NOT_LABEL.sub("-", device_id.lower()).strip("-")[: DNS_LABEL_MAX - _HASH_LENGTH - 1].rstrip("-")
    return f"{stem}-{digest}" if stem else f"d-{digest}"

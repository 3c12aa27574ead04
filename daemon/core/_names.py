"""Resource-name rules: the kubelet's (IsExtendedResourceName) and the SR-IOV plugin's."""

from __future__ import annotations

import re

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SRIOV_RESOURCE_NAME = re.compile(r"[a-zA-Z0-9_-]+")


def extended_resource_name_problem(name: str) -> str | None:
    """Why the kubelet would refuse ``name`` as an extended resource name, or ``None`` if valid.

    Mirrors the kubelet's IsExtendedResourceName: a ``domain/name`` with a lower-case DNS-1123
    domain that (with ``requests.`` in front) is at most 253 characters, not under
    ``kubernetes.io/``, and a 1-63 character name part.
    """
    if "/" not in name:
        return "has no domain prefix (expected domain/name)"
    if "kubernetes.io/" in name:
        return "must not contain 'kubernetes.io/'"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    if name.count("/") != 1:
        return "must contain exactly one '/'"
    domain, _, short = name.partition("/")
    qualified_domain = "requests." + domain
    if len(qualified_domain) > 253:
        return "domain is longer than 244 characters"
    if dns_subdomain_problem(qualified_domain):
        return f"domain {domain!r} is not a lower-case DNS subdomain"
    if not 1 <= len(short) <= 63:
        return f"name part {short!r} must be 1-63 characters"
    if not _NAME_PART.fullmatch(short):
        return (
            f"name part {short!r} must be letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def dns_subdomain_problem(name: str, max_length: int = 253) -> str | None:
    """Why ``name`` is not a lower-case DNS-1123 subdomain of at most ``max_length`` characters."""
    if not name:
        return "must not be empty"
    if len(name) > max_length:
        return f"must be at most {max_length} characters"
    if not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        return "must be lower-case DNS labels (a-z, 0-9, '-') separated by '.'"
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a label value (a taint's value): at most 63 letters, digits, '-',
    '_' or '.', starting and ending with a letter or digit; empty is one."""
    if len(value) > 63:
        return "must be at most 63 characters"
    if value and not _NAME_PART.fullmatch(value):
        return "must be letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


def dra_pool_part(resource: str) -> str:
    """A resource name made valid inside a ResourceSlice pool name (``<node>/<this>``): lower
    case, ``_`` as ``-`` (``intel.com/sriov_vfs`` -> ``intel.com/sriov-vfs``). A resource name
    the config accepts (a lower-case DNS subdomain, ``/``, letters, digits, ``_`` and ``-``
    starting and ending with a letter or digit) always gives DNS subdomains this way."""
    return resource.lower().replace("_", "-")


def resource_name_problem(resource_name: str) -> str | None:
    """Why the SR-IOV plugin would refuse a pool's ``resourceName`` (``^[a-zA-Z0-9_-]+$``)."""
    if not _SRIOV_RESOURCE_NAME.fullmatch(resource_name):
        return f"{resource_name!r} may contain only letters, digits, '_' and '-'"
    return None


def device_list_env_name(family: str, resource_prefix: str, resource_name: str) -> str:
    """``<FAMILY>_<prefix>_<name>`` (``PCIDEVICE_INTEL_COM_SRIOV``), the variable naming a
    container's devices: only ``.`` replaced by ``_``, upper-cased (dashes kept), as the SR-IOV
    plugin spells ``PCIDEVICE_*``."""
    return f"{family}_{resource_prefix}_{resource_name}".replace(".", "_").upper()

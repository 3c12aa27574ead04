"""What a cluster admin applies once for devplugd's DRA pools: a DeviceClass per pool (KEP-5004:
``resources.limits: intel.com/sriov_vfs: 1`` keeps working, the scheduler asks DRA for it on
nodes where no device plugin serves that name) and the RBAC the daemon needs for its
ResourceSlices. ``devplugd dra device-classes`` prints them as YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from daemon.core._config import ConfiguredPool, DaemonConfig
from daemon.core._names import dns_subdomain_problem, dra_pool_part

from ._devices import string_problem
from ._slices import MANAGED_BY
from ._vfioconfig import VfioConfig

DEVICE_CLASS_API_VERSION = "resource.k8s.io/v1"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


class DeviceClassError(ValueError):
    """A pool's resource cannot be served by a DeviceClass; the message names it and why."""


def device_class_name(resource: str) -> str:
    """``intel.com/sriov_vfs`` -> ``sriov-vfs.intel.com``: the name part lower-cased with ``_`` as
    ``-`` (a DNS label, as the config's resource-name rules leave it), then ``.`` and the prefix
    (a lower-case DNS subdomain already), so each class reads as a name in its vendor's domain,
    like ``gpu.nvidia.com``. Two DRA pools never share one: it is their pool names' part
    (``dra_pool_part``) turned round, and those are checked to differ when the config is read."""
    prefix, _, name = dra_pool_part(resource).partition("/")
    class_name = f"{name}.{prefix}"
    if problem := dns_subdomain_problem(class_name):
        raise DeviceClassError(f"{resource!r} gives no DeviceClass name: {class_name!r} {problem}")
    return class_name


def selector_expression(driver: str, resource: str) -> str:
    """The CEL selector of a pool's devices: our driver's, with the pool's ``resourceName``."""
    return f'device.driver == "{driver}" && device.attributes["{driver}"].resourceName == "{resource}"'


def device_class(driver: str, resource: str) -> dict[str, Any]:
    """The DeviceClass of one DRA pool, named by ``device_class_name``."""
    if problem := string_problem(resource):
        raise DeviceClassError(f"{resource!r} cannot be selected by a DeviceClass: as the resourceName "
                               f"attribute, {problem}")
    return {
        "apiVersion": DEVICE_CLASS_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": device_class_name(resource), "labels": dict(MANAGED_BY)},
        "spec": {
            "selectors": [{"cel": {"expression": selector_expression(driver, resource)}}],
            "extendedResourceName": resource,
        },
    }


def vfio_device_class(driver: str, resource: str) -> dict[str, Any]:
    """The second DeviceClass of a ``vfioOnDemand`` pool (``<name>-vfio.<prefix>``): the same
    devices, with the ``VfioConfig`` that has a claim's device bound to vfio-pci (it reaches the
    allocation as a config ``FromClass``), so a VM's claim only names the class. It claims no
    extended resource name: ``resources.limits`` keeps meaning the pool's own class."""
    plain = device_class(driver, resource)
    name, _, prefix = plain["metadata"]["name"].partition(".")
    class_name = f"{name}-vfio.{prefix}"
    if problem := dns_subdomain_problem(class_name):
        raise DeviceClassError(f"{resource!r} gives no vfio DeviceClass name: {class_name!r} {problem}")
    return {
        **plain,
        "metadata": {**plain["metadata"], "name": class_name},
        "spec": {
            "selectors": plain["spec"]["selectors"],
            "config": [{"opaque": {"driver": driver, "parameters": VfioConfig().to_json()}}],
        },
    }


def device_classes(config: DaemonConfig, driver: str,
                   lends: Callable[[ConfiguredPool[Any]], bool] = lambda pool: False) -> list[dict[str, Any]]:
    """One DeviceClass per DRA pool of ``config``, in file order, each followed by its
    ``-vfio`` class when ``lends`` says the pool's devices may go to vfio-pci on demand.
    Raises DeviceClassError."""
    classes = []
    for pool in config.dra_pools:
        classes.append(device_class(driver, pool.resource))
        if lends(pool):
            classes.append(vfio_device_class(driver, pool.resource))
    return classes


def _rule(api_group: str, resources: Sequence[str], verbs: Sequence[str]) -> dict[str, Any]:
    return {"apiGroups": [api_group], "resources": list(resources), "verbs": list(verbs)}


def rbac_objects(driver: str, namespace: str = "devplugd", service_account: str = "devplugd") -> list[dict[str, Any]]:
    """The ServiceAccount, ClusterRole and ClusterRoleBinding the daemon runs with as a DRA
    driver (the rules of the DRA example driver's and the SR-IOV DRA driver's ClusterRoles): its
    ResourceSlices in full, including the kubelet's kind of wipe (deletecollection); the Node,
    for the slices' owner reference; ResourceClaims to read (Prepare, and the periodic look for
    claims gone from the API server), and their status to read and write (``status.devices``,
    KEP-4817; the verbs of the node-local driver role in Kubernetes' DRA authorization docs).
    The ``resourceclaims/driver`` rule, with the node-aware verbs ``associated-node:update`` and
    ``associated-node:patch``, is what Kubernetes 1.36+ asks of a write of ``status.devices``
    when DRAResourceClaimGranularStatusAuthorization is on (beta, on by default), limited to
    ``driver``: a ``resourceclaims/status`` rule alone is refused."""
    role = f"{service_account}-dra"
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": namespace, "labels": dict(MANAGED_BY)},
        },
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "ClusterRole",
            "metadata": {"name": role, "labels": dict(MANAGED_BY)},
            "rules": [
                _rule("resource.k8s.io", ["resourceslices"],
                      ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]),
                _rule("", ["nodes"], ["get"]),
                _rule("resource.k8s.io", ["resourceclaims"], ["get"]),
                _rule("resource.k8s.io", ["resourceclaims/status"], ["get", "update", "patch"]),
                {**_rule("resource.k8s.io", ["resourceclaims/driver"],
                         ["associated-node:update", "associated-node:patch"]), "resourceNames": [driver]},
            ],
        },
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role, "labels": dict(MANAGED_BY)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
        },
    ]

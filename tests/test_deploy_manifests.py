"""deploy/ against the Kubernetes API's own schemas (kubernetes-validate's, strict: unknown
fields refused) and against the daemon it deploys: its version, its config loader, the host
paths its settings default to, its metrics address; and the DaemonSet as the component
deploy/vfio-on-demand makes it (docs/passthrough.md, "Enabling it")."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from daemon import __version__, app
from daemon.dra._deviceclasses import rbac_objects
from daemon.handlers.pci._enablement import WRITTEN
from daemon.settings import Settings
from tests.daemonrun import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
Manifest = dict[str, Any]
DEFAULTS = Settings()
# The newest API the package has schemas of, and the oldest devplugd supports (resource.k8s.io/v1).
VERSIONS = [".".join(kubernetes_validate.latest_version().split(".")[:2]), "1.34"]


def _load(name: str) -> list[Manifest]:
    with (DEPLOY / name).open(encoding="utf-8") as stream:
        return [document for document in yaml.safe_load_all(stream) if document is not None]


KUSTOMIZATION = _load("kustomization.yaml")[0]
DOCUMENTS = [(name, document) for name in KUSTOMIZATION.get("resources", [])
             if (DEPLOY / name).is_file() for document in _load(name)]


def _one(kind: str) -> Manifest:
    (found,) = [document for _, document in DOCUMENTS if document["kind"] == kind]
    return found


def _pod() -> Manifest:
    spec: Manifest = _one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def _container() -> Manifest:
    containers: list[Manifest] = _pod()["containers"]
    (container,) = containers
    return container


def _refusal(document: Manifest, version: str) -> str | None:
    """Why the schemas of Kubernetes ``version`` refuse ``document`` in strict mode, or None."""
    try:
        used = kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{error.json_path}: {error.message}"
    except kubernetes_validate.SchemaNotFoundError as error:
        return str(error.message)
    assert used == version, f"the package has no {version} schemas: validated against {used}'s"
    return None


# -- the API server's schemas ------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "document"), [
    pytest.param(name, document, id=f"{name}:{document['kind']}/{document['metadata']['name']}")
    for name, document in DOCUMENTS])
def test_each_resource_is_a_valid_api_object(name: str, document: Manifest, version: str) -> None:
    assert _refusal(document, version) is None


@pytest.mark.parametrize(("field", "mistake", "value", "refusal"), [
    ("hostNetwork", "hostNetwrk", True, "'hostNetwrk' was unexpected"),
    ("terminationGracePeriodSeconds", "terminationGracePeriodSeconds", "20", "'20' is not of type 'integer'"),
], ids=["misspelled-field", "wrong-type"])
def test_a_broken_daemonset_is_refused(field: str, mistake: str, value: object, refusal: str) -> None:
    broken = copy.deepcopy(_one("DaemonSet"))
    spec = broken["spec"]["template"]["spec"]
    spec.pop(field, None)
    spec[mistake] = value
    for version in VERSIONS:
        assert refusal in (_refusal(broken, version) or "accepted")


# -- the kustomization and what it ties together -----------------------------------------------


def test_kustomization_applies_every_manifest_beside_it() -> None:
    beside = sorted(path.name for path in DEPLOY.glob("*.y*ml") if path.name != "kustomization.yaml")
    assert sorted(KUSTOMIZATION["resources"]) == beside
    assert all((DEPLOY / name).is_file() for name in KUSTOMIZATION["resources"])


def test_service_account_is_the_pods_and_bound_in_the_kustomization_namespace() -> None:
    namespace = KUSTOMIZATION.get("namespace")
    assert namespace
    account = _one("ServiceAccount")["metadata"]["name"]
    assert _pod()["serviceAccountName"] == account
    binding = _one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == _one("ClusterRole")["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account, "namespace": namespace} in binding["subjects"]


def test_rbac_is_what_the_daemon_prints_for_its_driver_and_the_namespace_is_made_for_it() -> None:
    """One source of truth for the rules: `devplugd dra device-classes --rbac` (rbac_objects)."""
    driver = DEFAULTS.dra_driver
    assert [document for name, document in DOCUMENTS if name == "rbac.yaml"] == rbac_objects(driver)
    namespace = _one("Namespace")
    assert namespace["metadata"]["name"] == KUSTOMIZATION["namespace"]
    # hostPath volumes and the host's network: only Pod Security's privileged level admits them
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_generated_config_map_is_the_config_volume_and_keeps_its_name() -> None:
    (generator,) = KUSTOMIZATION["configMapGenerator"]
    assert all((DEPLOY / name).is_file() for name in generator["files"])
    assert DEFAULTS.config_path.name in [Path(name).name for name in generator["files"]]
    (volume,) = [volume for volume in _pod()["volumes"] if volume["name"] == "config"]
    assert volume["configMap"]["name"] == generator["name"]
    # the daemon reloads a changed ConfigMap in place; a hash suffix would roll the pods instead
    assert generator.get("options", {}).get("disableNameSuffixHash") is True


def test_image_tag_is_the_daemon_version() -> None:
    image = _container()["image"]
    assert image == f"localhost/devplugd:{__version__}"
    assert {"name": image.rpartition(":")[0], "newTag": __version__} in KUSTOMIZATION["images"]


# -- the daemon it deploys ---------------------------------------------------------------------


def test_config_json_passes_the_daemons_own_validation() -> None:
    """As ``devplugd check-config deploy/config.json``: ConfigFileError if it is refused."""
    _, config = app.load(Settings(), config_path=DEPLOY / "config.json")
    assert config.pools
    assert config.warnings == ()


HOST_PATHS = {  # what the daemon reads or writes by default, and whether it writes there
    "device_plugin_dir": (DEFAULTS.device_plugin_dir, True),
    "plugins_registry_dir": (DEFAULTS.plugins_registry_dir, True),
    "dra_plugin_dir": (DEFAULTS.dra_plugin_dir, True),
    "cdi_dir": (DEFAULTS.cdi_dir, True),
    "devinfo_dir": (DEFAULTS.devinfo_dir, True),
    "nfd_features_dir": (DEFAULTS.nfd_features_dir, True),
    "state_dir": (DEFAULTS.state_dir, True),
    "control_socket": (DEFAULTS.control_socket.parent, True),
    "udev_data_dir": (DEFAULTS.udev_data_dir.parent, False),
    "sysfs_root": (DEFAULTS.sysfs_root, False),
    "dev_root": (DEFAULTS.dev_root, False),
}


@pytest.mark.parametrize(("path", "writes"), HOST_PATHS.values(), ids=HOST_PATHS.keys())
def test_host_path_is_the_hosts_in_the_pod(path: Path, writes: bool) -> None:
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in _pod()["volumes"] if "hostPath" in volume}
    covering = [mount for mount in _container()["volumeMounts"] if path.is_relative_to(mount["mountPath"])]
    assert covering, f"{path} is not mounted"
    mount = max(covering, key=lambda mount: len(Path(mount["mountPath"]).parts))  # the one seen at path
    assert host_paths.get(mount["name"]) == mount["mountPath"], f"{path} is not the host's {path}"
    assert "subPath" not in mount
    assert not (writes and mount.get("readOnly")), f"{path} is mounted read-only"


def test_read_only_host_paths_are_read_only_with_what_the_host_mounted_under_them() -> None:
    """A read-only bind leaves the submounts writable: the host's cgroups and efivars under
    /sys, its /dev/shm under /dev. Each read-only host path asks for a recursive one."""
    host_volumes = {volume["name"] for volume in _pod()["volumes"] if "hostPath" in volume}
    read_only = [mount for mount in _container()["volumeMounts"] if mount["name"] in host_volumes
                 and mount.get("readOnly")]
    assert {mount["mountPath"] for mount in read_only} >= {"/sys", "/dev", "/run/udev"}
    for mount in read_only:
        assert mount.get("recursiveReadOnly") == "IfPossible", mount["mountPath"]
        assert mount.get("mountPropagation", "None") == "None", mount["mountPath"]  # what recursive needs


def test_config_volume_is_mounted_where_the_daemon_reads_its_config() -> None:
    mounts = {mount["mountPath"]: mount["name"] for mount in _container()["volumeMounts"]}
    assert mounts.get(str(DEFAULTS.config_path.parent)) == "config"
    config_arguments = [arg for arg in _container()["args"] if arg.startswith("--config")]
    assert config_arguments in ([], [f"--config={DEFAULTS.config_path}"])


def test_metrics_listen_on_the_nodes_address_where_the_liveness_probe_asks() -> None:
    assert _pod()["hostNetwork"] is True  # the host's links and uevents are heard in its netns only
    container = _container()
    assert "--metrics-address=$(HOST_IP):9464" in container["args"]
    fields = {env["name"]: env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for env in container["env"]}
    assert fields["HOST_IP"] == "status.hostIP"
    assert fields.get("NODE_NAME") == "spec.nodeName"  # --node-name's default, for DRA's slices
    probe = container["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", 9464)
    assert "host" not in probe  # the pod's IP, which is the node's under hostNetwork


def test_a_rolling_update_starts_the_new_pod_before_the_old_one_goes_and_names_its_sockets_after_it() -> None:
    """maxSurge 1, maxUnavailable 0: a plugin is registered throughout; the new pod can be
    scheduled beside the old one (no hostPort, which hostNetwork makes of any declared port);
    its UID reaches --pod-uid's default, so its DRA sockets are not the old pod's."""
    strategy = _one("DaemonSet")["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    container = _container()
    assert "ports" not in container and not any("hostPort" in str(c) for c in _pod()["containers"])
    fields = {env["name"]: env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for env in container["env"]}
    assert fields.get("POD_UID") == "metadata.uid"
    # Ready once it is the active instance: the old pod is stopped only after the handover
    assert container["readinessProbe"]["exec"]["command"] == ["/usr/bin/devplugd", "active"]
    assert not any(arg.startswith("--pod-uid") for arg in container["args"])  # $POD_UID is the default


def test_container_is_unprivileged() -> None:
    context = _container()["securityContext"]
    assert context.get("privileged") is not True
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]


# -- the vfioOnDemand component (docs/passthrough.md, "Enabling it") ----------------------------

COMPONENT = DEPLOY / "vfio-on-demand"


def _patched(document: Manifest, operations: list[Manifest]) -> Manifest:
    """``document`` with the JSON patch (RFC 6902) ``operations`` applied: its ``test`` and
    ``add`` operations, all the component uses (any other fails here)."""
    patched = copy.deepcopy(document)
    for operation in operations:
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        target = patched
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if operation["op"] == "test":
            found = target[int(last)] if isinstance(target, list) else target[last]
            assert found == operation["value"], f"{operation['path']} is {found!r}, not {operation['value']!r}"
        elif operation["op"] == "add" and isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), copy.deepcopy(operation["value"]))
        elif operation["op"] == "add":
            target[last] = copy.deepcopy(operation["value"])
        else:
            raise AssertionError(f"{operation['op']} {operation['path']}: not an operation the component may use")
    return patched


def vfio_daemonset() -> Manifest:
    """The DaemonSet as an overlay with the component makes it (kustomize: its one patch, on the
    DaemonSet it targets)."""
    (component,) = _load(str(COMPONENT.relative_to(DEPLOY) / "kustomization.yaml"))
    assert (component["apiVersion"], component["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    (patch,) = component["patches"]
    daemonset = _one("DaemonSet")
    assert patch["target"] == {"kind": "DaemonSet", "name": daemonset["metadata"]["name"]}
    with (COMPONENT / patch["path"]).open(encoding="utf-8") as stream:
        return _patched(daemonset, yaml.safe_load(stream))


def _covering_mount(pod: Manifest, path: Path) -> tuple[Manifest, str | None]:
    """The container's mount seen at ``path`` (the deepest covering it) and its volume's host path."""
    (container,) = pod["containers"]
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    mount = max((mount for mount in container["volumeMounts"] if path.is_relative_to(mount["mountPath"])),
                key=lambda mount: len(Path(mount["mountPath"]).parts))
    return mount, host_paths.get(mount["name"])


@pytest.mark.parametrize("version", VERSIONS)
def test_the_vfio_on_demand_daemonset_is_a_valid_api_object(version: str) -> None:
    assert _refusal(vfio_daemonset(), version) is None


def test_vfio_on_demand_only_adds_to_the_daemonset() -> None:
    """Every operation of the patch adds: the base is the one place for everything else."""
    base, variant = _one("DaemonSet"), vfio_daemonset()
    base_pod, pod = base["spec"]["template"]["spec"], variant["spec"]["template"]["spec"]
    (base_container,), (container,) = base_pod["containers"], pod["containers"]
    for field in ("args", "volumeMounts"):
        assert container[field][:len(base_container[field])] == base_container[field]
    assert pod["volumes"][:len(base_pod["volumes"])] == base_pod["volumes"]
    assert {key: value for key, value in container["securityContext"].items() if key != "appArmorProfile"} == \
        base_container["securityContext"]


def test_vfio_on_demand_makes_writable_the_two_sysfs_subtrees_the_daemon_writes_and_no_more() -> None:
    pod = vfio_daemonset()["spec"]["template"]["spec"]
    for part in WRITTEN:
        path = DEFAULTS.sysfs_root / part
        mount, host_path = _covering_mount(pod, path)
        assert (mount["mountPath"], host_path, mount.get("readOnly", False)) == (str(path), str(path), False)
    for elsewhere in ("kernel", "module", "fs/cgroup", "firmware"):
        mount, host_path = _covering_mount(pod, DEFAULTS.sysfs_root / elsewhere)
        assert (mount["mountPath"], host_path, mount.get("readOnly")) == ("/sys", "/sys", True)


def test_vfio_on_demand_reads_the_hosts_proc_where_its_proc_root_says() -> None:
    """The host's mount table (PID 1's) and swaps for the in-use check; its net/ is the daemon's
    own network namespace, the host's under hostNetwork. Read-only, and no hostPID."""
    pod = vfio_daemonset()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (proc_root,) = [arg.removeprefix("--proc-root=") for arg in container["args"] if arg.startswith("--proc-root")]
    mount, host_path = _covering_mount(pod, Path(proc_root))
    assert (mount["mountPath"], host_path) == (proc_root, "/proc")
    assert (mount["readOnly"], mount["recursiveReadOnly"]) == (True, "IfPossible")
    assert pod["hostNetwork"] is True and "hostPID" not in pod


def test_vfio_on_demand_keeps_the_container_unprivileged_and_only_lifts_apparmor() -> None:
    """Root owns the sysfs files, so writing them takes no capability; the runtime's default
    AppArmor profile would deny any write under /sys (but the cgroups) whatever the mount says."""
    (container,) = vfio_daemonset()["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert context.get("privileged") is not True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert context["appArmorProfile"] == {"type": "Unconfined"}



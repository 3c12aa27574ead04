"""deploy/daemonset.yaml's pod, run by podman as the kubelet would run it on a node.

``pod_command`` turns the manifest's pod spec into one ``podman run``, field by field: every
hostPath volume becomes a bind of the same path (below ``node_root``, the node's ``/`` in a test,
except the host's own ``/sys``, ``/dev``, ``/run/udev`` and ``/proc``, and what is below them, which
are the host's), the ConfigMap volume
a bind of a directory laid out as the kubelet's atomic writer lays it out (``ConfigMapVolume``),
an emptyDir a tmpfs, the downward-API env vars their values, ``$(VAR)`` in the args expanded, the
container's securityContext its podman options, the host network the host's. A field it does not
know fails the translation (``UnknownField``): a new field in the manifest must be taught here,
or the test would silently run something the DaemonSet does not.

Fields that only the API server or the scheduler act on (service account, priority class,
tolerations, DNS policy, ports and requests) have no podman counterpart and are listed as such;
so are the probe's timings (the test calls the probe itself, once).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.daemonrun import REPO_ROOT

DAEMONSET = REPO_ROOT / "deploy" / "daemonset.yaml"
# The host's own, and what is below them (the vfio-on-demand component's /sys/bus/pci, /sys/devices
# and /proc): a fake of these would need a fake kernel.
HOST_PATHS = ("/sys", "/dev", "/run/udev", "/proc")
# What the API server and the scheduler use, and the kubelet does not turn into a container option.
NOT_ON_THE_NODE = {"serviceAccountName", "priorityClassName", "tolerations", "dnsPolicy"}
POD_FIELDS = NOT_ON_THE_NODE | {"hostNetwork", "terminationGracePeriodSeconds", "containers", "volumes"}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "args", "env", "ports", "livenessProbe", "readinessProbe",
                    "resources", "securityContext", "volumeMounts"}
SECURITY_FIELDS = {"runAsUser", "runAsGroup", "privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem",
                   "capabilities", "seccompProfile", "appArmorProfile"}
MEMORY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
PROBE_TIMINGS = {"initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold"}


class UnknownField(AssertionError):
    pass


def load_pod_spec(path: Path = DAEMONSET) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
    return spec


def _only(fields: dict[str, Any], known: set[str], where: str) -> None:
    if unknown := set(fields) - known:
        raise UnknownField(f"{where}: {sorted(unknown)} not translated to podman (tests/e2e/daemonset.py)")


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * MEMORY_UNITS[unit]


class ConfigMapVolume:
    """A ConfigMap volume as the kubelet writes it: each key a symlink ``key -> ..data/key``,
    ``..data`` a symlink to a timestamped directory; an update writes a new directory, points a
    temporary link at it and renames that over ``..data`` (one atomic swap), then removes the old."""

    def __init__(self, directory: Path, files: dict[str, str]) -> None:
        self.directory = directory
        directory.mkdir(parents=True)
        self._current: Path | None = None
        self.update(files)

    def update(self, files: dict[str, str]) -> None:
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.") + f"{time.monotonic_ns() % 10**9:09d}"
        payload = self.directory / stamp
        payload.mkdir(mode=0o755)
        for name, text in files.items():
            (payload / name).write_text(text)
            os.chmod(payload / name, 0o644)
        temporary = self.directory / "..data_tmp"
        os.symlink(stamp, temporary)
        os.rename(temporary, self.directory / "..data")
        for name in files:
            if not (self.directory / name).is_symlink():
                os.symlink(f"..data/{name}", self.directory / name)
        if self._current is not None:
            for old in self._current.iterdir():
                old.unlink()
            self._current.rmdir()
        self._current = payload


@dataclass
class PodCommand:
    argv: list[str]           # podman run's options, the image and the args
    env: dict[str, str]       # the container's environment, as the kubelet resolved it
    liveness_url: str         # the liveness probe's httpGet, on the host network
    stop_timeout: int
    readiness: list[str]      # the readiness probe's command, run in the container


def pod_command(spec: dict[str, Any], *, name: str, node_root: Path, config_map: ConfigMapVolume,
                field_values: dict[str, str]) -> PodCommand:
    """``podman run`` options for the pod's one container (its image and args last)."""
    _only(spec, POD_FIELDS, "pod spec")
    (container,) = spec["containers"]
    _only(container, CONTAINER_FIELDS, f"container {container['name']}")
    argv = ["--name", name]
    if spec.get("hostNetwork"):
        argv += ["--network", "host", "--uts", "host"]  # a hostNetwork pod has the node's host name too
    stop_timeout = int(spec.get("terminationGracePeriodSeconds", 30))
    argv += ["--stop-timeout", str(stop_timeout)]
    if container.get("imagePullPolicy") in ("IfNotPresent", "Never"):
        argv += ["--pull", "never"]  # built here: present, so never pulled

    env: dict[str, str] = {}
    for variable in container.get("env", []):
        _only(variable, {"name", "value", "valueFrom"}, f"env {variable['name']}")
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            (source,) = variable["valueFrom"].items()
            if source[0] != "fieldRef":
                raise UnknownField(f"env {variable['name']}: valueFrom.{source[0]}")
            _only(source[1], {"fieldPath"}, f"env {variable['name']}: fieldRef")
            env[variable["name"]] = field_values[source[1]["fieldPath"]]
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]

    argv += _security(container.get("securityContext", {}))
    resources = container.get("resources", {})
    _only(resources, {"requests", "limits"}, "resources")
    _only(resources.get("limits", {}), {"memory"}, "resources.limits")
    if limit := resources.get("limits", {}).get("memory"):
        argv += ["--memory", str(_bytes(limit))]
    argv += _volumes(spec["volumes"], container["volumeMounts"], node_root, config_map)

    def expand(argument: str) -> str:  # the kubelet's $(VAR) expansion ($$ escapes)
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), argument)

    argv += [container["image"], *(expand(argument) for argument in container.get("args", []))]
    for port in container.get("ports", []):
        _only(port, {"name", "containerPort", "protocol"}, f"port {port.get('name')}")
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    _only(container["livenessProbe"], {"httpGet", *PROBE_TIMINGS}, "livenessProbe")
    probe = container["livenessProbe"]["httpGet"]
    _only(probe, {"path", "port"}, "livenessProbe.httpGet")
    port = ports.get(probe["port"], probe["port"])
    url = f"http://{field_values['status.hostIP']}:{port}{probe['path']}"  # a hostNetwork pod's IP is the node's
    _only(container["readinessProbe"], {"exec", *PROBE_TIMINGS}, "readinessProbe")
    _only(container["readinessProbe"]["exec"], {"command"}, "readinessProbe.exec")
    return PodCommand(argv, env, url, stop_timeout, list(container["readinessProbe"]["exec"]["command"]))


def _security(context: dict[str, Any]) -> list[str]:
    _only(context, SECURITY_FIELDS, "securityContext")
    argv = ["--user", f"{context.get('runAsUser', 0)}:{context.get('runAsGroup', 0)}"]
    if context.get("privileged"):
        argv.append("--privileged")
    if context.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    if context.get("readOnlyRootFilesystem"):
        argv += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs the kubelet would not mount either
    capabilities = context.get("capabilities", {})
    argv += [f"--cap-drop={name}" for name in capabilities.get("drop", [])]
    argv += [f"--cap-add={name}" for name in capabilities.get("add", [])]
    if context.get("seccompProfile", {}).get("type", "RuntimeDefault") != "RuntimeDefault":
        raise UnknownField(f"seccompProfile {context['seccompProfile']}")
    apparmor = context.get("appArmorProfile", {}).get("type", "RuntimeDefault")
    if apparmor == "Unconfined":
        argv += ["--security-opt", "apparmor=unconfined"]
    elif apparmor != "RuntimeDefault":
        raise UnknownField(f"appArmorProfile {context['appArmorProfile']}")
    return argv


def _volumes(volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], node_root: Path,
             config_map: ConfigMapVolume) -> list[str]:
    sources: dict[str, str] = {}
    argv: list[str] = []
    for volume in volumes:
        _only(volume, {"name", "hostPath", "configMap", "emptyDir"}, f"volume {volume['name']}")
        if "hostPath" in volume:
            _only(volume["hostPath"], {"path", "type"}, f"volume {volume['name']}: hostPath")
            path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
            if any(path == host or path.startswith(host + "/") for host in HOST_PATHS) and os.path.exists(path):
                sources[volume["name"]] = path
                continue
            on_node = node_root / path.lstrip("/")
            if kind == "DirectoryOrCreate":
                on_node.mkdir(mode=0o755, parents=True, exist_ok=True)
            elif not on_node.is_dir():
                raise AssertionError(f"hostPath {path} ({kind}): missing on the node")
            sources[volume["name"]] = str(on_node)
        elif "configMap" in volume:
            _only(volume["configMap"], {"name"}, f"volume {volume['name']}: configMap")  # items would rename keys
            sources[volume["name"]] = str(config_map.directory)
        elif "emptyDir" in volume:
            _only(volume["emptyDir"], {"medium", "sizeLimit"}, f"volume {volume['name']}: emptyDir")
            if volume["emptyDir"].get("medium") == "Memory":
                sources[volume["name"]] = ""  # a tmpfs, below
            else:  # a directory on the node's disk
                on_disk = node_root / "emptydir" / volume["name"]
                on_disk.mkdir(parents=True, exist_ok=True)
                sources[volume["name"]] = str(on_disk)
        else:
            raise UnknownField(f"volume {volume['name']}: {sorted(volume)}")
    by_name = {volume["name"]: volume for volume in volumes}
    for mount in mounts:
        _only(mount, {"name", "mountPath", "readOnly", "recursiveReadOnly"}, f"volumeMount {mount['name']}")
        if mount.get("recursiveReadOnly", "Disabled") not in ("Disabled", "IfPossible"):
            raise UnknownField(f"volumeMount {mount['name']}: recursiveReadOnly {mount['recursiveReadOnly']}")
        # IfPossible: plain read-only where the runtime cannot do better, as this podman (4.3) cannot
        source = sources[mount["name"]]
        if source:
            argv += ["--volume", f"{source}:{mount['mountPath']}:{'ro' if mount.get('readOnly') else 'rw'}"]
        else:
            empty = by_name[mount["name"]]["emptyDir"]
            size = f",size={_bytes(empty['sizeLimit'])}" if "sizeLimit" in empty else ""
            argv += ["--tmpfs", f"{mount['mountPath']}:rw{size}"]
    return argv

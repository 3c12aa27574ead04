"""A DaemonSet rolling update (maxSurge 1, maxUnavailable 0) on one node, with two real daemons:
the old pod (A) serving, the new pod (B) started beside it with another pod UID against the same
state directory, kubelet directories, control socket, CDI and device-info directories, the
kubelet stand-in and the API server stand-in.

What a user sees: the kubelet has both registered and its calls reach the new pod; a claim the
old pod prepared is unprepared through the new one; leases granted before and after the
handover are all in the one lease book; the old pod refuses what it can no longer do safely
(retryable), and its going away takes none of the new pod's sockets or files.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon._generated.dra.v1 import api_pb2 as dra_v1
from daemon._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from daemon.settings import rolling_update_registration_socket_name
from tests.apiserver import ApiServer
from tests.books import book_document
from tests.daemonrun import DaemonProcess, control_cli, daemon_command, wait_for_control
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet
from tests.seam import Seam, create_vfs
from tests.test_dra_daemon import DRIVER, RESOURCE, add_kvm, claim, config, dra_daemon, names, wait_published
from tests.test_dra_daemon import api as api  # a fixture
from tests.test_dra_daemon import dra_kubelet as dra_kubelet  # a fixture
from tests.waiting import wait_until

UID_A = "aaaaaaaa-0000-4000-8000-00000000000a"
UID_B = "bbbbbbbb-0000-4000-8000-00000000000b"
KVM = "intel.com/kvm"


@pytest.fixture
def start_pod(run_daemon: Callable[..., DaemonProcess], seam: Seam, api: ApiServer, host: FakeHost,
              short_tmp: Path) -> Callable[..., DaemonProcess]:
    """``devplugd run`` as a pod of the DaemonSet would run it: its pod UID, the node's paths."""
    add_kvm(host)

    def start(pod_uid: str | None, *, wait: bool = True) -> DaemonProcess:
        kubeconfig = api.kubeconfig(short_tmp / "kubeconfig")
        uid = ("--pod-uid", pod_uid) if pod_uid else ()
        if not wait:  # its uevent socket is bound only once it is active
            return run_daemon(config(), "--uevent-source", f"unix:{seam.path}", "--node-name", "node1",
                              "--dra-plugin-dir", str(short_tmp / "plugins"), "--kubeconfig", str(kubeconfig), *uid)
        return dra_daemon(run_daemon, seam, short_tmp, config(), "--kubeconfig", str(kubeconfig), *uid)
    return start


def ready(short_tmp: Path, pod_uid: str) -> tuple[int, str]:
    """``devplugd active`` as the DaemonSet's readiness probe runs it in the pod ($POD_UID)."""
    done = subprocess.run(daemon_command("active", "--state-dir", str(short_tmp / "state")), capture_output=True,
                          text=True, timeout=30, env={**os.environ, "POD_UID": pod_uid})
    return done.returncode, done.stderr


def lease_book(short_tmp: Path) -> dict[str, Any]:
    """The lease book as it is on disk (parsed: a torn file fails here)."""
    book: dict[str, Any] = book_document(short_tmp / "state" / "leases.json")
    return book


def sockets_in(directory: Path) -> set[str]:
    return {name for name in os.listdir(directory) if stat.S_ISSOCK(os.lstat(directory / name).st_mode)}


def prepare_directly(endpoint: str, ref: tuple[str, str, str]) -> grpc.RpcError | None:
    """NodePrepareResources on one instance's own socket, bypassing the kubelet's choice."""
    with grpc.insecure_channel(f"unix://{endpoint}") as channel:
        try:
            dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources(dra_v1.NodePrepareResourcesRequest(
                claims=[dra_v1.Claim(namespace=ref[0], uid=ref[1], name=ref[2])]), timeout=10)
        except grpc.RpcError as error:
            return error
    return None


def test_a_rolling_update_hands_the_state_to_the_new_pod_and_keeps_a_plugin_registered_throughout(
    api: ApiServer, host: FakeHost, seam: Seam, dra_kubelet: FakeKubelet, start_pod: Callable[..., DaemonProcess],
    short_tmp: Path,
) -> None:
    vfs = create_vfs(host, None, 0, 4)
    old = start_pod(UID_A)
    dra_kubelet.wait_for_dra(DRIVER)
    assert ready(short_tmp, UID_A) == (0, "") and ready(short_tmp, UID_B)[0] == 1  # the DaemonSet's readiness
    wait_published(api, names(*vfs))
    dra_kubelet.wait_for_devices(KVM, 1)
    control = short_tmp / "control.sock"
    wait_for_control(control)
    first = claim(api, "before", vfs[0])
    dra_kubelet.prepare([first])
    leased_by_old = json.loads(control_cli(control, "allocate", RESOURCE, "--device", vfs[2], "-o", "json").stdout)

    new = start_pod(UID_B)  # the surge pod, beside the old one
    new.wait_for_log("took the state directory")
    assert ready(short_tmp, UID_B) == (0, "")  # Ready only now: the old pod is stopped only now
    assert "is active, not this pod's devplugd" in ready(short_tmp, UID_A)[1]
    old.wait_for_log("handed over to devplugd pid")
    assert f"pod {UID_B}" in old.log  # it says to whom
    registry, plugins = short_tmp / "plugins_registry", short_tmp / "plugins" / DRIVER
    expected = [(str(registry / rolling_update_registration_socket_name(registry, DRIVER, uid)),
                 str(plugins / f"dra-{uid}.sock")) for uid in (UID_A, UID_B)]
    assert dra_kubelet.wait_for_dra_instances(DRIVER, 2) == expected  # both registered, the old one first
    new_endpoint = expected[1][1]

    # the kubelet's calls reach the new pod, which unprepares what the old one prepared
    dra_kubelet.unprepare([first])
    assert not (short_tmp / "cdi" / f"devplugd-claim-{first[1]}.json").exists()
    second = claim(api, "after", vfs[0])  # the VF is free again, through the new pod's books
    assert dra_kubelet.prepare([second])[second[1]].devices[0].device_name == sorted(names(vfs[0]))[0]
    assert [endpoint for _, endpoint in dra_kubelet.dra_state(DRIVER).calls[-2:]] == [new_endpoint] * 2
    # the old pod, asked directly, refuses: retryable, and naming who has the state now
    refused = prepare_directly(expected[0][1], claim(api, "to-the-old-one", vfs[1]))
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert f"handed over to devplugd pid {new.process.pid} in pod {UID_B}" in refused.details()

    # one lease book: the old pod's lease is the new pod's to know, its next lease is written beside it
    wait_for_control(control)
    refused_lease = control_cli(control, "allocate", RESOURCE, "--device", vfs[2])
    assert refused_lease.returncode != 0 and "held by" in refused_lease.stderr
    leased_by_new = json.loads(control_cli(control, "allocate", RESOURCE, "--device", vfs[3], "-o", "json").stdout)
    assert {lease["lease"] for lease in lease_book(short_tmp)["leases"]} == {leased_by_old["lease"], leased_by_new["lease"]}
    wait_published(api, names(vfs[0], vfs[1]))  # both leased VFs out of the slices the new pod writes
    dra_kubelet.wait_for(lambda k: k.state(KVM).connected and k.state(KVM).registrations == 2, what="kvm from B")

    # the old pod goes (SIGTERM): the new one stays registered and serving, with all its files
    before = {directory: sockets_in(short_tmp / directory) for directory in ("device-plugins", "plugins_registry")}
    cdi_files = set(os.listdir(short_tmp / "cdi"))
    assert old.stop() == 0
    assert dra_kubelet.wait_for_dra_instances(DRIVER, 1) == expected[1:]
    assert dra_kubelet.dra_state(DRIVER).registered
    assert sockets_in(short_tmp / "plugins_registry") == before["plugins_registry"] - {Path(expected[0][0]).name}
    assert sockets_in(short_tmp / "device-plugins") == before["device-plugins"]
    assert sockets_in(plugins) == {f"dra-{UID_B}.sock"}
    assert set(os.listdir(short_tmp / "cdi")) == cdi_files and f"devplugd-claim-{second[1]}.json" in cdi_files
    assert stat.S_ISSOCK(os.lstat(control).st_mode) and stat.S_ISSOCK(os.lstat(short_tmp / "state" / "handover.sock")
                                                                      .st_mode)
    third = claim(api, "later", vfs[1])
    assert dra_kubelet.prepare([third])[third[1]].devices
    dra_kubelet.wait_for_devices(KVM, 1)
    assert json.loads(control_cli(control, "leases", "-o", "json").stdout)
    assert "Traceback" not in old.log + new.log
    assert new.process.poll() is None


def test_without_a_pod_uid_a_second_daemon_waits_for_the_first_to_stop(
    api: ApiServer, host: FakeHost, seam: Seam, dra_kubelet: FakeKubelet, start_pod: Callable[..., DaemonProcess],
    short_tmp: Path,
) -> None:
    """Not a rolling update (no pod UID: started by hand beside the unit, say): it takes nothing
    over, and becomes active only once the first one has stopped."""
    create_vfs(host, None, 0, 1)
    first = start_pod(None)
    dra_kubelet.wait_for_dra(DRIVER)
    second = start_pod(None, wait=False)
    second.wait_for_log("waiting until it stops")
    control = short_tmp / "control.sock"
    wait_for_control(control)  # still the first one's
    assert "handing over" not in first.log and first.process.poll() is None
    assert first.stop() == 0
    second.wait_for_log("took the state directory")
    seam.wait_ready()
    dra_kubelet.wait_for_dra(DRIVER, registrations=2)
    wait_until(lambda: control_cli(control, "list").returncode == 0, what="the second one's control socket")


def test_the_first_rolling_update_waits_out_an_old_daemon_that_takes_no_lock(
    api: ApiServer, host: FakeHost, seam: Seam, dra_kubelet: FakeKubelet, start_pod: Callable[..., DaemonProcess],
    short_tmp: Path,
) -> None:
    """The old pod of the first update to this version takes no lock and cannot be asked: while
    it answers on the control socket the new pod touches nothing shared, and it takes over once
    the old one is gone (the DaemonSet stops it once the new pod runs)."""
    create_vfs(host, None, 0, 1)
    control = short_tmp / "control.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # what the old daemon's control socket answers
    old.bind(str(control))
    old.listen(1)
    try:
        new = start_pod(UID_B, wait=False)
        new.wait_for_log("takes no lock")
        assert not seam.path.exists() and sockets_in(short_tmp / "plugins_registry") == set()
    finally:
        old.close()
    seam.wait_ready()
    dra_kubelet.wait_for_dra(DRIVER)
    wait_for_control(control)

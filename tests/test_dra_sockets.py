"""The DRA plugin's sockets: dra.sock (DRAPlugin v1 and v1beta1, DRAResourceHealth) and the
registration socket, served in the test's trio run over real unix sockets, registered with the
kubelet stand-in's plugin watcher, and served again when the kubelet removes them."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path

import pytest
import trio
import trio_asyncio

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon._generated.dra.v1 import api_pb2 as dra_v1
from daemon._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from daemon._generated.drahealth.v1 import api_pb2 as dra_health_v1
from daemon._generated.drahealth.v1alpha1 import api_pb2 as dra_health
from daemon._generated.pluginregistration.v1 import api_pb2 as reg
from daemon.core._notifier import Notifier
from daemon.dra import SUPPORTED_VERSIONS, DraSockets, HealthServicer
from daemon.settings import Settings, rolling_update_registration_socket_name
from tests.drasockets import DRIVER, NODE, POOL, DraRig, RecordingPlugin, dra_settings, get_info, serving_dra
from tests.kubelet import DraCallError, FakeKubelet
from tests.waiting import wait_until_async

CLAIMS = [("default", "uid-1", "claim-1"), ("default", "uid-2", "claim-2")]


def _identity(path) -> tuple[int, int, int] | None:
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


def test_the_dra_protos_have_the_kubelets_names_beside_the_device_plugin_api():
    services = {
        module.DESCRIPTOR.name: [s.full_name for s in module.DESCRIPTOR.services_by_name.values()]
        for module in (dra_v1, dra_v1beta1, dra_health, dra_health_v1)
    }
    assert services == {
        "daemon/_generated/dra/v1/api.proto": ["k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"],
        "daemon/_generated/dra/v1beta1/api.proto": ["k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"],
        "daemon/_generated/drahealth/v1alpha1/api.proto": ["v1alpha1.DRAResourceHealth"],
        "daemon/_generated/drahealth/v1/api.proto": ["v1.DRAResourceHealth"],
    }
    plugin = dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert [m.name for m in plugin.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert {f.name: f.number for f in dra_v1.Device.DESCRIPTOR.fields} == {
        "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
    assert {f.name: f.number for f in dra_v1beta1.Device.DESCRIPTOR.fields} == {
        "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    assert {f.name: f.number for f in dra_v1.Claim.DESCRIPTOR.fields} == {"namespace": 1, "uid": 2, "name": 3}
    assert {f.name: f.number for f in dra_health.DeviceHealth.DESCRIPTOR.fields} == {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5}
    assert dra_health.HealthStatus.Name(2) == "UNHEALTHY"
    # one descriptor pool holds all of them: same-named messages in different packages
    assert {dp.Device.DESCRIPTOR.full_name, dra_v1.Device.DESCRIPTOR.full_name,
            dra_v1beta1.Device.DESCRIPTOR.full_name} == {
        "v1beta1.Device", "k8s.io.kubelet.pkg.apis.dra.v1.Device", "k8s.io.kubelet.pkg.apis.dra.v1beta1.Device"}
    assert reg.DESCRIPTOR.services_by_name["Registration"].full_name == "pluginregistration.Registration"


async def test_get_info_names_the_driver_dra_sock_and_the_services_v1_first(short_tmp):
    async with serving_dra(short_tmp) as rig:
        info = await get_info(rig.settings.dra_registration_socket)
        assert info.type == "DRAPlugin"
        assert info.name == DRIVER
        assert info.endpoint == str(short_tmp / "plugins" / DRIVER / "dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                                 "v1alpha1.DRAResourceHealth"]
        assert list(info.supported_versions) == list(SUPPORTED_VERSIONS)
        assert rig.settings.dra_registration_socket == short_tmp / "plugins_registry" / f"{DRIVER}-reg.sock"
        state = await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        assert state.service == "v1.DRAPlugin"


async def test_the_plugin_directory_is_made_0750_and_the_sockets_exist_once_started(short_tmp):
    async with serving_dra(short_tmp, with_inotify=False) as rig:
        # started means served: both files are sockets before the kubelet got to them
        assert stat.S_ISSOCK(os.lstat(rig.settings.dra_socket).st_mode)
        assert stat.S_ISSOCK(os.lstat(rig.settings.dra_registration_socket).st_mode)
        assert stat.S_IMODE(os.stat(rig.settings.dra_socket.parent).st_mode) == 0o750
        assert rig.sockets.serving


async def test_the_kubelets_registration_status_is_recorded(short_tmp):
    async with serving_dra(short_tmp) as rig:
        assert not rig.sockets.registered
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        await wait_until_async(lambda: rig.sockets.registered, what="NotifyRegistrationStatus(true) recorded")
        assert rig.sockets.registration_error == ""


async def test_a_kubelet_without_our_versions_refuses_and_the_error_is_recorded_and_logged(short_tmp, caplog):
    caplog.set_level(logging.INFO, logger="devplugd.dra")
    async with serving_dra(short_tmp, kubelet_versions=("v1alpha4.DRAPlugin",)) as rig:
        await wait_until_async(lambda: rig.sockets.registration_error != "", what="the refusal recorded")
        assert not rig.sockets.registered
        assert ('none of services supported by the plugin (["v1.DRAPlugin" "v1beta1.DRAPlugin" '
                '"v1.DRAResourceHealth" "v1alpha1.DRAResourceHealth"]) are supported by the kubelet '
                '(["v1alpha4.DRAPlugin"])') in rig.sockets.registration_error
        assert "kubelet refused DRA driver devplugd.io" in caplog.text
        assert rig.run_ended == []  # a refusal is the kubelet's to retry; we keep serving
        assert rig.sockets.serving


@pytest.mark.parametrize("version", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
async def test_both_versions_reach_the_one_v1_servicer_with_the_same_claims(short_tmp, version):
    async with serving_dra(short_tmp, kubelet_versions=(version,)) as rig:
        state = await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        assert state.service == version
        answers = await rig.kubelet_call(rig.kubelet.prepare, CLAIMS)
        expected = dra_v1.NodePrepareResourcesRequest(claims=[
            dra_v1.Claim(namespace=namespace, uid=uid, name=name) for namespace, uid, name in CLAIMS])
        assert rig.plugin.prepared == [expected]
        assert sorted(answers) == ["uid-1", "uid-2"]
        device = answers["uid-1"].devices[0]
        assert (device.pool_name, device.device_name, list(device.cdi_device_ids), list(device.request_names)) == (
            POOL, "dev-claim-1", [f"{DRIVER}/claim=uid-1"], ["vf"])
        if version == "v1.DRAPlugin":
            assert isinstance(device, dra_v1.Device)
            assert device.share_id == "share-uid-1"
        else:
            assert isinstance(device, dra_v1beta1.Device)
            # no share_id in v1beta1, not even as an unknown field passed through to the kubelet
            assert "share_id" not in [f.name for f in device.DESCRIPTOR.fields]
            plain = dra_v1beta1.Device(pool_name=POOL, device_name="dev-claim-1", request_names=["vf"],
                                       cdi_device_ids=[f"{DRIVER}/claim=uid-1"])
            assert device.SerializeToString() == plain.SerializeToString()
        undone = await rig.kubelet_call(rig.kubelet.unprepare, CLAIMS[:1])
        assert list(undone) == ["uid-1"] and undone["uid-1"].error == ""
        assert rig.plugin.unprepared == [dra_v1.NodeUnprepareResourcesRequest(claims=expected.claims[:1])]


async def test_the_stand_in_fails_calls_as_the_kubelet_does(short_tmp):
    async with serving_dra(short_tmp) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        rig.plugin.skip = {"uid-2"}
        with pytest.raises(DraCallError, match=r"^NodePrepareResources skipped 1 ResourceClaims$"):
            await rig.kubelet_call(rig.kubelet.prepare, CLAIMS)
        with pytest.raises(DraCallError, match=r"^NodeUnprepareResources skipped 1 ResourceClaims$"):
            await rig.kubelet_call(rig.kubelet.unprepare, CLAIMS)
        rig.plugin.skip, rig.plugin.unknown_uid = set(), "uid-9"
        with pytest.raises(DraCallError, match=r"^NodePrepareResources returned result for unknown claim UID uid-9$"):
            await rig.kubelet_call(rig.kubelet.prepare, CLAIMS)
        rig.plugin.unknown_uid, rig.plugin.errors = "", {"uid-1": "device is gone"}
        with pytest.raises(DraCallError, match=r"^NodePrepareResources failed for ResourceClaim claim-1: device is gone$"):
            await rig.kubelet_call(rig.kubelet.prepare, CLAIMS)
        answers = await rig.kubelet_call(rig.kubelet.prepare, CLAIMS, fail_on_claim_error=False)
        assert answers["uid-1"].error == "device is gone" and len(answers["uid-2"].devices) == 1


async def look_after(rig: DraRig, marker: Path | None = None) -> None:
    """Until the sockets have looked at what is missing after every removal event so far: with
    ``marker`` (a file in a watched directory, not ours), until inotify's removal of it is
    forwarded, so every earlier removal event has been too; then one more look, asked for now."""
    if marker is not None:
        marker.write_bytes(b"")
        marker.unlink()
        await wait_until_async(lambda: str(marker) in rig.removals, what=f"the removal of {marker} forwarded")
    looks = rig.sockets.looks
    rig.sockets.socket_removed(str(rig.settings.dra_socket))  # still ours: a look that changes nothing
    await wait_until_async(lambda: rig.sockets.looks > looks, what="the sockets' look at what is missing")


async def test_a_kubelet_restart_removes_both_sockets_and_both_are_served_and_registered_again(short_tmp):
    async with serving_dra(short_tmp) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        await wait_until_async(lambda: rig.sockets.registered, what="registered")
        before = _identity(rig.settings.dra_socket), _identity(rig.settings.dra_registration_socket)
        removed = await rig.kubelet_call(rig.kubelet.restart_dra)
        assert sorted(removed) == sorted([str(rig.settings.dra_registration_socket), str(rig.settings.dra_socket)])
        await wait_until_async(
            lambda: rig.kubelet.dra_state(DRIVER).registered and rig.kubelet.dra_state(DRIVER).registrations == 2,
            what="registered again")
        after = _identity(rig.settings.dra_socket), _identity(rig.settings.dra_registration_socket)
        assert None not in after and after[0] != before[0] and after[1] != before[1]
        await wait_until_async(lambda: rig.sockets.registered, what="the new registration recorded")
        answers = await rig.kubelet_call(rig.kubelet.prepare, CLAIMS)  # the new endpoint answers
        assert sorted(answers) == ["uid-1", "uid-2"]
        # our own clean-up's removal events arrive late: once they have been acted on, nothing more happened
        await look_after(rig, marker=rig.settings.plugins_registry_dir / "marker")
        assert (_identity(rig.settings.dra_socket), _identity(rig.settings.dra_registration_socket)) == after
        assert rig.kubelet.dra_state(DRIVER).registrations == 2
        assert rig.run_ended == [] and rig.sockets.serving


async def test_a_second_restart_is_survived_too(short_tmp):
    async with serving_dra(short_tmp) as rig:
        for round_ in (1, 2, 3):
            await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, round_)
            await rig.kubelet_call(rig.kubelet.restart_dra)
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, 4)
        assert rig.run_ended == []


async def test_a_removed_registration_socket_alone_is_served_again_and_dra_sock_is_kept(short_tmp):
    async with serving_dra(short_tmp) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        plugin_socket = _identity(rig.settings.dra_socket)
        registration_socket = _identity(rig.settings.dra_registration_socket)
        os.unlink(rig.settings.dra_registration_socket)
        await wait_until_async(lambda: _identity(rig.settings.dra_registration_socket) not in (None, registration_socket),
                               what="the registration socket served again")
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, 2)
        assert _identity(rig.settings.dra_socket) == plugin_socket


async def test_a_removed_dra_sock_alone_is_served_again_and_registered_again(short_tmp):
    async with serving_dra(short_tmp) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        os.unlink(rig.settings.dra_socket)
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, 2)
        assert stat.S_ISSOCK(os.lstat(rig.settings.dra_socket).st_mode)
        answers = await rig.kubelet_call(rig.kubelet.prepare, CLAIMS[:1])
        assert list(answers) == ["uid-1"]


async def test_a_removal_event_about_a_socket_that_is_still_ours_changes_nothing(short_tmp):
    async with serving_dra(short_tmp, with_inotify=False) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        before = _identity(rig.settings.dra_socket), _identity(rig.settings.dra_registration_socket)
        rig.sockets.socket_removed(str(rig.settings.dra_socket))
        rig.sockets.socket_removed(str(rig.settings.dra_registration_socket))
        rig.sockets.socket_removed(str(short_tmp / "plugins_registry" / "other-reg.sock"))
        await look_after(rig)
        assert (_identity(rig.settings.dra_socket), _identity(rig.settings.dra_registration_socket)) == before
        assert rig.kubelet.dra_state(DRIVER).registrations == 1


async def test_cancelling_run_stops_both_servers_and_removes_both_sockets(short_tmp):
    settings = dra_settings(short_tmp)
    async with serving_dra(short_tmp) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
    assert rig.run_ended == ["Cancelled"]
    assert not settings.dra_socket.exists() and not settings.dra_registration_socket.exists()
    assert settings.dra_socket.parent.is_dir()


async def test_run_reports_started_when_it_cannot_listen_and_serves_once_it_can(short_tmp, caplog):
    settings = dra_settings(short_tmp)
    settings.dra_socket.parent.mkdir(parents=True)
    settings.dra_socket.write_text("not a socket: left alone, and in the way")
    async with serving_dra(short_tmp) as rig:
        assert not rig.sockets.serving
        assert "cannot serve DRA driver devplugd.io" in caplog.text
        assert settings.dra_socket.read_text().startswith("not a socket")
        settings.dra_socket.unlink()
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, timeout=5.0)
        assert rig.sockets.serving and rig.run_ended == []


# -- rolling updates: the pod's UID in the socket names ------------------------------------------
UID_A = "11111111-2222-3333-4444-555555555555"
UID_B = "ad4af911-5bcd-47c5-a554-f35cea869472"
REGISTRY = Path("/var/lib/kubelet/plugins_registry")


@pytest.mark.parametrize(("driver", "expected"), [
    # the full UID when the path fits in 108 bytes
    ("devplugd.io", f"devplugd.io-{UID_B}-reg.sock"),
    # too long with it (114 bytes): 8 bytes of sha256(UID), unpadded URL-safe base64 (from openssl)
    ("gpu.dra-example-driver.sigs.k8s.io", "gpu.dra-example-driver.sigs.k8s.io-Jk8-oymVURI-reg.sock"),
    # too long even so: dra- and 16 bytes of sha256(driver NUL UID), the driver's name left out
    ("a" * 100, "dra-0XAjsR3nLFWHa0HL1OOe6g-reg.sock"),
])
def test_a_pod_uid_names_the_registration_socket_as_the_go_helper_does(driver: str, expected: str) -> None:
    assert rolling_update_registration_socket_name(REGISTRY, driver, UID_B) == expected
    settings = Settings(plugins_registry_dir=REGISTRY, dra_driver=driver, pod_uid=UID_B)
    assert settings.dra_registration_socket == REGISTRY / expected
    assert len(str(settings.dra_registration_socket)) <= 108


def test_the_full_uid_form_is_kept_up_to_108_bytes_and_left_one_byte_later() -> None:
    name = f"devplugd.io-{UID_A}-reg.sock"
    fits = Path("/" + "r" * (108 - len(name) - 2))
    assert len(f"{fits}/{name}") == 108
    assert rolling_update_registration_socket_name(fits, "devplugd.io", UID_A) == name
    assert rolling_update_registration_socket_name(Path(f"{fits}r"), "devplugd.io", UID_A) != name


def test_a_pod_uid_names_the_plugin_socket_in_the_shared_driver_directory_and_none_keeps_the_old_names(
        short_tmp: Path) -> None:
    with_uid = dataclasses.replace(dra_settings(short_tmp), pod_uid=UID_A)
    assert with_uid.dra_socket == short_tmp / "plugins" / DRIVER / f"dra-{UID_A}.sock"
    plain = dra_settings(short_tmp)
    assert plain.dra_socket == short_tmp / "plugins" / DRIVER / "dra.sock"
    assert plain.dra_registration_socket == short_tmp / "plugins_registry" / f"{DRIVER}-reg.sock"


async def test_two_pods_of_a_rolling_update_are_registered_side_by_side_and_the_newest_gets_the_calls(
        short_tmp: Path) -> None:
    """The old pod (A) serving, the new one (B) started beside it: the kubelet stand-in registers
    both, calls go to B; A stopping takes only its own sockets, and B stays registered."""
    kubelet = FakeKubelet(short_tmp / "device-plugins", short_tmp / "plugins_registry")
    kubelet.start()
    try:
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            notifier = Notifier()
            instances: dict[str, tuple[Settings, RecordingPlugin, trio.CancelScope]] = {}
            for uid in (UID_A, UID_B):
                settings = dataclasses.replace(dra_settings(short_tmp), pod_uid=uid)
                plugin = RecordingPlugin()
                sockets = DraSockets(settings, plugin, HealthServicer(notifier, NODE))
                scope = trio.CancelScope()

                async def run(sockets: DraSockets = sockets, scope: trio.CancelScope = scope,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                    with scope:
                        await sockets.run(task_status=task_status)
                await nursery.start(run)
                instances[uid] = (settings, plugin, scope)
                await trio.to_thread.run_sync(kubelet.wait_for_dra_instances, DRIVER, len(instances))
            (a_settings, a_plugin, a_scope), (b_settings, b_plugin, _) = instances[UID_A], instances[UID_B]
            registered = await trio.to_thread.run_sync(kubelet.dra_instances, DRIVER)
            assert registered == [(str(s.dra_registration_socket), str(s.dra_socket)) for s in (a_settings, b_settings)]
            await trio.to_thread.run_sync(kubelet.prepare, CLAIMS[:1])
            assert len(b_plugin.prepared) == 1 and a_plugin.prepared == []
            a_scope.cancel()  # the old pod stops
            await trio.to_thread.run_sync(kubelet.wait_for_dra_instances, DRIVER, 1)
            assert not a_settings.dra_socket.exists() and not a_settings.dra_registration_socket.exists()
            assert stat.S_ISSOCK(os.lstat(b_settings.dra_socket).st_mode)
            assert stat.S_ISSOCK(os.lstat(b_settings.dra_registration_socket).st_mode)
            assert kubelet.dra_state(DRIVER).registered
            await trio.to_thread.run_sync(kubelet.unprepare, CLAIMS[:1])
            assert len(b_plugin.unprepared) == 1 and a_plugin.unprepared == []
            assert [endpoint for _, endpoint in kubelet.dra_state(DRIVER).calls] == [str(b_settings.dra_socket)] * 2
            nursery.cancel_scope.cancel()
    finally:
        kubelet.close()

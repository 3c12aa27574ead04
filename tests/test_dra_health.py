"""DRAResourceHealth for the DRA pools, as the kubelet stand-in's health cache sees it: the first
message lists every DRA device, each health change sends the full list again, other pools are
never in it, and an unchanged list is repeated before the kubelet would take it as Unknown."""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any

import trio

from daemon._generated.drahealth.v1alpha1 import api_pb2 as dra_health
from daemon.core import UNHEALTHY, DeviceInfo, DeviceSpec, ResourcePool
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD, DeviceTree
from daemon.dra import device_name, pool_name
from daemon.dra._health import HEALTH_TIMEOUT_SECONDS, RESEND_INTERVAL, VANISHED_MESSAGE, health_report
from tests.drasockets import DRIVER, NODE, DraRig, serving_dra, wait_until

X, Y, PLUGIN_POOL, WITHHELD = "example.com/x", "example.com/y", "example.com/plugin", "example.com/withheld"
PCI = "0000:3b:02.1"


def pool(resource: str, devices: dict[str, DeviceInfo], road: str = DRA_ROAD, **holds: Any) -> ResourcePool:
    return ResourcePool(resource, "test", None, MappingProxyType(devices), road=road, **holds)


def key(resource: str, device_id: str) -> tuple[str, str]:
    return pool_name(NODE, resource), device_name(device_id)


def first_tree() -> DeviceTree:
    return DeviceTree.build(1, [
        # held devices stay out of the slices but still report their health
        pool(X, {"d1": DeviceInfo(), PCI: DeviceInfo(), "leased": DeviceInfo(), "claimed": DeviceInfo(),
                 "held": DeviceInfo()},
             leased=frozenset({"leased"}), claimed=frozenset({"claimed"}), kubelet_held=frozenset({"held"})),
        pool(Y, {"kvm-3": DeviceInfo(health=UNHEALTHY)}),
        pool(PLUGIN_POOL, {"p1": DeviceInfo()}, road=DEVICE_PLUGIN_ROAD),
        pool(WITHHELD, {"w1": DeviceInfo()}, road=WITHHELD_ROAD),
    ])


EVERY_DRA_DEVICE = {
    key(X, "d1"): ("Healthy", ""), key(X, PCI): ("Healthy", ""), key(X, "leased"): ("Healthy", ""),
    key(X, "claimed"): ("Healthy", ""), key(X, "held"): ("Healthy", ""), key(Y, "kvm-3"): ("Unhealthy", ""),
}


async def messages(rig: DraRig, count: int, timeout: float = 5.0) -> list[dict[tuple[str, str], Any]]:
    await wait_until(lambda: len(rig.kubelet.dra_state(DRIVER).health_messages) >= count,
                     f"{count} health messages", timeout)
    return rig.kubelet.dra_state(DRIVER).health_messages


def test_the_report_names_pools_and_devices_as_the_slices_do():
    report = health_report(first_tree(), NODE)
    assert [(pool_id, device) for pool_id, device, _, _ in report] == sorted(EVERY_DRA_DEVICE)
    assert key(X, PCI) == ("node1/example.com/x", "0000-3b-02-1")
    assert all(entry[0].startswith(f"{NODE}/") for entry in report)


async def test_the_first_message_lists_every_device_of_every_dra_pool_and_nothing_else(short_tmp):
    async with serving_dra(short_tmp, tree=first_tree()) as rig:
        first = (await messages(rig, 1))[0]
        assert {k: (record.health, record.message) for k, record in first.items()} == EVERY_DRA_DEVICE
        assert not any(k[0] in (pool_name(NODE, PLUGIN_POOL), pool_name(NODE, WITHHELD)) for k in first)
        record = first[key(X, "d1")]
        assert record.timeout == HEALTH_TIMEOUT_SECONDS
        assert abs(record.last_updated_time - time.time()) < 5
        assert rig.kubelet.dra_health(DRIVER) == EVERY_DRA_DEVICE
        assert rig.kubelet.dra_state(DRIVER).health_streams == 1


async def test_a_device_turning_unhealthy_sends_the_full_list_again(short_tmp):
    tree = first_tree()
    async with serving_dra(short_tmp, tree=tree) as rig:
        await messages(rig, 1)
        x = tree.pools[X]
        sick = pool(X, {**x.devices, "d1": DeviceInfo(health=UNHEALTHY)},
                    leased=x.leased, claimed=x.claimed, kubelet_held=x.kubelet_held)
        rig.notifier.publish(DeviceTree.build(2, [sick, *(p for r, p in tree.pools.items() if r != X)]))
        second = (await messages(rig, 2))[1]
        assert {k: record.health for k, record in second.items()} == {
            **{k: health for k, (health, _) in EVERY_DRA_DEVICE.items()}, key(X, "d1"): "Unhealthy"}
        assert rig.kubelet.dra_health(DRIVER)[key(X, "d1")] == ("Unhealthy", "")


async def test_trees_that_change_no_dra_health_send_nothing(short_tmp):
    tree = first_tree()
    async with serving_dra(short_tmp, tree=tree) as rig:
        await messages(rig, 1)
        others = {r: p for r, p in tree.pools.items()}
        # the device-plugin pool loses its device; a DRA device changes what health does not show
        others[PLUGIN_POOL] = pool(PLUGIN_POOL, {}, road=DEVICE_PLUGIN_ROAD)
        rig.notifier.publish(DeviceTree.build(2, list(others.values())))
        others[Y] = pool(Y, {"kvm-3": DeviceInfo(health=UNHEALTHY, specs=(DeviceSpec("/dev/kvm", "/dev/kvm"),))})
        rig.notifier.publish(DeviceTree.build(3, list(others.values())))
        others[Y] = pool(Y, {"kvm-3": DeviceInfo()})  # and now its health changes
        rig.notifier.publish(DeviceTree.build(4, list(others.values())))
        await messages(rig, 2)
        await trio.sleep(0.2)
        sent = rig.kubelet.dra_state(DRIVER).health_messages
        assert len(sent) == 2
        assert sent[1][key(Y, "kvm-3")].health == "Healthy"


async def test_vanished_devices_are_unhealthy_and_say_why(short_tmp):
    tree = DeviceTree.build(1, [pool(X, {"d1": DeviceInfo(), "gone": DeviceInfo()}, vanished=frozenset({"gone"}),
                                     claimed=frozenset({"gone"}))])
    async with serving_dra(short_tmp, tree=tree) as rig:
        await messages(rig, 1)
        assert rig.kubelet.dra_health(DRIVER) == {
            key(X, "d1"): ("Healthy", ""), key(X, "gone"): ("Unhealthy", VANISHED_MESSAGE)}


async def test_devices_and_pools_that_come_and_go_send_the_new_list(short_tmp):
    async with serving_dra(short_tmp, tree=DeviceTree.build(1, [pool(X, {"d1": DeviceInfo()})])) as rig:
        await messages(rig, 1)
        rig.notifier.publish(DeviceTree.build(2, [pool(X, {"d1": DeviceInfo(), "d2": DeviceInfo()})]))
        assert set((await messages(rig, 2))[1]) == {key(X, "d1"), key(X, "d2")}
        # moved back to the device-plugin API: out of the list
        rig.notifier.publish(DeviceTree.build(3, [pool(X, {"d1": DeviceInfo(), "d2": DeviceInfo()},
                                                       road=DEVICE_PLUGIN_ROAD)]))
        assert (await messages(rig, 3))[2] == {}


async def test_an_unchanged_list_is_sent_again_so_the_kubelet_never_takes_it_as_unknown(short_tmp):
    async with serving_dra(short_tmp, resend_interval=0.1, tree=DeviceTree.build(1, [pool(X, {"d1": DeviceInfo()})])
                           ) as rig:
        # trees keep coming without a health change: the repeat is due all the same
        for version in range(2, 8):
            rig.notifier.publish(DeviceTree.build(version, [pool(X, {"d1": DeviceInfo()})]))
            await trio.sleep(0.05)
        sent = await messages(rig, 3, timeout=2.0)
        assert all(list(message) == [key(X, "d1")] for message in sent)
        assert {(m[key(X, "d1")].health, m[key(X, "d1")].timeout) for m in sent} == {("Healthy", HEALTH_TIMEOUT_SECONDS)}
        state = rig.kubelet.dra_state(DRIVER)
        # arrival stamps keep moving: the kubelet's 30 s timeout is always far off
        assert sent[-1][key(X, "d1")].received_at > sent[0][key(X, "d1")].received_at
        assert state.current_health(now=sent[-1][key(X, "d1")].received_at + HEALTH_TIMEOUT_SECONDS - 1) == {
            key(X, "d1"): ("Healthy", "")}
        assert state.current_health(now=sent[-1][key(X, "d1")].received_at + HEALTH_TIMEOUT_SECONDS + 1) == {
            key(X, "d1"): ("Unknown", "")}


async def test_a_stream_ends_and_unsubscribes_when_the_kubelet_goes(short_tmp):
    async with serving_dra(short_tmp, tree=DeviceTree.build(1, [pool(X, {"d1": DeviceInfo()})])) as rig:
        await messages(rig, 1)
        assert rig.health_streams() == 1
        await rig.kubelet_call(rig.kubelet.restart_dra)
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, 2, timeout=2.0)
        await messages(rig, 2)  # the new registration's stream
        # the old stream ends when its server stops or, at the latest, at its next resend
        # (RESEND_INTERVAL) to a connection that is gone: allow that on a loaded machine
        await wait_until(lambda: rig.health_streams() == 1,
                         "only the new stream subscribed", timeout=RESEND_INTERVAL + 10.0,
                         state=lambda: f"{rig.health_streams()} streams subscribed")
        assert rig.kubelet.dra_health(DRIVER) == {key(X, "d1"): ("Healthy", "")}
        await trio.to_thread.run_sync(rig.kubelet.stop)
        await wait_until(lambda: rig.health_streams() == 0,
                         "the stream ended with the kubelet's connection")
        assert rig.kubelet.dra_health(DRIVER) == {}


async def test_a_kubelet_without_the_health_gate_opens_no_stream_until_asked(short_tmp):
    async with serving_dra(short_tmp, dra_health_gate=False, tree=DeviceTree.build(1, [pool(X, {"d1": DeviceInfo()})])
                           ) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        await trio.sleep(0.1)
        assert rig.health_streams() == 0 and rig.kubelet.dra_state(DRIVER).health_streams == 0
        await rig.kubelet_call(rig.kubelet.watch_health, DRIVER)
        health = await rig.kubelet_call(rig.kubelet.wait_for_health, lambda h: h != {}, DRIVER)
        assert health == {key(X, "d1"): ("Healthy", "")}


def test_health_statuses_are_the_kubelets_numbers():
    assert (dra_health.UNKNOWN, dra_health.HEALTHY, dra_health.UNHEALTHY) == (0, 1, 2)

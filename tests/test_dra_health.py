"""DRAResourceHealth for the DRA pools, as the kubelet stand-in's health cache sees it: the first
message lists every DRA device, each health change sends the full list again, other pools are
never in it, and an unchanged list is repeated before the kubelet would take it as Unknown."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import trio

from daemon._generated.drahealth.v1 import api_pb2 as health_v1
from daemon._generated.drahealth.v1alpha1 import api_pb2 as dra_health
from daemon.core import UNHEALTHY, DeviceInfo, DeviceSpec
from daemon.core._tree import DEVICE_PLUGIN_ROAD, DRA_ROAD, WITHHELD_ROAD, DeviceTree
from daemon.dra import device_name, pool_name
from daemon.dra._health import HEALTH_TIMEOUT_SECONDS, RESEND_INTERVAL, VANISHED_MESSAGE, HealthReports, message_bytes
from tests.drasockets import DRIVER, NODE, DraRig, serving_dra
from tests.kubelet import DRA_HEALTH_VERSIONS
from tests.trees import pool, tree
from tests.waiting import wait_until_async

X, Y, PLUGIN_POOL, WITHHELD = "example.com/x", "example.com/y", "example.com/plugin", "example.com/withheld"
PCI = "0000:3b:02.1"


dra_pool = functools.partial(pool, road=DRA_ROAD)


def key(resource: str, device_id: str) -> tuple[str, str]:
    return pool_name(NODE, resource), device_name(device_id)


def first_tree() -> DeviceTree:
    return tree(
        # held devices stay out of the slices but still report their health
        dra_pool(X, ["d1", PCI, "leased", "claimed", "held"],
                 leased={"leased"}, claimed={"claimed"}, kubelet_held={"held"}),
        dra_pool(Y, ["kvm-3"], unhealthy=["kvm-3"]),
        pool(PLUGIN_POOL, ["p1"], road=DEVICE_PLUGIN_ROAD),
        pool(WITHHELD, ["w1"], road=WITHHELD_ROAD),
        version=1)


EVERY_DRA_DEVICE = {
    key(X, "d1"): ("Healthy", ""), key(X, PCI): ("Healthy", ""), key(X, "leased"): ("Healthy", ""),
    key(X, "claimed"): ("Healthy", ""), key(X, "held"): ("Healthy", ""), key(Y, "kvm-3"): ("Unhealthy", ""),
}


async def messages(rig: DraRig, count: int, timeout: float = 5.0) -> list[dict[tuple[str, str], Any]]:
    await wait_until_async(lambda: len(rig.kubelet.dra_state(DRIVER).health_messages) >= count, timeout,
                           f"{count} health messages")
    return rig.kubelet.dra_state(DRIVER).health_messages


def test_the_report_names_pools_and_devices_as_the_slices_do():
    report = HealthReports(NODE).report(first_tree())
    assert sorted((pool_id, device) for pool_id, part in report.items() for device in part.entries) == sorted(
        EVERY_DRA_DEVICE)
    assert key(X, PCI) == ("node1/example.com/x", "0000-3b-02-1")
    assert all(pool_id.startswith(f"{NODE}/") for pool_id in report)


def test_a_shared_device_is_one_entry_under_the_name_its_slice_publishes():
    """A devNode pool's shares are one device in the slices (KEP-5075), which the claims'
    results name: the kubelet finds that device's health under it, Unhealthy when a share is."""
    shares = {"kvm": ["kvm-0", "kvm-1", "kvm-2"]}
    reports = HealthReports(NODE, shares_of=lambda pool: shares if pool.resource == Y else {})
    healthy = reports.report(tree(dra_pool(X, ["d1"]), dra_pool(Y, shares["kvm"]), version=1))
    assert {pool_id: dict(part.entries) for pool_id, part in healthy.items()} == {
        pool_name(NODE, X): {"d1": (dra_health.HEALTHY, "")}, pool_name(NODE, Y): {"kvm": (dra_health.HEALTHY, "")}}
    sick = reports.report(tree(dra_pool(X, ["d1"]), dra_pool(Y, shares["kvm"], unhealthy=["kvm-1"]), version=2))
    assert dict(sick[pool_name(NODE, Y)].entries) == {"kvm": (dra_health.UNHEALTHY, "")}
    message = health_v1.NodeWatchResourcesResponse.FromString(message_bytes(sick))
    assert [(d.device.pool_name, d.device.device_name) for d in message.devices] == [
        (pool_name(NODE, X), "d1"), (pool_name(NODE, Y), "kvm")]


UNHEALTHY_STATUS = 2  # HealthStatus.UNHEALTHY on the wire


def test_a_message_keeps_each_unchanged_devices_encoding_and_its_time():
    """One device's health changes: the message says so, the others' entries (and their
    last_updated_time: when their health last changed) are what they were."""
    reports = HealthReports(NODE)
    first = health_v1.NodeWatchResourcesResponse.FromString(message_bytes(reports.report(first_tree())))
    time.sleep(1.01)  # a second later: a new encoding would carry another time
    changed = tree(dra_pool(X, ["d1", PCI, "leased", "claimed", "held"], unhealthy=["d1"],
                            leased={"leased"}, claimed={"claimed"}, kubelet_held={"held"}),
                   dra_pool(Y, ["kvm-3"], unhealthy=["kvm-3"]), version=2)
    second = health_v1.NodeWatchResourcesResponse.FromString(message_bytes(reports.report(changed)))
    def by_device(message):
        return {(d.device.pool_name, d.device.device_name): d for d in message.devices}
    before, after = by_device(first), by_device(second)
    assert before.keys() == after.keys() == EVERY_DRA_DEVICE.keys()
    assert [k for k in after if after[k] != before[k]] == [key(X, "d1")]
    assert after[key(X, "d1")].health == UNHEALTHY_STATUS and after[key(X, "d1")].last_updated_time > before[key(X, "d1")].last_updated_time


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


@pytest.mark.parametrize(("known", "chosen"), [
    (DRA_HEALTH_VERSIONS, "v1.DRAResourceHealth"),  # a 1.37 kubelet: v1 when the plugin offers both
    (("v1alpha1.DRAResourceHealth",), "v1alpha1.DRAResourceHealth"),  # a 1.36 kubelet knows only v1alpha1
])
async def test_either_health_version_gets_the_same_stream_on_the_connection_of_the_calls(short_tmp, known, chosen):
    async with serving_dra(short_tmp, tree=first_tree(), dra_health_versions=known) as rig:
        first = (await messages(rig, 1))[0]
        assert {k: (record.health, record.message) for k, record in first.items()} == EVERY_DRA_DEVICE
        state = rig.kubelet.dra_state(DRIVER)
        assert state.health_service == chosen and state.health_streams == 1
        # a change reaches that stream, and a call goes over the same connection meanwhile
        rig.notifier.publish(tree(dra_pool(X, ["d1"], unhealthy=["d1"]), version=2))
        await wait_until_async(lambda: rig.kubelet.dra_health(DRIVER).get(key(X, "d1")) == ("Unhealthy", ""), 5,
                               "the change on the stream")
        answer = await rig.kubelet_call(rig.kubelet.unprepare, [("default", "uid-1", "claim-1")])
        assert list(answer) == ["uid-1"] and state.health_streams == 1


async def test_a_device_turning_unhealthy_sends_the_full_list_again(short_tmp):
    first = first_tree()
    async with serving_dra(short_tmp, tree=first) as rig:
        await messages(rig, 1)
        x = first.pools[X]
        sick = dra_pool(X, x.devices, unhealthy=["d1"], leased=x.leased, claimed=x.claimed,
                        kubelet_held=x.kubelet_held)
        rig.notifier.publish(tree(sick, *(p for r, p in first.pools.items() if r != X), version=2))
        second = (await messages(rig, 2))[1]
        assert {k: record.health for k, record in second.items()} == {
            **{k: health for k, (health, _) in EVERY_DRA_DEVICE.items()}, key(X, "d1"): "Unhealthy"}
        assert rig.kubelet.dra_health(DRIVER)[key(X, "d1")] == ("Unhealthy", "")


async def test_trees_that_change_no_dra_health_send_nothing(short_tmp):
    first = first_tree()
    async with serving_dra(short_tmp, tree=first) as rig:
        await messages(rig, 1)
        others = dict(first.pools)
        # the device-plugin pool loses its device; a DRA device changes what health does not show
        others[PLUGIN_POOL] = pool(PLUGIN_POOL, [], road=DEVICE_PLUGIN_ROAD)
        rig.notifier.publish(tree(*others.values(), version=2))
        others[Y] = dra_pool(Y, {"kvm-3": DeviceInfo(health=UNHEALTHY, specs=(DeviceSpec("/dev/kvm", "/dev/kvm"),))})
        rig.notifier.publish(tree(*others.values(), version=3))
        others[Y] = dra_pool(Y, ["kvm-3"])  # and now its health changes
        rig.notifier.publish(tree(*others.values(), version=4))
        await messages(rig, 2)
        # a later health change: its message comes next, so nothing came between for trees 2 to 4
        others[Y] = dra_pool(Y, ["kvm-3"], unhealthy=["kvm-3"])
        rig.notifier.publish(tree(*others.values(), version=5))
        sent = await messages(rig, 3)
        assert len(sent) == 3
        assert sent[1][key(Y, "kvm-3")].health == "Healthy"
        assert sent[2][key(Y, "kvm-3")].health == "Unhealthy"


async def test_vanished_devices_are_unhealthy_and_say_why(short_tmp):
    async with serving_dra(short_tmp, tree=tree(dra_pool(X, ["d1", "gone"], vanished={"gone"}, claimed={"gone"}),
                                                version=1)) as rig:
        await messages(rig, 1)
        assert rig.kubelet.dra_health(DRIVER) == {
            key(X, "d1"): ("Healthy", ""), key(X, "gone"): ("Unhealthy", VANISHED_MESSAGE)}


async def test_devices_and_pools_that_come_and_go_send_the_new_list(short_tmp):
    async with serving_dra(short_tmp, tree=tree(dra_pool(X, ["d1"]), version=1)) as rig:
        await messages(rig, 1)
        rig.notifier.publish(tree(dra_pool(X, ["d1", "d2"]), version=2))
        assert set((await messages(rig, 2))[1]) == {key(X, "d1"), key(X, "d2")}
        # moved back to the device-plugin API: out of the list
        rig.notifier.publish(tree(pool(X, ["d1", "d2"], road=DEVICE_PLUGIN_ROAD), version=3))
        assert (await messages(rig, 3))[2] == {}


async def test_an_unchanged_list_is_sent_again_so_the_kubelet_never_takes_it_as_unknown(short_tmp):
    async with serving_dra(short_tmp, resend_interval=0.1, tree=tree(dra_pool(X, ["d1"]), version=1)) as rig:
        # trees keep coming without a health change: the repeat is due all the same
        for version in range(2, 8):
            rig.notifier.publish(tree(dra_pool(X, ["d1"]), version=version))
            await trio.sleep(0.05)
        sent = await messages(rig, 3)
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
    async with serving_dra(short_tmp, tree=tree(dra_pool(X, ["d1"]), version=1)) as rig:
        await messages(rig, 1)
        assert rig.health_streams() == 1
        await rig.kubelet_call(rig.kubelet.restart_dra)
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER, 2)
        await messages(rig, 2)  # the new registration's stream
        # the old stream ends when its server stops or, at the latest, at its next resend
        # (RESEND_INTERVAL) to a connection that is gone: allow that on a loaded machine
        await wait_until_async(lambda: rig.health_streams() == 1, RESEND_INTERVAL + 10.0,
                               lambda: f"only the new stream subscribed: {rig.health_streams()} streams subscribed")
        assert rig.kubelet.dra_health(DRIVER) == {key(X, "d1"): ("Healthy", "")}
        await trio.to_thread.run_sync(rig.kubelet.stop)
        await wait_until_async(lambda: rig.health_streams() == 0, what="the stream ended with the kubelet's connection")
        assert rig.kubelet.dra_health(DRIVER) == {}


async def test_a_kubelet_without_the_health_gate_opens_no_stream_until_asked(short_tmp):
    async with serving_dra(short_tmp, dra_health_gate=False, tree=tree(dra_pool(X, ["d1"]), version=1)) as rig:
        await rig.kubelet_call(rig.kubelet.wait_for_dra, DRIVER)
        # registered: a kubelet with the gate has started its stream by now (as it registers)
        assert not await rig.kubelet_call(rig.kubelet.watching_health, DRIVER)
        assert rig.health_streams() == 0 and rig.kubelet.dra_state(DRIVER).health_streams == 0
        await rig.kubelet_call(rig.kubelet.watch_health, DRIVER)
        health = await rig.kubelet_call(rig.kubelet.wait_for_health, lambda h: h != {}, DRIVER)
        assert health == {key(X, "d1"): ("Healthy", "")}


def test_health_statuses_are_the_kubelets_numbers():
    assert (dra_health.UNKNOWN, dra_health.HEALTHY, dra_health.UNHEALTHY) == (0, 1, 2)


def test_a_report_made_from_the_last_one_says_what_a_fresh_one_says():
    """Changed records, a device vanishing with the same record, devices coming and going: the
    part of a pool made from its last part (only changed devices looked at) is what a report
    made from nothing says, and its message carries every device once."""
    reports = HealthReports(NODE)
    first = dra_pool(X, ["d1", "d2", "d3"])
    trees_in_turn = [
        tree(first, version=1),
        tree(dra_pool(X, first.devices, unhealthy=["d2"]), version=2),
        tree(dra_pool(X, first.devices, vanished={"d3"}), version=3),  # the same records, d3 vanished
        tree(dra_pool(X, ["d1", "d4"]), version=4),
        tree(dra_pool(X, ["d1", "d4"]), dra_pool(Y, ["kvm-3"], unhealthy=["kvm-3"]), version=5),
    ]
    for offered in trees_in_turn:
        made = reports.report(offered)
        fresh = HealthReports(NODE).report(offered)
        assert {k: part.entries for k, part in made.items()} == {k: part.entries for k, part in fresh.items()}
        sent = health_v1.NodeWatchResourcesResponse.FromString(message_bytes(made))
        assert sorted((d.device.pool_name, d.device.device_name, d.health, d.message) for d in sent.devices) == sorted(
            (k, name, status, message) for k, part in fresh.items() for name, (status, message) in part.entries.items())

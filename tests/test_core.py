"""The core on its own: the immutable tree and its diff, the notifier, the kernel loop."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import trio

from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
from daemon.core import HEALTHY, UNHEALTHY, DeviceInfo, DeviceSpec, default_allocation
from daemon.core._notifier import Notifier, TreeMailbox
from daemon.core._tree import DeviceTree, ResourceDiff
from daemon.deviceplugin import ListingMessages, device_message
from daemon.supervise import Backoff, keep_running
from tests.trees import pool, tree


class Recorder:
    """A consumer of the tree that keeps every tree offered to it."""

    def __init__(self) -> None:
        self.trees: list[DeviceTree] = []

    def offer(self, tree: DeviceTree) -> None:
        self.trees.append(tree)


class Failing:
    def offer(self, tree: DeviceTree) -> None:
        raise RuntimeError("a consumer with a bug")


def test_tree_is_read_only():
    snapshot = tree(pool("a/x", {"d1": DeviceInfo()}), version=1)
    with pytest.raises(TypeError):
        snapshot.pools["a/y"] = pool("a/y", {})  # type: ignore[index]
    with pytest.raises(TypeError):
        snapshot.pools["a/x"].devices["d2"] = DeviceInfo()  # type: ignore[index]


def test_listing_is_sorted_and_carries_health_and_topology():
    resource = pool("a/x", {"b": DeviceInfo(health=UNHEALTHY), "a": DeviceInfo(numa_nodes=(1,))})
    assert resource.listing == (("a", HEALTHY, (1,)), ("b", UNHEALTHY, ()))


def test_diff_names_added_removed_and_changed_devices():
    old = pool("a/x", {"d1": DeviceInfo(), "d2": DeviceInfo()})
    new = pool("a/x", {"d2": DeviceInfo(specs=(DeviceSpec("/dev/x", "/dev/x"),)), "d3": DeviceInfo()})
    result = ResourceDiff(old, new)
    assert (result.added, result.removed, result.changed) == ({"d3"}, {"d1"}, {"d2"})


def test_changed_listings_ignore_changes_the_kubelet_cannot_see():
    old = tree(pool("a/x", {"d1": DeviceInfo()}), pool("a/y", {"d1": DeviceInfo()}), version=1)
    new = tree(pool("a/x", {"d1": DeviceInfo(specs=(DeviceSpec("/dev/x", "/dev/x"),))}),
               pool("a/y", {"d1": DeviceInfo(health=UNHEALTHY)}), pool("a/z", {}), version=2)
    assert new.diff(old).listings_changed == {"a/y", "a/z"}
    assert new.diff(old).changed == {"a/x", "a/y", "a/z"}


def test_diff_sees_a_device_leased_or_released_as_changed():
    devices = {"d1": DeviceInfo(), "d2": DeviceInfo()}
    old = tree(pool("a/x", devices), version=1)
    new = tree(pool("a/x", devices, leased={"d2"}), version=2)
    assert new.diff(old).resources["a/x"].changed == {"d2"}
    assert new.diff(old).listings_changed == {"a/x"}  # the kubelet no longer sees d2
    assert not tree(*new.pools.values(), version=3).diff(new).resources  # the same pools: nothing to look at


def test_notifier_offers_every_tree_to_every_consumer_in_order():
    notifier = Notifier()
    first, second = Recorder(), Recorder()
    assert notifier.subscribe(first) is notifier.tree
    notifier.subscribe(second)
    trees = [tree(pool("a/x", {"d1": DeviceInfo()}), version=1), tree(pool("a/x", {}), version=2)]
    for published in trees:
        notifier.publish(published)
    assert first.trees == trees and second.trees == trees
    assert notifier.tree is trees[-1]


def test_a_failing_consumer_does_not_keep_the_tree_from_the_others(caplog):
    notifier = Notifier()
    recorder = Recorder()
    notifier.subscribe(Failing())
    notifier.subscribe(recorder)
    published = tree(pool("a/x", {"d1": DeviceInfo()}), version=1)
    notifier.publish(published)
    notifier.publish(tree(*published.pools.values(), version=2))
    assert [t.version for t in recorder.trees] == [1, 2]
    assert "a consumer of the device tree failed on version 1" in caplog.text


def test_unsubscribed_consumers_hear_nothing_more():
    notifier = Notifier()
    watcher = Recorder()
    notifier.subscribe(watcher)
    notifier.unsubscribe(watcher)
    still = Recorder()
    notifier.subscribe(still)
    notifier.publish(tree(pool("a/x", {"d1": DeviceInfo()}), version=1))
    assert watcher.trees == [] and [t.version for t in still.trees] == [1]


def test_a_mailbox_without_a_scope_conflates_a_slow_reader_to_the_newest():
    wakeups: list[int] = []
    mailbox = TreeMailbox(lambda: wakeups.append(1))
    for version in range(100):
        mailbox.offer(tree(pool("a/x", {"d1": DeviceInfo(health=UNHEALTHY if version % 2 else HEALTHY)}), version=version))
    taken = mailbox.take()
    assert taken is not None and taken[0].version == 99
    assert mailbox.take() is None
    assert len(wakeups) == 100


def test_default_allocation_merges_specs_once_per_host_path_in_request_order():
    shared = DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio")
    resource = pool("a/x", {
        "d1": DeviceInfo(specs=(shared, DeviceSpec("/dev/vfio/1", "/dev/vfio/1")), envs=MappingProxyType({"A": "1"})),
        "d2": DeviceInfo(specs=(shared, DeviceSpec("/dev/vfio/2", "/dev/vfio/2")), envs=MappingProxyType({"A": "2"})),
    })
    allocation = default_allocation(resource, ["d2", "d1"])
    assert [s.host_path for s in allocation.specs] == ["/dev/vfio/vfio", "/dev/vfio/2", "/dev/vfio/1"]
    assert allocation.envs == {"A": "2"}  # first one wins, like the kubelet's merge


def test_backoff_starts_at_its_first_delay_doubles_up_to_its_maximum_and_resets():
    backoff = Backoff(first=0.5, maximum=3.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_listandwatch_messages_from_kept_encodings_equal_messages_built_field_by_field():
    long_id = "x" * 200  # a Device of over 127 bytes: a two-byte length
    devices = {"a": DeviceInfo(numa_nodes=(0, 1)), "b": DeviceInfo(health=UNHEALTHY), long_id: DeviceInfo()}
    messages = ListingMessages()
    for _ in range(2):  # the second list reuses the kept encodings
        built = messages.response(pool("a/x", devices))
        expected = dp.ListAndWatchResponse(devices=[device_message(i, h, n) for i, h, n in pool("a/x", devices).listing])
        assert built == expected and built.SerializeToString() == expected.SerializeToString()
        devices["c"] = DeviceInfo()
    assert messages.response(None) == dp.ListAndWatchResponse()


async def test_a_failing_task_is_logged_and_run_again_until_it_returns(autojump_clock, caplog):
    runs: list[float] = []

    async def flaky() -> None:
        runs.append(trio.current_time())
        if len(runs) < 3:
            raise RuntimeError(f"failure {len(runs)}")

    await keep_running("the flaky consumer", flaky, Backoff(first=1.0, maximum=10.0))
    assert [later - runs[0] for later in runs] == [0.0, 1.0, 3.0]  # after 1 s, then 2 s more
    failures = [record for record in caplog.records if "the flaky consumer failed" in record.getMessage()]
    assert [record.exc_info[1].args[0] for record in failures] == ["failure 1", "failure 2"]

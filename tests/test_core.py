"""The core on its own: the immutable tree and its diff, the notifier, the kernel loop."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from daemon.core import HEALTHY, UNHEALTHY, DeviceInfo, DeviceSpec, ResourcePool
from daemon.core._handler import default_allocation
from daemon.core._notifier import LatestValue, Notifier
from daemon.core._tree import DeviceTree, diff_pools


def pool(resource: str, devices: dict[str, DeviceInfo]) -> ResourcePool:
    return ResourcePool(resource, "test", None, MappingProxyType(devices))


def tree(version: int, *pools: ResourcePool) -> DeviceTree:
    return DeviceTree.build(version, pools)


class Recorder:
    def __init__(self) -> None:
        self.offers: list[ResourcePool | None] = []

    def offer(self, offered: ResourcePool | None) -> None:
        self.offers.append(offered)


def test_tree_is_read_only():
    snapshot = tree(1, pool("a/x", {"d1": DeviceInfo()}))
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
    result = diff_pools(old, new)
    assert (result.added, result.removed, result.changed) == ({"d3"}, {"d1"}, {"d2"})


def test_changed_listings_ignore_changes_the_kubelet_cannot_see():
    old = tree(1, pool("a/x", {"d1": DeviceInfo()}), pool("a/y", {"d1": DeviceInfo()}))
    new = tree(2, pool("a/x", {"d1": DeviceInfo(specs=(DeviceSpec("/dev/x", "/dev/x"),))}),
               pool("a/y", {"d1": DeviceInfo(health=UNHEALTHY)}), pool("a/z", {}))
    assert new.changed_listings(old) == {"a/y", "a/z"}
    assert set(new.changed_resources(old)) == {"a/x", "a/y", "a/z"}


def test_notifier_wakes_only_subscribers_of_changed_resources():
    notifier = Notifier()
    watcher_x, watcher_y = Recorder(), Recorder()
    notifier.publish(tree(1, pool("a/x", {"d1": DeviceInfo()}), pool("a/y", {"d1": DeviceInfo()})))
    assert notifier.subscribe("a/x", watcher_x) is notifier.tree.pools["a/x"]
    notifier.subscribe("a/y", watcher_y)
    notifier.publish(tree(2, pool("a/x", {"d1": DeviceInfo(), "d2": DeviceInfo()}), notifier.tree.pools["a/y"]))
    assert [len(p.devices) for p in watcher_x.offers if p] == [2]
    assert watcher_y.offers == []
    notifier.publish(tree(3, notifier.tree.pools["a/x"]))
    assert watcher_y.offers == [None]  # resource withdrawn


def test_unsubscribed_streams_hear_nothing_more():
    notifier = Notifier()
    watcher = Recorder()
    notifier.subscribe("a/x", watcher)
    notifier.unsubscribe("a/x", watcher)
    notifier.publish(tree(1, pool("a/x", {"d1": DeviceInfo()})))
    assert watcher.offers == [] and notifier.subscriber_count("a/x") == 0


def test_latest_value_conflates_a_slow_reader_to_the_newest():
    wakeups: list[int] = []
    slot: LatestValue[int] = LatestValue(lambda: wakeups.append(1))
    for value in range(100):
        slot.put(value)
    assert slot.take() == (True, 99)
    assert slot.take() == (False, None)
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

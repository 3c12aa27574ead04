"""Node labels for node-feature-discovery: the features file, from trees and from a running daemon."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

import pytest

from daemon.core import ResourcePool
from daemon.nfd import FILE_NAME, NfdFeatures, features_text, label_names
from tests import trees
from tests.devnodes import mknod
from tests.fakesysfs import FakeHost


def pool(resource: str, count: int, vanished: int = 0) -> ResourcePool:
    """``resource`` with ``count`` plain devices, the first ``vanished`` of them vanished."""
    device_ids = [f"d{index}" for index in range(count)]
    return trees.pool(resource, device_ids, vanished=device_ids[:vanished])


def lines(text: str) -> list[str]:
    return text.splitlines()


def test_each_pool_has_its_count_and_present_while_it_has_devices() -> None:
    tree = trees.tree(pool("intel.com/sriov_vfs", 8), pool("devplugd.io/kvm", 0), version=1)
    assert lines(features_text(tree)) == [
        "devplugd.io/kvm.count=0",
        "devplugd.io/sriov_vfs.present=true",
        "devplugd.io/sriov_vfs.count=8",
    ]


def test_vanished_devices_kept_for_a_pod_do_not_count() -> None:
    tree = trees.tree(pool("intel.com/usb", 2, vanished=2), version=1)
    assert lines(features_text(tree)) == ["devplugd.io/usb.count=0"]


def test_names_are_made_valid_and_pools_of_the_same_name_keep_their_prefix() -> None:
    names = label_names(["a.com/x", "b.com/x", "intel.com/" + "long" * 20, "intel.com/ok+name"])
    assert names["a.com/x"] == "a.com-x" and names["b.com/x"] == "b.com-x"
    assert len(names["intel.com/" + "long" * 20] + ".present") <= 63
    assert names["intel.com/ok+name"] == "ok-name"


def test_the_file_is_written_only_where_nfd_is_and_only_when_it_changes(tmp_path: Path) -> None:
    directory = tmp_path / "features.d"
    labels = NfdFeatures(directory)
    tree = trees.tree(pool("intel.com/kvm", 3), version=1)
    labels.update(tree)
    assert not directory.exists()  # NFD is not installed: nothing is made
    directory.mkdir()
    labels.update(tree)
    written = (directory / FILE_NAME).stat()
    assert (directory / FILE_NAME).read_text() == "devplugd.io/kvm.present=true\ndevplugd.io/kvm.count=3\n"
    labels.update(trees.tree(pool("intel.com/kvm", 3), version=2))
    assert (directory / FILE_NAME).stat().st_ino == written.st_ino  # same content: not rewritten
    labels.update(trees.tree(pool("intel.com/kvm", 1), version=3))
    assert (directory / FILE_NAME).read_text().endswith("devplugd.io/kvm.count=1\n")
    assert [p.name for p in directory.iterdir()] == [FILE_NAME]  # no temporary file left


def test_a_file_that_cannot_be_written_is_one_error_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "features.d"
    (directory / FILE_NAME).mkdir(parents=True)  # a directory where our file should be
    labels = NfdFeatures(directory)
    caplog.set_level(logging.ERROR, logger="devplugd.nfd")
    for version in range(3):
        labels.update(trees.tree(pool("intel.com/kvm", version), version=version))
    assert len([r for r in caplog.records if "cannot write node labels" in r.getMessage()]) == 1
    (directory / FILE_NAME).rmdir()
    labels.update(trees.tree(pool("intel.com/kvm", 9), version=9))
    assert (directory / FILE_NAME).read_text().endswith("devplugd.io/kvm.count=9\n")


def _config(count: int) -> dict[str, Any]:
    return {"resourceList": [{"resourceName": "kvm", "resourcePrefix": "devplugd.io", "deviceType": "devNode",
                              "selectors": {"paths": ["/dev/kvm"]}, "count": count}]}


def test_a_running_daemon_keeps_the_labels_current_and_leaves_them_when_it_stops(
        host: FakeHost, run_daemon: Any, short_tmp: Path) -> None:
    mknod(host.dev, "kvm", 10, 232)
    features = short_tmp / "nfd"
    features.mkdir()
    config = short_tmp / "config-0.json"
    daemon = run_daemon(_config(3), registration="none")
    path = features / FILE_NAME
    daemon.wait_until(lambda: path.exists() and "devplugd.io/kvm.count=3" in path.read_text(), "labels for 3")
    config.write_text(json.dumps(_config(5)))
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_until(lambda: "devplugd.io/kvm.count=5" in path.read_text(), "labels following the reload")
    assert daemon.stop() == 0
    assert path.read_text() == "devplugd.io/kvm.present=true\ndevplugd.io/kvm.count=5\n"  # a restart keeps them

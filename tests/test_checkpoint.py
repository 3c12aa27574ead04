"""Reading the kubelet's checkpoint: who holds which device, and a bad file never a crash."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import trio

import daemon.checkpoint
from daemon.checkpoint import CHECKPOINT_NAME, CheckpointReader
from daemon.core import Event
from daemon.core._events import CheckpointChanged, ConfigChanged
from daemon.sources.inotify import InotifySource


def allocations(directory):
    """What the daemon reads from the checkpoint in ``directory``: ``None`` when it cannot."""
    return CheckpointReader(directory).read_if_changed().allocations


def write(directory, document) -> None:
    text = document if isinstance(document, str) else json.dumps(document)
    (directory / CHECKPOINT_NAME).write_text(text)


def test_entries_of_both_formats_name_their_pod_and_container(tmp_path):
    write(tmp_path, {"Data": {"PodDeviceEntries": [
        {"PodUID": "u1", "ContainerName": "app", "ResourceName": "intel.com/dpdk", "DeviceIDs": {"0": ["a"], "-1": ["b"]}},
        {"PodUID": "u2", "ContainerName": "old", "ResourceName": "intel.com/dpdk", "DeviceIDs": ["c"]},
        {"PodUID": "u3"},  # an entry missing its fields is skipped, not fatal
    ]}, "Checksum": 1})
    assert allocations(tmp_path) == {("intel.com/dpdk", "a"): "pod u1/app", ("intel.com/dpdk", "b"): "pod u1/app",
                                     ("intel.com/dpdk", "c"): "pod u2/old"}


def test_no_checkpoint_means_nothing_allocated(tmp_path):
    assert allocations(tmp_path) == {}


@pytest.mark.parametrize("document", ["{torn", "[]", {"Data": {}}, {"Data": {"PodDeviceEntries": 7}}, "[" * 200_000],
                         ids=["torn", "a-list", "no-entries", "entries-not-a-list", "nested-too-deeply"])
def test_a_checkpoint_that_cannot_be_read_is_logged_and_told_apart_from_an_empty_one(tmp_path, caplog, document):
    write(tmp_path, document)
    with caplog.at_level(logging.WARNING):
        reading = CheckpointReader(tmp_path).read_if_changed()  # who holds what is unknown
    assert reading.allocations is None and reading.error is not None
    assert "cannot read the kubelet checkpoint" in reading.error and reading.error in caplog.text


async def test_the_reader_parses_the_file_off_the_event_loop_and_only_after_it_changed(tmp_path, monkeypatch):
    parsed: list[int] = []
    real = daemon.checkpoint.read_holdings

    def counting(directory):
        parsed.append(threading.get_ident())
        return real(directory)

    monkeypatch.setattr(daemon.checkpoint, "read_holdings", counting)
    entry = {"PodUID": "u1", "ContainerName": "app", "ResourceName": "intel.com/dpdk", "DeviceIDs": {"0": ["a"]}}
    write(tmp_path, {"Data": {"PodDeviceEntries": [entry]}, "Checksum": 1})
    reader = CheckpointReader(tmp_path)
    assert reader.stale
    assert (await reader.current()).allocations == {("intel.com/dpdk", "a"): "pod u1/app"}
    assert parsed and parsed[0] != threading.get_ident()  # in a worker thread
    assert not reader.stale
    await reader.current()
    reader.mark_changed()  # inotify says written, but the file is the same one
    await reader.current()
    assert len(parsed) == 1
    write(tmp_path, {"Data": {"PodDeviceEntries": []}, "Checksum": 2})
    reader.mark_changed()
    assert (await reader.current()).allocations == {}
    assert len(parsed) == 2
    assert reader.read_if_changed().allocations == {} and len(parsed) == 2  # a scrape's read: unchanged, not parsed


async def test_inotify_reports_the_checkpoint_written_as_the_kubelet_writes_it(tmp_path):
    """Temporary file, then rename into place (the kubelet's file store): one CheckpointChanged
    on the bus; the temporary file's own events are nothing of the loop's."""
    plugins = tmp_path / "device-plugins"
    plugins.mkdir()
    config = tmp_path / "config.json"
    source = InotifySource([plugins], plugins, config)
    bus_send, bus = trio.open_memory_channel[Event](16)
    kubelet_send, kubelet_events = trio.open_memory_channel[Event](16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(source.run, bus_send, kubelet_send)
        await trio.sleep(0)
        (plugins / ".123456").write_text("{}")
        os.rename(plugins / ".123456", plugins / CHECKPOINT_NAME)
        with trio.fail_after(5):
            assert await bus.receive() == CheckpointChanged(str(plugins / CHECKPOINT_NAME))
        (plugins / CHECKPOINT_NAME).unlink()
        with trio.fail_after(5):
            assert await bus.receive() == CheckpointChanged(str(plugins / CHECKPOINT_NAME))
        config.write_text("{}")  # a later change the bus hears of: nothing came between
        with trio.fail_after(5):
            assert await bus.receive() == ConfigChanged(f"{config} changed")
        nursery.cancel_scope.cancel()
    while True:  # the endpoints hear of the temporary file only (a removed file there), never the checkpoint
        try:
            event = kubelet_events.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        assert CHECKPOINT_NAME not in getattr(event, "path", "")

"""The committed gRPC modules are exactly what the .proto files generate, and the wire names are
the kubelet's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.daemonrun import REPO_ROOT


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO_ROOT / "tools" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_matches_a_fresh_generation(tmp_path: Path):
    generator = _load_generator()
    fresh = generator.generate(tmp_path)
    committed_root = REPO_ROOT / "daemon" / "_generated"
    fresh_root = tmp_path / "daemon" / "_generated"
    fresh_files = {path.relative_to(fresh_root) for path in fresh}
    committed_files = {p.relative_to(committed_root) for p in committed_root.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts}
    assert committed_files == fresh_files, "run: python tools/gen_proto.py"
    for relative in fresh_files:
        assert (committed_root / relative).read_bytes() == (fresh_root / relative).read_bytes(), (
            f"{relative} is stale: run python tools/gen_proto.py")


def test_method_paths_and_message_fields_are_the_kubelets():
    from daemon._generated.deviceplugin.v1beta1 import api_pb2 as dp
    from daemon._generated.pluginregistration.v1 import api_pb2 as reg

    plugin = dp.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert plugin.full_name == "v1beta1.DevicePlugin"
    assert [m.name for m in plugin.methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
    assert dp.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert reg.DESCRIPTOR.services_by_name["Registration"].full_name == "pluginregistration.Registration"
    numbers = {f.name: f.number for f in dp.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert numbers == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert {f.name: f.number for f in dp.ContainerPreferredAllocationRequest.DESCRIPTOR.fields} == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert [f.name for f in dp.Device.DESCRIPTOR.fields] == ["ID", "health", "topology"]
    assert {f.name: f.number for f in reg.PluginInfo.DESCRIPTOR.fields} == {
        "type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}

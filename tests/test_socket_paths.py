"""Socket paths gRPC can serve: one limit (``GRPC_PATH_MAX``, 105 bytes, measured on grpcio's
unix listener) for every socket devplugd serves, checked at the boundary with real servers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trio_asyncio

from daemon.deviceplugin import socket_file_name
from daemon.sockets import GRPC_PATH_MAX, SOCKET_PREFIX, start_unix_server
from tests.daemonrun import DaemonProcess
from tests.fakesysfs import FakeHost
from tests.kubelet import FakeKubelet

PF = "0000:3b:00.0"
VFS = [f"0000:3b:02.{n}" for n in range(3)]
# three pools, one VF each; the last has the longest name
CONFIG = {"resourceList": [
    {"resourceName": name, "selectors": {"drivers": ["vfio-pci"], "pfNames": [f"ens1f0#{index}"]}}
    for index, name in enumerate(("a", "bb", "a_long_resource_name"))]}


def directory_of_length(base: Path, length: int) -> Path:
    """A directory under ``base`` whose path is ``length`` characters long."""
    directory = base / ("d" * (length - len(str(base)) - 1))
    assert len(str(directory)) == length
    directory.mkdir(parents=True)
    return directory


async def serves(path: Path, *, ours: bool = True) -> bool:
    """Whether a grpc.aio server listens on ``path``: through our ``start_unix_server`` (which
    refuses past the limit with an OSError naming it), or through grpc alone."""
    async def start_and_stop() -> bool:
        server = grpc.aio.server()
        try:
            if ours:
                await start_unix_server(server, str(path))
            elif server.add_insecure_port(f"unix://{path}") == 0:
                return False
            else:
                await server.start()
        except (OSError, RuntimeError):
            return False
        await server.stop(0)
        return True

    async with trio_asyncio.open_loop():
        served: bool = await trio_asyncio.aio_as_trio(start_and_stop)()
    return served


def path_of_length(base: Path, length: int) -> Path:
    path = Path(str(base) + "/" + "s" * (length - len(str(base)) - 1))
    assert len(str(path)) == length
    return path


@pytest.mark.parametrize(("length", "bound"), [(GRPC_PATH_MAX, True), (GRPC_PATH_MAX + 1, False),
                                                (GRPC_PATH_MAX + 2, False)])
async def test_grpc_itself_serves_a_unix_socket_path_up_to_the_limit_and_not_beyond(short_tmp, length, bound):
    """The measured fact the limit stands on (the kernel's sun_path would take 107)."""
    assert await serves(path_of_length(short_tmp, length), ours=False) is bound


async def test_our_servers_refuse_past_the_limit_saying_why(short_tmp):
    path = path_of_length(short_tmp, GRPC_PATH_MAX + 1)

    async def refusal() -> str:
        with pytest.raises(OSError) as refused:
            await start_unix_server(grpc.aio.server(), str(path))
        return str(refused.value)

    async with trio_asyncio.open_loop():
        said = await trio_asyncio.aio_as_trio(refusal)()
    assert said == f"{path} is {GRPC_PATH_MAX + 1} bytes long, and gRPC serves unix socket paths of at most " \
                   f"{GRPC_PATH_MAX}"


@pytest.mark.parametrize("overshoot", [0, 1, 2])
async def test_a_device_plugin_socket_name_is_hashed_exactly_when_grpc_could_not_serve_it(short_tmp, overshoot):
    suffix = f"{int(time.time() * 1000):x}.1"
    readable = f"{SOCKET_PREFIX}example.com_a_long_pool_name-{suffix}.sock"
    directory = directory_of_length(short_tmp, GRPC_PATH_MAX + overshoot - len(readable) - 1)
    name = socket_file_name("example.com/a_long_pool_name", suffix, directory)
    assert (name == readable) is (overshoot == 0)
    assert len(str(directory / name)) <= GRPC_PATH_MAX
    assert await serves(directory / name)


@pytest.fixture
def long_kubelet(short_tmp: Path) -> Iterator[tuple[FakeKubelet, Path]]:
    """A kubelet whose device-plugin directory is long enough that the longest pool's readable
    socket path is 106 bytes: one more than gRPC serves, less than the kernel's 107."""
    token = f"{int(time.time() * 1000):x}"
    longest = f"{SOCKET_PREFIX}intel.com_a_long_resource_name-{token}.1.sock"
    directory = directory_of_length(short_tmp, GRPC_PATH_MAX + 1 - len(longest) - 1)
    stand_in = FakeKubelet(directory)
    stand_in.start()
    yield stand_in, directory
    stand_in.close()


def test_every_pool_registers_when_the_kubelets_directory_is_long(host: FakeHost, long_kubelet, run_daemon):
    """Tried as a new user would: a kubelet root longer than /var/lib/kubelet. Every pool is
    served and registers; the one whose readable socket path gRPC would refuse, under a hashed name."""
    kubelet, directory = long_kubelet
    host.add_pf(PF, netdev="ens1f0")
    host.add_vfs(PF, VFS, driver="vfio-pci", iommu_groups=[10, 11, 12])
    daemon: DaemonProcess = run_daemon(CONFIG, "--uevent-source", "none", "--device-plugin-dir", str(directory))
    for name in ("a", "bb", "a_long_resource_name"):
        kubelet.wait_for_devices(f"intel.com/{name}", 1)
    sockets = sorted(p.name for p in directory.glob(f"{SOCKET_PREFIX}*.sock"))
    assert len(sockets) == 3 and any("a_long_resource_name" not in s and "_a-" not in s and "_bb-" not in s
                                     for s in sockets)  # the hashed one
    assert "cannot serve" not in daemon.log


def test_a_control_socket_gRPC_cannot_serve_stops_the_daemon_naming_it(host: FakeHost, short_tmp, run_daemon):
    too_long = Path(str(short_tmp) + "/" + "c" * (GRPC_PATH_MAX + 1 - len(str(short_tmp)) - 1))
    daemon = run_daemon(CONFIG, "--uevent-source", "none", "--control-socket", str(too_long))
    assert daemon.process.wait(20) == 2
    assert f"--control-socket: {too_long} is {GRPC_PATH_MAX + 1} bytes long, and gRPC serves unix socket paths " \
           f"of at most {GRPC_PATH_MAX}" in daemon.log
    assert "Traceback" not in daemon.log


def test_a_control_socket_at_the_limit_is_served(host: FakeHost, short_tmp, run_daemon):
    at_limit = Path(str(short_tmp) + "/" + "c" * (GRPC_PATH_MAX - len(str(short_tmp)) - 1))
    daemon = run_daemon(CONFIG, "--uevent-source", "none", "--control-socket", str(at_limit), registration="none")
    daemon.wait_for_log(f"host API on {at_limit}")
    assert daemon.process.poll() is None


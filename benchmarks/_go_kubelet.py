"""Both sides of a DRA call in Go, built here: the kubelet's (``benchmarks/go_kubelet/main.go``)
and a reference driver's (``benchmarks/go_driver/main.go``).

The kubelet is a grpc-go client; the stand-in (``tests/kubelet.py``) is a Python one, whose own
client costs show in every figure taken through it. ``GoKubelet`` makes the same calls with
grpc-go over the same ``dra.sock``, timed inside the Go process, so a benchmark can print the
kubelet's view of a call beside the stand-in's. ``GoDriver`` serves the same calls with grpc-go
and takes the steps devplugd takes on their path (the claim's GET, device-info file, CDI spec,
device metadata, checkpoint), so a benchmark can print what that work costs on the machine
without Python in it.

``build`` generates the Go code of ``proto/dra/v1/api.proto`` into a scratch GOPATH and builds
a program there, offline, with Debian's Go packages (GOPATH mode: Debian ships the Go libraries
as sources under ``/usr/share/gocode``): ``apt-get install golang-go protobuf-compiler
protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev``. Without
them ``build`` says what is missing and a benchmark goes on without the Go rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import IO, Any

from benchmarks._common import REPO_ROOT

PROGRAMS = ("go_kubelet", "go_driver")  # each is benchmarks/<it>/main.go
DRA_PROTO = REPO_ROOT / "proto" / "dra" / "v1" / "api.proto"
DEBIAN_GOPATH = "/usr/share/gocode"
PACKAGE = "devplugd.bench"  # the scratch GOPATH's import path root (main.go imports <it>/drapb)
GO_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "devplugd-benchmarks" / "go-build"
TOOLS = ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
DEBIAN_PACKAGES = ("golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev "
                   "golang-google-protobuf-dev")


class GoBuildError(Exception):
    """A Go program could not be built (the message: what is missing, or the tool's output)."""


def build(workdir: Path, program: str = "go_kubelet") -> Path:
    """Build ``program`` (one of ``PROGRAMS``) under ``workdir``; its path. Raises GoBuildError."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing or not Path(DEBIAN_GOPATH, "src", "google.golang.org", "grpc").is_dir():
        raise GoBuildError(f"no {', '.join(missing) or 'grpc-go in ' + DEBIAN_GOPATH} "
                           f"(apt-get install {DEBIAN_PACKAGES})")
    gopath = workdir / "gopath"
    source = gopath / "src" / PACKAGE
    (source / program).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO_ROOT / "benchmarks" / program / "main.go", source / program / "main.go")
    mapping = f"M{DRA_PROTO.name}={PACKAGE}/drapb"
    binary = workdir / program
    # Go's build cache outside the scratch directory: compiling grpc-go takes a minute, once
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": f"{gopath}:{DEBIAN_GOPATH}", "GOCACHE": str(GO_CACHE),
           "GOFLAGS": "", "CGO_ENABLED": "0"}
    for command in (
        ["protoc", f"-I{DRA_PROTO.parent}", f"--go_out={gopath / 'src'}", f"--go_opt={mapping}",
         f"--go-grpc_out={gopath / 'src'}", f"--go-grpc_opt={mapping}", DRA_PROTO.name],
        ["go", "build", "-o", str(binary), f"{PACKAGE}/{program}"],
    ):
        done = subprocess.run(command, cwd=DRA_PROTO.parent if command[0] == "protoc" else gopath, env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise GoBuildError(f"{command[0]} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return binary


class GoKubelet:
    """The built client, connected to one DRA socket; one call at a time."""

    def __init__(self, binary: Path, socket: str) -> None:
        self._process = subprocess.Popen([str(binary), socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, bufsize=1)

    def _call(self, command: str, claim: tuple[str, str, str] | None) -> tuple[float, dict[str, Any]]:
        stdin: IO[str] | None = self._process.stdin
        stdout: IO[str] | None = self._process.stdout
        assert stdin is not None and stdout is not None
        line = command if claim is None else f"{command} {claim[0]} {claim[2]} {claim[1]}"
        stdin.write(line + "\n")
        stdin.flush()
        answer = stdout.readline()
        if not answer:
            raise GoBuildError(f"the Go client ended (exit {self._process.wait()}) at {line!r}")
        nanoseconds, text = answer.split(" ", 1)
        return int(nanoseconds) / 1e9, json.loads(text)

    def prepare(self, claim: tuple[str, str, str] | None) -> tuple[float, dict[str, Any]]:
        """NodePrepareResources of ``claim`` ((namespace, uid, name); None: of none): the call's
        seconds as grpc-go timed it, and the answer as protojson (``grpcError``: the call failed)."""
        return self._call("prepare", claim)

    def unprepare(self, claim: tuple[str, str, str] | None) -> tuple[float, dict[str, Any]]:
        return self._call("unprepare", claim)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        _wait_or_kill(self._process)


class GoDriver:
    """The built reference driver, serving ``socket`` (the stand-in's claims read from ``api_url``
    with the bearer ``token``); its log lines go to ``log``."""

    def __init__(self, binary: Path, socket: Path, api_url: str, token: str, driver: str, cdi_dir: Path,
                 devinfo_dir: Path, state_dir: Path, log: IO[str]) -> None:
        self._process = subprocess.Popen(
            [str(binary), str(socket), api_url, driver, str(cdi_dir), str(devinfo_dir), str(state_dir)],
            env={**os.environ, "API_TOKEN": token},
            stdout=subprocess.PIPE, stderr=log, text=True)
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "serving":
            raise GoBuildError(f"the Go driver did not start (exit {self._process.wait()}); see {log.name}")

    def close(self) -> None:
        self._process.terminate()
        _wait_or_kill(self._process)


def _wait_or_kill(process: subprocess.Popen[str]) -> None:
    """Wait up to 5 s for a program told to end (its stdin closed, or SIGTERM), then kill it."""
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

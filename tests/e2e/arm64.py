"""Helpers for the arm64 proof (issue 24): what a .deb's ELF objects are built for, its Depends by
name, lintian's verdict, and a process started in a chroot of another architecture (run by
qemu-user through binfmt_misc, which ``make deb ARCH=arm64`` enabled) that shares a directory
with this host, so the kubelet stand-in running natively here and the emulated daemon meet on
unix sockets there.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ._host import CONTAINER_PATH, HOST_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]

def enable_emulation(arch: str) -> None:
    """packaging/foreign.sh's ``foreign_setup``: qemu-user-static and binfmt-support installed,
    binfmt_misc mounted, the emulator enabled (a machine booted since the .deb was built has none)."""
    done = subprocess.run(["bash", "-c", '. packaging/foreign.sh && foreign_setup "$1"', "bash", arch],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"foreign_setup {arch}: {done.stdout}{done.stderr}"


# e_machine of the ELF header (elf.h): the architectures a .deb of ours is built for.
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
DEB_CPU = {"amd64": "x86_64", "arm64": "aarch64"}


def elf_machines(deb: Path) -> dict[str, str]:
    """Every ELF object in ``deb`` (path inside the package -> the CPU it is for, from its header)."""
    with tempfile.TemporaryDirectory(prefix="devplugd-elf-") as unpacked:
        subprocess.run(["dpkg-deb", "-x", str(deb), unpacked], check=True, capture_output=True)
        found = {}
        for directory, _, names in os.walk(unpacked):
            for name in names:
                path = Path(directory) / name
                if path.is_symlink() or not path.is_file():
                    continue
                with open(path, "rb") as file:
                    header = file.read(20)
                if len(header) == 20 and header[:4] == b"\x7fELF":
                    (machine,) = struct.unpack("<H", header[18:20])
                    found[str(path.relative_to(unpacked))] = ELF_MACHINES.get(machine, f"e_machine {machine}")
        return found


def depends_names(field: str) -> set[str]:
    """The package names of a Depends field (versions, architecture qualifiers, alternatives' order kept out)."""
    names = set()
    for relation in field.split(","):
        for alternative in relation.split("|"):
            name = re.sub(r"\(.*?\)|\[.*?\]|:any", "", alternative).strip()
            if name:
                names.add(name)
    return names


def lintian(deb: Path) -> subprocess.Popen[str]:
    """lintian on ``deb``, started now (two run side by side on two cores)."""
    return subprocess.Popen(["lintian", "--tag-display-limit", "0", str(deb)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


def lintian_errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("E: ")]


# In a private mount namespace, gone with the process: proc, a read-only sysfs, the host's /dev,
# an empty /run, and the shared directory bound at its own path inside the root, so every path
# the daemon is given (sockets, the fake sysfs, its state) names the same file on both sides.
_SPAWN_SCRIPT = r"""
set -e
root=$1; shared=$2; shift 2
mount -t proc proc "$root/proc"
mount -t sysfs -o ro sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=0755 tmpfs "$root/run"
mkdir -p "$root$shared"
mount --bind "$shared" "$root$shared"
exec chroot "$root" "$@"
"""


def spawn_in_root(root: Path, shared: Path, argv: Sequence[str], log: Path,
                  env: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start ``argv`` chrooted into ``root`` with ``shared`` visible at the same path inside. Every
    step execs the next (unshare, sh, chroot, env, the program), so the returned process IS the
    program: a signal sent to it reaches the program (qemu-user passes it on) and its exit status
    is the program's."""
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _SPAWN_SCRIPT, "sh", str(root),
               str(shared), "env", "-i", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", *env, *argv]
    with open(log, "wb") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=HOST_ENV)

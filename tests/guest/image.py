"""The guest's kernel and initramfs, built once from Debian's packages and cached.

What a guest needs to show real SR-IOV (see shared/docs/real-kernel-sriov.md):

- Debian bookworm's own 6.1 kernel (``linux-image-6.1.0-<N>-amd64``, resolved through the
  ``linux-image-amd64`` metapackage at build time, so a security update's new ABI is picked up and
  an old one that left the mirror is never asked for). Its VT-d driver is built in; nvme,
  vfio and 9p are modules.
- An initramfs of busybox-static, the modules the guest loads (nvme for the PFs' ``sriov_configure``,
  vfio-pci + vfio_iommu_type1 for ``/dev/vfio/<group>``, virtio_pci + 9pnet_virtio + 9p for the
  shares; xhci_pci, usbhid + hid_generic, usb_storage + sd_mod, ftdi_sio and evdev for USB
  hotplug, shared/docs/real-kernel-devices.md section 3) with everything they depend on, in load
  order, and our ``/init``.

The result lives in ``/var/cache/devplugd-guest/<kernel-version>/`` (``vmlinux``, ``initrd.gz``,
``manifest.json``). It is built in a temporary sibling directory and renamed into place, under an
flock, so a killed build never leaves a half cache and two test runs never build twice. The
manifest records the kernel package and version, busybox's version, the modules and a hash of
the recipe (init script, module list, format): a different recipe means a rebuild, so an edited
``/init`` is never silently replaced by a stale cached one.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.e2e._host import locked

CACHE_ROOT = Path(os.environ.get("DEVPLUGD_GUEST_CACHE", "/var/cache/devplugd-guest"))
KERNEL_METAPACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"
# What the guest loads, by the names modprobe knows; their dependencies come along.
GUEST_MODULES = ("nvme", "vfio-pci", "vfio_iommu_type1", "virtio_pci", "9pnet_virtio", "9p")
# Loaded only for ``run_in_guest(usb=True)`` (its qemu-xhci; the host root has no /lib/modules for
# the guest kernel, so nothing autoloads); with their dependencies (xhci_hcd, usbcore, hid,
# usbserial, scsi_mod...) they cost about 2 s of boot under TCG, which the other guests skip.
USB_MODULES = ("xhci_pci", "usbhid", "hid_generic", "usb_storage", "sd_mod", "ftdi_sio", "evdev")
# /init checks /sys/module/<name> for each before running the command: a failed insmod must not pass.
REQUIRED_LOADED = tuple(module.replace("-", "_") for module in GUEST_MODULES)
REQUIRED_USB = tuple(module.replace("-", "_") for module in USB_MODULES)
NINEP_MSIZE = 512000  # the virtio transport's maximum in 6.1 (PAGE_SIZE * (128 - 3)); fewer round trips
FORMAT = 2  # bump when the layout of the cache changes
TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# host tool -> the Debian package that has it (.ci/run installs them; missing ones fail loudly)
HOST_TOOLS = {
    "apt-get": "apt", "apt-cache": "apt", "dpkg-deb": "dpkg", "depmod": "kmod", "modprobe": "kmod",
    "cpio": "cpio", "gzip": "gzip",
}


class ImageError(RuntimeError):
    """The guest image could not be resolved or built."""


@dataclass(frozen=True)
class KernelPackage:
    """Bookworm's current kernel image package, e.g. linux-image-6.1.0-57-amd64 6.1.192-3."""

    name: str
    version: str

    @property
    def kernel_version(self) -> str:
        """The ``uname -r`` of the kernel inside (the package name without ``linux-image-``)."""
        return self.name.removeprefix("linux-image-")


@dataclass(frozen=True)
class GuestImage:
    """A built, cached guest: pass ``kernel`` and ``initrd`` to QEMU."""

    directory: Path
    manifest: dict[str, object]

    @property
    def kernel(self) -> Path:
        """The uncompressed ELF vmlinux: QEMU boots it through its PVH entry point."""
        return self.directory / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.gz"

    @property
    def kernel_version(self) -> str:
        return str(self.manifest["kernel_version"])


_resolved: GuestImage | None = None  # per process: apt-cache alone costs over a second


def ensure_image() -> GuestImage:
    """The cached image for bookworm's current kernel, built first when missing or stale
    (resolved once per process; a cache removed meanwhile is noticed and rebuilt)."""
    global _resolved
    if _resolved is None or _load_cached(_resolved.directory, _resolved.manifest["kernel_package_version"]) is None:
        _resolved = _ensure_image()
    return _resolved


def _ensure_image() -> GuestImage:
    check_host_tools()
    package = resolve_kernel_package()
    destination = CACHE_ROOT / package.kernel_version
    with locked(CACHE_ROOT / ".lock"):
        _remove_stale_builds(CACHE_ROOT)
        cached = _load_cached(destination, package.version)
        if cached is not None:
            return cached
        return _build_into(package, destination)


def check_host_tools() -> None:
    """Fail with the apt packages to install when a build tool is missing (never skip)."""
    missing = sorted({package for tool, package in HOST_TOOLS.items() if shutil.which(tool, path=TOOL_PATH) is None})
    if missing:
        raise ImageError(f"guest image needs these Debian packages: apt-get install {' '.join(missing)}")


def resolve_kernel_package() -> KernelPackage:
    """Ask apt which kernel ``linux-image-amd64`` points at now (apt lists refreshed once if empty)."""
    try:
        return _resolve_from_apt_lists()
    except ImageError:
        _run(["apt-get", "-qq", "-o", "DPkg::Lock::Timeout=300", "update"])
        return _resolve_from_apt_lists()


def _resolve_from_apt_lists() -> KernelPackage:
    """The candidate metapackage's ``Depends: linux-image-6.1.0-N-amd64 (= V)``: name and version
    in one apt-cache call (each costs over a second)."""
    shown = _run(["apt-cache", "show", "--no-all-versions", KERNEL_METAPACKAGE]).stdout
    match = re.search(r"^Depends:.*?\b(linux-image-\S+)\s*\(=\s*([^)\s]+)\)", shown, re.MULTILINE)
    if match is None:
        raise ImageError(f"apt-cache show {KERNEL_METAPACKAGE} names no kernel image:\n{shown}")
    return KernelPackage(name=match.group(1), version=match.group(2))


def _candidate_version(package: str) -> str:
    shown = _run(["apt-cache", "show", "--no-all-versions", package]).stdout
    match = re.search(r"^Version:\s*(\S+)", shown, re.MULTILINE)
    if match is None:
        raise ImageError(f"apt-cache show {package} gives no version")
    return match.group(1)


def recipe_hash() -> str:
    """Changes whenever what we would put in the initramfs changes."""
    recipe = json.dumps({"format": FORMAT, "modules": GUEST_MODULES, "usb_modules": USB_MODULES,
                         "init": init_script()}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _load_cached(directory: Path, package_version: object) -> GuestImage | None:
    """The image in ``directory`` if it was built from this recipe and this package version (an
    update can keep the ABI name, e.g. -57, and still change the kernel)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("recipe") != recipe_hash() or manifest.get("kernel_package_version") != package_version:
        return None
    return GuestImage(directory=directory, manifest=manifest)


def _build_into(package: KernelPackage, destination: Path) -> GuestImage:
    """Build in ``.build-*`` beside ``destination``, then rename it into place."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=CACHE_ROOT))
    try:
        manifest = build_image(package, work)
        manifest["build_seconds"] = round(time.monotonic() - started, 1)
        (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_directory(work, destination)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return GuestImage(directory=destination, manifest=manifest)


def _replace_directory(new: Path, destination: Path) -> None:
    """Rename ``new`` to ``destination``; a stale one is moved aside first and removed after."""
    old = destination.with_name(f".old-{destination.name}-{os.getpid()}")
    if destination.exists():
        destination.rename(old)
    new.chmod(0o755)
    new.rename(destination)
    shutil.rmtree(old, ignore_errors=True)


def build_image(package: KernelPackage, work: Path) -> dict[str, object]:
    """Download, unpack and assemble ``vmlinux`` and ``initrd.gz`` in ``work``; returns the manifest."""
    downloads = work / "debs"
    kernel_root = work / "kernel"
    initramfs = work / "initramfs"
    kernel_deb = _download(f"{package.name}={package.version}", downloads)
    busybox_version = _candidate_version(BUSYBOX_PACKAGE)
    busybox_deb = _download(f"{BUSYBOX_PACKAGE}={busybox_version}", downloads)
    _run(["dpkg-deb", "-x", str(kernel_deb), str(kernel_root)])
    kernel_version = _kernel_version_in(kernel_root, package)
    bzimage = (kernel_root / "boot" / f"vmlinuz-{kernel_version}").read_bytes()
    (work / "vmlinux").write_bytes(uncompressed_kernel(bzimage))
    _run(["depmod", "-b", str(kernel_root), kernel_version])  # the .deb ships no modules.dep
    modules = module_load_order(kernel_root, kernel_version, GUEST_MODULES)
    usb_modules = [module for module in module_load_order(kernel_root, kernel_version, USB_MODULES)
                   if module not in modules]
    _assemble_initramfs(initramfs, busybox_deb, modules, usb_modules)
    _write_cpio(initramfs, work / "initrd.gz")
    for scratch in (downloads, kernel_root, initramfs):
        shutil.rmtree(scratch)
    return {
        "kernel_package": package.name, "kernel_package_version": package.version,
        "kernel_version": kernel_version, "busybox_version": busybox_version,
        "modules": [module.name for module in modules], "usb_modules": [module.name for module in usb_modules],
        "recipe": recipe_hash(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _download(package_spec: str, directory: Path) -> Path:
    """``apt-get download`` into ``directory`` (as root: the _apt sandbox user cannot write a mkdtemp)."""
    directory.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", "-qq", "-o", "APT::Sandbox::User=root", "download", package_spec], cwd=directory)
    debs = sorted(directory.glob(f"{package_spec.split('=')[0]}_*.deb"))
    if len(debs) != 1:
        raise ImageError(f"apt-get download {package_spec} left {debs}")
    return debs[0]


def _kernel_version_in(kernel_root: Path, package: KernelPackage) -> str:
    versions = [path.name for path in (kernel_root / "lib" / "modules").iterdir()]
    if versions != [package.kernel_version]:
        raise ImageError(f"{package.name} holds modules for {versions}, expected {package.kernel_version}")
    return versions[0]


def uncompressed_kernel(bzimage: bytes) -> bytes:
    """The ELF vmlinux inside a bzImage, checked to have a PVH entry point.

    Why: under TCG the bzImage's own xz decompressor takes about 6 s of a 13 s boot. QEMU boots
    an ELF kernel that carries a Xen PVH entry note (``CONFIG_PVH``, set in Debian's kernel)
    directly, with nothing to decompress. The payload is located through the boot protocol's
    header (``setup_sects`` at 0x1f1, ``payload_offset``/``payload_length`` at 0x248, relative
    to the protected-mode code that starts after the setup sectors)."""
    if bzimage[0x202:0x206] != b"HdrS":
        raise ImageError("vmlinuz is not a bzImage (no HdrS boot header)")
    setup_sectors = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sectors + 1) * 512 + offset
    vmlinux = _decompress_payload(bzimage[start:start + length])
    if not vmlinux.startswith(b"\x7fELF") or not _has_pvh_note(vmlinux):
        raise ImageError("the kernel has no PVH entry note (CONFIG_PVH): QEMU cannot boot it uncompressed")
    return vmlinux


def _decompress_payload(payload: bytes) -> bytes:
    if payload.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    if payload.startswith(b"\x1f\x8b"):
        return zlib.decompressobj(wbits=31).decompress(payload)
    raise ImageError(f"the bzImage's payload is neither xz nor gzip (starts {payload[:6].hex()})")


XEN_ELFNOTE_PHYS32_ENTRY = 18


def _has_pvh_note(elf: bytes) -> bool:
    """Whether an ELF64 little-endian file has a PT_NOTE with a ``Xen`` note of type PHYS32_ENTRY."""
    program_headers, = struct.unpack_from("<Q", elf, 0x20)
    entry_size, entry_count = struct.unpack_from("<HH", elf, 0x36)
    for index in range(entry_count):
        kind, _flags, offset, _vaddr, _paddr, size = struct.unpack_from(
            "<IIQQQQ", elf, program_headers + index * entry_size)
        if kind == 4 and _notes_have(elf[offset:offset + size], b"Xen", XEN_ELFNOTE_PHYS32_ENTRY):
            return True
    return False


def _notes_have(notes: bytes, owner: bytes, note_type: int) -> bool:
    position = 0
    while position + 12 <= len(notes):
        name_size, description_size, kind = struct.unpack_from("<III", notes, position)
        name = notes[position + 12:position + 12 + name_size].rstrip(b"\0")
        if name == owner and kind == note_type:
            return True
        position += 12 + _aligned4(name_size) + _aligned4(description_size)
    return False


def _aligned4(size: int) -> int:
    return (size + 3) & ~3


def module_load_order(kernel_root: Path, kernel_version: str, modules: Sequence[str]) -> list[Path]:
    """The .ko files to insmod, dependencies first, each once (``modprobe --show-depends``)."""
    ordered: list[Path] = []
    for module in modules:
        shown = _run(["modprobe", "-d", str(kernel_root), "-S", kernel_version, "--show-depends", module]).stdout
        for line in shown.splitlines():
            if not line.startswith("insmod "):
                continue  # "builtin NAME": nothing to load
            path = Path(line.split()[1])
            if path not in ordered:
                ordered.append(path)
    return ordered


def _assemble_initramfs(root: Path, busybox_deb: Path, modules: Sequence[Path], usb_modules: Sequence[Path] = ()) -> None:
    """busybox at /bin/busybox, the modules flat in /lib/modules with ``load-order`` (and
    ``load-order-usb``), /init, /dev/console."""
    for directory in ("bin", "dev", "proc", "sys", "run", "tmp", "lib/modules", "share", "newroot"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    _extract_busybox(busybox_deb, root / "bin" / "busybox")
    names = [_copy_module(module, root / "lib" / "modules") for module in modules]
    (root / "lib" / "modules" / "load-order").write_text("".join(f"{name}\n" for name in names))
    usb_names = [_copy_module(module, root / "lib" / "modules") for module in usb_modules]
    (root / "lib" / "modules" / "load-order-usb").write_text("".join(f"{name}\n" for name in usb_names))
    init = root / "init"
    init.write_text(init_script())
    init.chmod(0o755)
    # The kernel opens /dev/console for init's stdio before anything is mounted.
    os.mknod(root / "dev" / "console", 0o600 | stat.S_IFCHR, os.makedev(5, 1))


def _extract_busybox(deb: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as unpacked:
        _run(["dpkg-deb", "-x", str(deb), unpacked])
        shutil.copyfile(Path(unpacked) / "bin" / "busybox", target)
    target.chmod(0o755)


def _copy_module(module: Path, directory: Path) -> str:
    """Copy one module as a plain .ko: busybox insmod does not decompress (.ko.xz / .ko.zst)."""
    name = module.name
    if name.endswith(".ko.xz"):
        name = name.removesuffix(".xz")
        (directory / name).write_bytes(lzma.decompress(module.read_bytes()))
    elif name.endswith(".ko.zst"):
        name = name.removesuffix(".zst")
        _run(["zstd", "-q", "-d", "-f", str(module), "-o", str(directory / name)])
    else:
        shutil.copyfile(module, directory / name)
    return name


def _write_cpio(root: Path, target: Path) -> None:
    """``find . | cpio -o -H newc | gzip``, files owned by root whoever builds."""
    names = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
    archive = _run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=root,
                   input_bytes=("\n".join([".", *names]) + "\n").encode()).stdout_bytes
    with open(target, "wb") as output:
        subprocess.run(["gzip", "-6", "-n"], input=archive, stdout=output, check=True)


def _remove_stale_builds(cache_root: Path) -> None:
    """Under the lock no build is running: ``.build-*``/``.old-*`` are leftovers of killed runs."""
    for leftover in [*cache_root.glob(".build-*"), *cache_root.glob(".old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


@dataclass(frozen=True)
class _Completed:
    stdout_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")


def _run(command: list[str], *, cwd: Path | None = None, input_bytes: bytes | None = None) -> _Completed:
    """Run a host tool; a failure raises with its stderr."""
    environment = {**os.environ, "PATH": TOOL_PATH, "LC_ALL": "C"}
    completed = subprocess.run(command, cwd=cwd, input=input_bytes, capture_output=True, env=environment,
                               check=False)
    if completed.returncode != 0:
        raise ImageError(f"{' '.join(command)} exited {completed.returncode}:\n"
                         f"{completed.stderr.decode(errors='replace')}")
    return _Completed(completed.stdout)


def init_script() -> str:
    """The guest's /init (busybox sh). Everything per run comes from the ``host0`` share's
    ``.guest/`` directory written by machine.py, so one cached initramfs serves every scenario:

    1. proc, sysfs, devtmpfs (+ devpts, /dev/shm) and a tmpfs /run: what the kernel and Python need.
    2. insmod the modules in dependency order; check the required ones are really loaded.
    3. mount ``host0`` (the share, read-write, cache=none: the host reads it after we stop) and
       source ``.guest/guest.env`` (GUEST_SHARE: where the share appears in the chroot;
       GUEST_REPO: the checkout, put back over the tmpfs when it lives under /tmp or /var/tmp;
       GUEST_USB=1: insmod the USB modules too, and check them).
    4. mount ``hostroot`` (the host's /, read-only; cache=loose is correct because nothing on it
       changes during a run and makes imports several times faster), bind the guest's /proc
       /sys /dev /run over it and put tmpfs on /tmp and /var/tmp (the only places Python or a
       test writes besides the share), bind the share at its host path.
    5. wait until every NVMe PF (class 0x010802, no ``physfn``) is bound to nvme: writing
       ``sriov_numvfs`` needs the driver's ``sriov_configure``, and nvme probes asynchronously.
    6. chroot and run ``.guest/run.sh`` (cwd, environment, argv), its output teed into
       ``.guest/output.log`` and the console, its exit status into ``.guest/exit-status``.
    7. ``poweroff -f`` (QEMU runs with -no-reboot, so a panic ends it too).
    """
    return (_INIT_TEMPLATE.replace("@MSIZE@", str(NINEP_MSIZE)).replace("@REQUIRED@", " ".join(REQUIRED_LOADED))
            .replace("@REQUIRED_USB@", " ".join(REQUIRED_USB)))


_INIT_TEMPLATE = r"""#!/bin/busybox sh
# devplugd guest /init, written by tests/guest/image.py (see init_script's docstring).
/bin/busybox --install -s /bin
export PATH=/bin
R=/newroot
S=/share/.guest
stamp() { read up rest </proc/uptime; echo "devplugd-guest: $1 ${up}"; }
fail() { echo "devplugd-guest: FAILED: $*"; [ -d "$S" ] && echo "$*" >"$S/init-failed"; sync; poweroff -f; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
stamp mounted

while read -r module; do
    insmod "/lib/modules/$module" || echo "devplugd-guest: insmod $module failed"
done </lib/modules/load-order
for module in @REQUIRED@; do
    [ -d "/sys/module/$module" ] || fail "module $module is not loaded"
done
stamp modules

NINEP="trans=virtio,version=9p2000.L,msize=@MSIZE@"
mount -t 9p -o "$NINEP,cache=none" host0 /share || fail "cannot mount the host0 share"
[ -f "$S/guest.env" ] || fail "no $S/guest.env in the share"
. "$S/guest.env"
if [ "${GUEST_USB:-0}" = 1 ]; then
    while read -r module; do
        insmod "/lib/modules/$module" || echo "devplugd-guest: insmod $module failed"
    done </lib/modules/load-order-usb
    for module in @REQUIRED_USB@; do
        [ -d "/sys/module/$module" ] || fail "module $module is not loaded"
    done
    stamp usb-modules
fi
mount -t 9p -o "$NINEP,cache=loose,ro" hostroot "$R" || fail "cannot mount hostroot"
# A checkout under /tmp or /var/tmp (a CI runner's) would vanish under the tmpfs mounts below:
# hold on to it first, and put it back at its path afterwards.
mkdir -p /repo
mount -o bind "$R$GUEST_REPO" /repo || fail "cannot find the checkout $GUEST_REPO on the host root"
for dir in proc sys dev run; do
    mount -o rbind "/$dir" "$R/$dir" || fail "cannot bind /$dir"
done
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp" || fail "cannot mount $R/tmp"
mount -t tmpfs -o mode=1777 tmpfs "$R/var/tmp" || fail "cannot mount $R/var/tmp"
case "$GUEST_REPO" in
    /tmp/*|/var/tmp/*)
        mkdir -p "$R$GUEST_REPO"
        mount -o bind /repo "$R$GUEST_REPO" || fail "cannot bind the checkout at $GUEST_REPO" ;;
esac
mkdir -p "$R$GUEST_SHARE" 2>/dev/null
mount -o bind /share "$R$GUEST_SHARE" || fail "cannot bind the share at $GUEST_SHARE"
stamp mounted-root

for dev in /sys/bus/pci/devices/*; do
    [ "$(cat "$dev/class")" = 0x010802 ] && [ ! -e "$dev/physfn" ] || continue
    tries=0
    until [ -e "$dev/driver" ]; do
        tries=$((tries + 1))
        [ $tries -le 3000 ] || fail "${dev##*/} not bound to nvme after 30 s"
        usleep 10000
    done
done
stamp command-start
echo "command-start ${up}" >"$S/timing"

( chroot "$R" /bin/sh "$GUEST_SHARE/.guest/run.sh"; echo $? >"$S/exit-status" ) 2>&1 | tee "$S/output.log"

stamp command-end
echo "command-end ${up}" >>"$S/timing"
sync
poweroff -f
"""

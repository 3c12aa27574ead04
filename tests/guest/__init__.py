"""A real Linux guest for tests that need real SR-IOV: QEMU with emulated NVMe PFs and VT-d.

    from tests.guest import guest_python, run_in_guest

    result = run_in_guest(guest_python(script), pfs=[4, 8], share=tmp_path, timeout=120)
    json.loads((tmp_path / "result.json").read_text())

    # more topologies, a real udevd, QEMU's monitor from the guest (AER injection):
    run_in_guest(command, ports=[SriovNvme(2), MultifunctionNvme(3, slow_link=True), BridgedNvme(2)],
                 share=tmp_path, udevd=True, monitor=True)

See machine.py for the API and what the guest looks like, image.py for the kernel and initramfs;
for scripts that run in the guest: devices.py (bind/unbind, IOMMU groups, ports), listener.py
(kernel and udev uevents), monitor.py (``hmp``, ``inject_aer``).
"""

from tests.guest.image import GuestImage, ImageError, ensure_image
from tests.guest.machine import (
    GUEST_PYTHON,
    BridgedNvme,
    GuestBootFailed,
    GuestCommandFailed,
    GuestError,
    GuestResult,
    GuestTimeout,
    MultifunctionNvme,
    Port,
    SriovNvme,
    guest_python,
    nvme_pf_properties,
    qemu_command,
    run_in_guest,
)

__all__ = [
    "GUEST_PYTHON", "BridgedNvme", "GuestBootFailed", "GuestCommandFailed", "GuestError", "GuestImage",
    "GuestResult", "GuestTimeout", "ImageError", "MultifunctionNvme", "Port", "SriovNvme", "ensure_image",
    "guest_python", "nvme_pf_properties", "qemu_command", "run_in_guest",
]

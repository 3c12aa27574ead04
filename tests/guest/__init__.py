"""A real Linux guest for tests that need real SR-IOV: QEMU with emulated NVMe PFs and VT-d.

    from tests.guest import guest_python, run_in_guest

    result = run_in_guest(guest_python(script), pfs=[4, 8], share=tmp_path, timeout=120)
    json.loads((tmp_path / "result.json").read_text())

See machine.py for the API and what the guest looks like, image.py for the kernel and initramfs.
"""

from tests.guest.image import GuestImage, ImageError, ensure_image
from tests.guest.machine import (
    GUEST_PYTHON,
    GuestBootFailed,
    GuestCommandFailed,
    GuestError,
    GuestResult,
    GuestTimeout,
    guest_python,
    nvme_pf_properties,
    qemu_command,
    run_in_guest,
)

__all__ = [
    "GUEST_PYTHON", "GuestBootFailed", "GuestCommandFailed", "GuestError", "GuestImage", "GuestResult",
    "GuestTimeout", "ImageError", "ensure_image", "guest_python", "nvme_pf_properties", "qemu_command",
    "run_in_guest",
]

"""End-to-end harness: a minimal Debian bookworm booted with systemd-nspawn, driven with nsenter.

* ``container.py``: ``BookwormImage`` (cached debootstrap tarballs: ``base()``, and
  ``with_depends(relations)`` with a package's dependencies added) and ``Container`` (unpack,
  ``chroot()`` before boot, ``boot()``, ``run()``/``copy_in()``/``write_text()``/``read_text()``
  through nsenter, torn down on exit; ``timings``);
* ``units.py``: unit state, start traces and the readiness check, journal queries;
* ``package.py``: the .deb under test (``make deb``), its chroot install, its venv python, and
  file lists for the purge check;
* ``stand_in.py`` and ``kubelet_driver.py``: tests/kubelet.py's FakeKubelet run inside the
  container as a transient unit;
* ``_cgroup.py``, ``_host.py``: one cgroup per container, host tools, locks, chroots.
"""

from tests.e2e._cgroup import cgroup_layout
from tests.e2e._host import CommandFailed
from tests.e2e.container import BookwormImage, BootError, Container

__all__ = ["BookwormImage", "BootError", "CommandFailed", "Container", "cgroup_layout"]

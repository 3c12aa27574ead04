"""Node labels through node-feature-discovery: one features file kept current from the tree.

NFD's worker reads every file in its ``features.d`` directory (``--nfd-features-dir``, default
``/etc/kubernetes/node-feature-discovery/features.d``) as ``name=value`` lines and turns them into
node labels, so a pod or a DaemonSet can select the nodes that have a pool's devices. devplugd
writes one file there, ``devplugd``, and only when the directory exists (NFD is installed)::

    devplugd.io/sriov_vfs.present=true
    devplugd.io/sriov_vfs.count=8
    devplugd.io/kvm.count=0

per pool: ``count`` is the number of devices it has (vanished ones, kept listed for a pod that
held them, do not count), and ``present=true`` is there while it has at least one. The name is
the pool's resource name made valid as a label name (at most 63 characters with its suffix;
characters outside ``A-Z a-z 0-9 - _ .`` become ``-``); two pools whose names would be the same
(``a.com/x`` and ``b.com/x``) get their prefix too (``a.com-x``). The labels' ``devplugd.io/``
namespace must be allowed by NFD's master (``extraLabelNs``).

The file is written atomically (NFD ignores files starting with a dot, as our temporary one
does), only when its content changes, in a worker thread a moment after a change (a burst of
trees is one write). It stays when devplugd stops or restarts: labels would flap on every
restart otherwise; the package's purge removes it. A directory that cannot be written is one
error line per distinct error; the pools are served as before.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from daemon.core._tree import DeviceTree
from daemon.files import write_atomically
from daemon.follow import TreeFollower

log = logging.getLogger("devplugd.nfd")

FILE_NAME = "devplugd"
LABEL_NAMESPACE = "devplugd.io"
SETTLE_SECONDS = 0.2  # labels are for the scheduler's next decisions, not for milliseconds
MAX_NAME = 63
_INVALID = re.compile(r"[^A-Za-z0-9_.-]")
SUFFIXES = (".present", ".count")


def _label_part(text: str) -> str:
    part = _INVALID.sub("-", text)[: MAX_NAME - max(map(len, SUFFIXES))]
    return part.strip("-_.") or "pool"


def label_names(resources: list[str]) -> dict[str, str]:
    """Resource -> the name its labels carry: the resource name, or prefix and name where two
    pools' names would be the same."""
    by_name = {resource: _label_part(resource.partition("/")[2] or resource) for resource in resources}
    taken = list(by_name.values())
    return {
        resource: name if taken.count(name) == 1 else _label_part(resource.replace("/", "-"))
        for resource, name in by_name.items()
    }


def features_text(tree: DeviceTree) -> str:
    names = label_names(sorted(tree.pools))
    lines = []
    for resource in sorted(tree.pools):
        pool = tree.pools[resource]
        count = len(pool.devices) - len(pool.vanished)
        label = f"{LABEL_NAMESPACE}/{names[resource]}"
        if count > 0:
            lines.append(f"{label}.present=true")
        lines.append(f"{label}.count={count}")
    return "".join(line + "\n" for line in lines)


class NfdFeatures(TreeFollower):
    """Keeps ``<directory>/devplugd`` in step with the newest tree: a subscriber of the notifier."""

    def __init__(self, directory: Path) -> None:
        super().__init__(self.update, SETTLE_SECONDS)
        self._directory = directory
        self._written: str | None = None
        self._last_error: str | None = None

    @property
    def path(self) -> Path:
        return self._directory / FILE_NAME

    def update(self, tree: DeviceTree) -> None:
        if not self._directory.is_dir():
            return  # NFD is not installed here: nothing reads labels
        text = features_text(tree)
        if text == self._written:
            return
        try:
            write_atomically(self.path, text.encode(), mode=0o644)
        except OSError as error:
            message = f"cannot write node labels to {self.path}: {error.strerror or error}"
            if message != self._last_error:
                log.error("%s; the pools are served as before", message)
                self._last_error = message
            return
        if self._last_error is not None:
            log.info("node labels written to %s again", self.path)
        self._written, self._last_error = text, None

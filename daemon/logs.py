"""Logging: journald's native protocol under systemd, readable lines on stderr otherwise.

Every record may carry structured fields (``extra={"RESOURCE": ...}``): under journald they
become journal fields (``journalctl -u devplugd RESOURCE=intel.com/vfs``), on stderr they are
appended as ``[RESOURCE=... PCI_ADDR=...]``. Journal entries carry SYSLOG_IDENTIFIER=devplugd.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

STRUCTURED_FIELDS = ("RESOURCE", "DEVICE_ID", "PCI_ADDR", "NETDEV", "EVENT", "HEALTH", "CONFIG_PATH")
LEVELS = ("debug", "info", "warning", "error")
SYSLOG_IDENTIFIER = "devplugd"


class _FieldsFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [f"{name}={getattr(record, name)}" for name in STRUCTURED_FIELDS if hasattr(record, name)]
        return f"{line} [{' '.join(fields)}]" if fields else line


def stderr_is_journal(environ: Mapping[str, str]) -> bool:
    """Whether systemd connected our stderr to journald (``JOURNAL_STREAM`` names its inode)."""
    stream = environ.get("JOURNAL_STREAM", "")
    if not stream:
        return False
    try:
        status = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{status.st_dev}:{status.st_ino}"


def configure_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    handler: logging.Handler
    if stderr_is_journal(os.environ if environ is None else environ):
        from systemd.journal import JournalHandler

        handler = JournalHandler(SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

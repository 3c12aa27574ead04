"""Logging set-up: readable lines on stderr, with the structured fields a record carries."""

from __future__ import annotations

import logging
import sys

STRUCTURED_FIELDS = ("RESOURCE", "DEVICE_ID", "PCI_ADDR", "NETDEV", "EVENT", "HEALTH", "CONFIG_PATH")
LEVELS = ("debug", "info", "warning", "error")


class _FieldsFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [f"{name}={getattr(record, name)}" for name in STRUCTURED_FIELDS if hasattr(record, name)]
        return f"{line} [{' '.join(fields)}]" if fields else line


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

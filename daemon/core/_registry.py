"""Finding handlers: every entry point in the ``devplugd.handlers`` group is a handler class
taking a HandlerContext. The core knows them only through this group."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points

from ._config import ParserTable, PoolParser
from ._handler import AnyHandler, HandlerContext

ENTRY_POINT_GROUP = "devplugd.handlers"


class HandlerLoadError(Exception):
    pass


def load_handlers(context: HandlerContext, group: str = ENTRY_POINT_GROUP) -> dict[str, AnyHandler]:
    handlers: dict[str, AnyHandler] = {}
    for entry_point in sorted(entry_points(group=group), key=lambda ep: ep.name):
        try:
            handler: AnyHandler = entry_point.load()(context)
        except Exception as error:  # a broken plug-in must say which one it is
            raise HandlerLoadError(f"handler {entry_point.name!r} ({entry_point.value}): {error}") from error
        handlers[handler.name] = handler
    if not handlers:
        raise HandlerLoadError(f"no handlers found in entry-point group {group!r}: is devplugd installed?")
    return handlers


def parser_table(handlers: Mapping[str, AnyHandler]) -> ParserTable:
    """deviceType -> (handler name, its pool parser)."""
    table: dict[str, tuple[str, PoolParser]] = {}
    for handler in handlers.values():
        for device_type in handler.device_types:
            table[device_type] = (handler.name, handler.parse_pool)
    return table

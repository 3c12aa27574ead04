"""Finding handlers: every entry point in the ``devplugd.handlers`` group is a handler class
taking a HandlerContext. The core knows them only through this group."""

from __future__ import annotations

from importlib.metadata import entry_points

from ._config import ParserTable
from ._handler import Handler, HandlerContext

ENTRY_POINT_GROUP = "devplugd.handlers"


class HandlerLoadError(Exception):
    pass


def load_handlers(context: HandlerContext, group: str = ENTRY_POINT_GROUP) -> dict[str, Handler]:
    handlers: dict[str, Handler] = {}
    for entry_point in sorted(entry_points(group=group), key=lambda ep: ep.name):
        try:
            handler_class = entry_point.load()
        except Exception as error:  # a broken plug-in must say which one it is
            raise HandlerLoadError(f"handler {entry_point.name!r} ({entry_point.value}): {error}") from error
        handler: Handler = handler_class(context)
        handlers[handler.name] = handler
    if not handlers:
        raise HandlerLoadError(f"no handlers found in entry-point group {group!r}: is devplugd installed?")
    return handlers


def parser_table(handlers: dict[str, Handler]) -> ParserTable:
    """deviceType -> (handler name, its pool parser)."""
    table = {}
    for handler in handlers.values():
        for device_type in handler.device_types:
            table[device_type] = (handler.name, handler.parse_pool)
    return table

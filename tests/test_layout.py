"""The layering a reviewer checks by reading the imports: a handler depends on the core and on the
shared modules beside the handlers (``daemon/handlers/_*.py``), never on another handler's
package; the shared modules depend on no handler package. And no file of the daemon's own code
is over 400 lines (the generated gRPC modules aside).

The imports are parsed with ``ast`` (every ``import`` and ``from ... import``, at any depth,
relative ones resolved against the importing module's package), not by importing anything, so a
dependency hidden in a function body or under ``TYPE_CHECKING`` counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemonrun import REPO_ROOT

DAEMON = REPO_ROOT / "daemon"
HANDLERS = DAEMON / "handlers"
GENERATED = DAEMON / "_generated"
MAX_LINES = 400

def handler_packages(handlers: Path = HANDLERS) -> set[str]:
    """The handler packages: the directories beside the shared modules that have an ``__init__.py``."""
    return {path.parent.name for path in handlers.glob("*/__init__.py")}


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = REPO_ROOT) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything ``path`` imports: for ``from A import b``, both ``A``
    and ``A.b`` (``b`` may be a module: ``from daemon.handlers import pci``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . (level 1: the package itself), from .. (its parent), ...
                package_parts = package.split(".")
                base_parts = package_parts[: len(package_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def handler_package_of(dotted: str, packages: set[str]) -> str | None:
    """The handler package a dotted module name is in (``pci`` of ``daemon.handlers.pci._folding``)."""
    parts = dotted.split(".")
    if parts[:2] == ["daemon", "handlers"] and len(parts) > 2 and parts[2] in packages:
        return parts[2]
    return None


def foreign_handler_imports(path: Path, packages: set[str], root: Path = REPO_ROOT) -> list[tuple[int, str]]:
    """(line, name) of each import of ``path`` from a handler package that is not its own (any
    handler package, for a shared module)."""
    own = handler_package_of(module_name(path, root), packages)
    found = set()
    for line, dotted in imported_modules(path, root):
        other = handler_package_of(dotted, packages)
        if other is not None and other != own:
            found.add((line, dotted))
    return sorted(found)


def handler_modules() -> list[Path]:
    return sorted(path for path in HANDLERS.rglob("*.py") if "__pycache__" not in path.parts)


def daemon_files() -> list[Path]:
    return sorted(path for path in DAEMON.rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts and GENERATED not in path.parents)


def test_there_are_handler_packages_and_shared_modules_to_check() -> None:
    assert {"pci", "auxnet", "devnode", "usb"} <= handler_packages()
    assert [path.name for path in HANDLERS.glob("_*.py")]


@pytest.mark.parametrize("path", handler_modules(), ids=lambda path: str(path.relative_to(HANDLERS)))
def test_a_handler_module_imports_from_no_other_handler_package(path: Path) -> None:
    """A module of a handler package imports its own package, the core and the shared modules; a
    shared module (``daemon/handlers/_*.py``) imports no handler package at all."""
    found = foreign_handler_imports(path, handler_packages())
    assert not found, "\n".join(f"{path.relative_to(REPO_ROOT)}:{line}: imports {name}" for line, name in found)


def test_the_import_check_sees_every_spelling_of_a_cross_handler_import(tmp_path: Path) -> None:
    handlers = tmp_path / "daemon" / "handlers"
    for package in ("alpha", "beta"):
        (handlers / package).mkdir(parents=True)
        (handlers / package / "__init__.py").write_text("")
    module = handlers / "alpha" / "_reader.py"
    module.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from daemon.core import UEvent\n"
        "from daemon.handlers._functions import PCI_ADDRESS\n"
        "from . import _own\n"
        "from daemon.handlers.alpha._own import x\n"
        "from daemon.handlers.beta import thing\n"  # 7
        "from ..beta._inner import other\n"  # 8
        "from .. import beta\n"  # 9
        "import daemon.handlers.beta._inner\n"  # 10
        "if TYPE_CHECKING:\n"
        "    from daemon.handlers import beta as hidden\n"  # 12
        "def late():\n"
        "    from daemon.handlers.beta import late_thing\n"  # 14
    )
    packages = handler_packages(handlers)
    assert packages == {"alpha", "beta"}
    found = foreign_handler_imports(module, packages, tmp_path)
    assert sorted({line for line, _ in found}) == [7, 8, 9, 10, 12, 14], found
    shared = handlers / "_shared.py"
    shared.write_text("from daemon.core import UEvent\nfrom daemon.handlers.alpha import x\n")
    assert foreign_handler_imports(shared, packages, tmp_path) == [
        (2, "daemon.handlers.alpha"), (2, "daemon.handlers.alpha.x")]


@pytest.mark.parametrize("path", daemon_files(), ids=lambda path: str(path.relative_to(DAEMON)))
def test_no_file_of_the_daemon_is_over_400_lines(path: Path) -> None:
    lines = len(path.read_text(errors="replace").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO_ROOT)} has {lines} lines (at most {MAX_LINES})"


def logger_names(path: Path) -> list[str]:
    """The names of the loggers a module gets (``logging.getLogger("...")`` with a literal)."""
    return [call.args[0].value for call in ast.walk(ast.parse(path.read_text()))
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "getLogger"
            and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)]


@pytest.mark.parametrize("path", daemon_files(), ids=lambda path: str(path.relative_to(DAEMON)))
def test_each_logger_is_named_after_the_module_that_logs_or_a_package_containing_it(path: Path) -> None:
    """A log line's logger says where to look: ``devplugd.loop`` is daemon/loop.py,
    ``devplugd.deviceplugin`` a module of daemon/deviceplugin/, ``devplugd`` the daemon itself."""
    parts = path.relative_to(DAEMON).with_suffix("").parts
    allowed = {"devplugd"} | {f"devplugd.{part.lstrip('_')}" for part in parts if part != "__init__"}
    for name in logger_names(path):
        assert name in allowed, f"{path.relative_to(REPO_ROOT)} logs as {name!r}; one of {sorted(allowed)}"


@pytest.mark.parametrize("path", handler_modules(), ids=lambda path: str(path.relative_to(HANDLERS)))
def test_a_handler_module_depends_on_the_core_facade_only(path: Path) -> None:
    """Of the daemon, a handler imports ``daemon.core`` (never a module behind it), its own
    package and the shared handler modules: nothing of the wiring."""
    for line, dotted in imported_modules(path):
        parts = dotted.split(".")
        if parts[0] != "daemon":
            continue
        assert parts[:2] in (["daemon", "core"], ["daemon", "handlers"]), \
            f"{path.relative_to(REPO_ROOT)}:{line} imports {dotted}, which is not the core nor a handler module"
        if parts[:2] == ["daemon", "core"] and len(parts) > 2:
            assert not parts[2].startswith("_"), f"{path.relative_to(REPO_ROOT)}:{line} imports {dotted}: " \
                                                 "handlers use the core's face, daemon.core"


# Parts of the handler contract no built-in handler happens to use today (documented in
# daemon/core/_handler.py and _allocation.py): they stay on the face.
CONTRACT_UNUSED_TODAY = frozenset({"ContainerPreStarter", "UseDefault", "default_allocation", "Mount"})


def test_the_core_facade_exports_what_handlers_use_and_nothing_else() -> None:
    import daemon.core

    used = {dotted.rpartition(".")[2] for path in handler_modules() for _, dotted in imported_modules(path)
            if dotted.startswith("daemon.core.")}
    assert set(daemon.core.__all__) == (used & set(daemon.core.__all__)) | CONTRACT_UNUSED_TODAY
    assert used - set(daemon.core.__all__) <= {"core"}, used - set(daemon.core.__all__)

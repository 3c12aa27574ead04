"""The documentation stays true to the code (issue 21): docs/ and the README fail a test when the
code has something they do not say, or say something the code does not have.

* every flag ``devplugd run --help`` prints, and every flag of every other command, is in the CLI
  reference (docs/cli.md), and each default ``run`` has is on its flag's row;
* every config key the parsers read is in the configuration reference (docs/configuration.md),
  under its ``deviceType``. The keys are not copied here: the parsers are run with
  ``ConfigObject`` recording every key they ask for, one pool of each ``deviceType`` the handlers
  declare; a static pass over the parsers' source makes sure no key is read only on a branch
  those pools do not take;
* every metric the daemon registers (``daemon.metrics.Metrics``) is in docs/metrics.md with its
  type and labels, and the page names no metric that does not exist;
* ``mkdocs build --strict`` passes, and fails on an orphan page or a broken link;
* the README is a front door: at most 200 lines, both set-up commands in its first 60.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from daemon.core._config import ConfigFileError, ParserTable, parse_config
from daemon.core._handler import HandlerContext
from daemon.core._jsonpath import ConfigObject
from daemon.core._registry import load_handlers, parser_table
from daemon.metrics import Metrics
from tests.daemonrun import REPO_ROOT, run_cli

DOCS = REPO_ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
CONFIG_PAGE = DOCS / "configuration.md"
METRICS_PAGE = DOCS / "metrics.md"
README = REPO_ROOT / "README.md"
README_MAX_LINES = 200
SETUP_WITHIN = 60
SETUP_COMMANDS = ("sudo ./scripts/run", "./scripts/test")

# configuration.md's sections for the keys every file and every pool has (the rest: one section
# per deviceType, its heading naming it in backticks)
FILE_SECTION = "The file"
POOL_ENTRY_SECTION = "Pool entry"
# The least a selector object of these types needs to be parsed to the end (the others: {}).
# Inputs, not the list of keys: what is checked is what the parsers read.
SELECTOR_SEEDS: dict[str, dict[str, Any]] = {
    "auxNetDevice": {"auxTypes": ["sf"]},
    "devNode": {"paths": ["/dev/null"], "udev": {"subsystems": ["mem"]}},
    "usbDevice": {"vendors": ["0403"]},
}
# ConfigObject's accessors that take the key first, for the static pass over the parsers
KEY_ACCESSORS = frozenset({"get", "require", "raw", "has", "string_list", "object", "objects", "path_of"})
JSON_KINDS = frozenset({"str", "bool", "int", "list", "dict"})
PARSER_SOURCES = (REPO_ROOT / "daemon/core/_config.py", *sorted((REPO_ROOT / "daemon/handlers").rglob("*.py")))


def backticked(name: str, text: str) -> bool:
    """``name`` written as code in ``text``: `name`, or the start of `name ARG`."""
    return re.search(rf"`{re.escape(name)}(?![\w-])[^`]*`", text) is not None


def sections(text: str) -> dict[str, str]:
    """A page's level-2 sections: heading -> everything down to the next level-2 heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


# ---- the command line ---------------------------------------------------------------------------

def printed_flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text)) - {"-h", "--help"}


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``dra device-classes``, its parser) for every command that has no subcommands."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield prefix.strip(), parser
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from commands(sub, f"{prefix} {name}")


def cli_parser() -> argparse.ArgumentParser:
    from daemon.__main__ import _parser  # the parser the CLI builds, flags and defaults included

    return _parser()


def test_every_flag_run_help_prints_is_in_the_cli_reference() -> None:
    printed = run_cli("run", "--help")
    assert printed.returncode == 0, printed.stderr
    flags = printed_flags(printed.stdout)
    assert "--config" in flags and "--metrics-address" in flags, printed.stdout  # the help was read
    page = CLI_PAGE.read_text()
    missing = sorted(flag for flag in flags if not backticked(flag, page))
    assert not missing, f"devplugd run --help prints {missing}, which {CLI_PAGE.name} does not name"


def test_every_command_and_flag_is_in_the_cli_reference() -> None:
    page = CLI_PAGE.read_text()
    synopsis = page.split("```")[1]
    problems = []
    for name, parser in commands(cli_parser()):
        if f"devplugd {name}" not in synopsis:
            problems.append(f"`devplugd {name}` is not in the synopsis")
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and not backticked(flag, page):
                    problems.append(f"{name} {flag}")
    assert not problems, f"{CLI_PAGE.name} lacks: {problems}"


def test_the_defaults_of_run_are_on_their_rows() -> None:
    (run,) = [parser for name, parser in commands(cli_parser()) if name == "run"]
    rows = [line for line in CLI_PAGE.read_text().splitlines() if line.startswith("| `--")]
    wrong = []
    for action in run._actions:
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS):
            continue
        flag = max(action.option_strings, key=len)
        row = next((row for row in rows if backticked(flag, row.split("|")[1])), None)
        if row is None or str(default) not in row:
            wrong.append(f"{flag} (default {default}): {row or 'no row'}")
    assert not wrong, f"{CLI_PAGE.name}'s flag table disagrees with the code: {wrong}"


# ---- the config keys -----------------------------------------------------------------------------

@dataclass
class KeysRead:
    """The keys the parsers asked for, by where: the file's, every pool entry's, each deviceType's."""

    file: set[str] = field(default_factory=set)
    pool_entry: set[str] = field(default_factory=set)
    by_device_type: dict[str, set[str]] = field(default_factory=dict)

    def all(self) -> set[str]:
        return self.file | self.pool_entry | set().union(*self.by_device_type.values())


def read_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> KeysRead:
    """Parse one pool of each deviceType the handlers declare, recording every key asked of a
    ``ConfigObject`` and whether the core or that deviceType's handler asked."""
    handlers = load_handlers(HandlerContext(sysfs_root=tmp_path, dev_root=tmp_path, proc_root=tmp_path,
                                            devinfo_dir=tmp_path, udev_data=tmp_path))
    keys = KeysRead()
    asking: list[str] = []  # the deviceType whose handler is parsing, if one is
    original = ConfigObject._key

    def recording(self: ConfigObject, key: str) -> str | None:
        if asking:
            keys.by_device_type[asking[-1]].add(key)
        elif self.json_path == "$":
            keys.file.add(key)
        else:
            keys.pool_entry.add(key)
        return original(self, key)

    def attributed(device_type: str, parse: Callable[[Any], object]) -> Callable[[Any], object]:
        def parse_recorded(entry: Any) -> object:
            asking.append(device_type)
            try:
                return parse(entry)
            finally:
                asking.pop()
        return parse_recorded

    monkeypatch.setattr(ConfigObject, "_key", recording)
    parsers: ParserTable = {device_type: (name, attributed(device_type, parse))
                            for device_type, (name, parse) in parser_table(handlers).items()}
    for device_type in sorted(parsers):
        keys.by_device_type[device_type] = set()
        pool = {"resourceName": "probe", "deviceType": device_type,
                "selectors": SELECTOR_SEEDS.get(device_type, {})}
        try:
            parse_config(json.dumps({"resourceList": [pool]}), "probe", "example.com", parsers)
        except ConfigFileError as error:
            pytest.fail(f"the probe pool of {device_type} does not parse ({error}): give it a seed in SELECTOR_SEEDS")
    return keys


def keys_in_parser_source() -> dict[str, str]:
    """Every key the parsers' source names literally in a ConfigObject accessor call (``get``
    only in its three-argument form, which a dict's ``get`` does not have) -> where."""
    found: dict[str, str] = {}
    for path in PARSER_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in KEY_ACCESSORS and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                continue
            if node.func.attr == "get" and not (len(node.args) == 3 and isinstance(node.args[1], ast.Name)
                                                and node.args[1].id in JSON_KINDS):
                continue
            found.setdefault(node.args[0].value, f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return found


def test_every_config_key_is_in_the_configuration_reference(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    keys = read_keys(monkeypatch, tmp_path)
    assert {"resourceList"} <= keys.file and {"resourceName", "selectors"} <= keys.pool_entry  # it recorded
    page = sections(CONFIG_PAGE.read_text())
    missing = [f"{key} (the file's)" for key in sorted(keys.file) if not backticked(key, page[FILE_SECTION])]
    missing += [f"{key} (every pool's)" for key in sorted(keys.pool_entry)
                if not backticked(key, page[POOL_ENTRY_SECTION])]
    for device_type, read in sorted(keys.by_device_type.items()):
        headed = [body for heading, body in page.items() if f"`{device_type}`" in heading]
        if not headed:
            missing.append(f"a section headed `{device_type}`")
            continue
        missing += [f"{key} ({device_type})" for key in sorted(read) if not backticked(key, headed[0])]
    assert not missing, f"{CONFIG_PAGE.name} lacks: {missing}"


def test_no_config_key_is_read_only_where_the_probes_do_not_look(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    read = read_keys(monkeypatch, tmp_path).all()
    unseen = {key: where for key, where in keys_in_parser_source().items() if key not in read}
    assert not unseen, (f"the parsers name keys the probe pools never made them read: {unseen}; "
                        "extend SELECTOR_SEEDS so that every branch is taken")
    page = CONFIG_PAGE.read_text()
    assert all(backticked(key, page) for key in keys_in_parser_source())


# ---- the metrics ---------------------------------------------------------------------------------

EXPOSED_SUFFIX = {"counter": "_total"}


def registered_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Every family the daemon's registry serves: exposed name -> (type, labels). The families
    come from the registry; their labels from the instruments and the tree collector's
    families (a family of another collector fails here, until this learns its labels)."""
    metrics = Metrics()
    labels: dict[str, tuple[str, ...]] = {}
    for instrument in vars(metrics).values():
        if isinstance(instrument, MetricWrapperBase):
            labels[instrument._name] = instrument._labelnames
    for family in metrics.tree.describe():
        labels[family.name] = family._labelnames
    served = {}
    for family in metrics.registry.collect():
        assert family.name in labels, f"{family.name}: its labels are unknown to this test"
        name = family.name + EXPOSED_SUFFIX.get(family.type, "")
        served[name] = (family.type, frozenset(labels[family.name]))
    return served


def documented_metrics(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """The rows of the metrics tables: | `name` | type | `label`, ... | what |."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) >= 3 and re.fullmatch(r"`devplugd_\w+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1], frozenset(re.findall(r"`(\w+)`", cells[2])))
    return rows


def test_the_metrics_page_lists_every_metric_with_its_type_and_labels() -> None:
    served = registered_metrics()
    documented = documented_metrics(METRICS_PAGE.read_text())
    assert len(served) > 30, served  # the registry was read
    missing = sorted(set(served) - set(documented))
    unknown = sorted(set(documented) - set(served))
    wrong = {name: f"documented {documented[name]}, served {served[name]}"
             for name in sorted(set(served) & set(documented)) if documented[name] != served[name]}
    assert not (missing or unknown or wrong), (
        f"{METRICS_PAGE.name}: missing {missing}; names no metric the daemon has {unknown}; wrong {wrong}")


# ---- the site ------------------------------------------------------------------------------------

def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` (not ``-q``: it hides the warnings --strict counts, and a broken
    site would pass)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = mkdocs_build(REPO_ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


@pytest.mark.parametrize("breakage", ["an orphan page", "a broken link", "a missing anchor"])
def test_the_strict_build_fails_on(breakage: str, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(DOCS, root / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", root / "mkdocs.yml")
    page = root / "docs" / "index.md"
    if breakage == "an orphan page":
        (root / "docs" / "orphan.md").write_text("# Not in the nav\n")
    elif breakage == "a broken link":
        page.write_text(page.read_text() + "\n[gone](no-such-page.md)\n")
    else:
        page.write_text(page.read_text() + "\n[gone](cli.md#no-such-heading)\n")
    built = mkdocs_build(root, tmp_path / "site")
    assert built.returncode != 0, f"mkdocs build --strict passed with {breakage}"


# ---- the README ----------------------------------------------------------------------------------

def fenced_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block."""
    inside = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            inside = not inside
        elif inside:
            yield number, line


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    fenced = list(fenced_lines(text))
    for command in SETUP_COMMANDS:
        where = [number for number, line in fenced if line.strip() == command]
        assert where and where[0] <= SETUP_WITHIN, (
            f"{command!r} must be a fenced line of the README within its first {SETUP_WITHIN} lines: {where}")


# ---- the .deb's copy -----------------------------------------------------------------------------

DOC_DIR = "/usr/share/doc/devplugd/"
UNIT = REPO_ROOT / "systemd" / "devplugd.service"
DEBIAN = REPO_ROOT / "packaging" / "deb" / "debian"


def test_the_units_documentation_is_shipped_uncompressed() -> None:
    """Each page the unit's Documentation= names is in the tree, in what debian/devplugd.docs
    ships, and kept from dh_compress (its path must stay the .md one)."""
    urls = [url for line in re.findall(r"^Documentation=(.*)$", UNIT.read_text(), re.MULTILINE) for url in line.split()]
    assert urls, f"{UNIT.name} names no documentation"
    shipped = DEBIAN.joinpath("devplugd.docs").read_text().split()
    compress = re.search(r"^\s+dh_compress\b.*$", DEBIAN.joinpath("rules").read_text(), re.MULTILINE)
    assert compress, "debian/rules calls no dh_compress"
    excluded = re.findall(r"-X\s*(\S+)", compress[0])
    for url in urls:
        assert url.startswith("file://" + DOC_DIR), f"{url}: not a page the .deb ships"
        relative = url.removeprefix("file://" + DOC_DIR)
        assert (REPO_ROOT / relative).is_file(), f"{url}: {relative} is not in the tree"
        assert relative.split("/")[0] in shipped, f"{url}: devplugd.docs does not ship {relative}"
        assert any(item in DOC_DIR.lstrip("/") + relative for item in excluded), f"{url}: dh_compress gzips it"

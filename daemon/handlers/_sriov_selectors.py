"""The SR-IOV plugin's ``pfNames`` and ``rootDevices`` selectors, matched exactly as upstream does
(``pkg/resources/deviceSelectors.go``), for netDevice and pciDevice functions (the pci handler:
the index is the VF's) and auxNetDevice SFs (the auxnet handler: the index is the SF's ``sfnum``).

An entry is ``<PF netdev|PF address>[#<indices>]`` where indices are ``N`` or ``A-B`` separated by
commas. As upstream: the *first* entry whose part before ``#`` equals the PF (case-insensitively)
decides; a malformed index list stops matching at the bad part; a device with no PF (not a VF or
an SF) is never selected.
"""

from __future__ import annotations

import logging

from daemon.core import ConfigObject


def pick_pf_entry(entries: tuple[str, ...], pf: str) -> str | None:
    """The first entry whose name part (before ``#``) equals ``pf`` case-insensitively."""
    wanted = pf.casefold()
    for entry in entries:
        if entry.split("#")[0].casefold() == wanted:
            return entry
    return None


def _go_atoi(text: str) -> int | None:
    """strconv.Atoi: optional sign, then decimal digits only."""
    body = text[1:] if text[:1] in "+-" else text
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(text)


def index_selected(entry: str, index: int) -> bool:
    """Whether VF ``index`` is selected by ``entry`` (``name``, or ``name#0,2-7``)."""
    if "#" not in entry:
        return True
    fields = entry.split("#")
    if len(fields) != 2:
        return False
    for part in fields[1].split(","):
        if "-" in part:
            bounds = part.split("-")
            if len(bounds) != 2:
                return False
            start, end = _go_atoi(bounds[0]), _go_atoi(bounds[1])
            if start is None or end is None:
                return False
            if start <= index <= end:
                return True
        else:
            single = _go_atoi(part)
            if single is None:
                return False
            if index == single:
                return True
    return False


def pf_selected(entries: tuple[str, ...], pf: str | None, index: int) -> bool:
    """Whether ``entries`` (of ``pfNames`` or ``rootDevices``) select function ``index`` of the PF
    named ``pf`` (its netdev or its address); a device without a PF (``None``, ``""``) never is."""
    entry = pick_pf_entry(entries, pf) if pf else None
    return entry is not None and index_selected(entry, index)


def entry_problem(entry: str) -> str | None:
    """Why a ``pfNames``/``rootDevices`` entry can never fully work (for a config warning)."""
    if "#" not in entry:
        return None
    fields = entry.split("#")
    if len(fields) != 2:
        return "more than one '#'"
    for part in fields[1].split(","):
        bounds = part.split("-") if "-" in part else [part]
        numbers = [_go_atoi(b) for b in bounds]
        if len(bounds) > 2 or None in numbers:
            return f"{part!r} is not an index or an A-B range"
        if len(numbers) == 2 and numbers[0] is not None and numbers[1] is not None and numbers[0] > numbers[1]:
            return f"range {part!r} is descending and selects nothing"
    return None


def warn_entry_problems(log: logging.Logger, selector: ConfigObject, pf_names: tuple[str, ...],
                        root_devices: tuple[str, ...]) -> None:
    """A config warning, naming its path, for each ``pfNames``/``rootDevices`` entry of
    ``selector`` that can never fully work (the pool still loads: upstream takes it too)."""
    for key, entries in (("pfNames", pf_names), ("rootDevices", root_devices)):
        for position, entry in enumerate(entries):
            if problem := entry_problem(entry):
                log.warning("%s[%d]: %r: %s", selector.path_of(key), position, entry, problem)

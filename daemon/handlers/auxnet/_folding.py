"""Folding one event into the SF facts: re-read only what it concerns, so that the result is
what a full scan of the same sysfs would give.

* A uevent whose devpath is at or below an SF directory (the SF's own add, bind, unbind and
  remove on the auxiliary bus, and those of its netdev, its RDMA device and its own auxiliary
  devices) reads that SF again; the SF's own ``remove`` takes it out.
* A ``pci`` uevent of a function with SFs (add, bind, unbind, change) reads again its record
  and every SF in its directory; its ``remove`` takes its SFs out.
* A ``net`` uevent of a PF's netdev (``<pf>/net/<ifname>``: the uplink renamed, an SF
  representor added) reads the PF's record again, its name may have changed; a PF with no SFs
  is not kept, so there is nothing to read.
* An SF's RDMA character devices are read with it, from its own directory (the kernel puts
  them there): their uevents are below the SF, and a read costs the SF's few entries, not the
  whole of ``<sysfs>/class/infiniband_*`` (32 ms with 512 SFs).
* Link events only replace link states.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from daemon.core import LinkChanged, LinkSnapshot, LinkState, UEvent
from daemon.handlers._functions import PCI_ADDRESS, lists_rdma_cm, rdma_cm_present

from ._discovery import AuxFacts, ScalableFunction, read_sf_logged, sf_in, sfs_below, with_pfs


def _updated(facts: AuxFacts, sysfs_root: str, changes: Mapping[str, ScalableFunction | None],
             addresses: set[str], reread: frozenset[str] = frozenset()) -> AuxFacts:
    """``facts`` with SFs replaced (``None``: gone) and the PFs of ``addresses`` brought up to date."""
    sfs = dict(facts.sfs)
    for name, sf in changes.items():
        old = sfs.pop(name, None)
        if old is not None:
            addresses.add(old.pf_address)
        if sf is not None:
            sfs[name] = sf
            addresses.add(sf.pf_address)
    pfs = dict(facts.pfs)
    with_pfs(sysfs_root, sfs, pfs, addresses, reread)
    if sfs == facts.sfs and pfs == facts.pfs:
        return facts
    return replace(facts, sfs=MappingProxyType(sfs), pfs=MappingProxyType(pfs))


def fold_sf(facts: AuxFacts, event: UEvent, sysfs_root: str, dev_root: str, name: str, devpath: str) -> AuxFacts:
    """An event at or below the SF ``name``: the SF read again."""
    if event.action == "remove" and event.devpath == devpath:
        sf = None
    else:
        # gone under a known SF: removed (its own event may come later) or its PF vanished
        sf = read_sf_logged(sysfs_root, dev_root, devpath, gone_level=logging.INFO if name in facts.sfs else None)
    if sf == facts.sfs.get(name):
        return facts
    return _updated(facts, sysfs_root, {name: sf}, set())


def fold_function(facts: AuxFacts, event: UEvent, sysfs_root: str, dev_root: str, address: str) -> AuxFacts:
    """A ``pci`` uevent of the function at ``address``: its SFs and its record read again (a PF
    removed takes its SFs with it: their own events may come late or not at all)."""
    known = {name for name, sf in facts.sfs.items() if sf.pf_address == address}
    found = {} if event.action == "remove" else sfs_below(sysfs_root, event.devpath)
    if not known and not found:
        return facts
    changes: dict[str, ScalableFunction | None] = dict.fromkeys(known - found.keys())
    for name, devpath in found.items():
        changes[name] = read_sf_logged(sysfs_root, dev_root, devpath,
                                       gone_level=logging.INFO if name in known else None)
    return _updated(facts, sysfs_root, changes, {address}, frozenset({address}))


def _with_rdma_cm_now(facts: AuxFacts, sysfs_root: str, dev_root: str) -> AuxFacts:
    """Every SF with RDMA devices read again when ``/dev/infiniband/rdma_cm`` came or went since
    their lists were read (rdma_ucm loaded or unloaded: a misc device, no uevent we follow): one
    stat per uevent otherwise."""
    listed = next((sf for sf in facts.sfs.values() if sf.rdma_char_devices), None)
    if listed is None:
        return facts
    if lists_rdma_cm(paths for _, paths in listed.rdma_char_devices) == rdma_cm_present(dev_root):
        return facts
    changes = {sf.name: read_sf_logged(sysfs_root, dev_root, sf.devpath, gone_level=logging.INFO)
               for sf in facts.sfs.values() if sf.rdma_char_devices}
    return _updated(facts, sysfs_root, changes, set())


def fold_uevent(facts: AuxFacts, event: UEvent, sysfs_root: str, dev_root: str) -> AuxFacts:
    facts = _with_rdma_cm_now(facts, sysfs_root, dev_root)
    if (found := sf_in(event.devpath)) is not None:
        return fold_sf(facts, event, sysfs_root, dev_root, *found)
    last = os.path.basename(event.devpath)
    if event.subsystem == "pci" and PCI_ADDRESS.fullmatch(last):
        return fold_function(facts, event, sysfs_root, dev_root, last)
    parent, _, _ = event.devpath.rpartition("/")
    owner, _, kind = parent.rpartition("/")
    pf = os.path.basename(owner)
    if event.subsystem == "net" and kind == "net" and pf in facts.pfs:
        return _updated(facts, sysfs_root, {}, {pf}, frozenset({pf}))
    return facts


def fold_links(facts: AuxFacts, event: LinkChanged | LinkSnapshot) -> AuxFacts:
    if isinstance(event, LinkSnapshot):
        if event.links == facts.links:
            return facts
        return replace(facts, links=MappingProxyType(dict(event.links)))
    if facts.links.get(event.ifname) == event.state:
        return facts
    links: dict[str, LinkState] = dict(facts.links)
    if event.state is None:
        links.pop(event.ifname, None)
    else:
        links[event.ifname] = event.state
    return replace(facts, links=MappingProxyType(links))

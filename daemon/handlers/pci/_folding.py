"""Folding one event into the PCI facts: re-read only the devices it concerns.

A uevent names a device path; the PCI function is the deepest ``DDDD:BB:DD.F`` component of it
(``/devices/pci0000:00/0000:00:02.0/0000:3b:00.0/net/ens1f0`` concerns ``0000:3b:00.0``).
That function is read again from sysfs exactly as a full scan reads it, together with the
functions whose facts depend on it: a VF's PF (``sriov_numvfs``), a PF's VFs (their PF netdev
and link type). A function that is gone leaves the facts. Link events only replace link states.
The result is what a full scan of the same sysfs would give.

PCIe error recovery (``change`` uevents with ``ERROR_EVENT``, sent by the kernel for every
function below the port it recovers) is folded from the event alone, never from sysfs: during a
fatal reset the kernel holds the device locks below the port for seconds, and a read of, say, a
PF's ``sriov_numvfs`` waits for them. The uevent is also all there is to know: sysfs shows no
recovery state. BEGIN_RECOVERY marks the function ``recovering``, SUCCESSFUL_RECOVERY clears
it, FAILED_RECOVERY marks it ``failed`` until it is re-probed (a ``bind``) or removed. Other
uevents of a function in recovery (or of its PF or VFs) are still read from sysfs, but
``fold_may_block`` tells the event loop to fold them in a worker thread.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from daemon.core import Lent, LinkChanged, LinkSnapshot, UEvent, list_dir
from daemon.handlers._functions import (
    PCI_ADDRESS,
    RDMA_SUBSYSTEMS,
    is_pcie_error_report,
    lists_rdma_cm,
    rdma_cm_present,
    read_rdma_char_devices,
)

from ._discovery import function_pkey, owned_rdma_char_devices, read_devices, vf_positions_of
from ._facts import PciDevice, PciFacts, copy_map

log = logging.getLogger("devplugd.pci")

RECOVERING = "recovering"
FAILED = "failed"
# ERROR_EVENT values (drivers/pci/pci-driver.c, pci_uevent_ers) -> the recovery state they leave
ERROR_EVENTS: Mapping[str, str | None] = MappingProxyType({
    "BEGIN_RECOVERY": RECOVERING,
    "SUCCESSFUL_RECOVERY": None,
    "FAILED_RECOVERY": FAILED,
})


def pci_address_of(devpath: str) -> str | None:
    """The deepest PCI function named in a device path, or ``None`` (virtual devices)."""
    for component in reversed(devpath.split("/")):
        if PCI_ADDRESS.fullmatch(component):
            return component
    return None


def _related_in(facts: PciFacts, address: str) -> set[str]:
    device = facts.devices.get(address)
    if device is None:
        return set()
    related = {device.pf_address} if device.pf_address else set()
    if device.is_pf:
        related.update(d.address for d in facts.devices.values() if d.pf_address == address)
    return related


def _known_positions(facts: PciFacts, addresses: Iterable[str]) -> dict[str, tuple[str, int]]:
    positions = {}
    for address in addresses:
        device = facts.devices.get(address)
        if device is not None and device.pf_address is not None and device.vf_index >= 0:
            positions[address] = (device.pf_address, device.vf_index)
    return positions


def _new_vfs_of(facts: PciFacts, devices_dir: str, pf_address: str) -> dict[str, tuple[str, int]]:
    """VFs of ``pf_address`` on disk that the facts do not know yet, with their positions."""
    positions = vf_positions_of(devices_dir, pf_address, list_dir(f"{devices_dir}/{pf_address}"))
    return {vf: position for vf, position in positions.items() if vf not in facts.devices}


def refresh_devices(facts: PciFacts, addresses: Iterable[str], sysfs_root: str, proc_root: str) -> PciFacts:
    """Facts with ``addresses`` read again, with the functions whose facts depend on them: their
    PF (its ``sriov_numvfs``) and, for a PF, its VFs (their PF netdev and link type).

    A burst (256 VFs from one ``sriov_numvfs`` write) must not cost 256 x 256 reads: a PF read
    again only because one of its VFs changed does not pull in its other VFs (nothing of theirs
    depends on a sibling), known VFs keep their index (checked with one readlink), and the first
    new VF of a PF brings in every VF of that PF the facts do not know yet, so the uevents of the
    others find them already read.
    """
    devices_dir = f"{sysfs_root}/bus/pci/devices"
    primary = set(addresses)
    wanted = set(primary)
    for address in primary:
        wanted |= _related_in(facts, address)
    positions = _known_positions(facts, wanted)
    read = read_devices(sysfs_root, proc_root, sorted(wanted), positions)
    extra_positions: dict[str, tuple[str, int]] = {}
    extra_pfs: set[str] = set()
    for address in primary:
        device = read.get(address)
        if device is None:
            continue
        if device.is_pf:
            extra_positions.update(vf_positions_of(devices_dir, address, list_dir(f"{devices_dir}/{address}")))
        elif device.pf_address is not None and address not in facts.devices:
            extra_positions.update(_new_vfs_of(facts, devices_dir, device.pf_address))
            extra_pfs.add(device.pf_address)
    extra = sorted((set(extra_positions) | extra_pfs) - wanted)
    if extra:
        read.update(read_devices(sysfs_root, proc_root, extra, {**positions, **extra_positions}))
    devices = copy_map(facts.devices)
    changed = set()
    for address, device in read.items():
        if device is None:
            if devices.pop(address, None) is not None:
                changed.add(address)
        elif devices.get(address) != device:
            devices[address] = device
            changed.add(address)
    if not changed:
        return facts
    return _child(facts, devices=MappingProxyType(devices), changed_addresses=frozenset(changed))


MAX_LINEAGE = 256


def _child(
    facts: PciFacts,
    *,
    changed_addresses: frozenset[str] = frozenset(),
    changed_links: frozenset[str] = frozenset(),
    **changes: object,
) -> PciFacts:
    step = (facts.token, changed_addresses, changed_links)
    return replace(
        facts,
        token=secrets.randbits(63),
        lineage=(*facts.lineage[-(MAX_LINEAGE - 1):], step),
        # the callers pass PciFacts fields by name; mypy cannot match **object to replace()'s fields
        **changes,  # type: ignore[arg-type]
    )


def fold_lent(facts: PciFacts, event: Lent) -> PciFacts:
    """The functions DRA claims hold on vfio-pci now, and the drivers they go back to; the
    functions whose entry changed are built again."""
    lent = dict(event.parts)
    if lent == facts.lent:
        return facts
    changed = frozenset(a for a in lent.keys() | facts.lent.keys() if lent.get(a, "") != facts.lent.get(a, ""))
    return _child(facts, lent=MappingProxyType(lent), changed_addresses=changed)


def _with_recovery(facts: PciFacts, address: str, state: str | None) -> PciFacts:
    if facts.recovery.get(address) == state:
        return facts
    recovery = dict(facts.recovery)
    if state is None:
        recovery.pop(address, None)
    else:
        recovery[address] = state
    return _child(facts, recovery=MappingProxyType(recovery), changed_addresses=frozenset({address}))


def fold_error_event(facts: PciFacts, event: UEvent, address: str) -> PciFacts:
    """A PCIe error recovery uevent, from the event alone (see the module docstring); each
    transition is logged with the function and the event."""
    error_event = event.properties["ERROR_EVENT"]
    online = event.properties.get("DEVICE_ONLINE", "?")
    fields = {"PCI_ADDR": address, "EVENT": error_event}
    if error_event not in ERROR_EVENTS:
        log.warning("%s: unknown ERROR_EVENT=%r in a change uevent (DEVICE_ONLINE=%s); ignored", address,
                    error_event, online, extra=fields)
        return facts
    if address not in facts.devices:
        log.debug("%s: %s for a function we do not know; ignored", address, error_event, extra=fields)
        return facts
    state = ERROR_EVENTS[error_event]
    folded = _with_recovery(facts, address, state)
    if folded is facts:
        return facts
    if state == RECOVERING:
        log.warning("%s: PCIe error recovery began (ERROR_EVENT=%s, DEVICE_ONLINE=%s): Unhealthy until it "
                    "succeeds", address, error_event, online, extra=fields)
    elif state == FAILED:
        log.error("%s: PCIe error recovery failed (ERROR_EVENT=%s, DEVICE_ONLINE=%s): Unhealthy until the "
                  "device is re-probed or removed", address, error_event, online, extra=fields)
    else:
        log.info("%s: PCIe error recovery succeeded (ERROR_EVENT=%s, DEVICE_ONLINE=%s): Healthy again",
                 address, error_event, online, extra=fields)
    return folded


def recovery_concerns(facts: PciFacts, event: UEvent) -> bool:
    """Whether folding ``event`` reads sysfs of a function in error recovery (or of its PF or
    VFs, which a fold reads with it): such a read may wait seconds for the kernel's device
    locks, so the loop runs that fold in a worker thread."""
    if not facts.recovery or is_pcie_error_report(event):
        return False
    address = pci_address_of(event.devpath)
    if address is None:
        return False
    return not facts.recovery.keys().isdisjoint({address, *_related_in(facts, address)})


def fold_rdma(facts: PciFacts, before: PciDevice | None, address: str, sysfs_root: str, dev_root: str) -> PciFacts:
    """An RDMA uevent below the function at ``address`` (``facts`` already hold its new record,
    ``before`` its old one): the character devices of its RDMA devices read again from its own
    directory (where the kernel parents them), not the whole of ``class/infiniband_*`` (26 ms with
    512 RDMA devices, for each of a VF burst's RDMA uevents). When ``/dev/infiniband/rdma_cm``
    came or went since the lists were read (rdma_ucm loaded or unloaded: a misc device, no RDMA
    uevent of its own), every function's list changes: all are read again, as a scan would."""
    if facts.rdma_char_devices and lists_rdma_cm(facts.rdma_char_devices.values()) != rdma_cm_present(dev_root):
        rdma = owned_rdma_char_devices(sysfs_root, dev_root, facts.devices.values())
        changed = frozenset(facts.devices)
    else:
        device = facts.devices.get(address)
        names = device.rdma_devices if device is not None else ()
        below = f"{sysfs_root}/bus/pci/devices/{address}"
        fresh = read_rdma_char_devices(sysfs_root, dev_root, below=below) if names else {}
        rdma = dict(facts.rdma_char_devices)
        for name in {*names, *(before.rdma_devices if before is not None else ())}:
            rdma.pop(name, None)
        rdma.update((name, fresh[name]) for name in names if name in fresh)
        changed = frozenset({address})
    if rdma == facts.rdma_char_devices:
        return facts
    return _child(facts, rdma_char_devices=MappingProxyType(rdma), changed_addresses=changed)


def fold_uevent(facts: PciFacts, event: UEvent, sysfs_root: str, dev_root: str, proc_root: str) -> PciFacts:
    if is_pcie_error_report(event):
        address = pci_address_of(event.devpath)
        return facts if address is None else fold_error_event(facts, event, address)
    address = pci_address_of(event.devpath)
    if address is None:
        return facts
    before = facts.devices.get(address)
    state = facts.recovery.get(address)
    if state is not None and event.subsystem == "pci" and (
        event.action == "remove" or (event.action == "bind" and state == FAILED)
    ):
        log.info("%s: %s after PCIe error recovery %s: its recovery state is cleared", address, event.action,
                 "failed" if state == FAILED else "began", extra={"PCI_ADDR": address, "EVENT": event.action})
        facts = _with_recovery(facts, address, None)
    refreshed = refresh_devices(facts, [address], sysfs_root, proc_root)
    gone = [a for a in refreshed.recovery if a not in refreshed.devices] if refreshed is not facts else []
    for stale in gone:  # a function that left the facts takes its recovery state with it
        refreshed = _with_recovery(refreshed, stale, None)
    if event.subsystem in RDMA_SUBSYSTEMS:
        refreshed = fold_rdma(refreshed, before, address, sysfs_root, dev_root)
    return refreshed


def with_pkeys_read_again(facts: PciFacts, ifnames: Iterable[str], sysfs_root: str) -> PciFacts:
    """The default partition key of the InfiniBand functions whose netdevs are ``ifnames`` read
    again: the subnet manager programs a port's table after the function is probed, with no
    uevent, and the IPoIB link coming up is the sign that it has."""
    wanted = set(ifnames)
    changed: dict[str, PciDevice] = {}
    for device in facts.devices.values():
        if device.link_type != "infiniband" or not device.rdma_devices or wanted.isdisjoint(device.netdevs):
            continue
        pkey = function_pkey(f"{sysfs_root}/bus/pci/devices/{device.address}", device.link_type, device.rdma_devices)
        if pkey != device.pkey:
            changed[device.address] = replace(device, pkey=pkey)
    if not changed:
        return facts
    devices = copy_map(facts.devices)
    devices.update(changed)
    return _child(facts, devices=MappingProxyType(devices), changed_addresses=frozenset(changed))


def fold_links(facts: PciFacts, event: LinkChanged | LinkSnapshot, sysfs_root: str | None = None) -> PciFacts:
    """Link states replaced; with ``sysfs_root``, the partition keys of the InfiniBand functions
    whose links came up (or changed in a snapshot) read again too."""
    folded = _fold_link_states(facts, event)
    if sysfs_root is None or folded is facts:
        return folded
    if isinstance(event, LinkChanged) and (event.state is None or not event.state.lower_up):
        return folded  # only a carrier coming up says the subnet manager may have set the keys
    ifnames = [event.ifname] if isinstance(event, LinkChanged) else list(folded.lineage[-1][2])
    return with_pkeys_read_again(folded, ifnames, sysfs_root)


def _fold_link_states(facts: PciFacts, event: LinkChanged | LinkSnapshot) -> PciFacts:
    if isinstance(event, LinkSnapshot):
        links: Mapping[str, object] = event.links
        changed = {name for name in facts.links.keys() | links.keys() if facts.links.get(name) != links.get(name)}
        if not changed:
            return facts
        return _child(facts, links=MappingProxyType(dict(event.links)), changed_links=frozenset(changed))
    if facts.links.get(event.ifname) == event.state:
        return facts
    updated = dict(facts.links)
    if event.state is None:
        updated.pop(event.ifname, None)
    else:
        updated[event.ifname] = event.state
    return _child(facts, links=MappingProxyType(updated), changed_links=frozenset({event.ifname}))

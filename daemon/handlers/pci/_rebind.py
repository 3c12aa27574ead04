"""Handing a PCI device to vfio-pci for one DRA claim, and back (``vfioOnDemand`` pools; the
``daemon.core.Lender`` hooks of the pci handler).

A device of such a pool is on its host driver (``nvme``, a GPU's) until a claim asks for vfio
(``VfioConfig``). Then every function of its IOMMU group goes to vfio-pci, the way an operator
does it: ``driver_override`` set to ``vfio-pci``, ``driver/unbind``, then the address written to
``drivers/vfio-pci/bind``, function by function, lowest first. At Unprepare each goes back:
``driver_override`` set to the driver it had (a VF under a PF whose ``sriov_drivers_autoprobe``
is 0 is probed by no driver without one, not even through an explicit bind), every function
unbound from vfio-pci first (no host driver binds into a group vfio-pci still has), then bound
to its driver through ``drivers/<driver>/bind`` and ``driver_override`` cleared; a function that
had no driver stays with none.

The checks come first and change nothing (``plan``, then ``check`` for the functions that would
move): the group holds the device's functions and bridges only; no function carries the host's
default route, IPv4 or IPv6 (read again: routes change after the pool was built); no block
device of a function (an NVMe multipath namespace it has a path to included, see ``_inuse``) is
mounted, used as swap or held by another block device (device-mapper, md). A write the kernel
refuses, a driver link that does not follow within ``BIND_TIMEOUT``, a node that does not
appear: AllocationError naming the function, the file and the reason. Nothing here remembers
anything: the DRA preparer records each loan in its checkpoint before ``lend`` and keeps it
until ``give_back`` returned.

A function on vfio-pci is described as discovery reads one: nothing its host driver made (an
interface, RDMA devices, a uio node, a vDPA device) is left in its record.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from daemon.core import (
    VFIO_IOMMUFD,
    VFIO_LEGACY,
    VFIO_PREFER_IOMMUFD,
    AllocationError,
    DeviceInfo,
    DeviceSpec,
    Loan,
    SysfsError,
    link_name,
    list_dir,
)
from daemon.handlers._functions import netdev_link_type
from daemon.handlers._sriov_allocation import VHOST_NET_SPECS

from ._allocation import (
    IOMMU_NODE,
    VFIO_CONTAINER,
    VFIO_DRIVER,
    PciDetails,
    first_per_host_path,
    vfio_specs,
    with_vfio_binding,
)
from ._discovery import read_default_route_interfaces, read_vfio_binding, vfio_cdev_of
from ._enablement import write_failure_hint
from ._facts import PciDevice
from ._groups import functions_beside
from ._inuse import check_unused, mounted_devices

log = logging.getLogger("devplugd.pci")

BIND_TIMEOUT = 10.0  # seconds for a driver link to follow a write (an unbind waits for the device's users)
NODE_TIMEOUT = 2.0  # seconds for /dev/vfio/<group> (or a VFIO device node) to appear after the bind
# _INFO providers of what a host driver made (uio node, RDMA character devices, vDPA device), and
# the specs a device on vfio-pci keeps beside its vfio ones (needVhostNet's, which are the host's)
_HOST_DRIVER_PROVIDERS = frozenset({"uio", "rdma", "vdpa"})
_KEPT_ON_VFIO = frozenset(spec.host_path for spec in VHOST_NET_SPECS)


def plan(sysfs_root: str, handler: str, resource: str, device_id: str, info: DeviceInfo) -> Loan:
    """The loan of the device ``device_id`` (record ``info``) as the host is now: its functions
    not on vfio-pci and their drivers; AllocationError when its group is not what the device is."""
    details: PciDetails = info.details
    functions = [record.device.address for record in details.functions]
    group = link_name(_device_dir(sysfs_root, functions[0]) + "/iommu_group")
    if group is None:
        raise AllocationError(f"{functions[0]} has no IOMMU group: vfio-pci cannot hand it out (is the IOMMU on?)")
    others = functions_beside(sysfs_root, group, functions, functions[0])
    if others:
        raise AllocationError(f"{functions[0]}: its IOMMU group {group} also holds {', '.join(others)}, which this "
                              "device does not include; the whole group would have to go to vfio-pci")
    parts: list[tuple[str, str | None]] = []
    for address in functions:
        device_dir = _device_dir(sysfs_root, address)
        if not os.path.isdir(device_dir):
            raise AllocationError(f"{address} is gone from sysfs")
        driver = link_name(device_dir + "/driver")
        if driver != VFIO_DRIVER:  # one on vfio-pci already is not touched, and not given back
            parts.append((address, driver))
    return Loan(handler, resource, device_id, tuple(parts))


def check(sysfs_root: str, proc_root: str, loan: Loan) -> None:
    """AllocationError naming the function of ``loan`` that must not leave its driver, and why."""
    if not loan.parts:
        return
    _check_vfio_loaded(sysfs_root)
    try:
        routes = read_default_route_interfaces(proc_root)
        mounted = mounted_devices(proc_root)
        for address, _ in loan.parts:
            check_unused(sysfs_root, address, routes, mounted)
    except SysfsError as error:
        raise AllocationError(f"{loan.parts[0][0]}: cannot tell whether the host still uses it: {error}") from error


def lend(sysfs_root: str, dev_root: str, loan: Loan, info: DeviceInfo, backend: str) -> DeviceInfo:
    """Rebind every function of ``loan`` to vfio-pci; the device ``info`` as it is then, with
    the device nodes of ``backend``. AllocationError when a step fails (what was rebound stays:
    the caller gives the loan back)."""
    bind_to_vfio(sysfs_root, loan)
    return _on_vfio(sysfs_root, dev_root, info, backend)


def bind_to_vfio(sysfs_root: str, loan: Loan) -> None:
    """Every function of ``loan`` that is not on vfio-pci goes to it, lowest first."""
    if loan.parts:
        _check_vfio_loaded(sysfs_root)
    for address, _ in loan.parts:
        device_dir = _device_dir(sysfs_root, address)
        current = link_name(device_dir + "/driver")
        if current == VFIO_DRIVER:
            continue
        _write(f"{device_dir}/driver_override", VFIO_DRIVER, address)
        if current is not None:
            _unbind(device_dir, address)
        _bind(sysfs_root, VFIO_DRIVER, address)


def give_back(sysfs_root: str, loan: Loan) -> None:
    """Every function of ``loan`` back on the driver it had: all off vfio-pci first, then each
    bound to its own. Tries every function; AllocationError naming those that failed."""
    failures: list[str] = []
    leaving: list[tuple[str, str]] = []
    for address, home in loan.parts:
        device_dir = _device_dir(sysfs_root, address)
        try:
            if not os.path.isdir(device_dir):
                log.warning("%s is gone from sysfs; nothing to give back", address, extra={"PCI_ADDR": address})
                continue
            # its own driver may probe it from now on, even under a PF whose sriov_drivers_autoprobe is 0
            _write(f"{device_dir}/driver_override", home or "\n", address)
            current = link_name(device_dir + "/driver")
            if current != home and current is not None:
                _unbind(device_dir, address)
            if home is not None:
                leaving.append((address, home))
        except AllocationError as error:
            failures.append(str(error))
    for address, home in leaving:
        device_dir = _device_dir(sysfs_root, address)
        try:
            if link_name(device_dir + "/driver") != home:
                if not _loaded(sysfs_root, home):
                    raise AllocationError(f"{address}: its driver {home} is not loaded any more "
                                          f"({_driver_dir(sysfs_root, home)} is missing); it stays with no driver")
                _bind(sysfs_root, home, address)
            _write(f"{device_dir}/driver_override", "\n", address)
        except AllocationError as error:
            failures.append(str(error))
    if failures:
        raise AllocationError("; ".join(failures))


# -- the checks ---------------------------------------------------------------------------------


def _check_vfio_loaded(sysfs_root: str) -> None:
    if not _loaded(sysfs_root, VFIO_DRIVER):
        raise AllocationError(f"{VFIO_DRIVER} is not loaded on this host ({_driver_dir(sysfs_root, VFIO_DRIVER)} is "
                              f"missing): load it (modprobe {VFIO_DRIVER}) before claims ask for it")


# -- the writes -----------------------------------------------------------------------------------


def _write(path: str, text: str, address: str) -> None:
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as error:
        raise AllocationError(f"{address}: cannot open {path}: {error.strerror or error}"
                              + write_failure_hint(error)) from error
    try:
        os.write(descriptor, text.encode())
    except OSError as error:
        shown = text.strip() or "a new line"
        raise AllocationError(f"{address}: writing {shown!r} to {path} failed: {error.strerror or error}"
                              + write_failure_hint(error)) from error
    finally:
        os.close(descriptor)


def _unbind(device_dir: str, address: str) -> None:
    """The function off its driver, and its ``driver`` link gone."""
    _write(f"{device_dir}/driver/unbind", address, address)
    _wait_for_driver(device_dir, address, None)


def _bind(sysfs_root: str, driver: str, address: str) -> None:
    """The (driverless) function bound to ``driver``, and its ``driver`` link naming it."""
    _write(f"{_driver_dir(sysfs_root, driver)}/bind", address, address)
    _wait_for_driver(_device_dir(sysfs_root, address), address, driver)


def _loaded(sysfs_root: str, driver: str) -> bool:
    return os.path.isdir(_driver_dir(sysfs_root, driver))


def _driver_dir(sysfs_root: str, driver: str) -> str:
    return f"{sysfs_root}/bus/pci/drivers/{driver}"


def _wait_for_driver(device_dir: str, address: str, wanted: str | None) -> None:
    """Until the function's ``driver`` link names ``wanted`` (``None``: no link); the kernel
    does it before the write returns, a slow probe or a device still in use takes longer."""
    _wait(lambda: link_name(device_dir + "/driver") == wanted, BIND_TIMEOUT,
          lambda: f"{address}: still {_driver_words(link_name(device_dir + '/driver'))} after {BIND_TIMEOUT:g} s, "
                  f"waiting for {_driver_words(wanted)}")


def _wait(done: Callable[[], bool], timeout: float, failure: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not done():
        if time.monotonic() > deadline:
            raise AllocationError(failure())
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _driver_words(driver: str | None) -> str:
    return f"bound to {driver}" if driver is not None else "bound to no driver"


# -- the device on vfio-pci -----------------------------------------------------------------------


def _on_vfio(sysfs_root: str, dev_root: str, info: DeviceInfo, backend: str) -> DeviceInfo:
    """``info`` with its functions as they are now on vfio-pci and the device specs of ``backend``."""
    details: PciDetails = info.details
    records = [_record_on_vfio(sysfs_root, record) for record in details.functions]
    group_specs = [spec for record in records for spec in vfio_specs(record.device)]
    for spec in group_specs:
        _wait_for_node(dev_root, spec.host_path, records[0].device.address)
    cdev_specs = _iommufd_specs(sysfs_root, dev_root, records, backend)
    specs = cdev_specs if cdev_specs is not None else group_specs
    kept = [spec for spec in info.specs if spec.host_path in _KEPT_ON_VFIO]
    first, *members = records
    return replace(info, specs=tuple(first_per_host_path([*specs, *kept])),
                   details=replace(first, members=tuple(members)))


def _record_on_vfio(sysfs_root: str, record: PciDetails) -> PciDetails:
    """``record`` as the function is now on vfio-pci: the vfio ``_INFO`` entry, its group read
    as Allocate reads it (``read_vfio_binding``, ``with_vfio_binding``) and its VFIO device;
    without the providers of what its host driver made (``uio``, ``rdma``, ``vdpa``)."""
    address = record.device.address
    binding = read_vfio_binding(sysfs_root, address)
    if binding is None:
        raise AllocationError(f"{address} is gone from sysfs")
    info = {provider: dict(values) for provider, values in record.info.items()
            if provider not in _HOST_DRIVER_PROVIDERS}
    info["vfio"] = {"mount": VFIO_CONTAINER}
    device = _device_on_vfio(_device_dir(sysfs_root, address), record.device)
    return with_vfio_binding(replace(record, device=device, info=info, rdma_device=None, vdpa=None, members=()),
                             binding)


def _device_on_vfio(device_dir: str, device: PciDevice) -> PciDevice:
    """The function's facts on vfio-pci, as discovery reads a function there: what its host
    driver made went with it (interfaces, and with them the default route; RDMA devices and
    their partition key; uio nodes; a vDPA device), and a VF's link type is its PF's. What the
    function is stays: address, IDs, class, NUMA node, PCIe root, SR-IOV place and PF link."""
    return replace(device, driver=VFIO_DRIVER, vfio_cdev=vfio_cdev_of(device_dir), netdevs=(),
                   link_type=_pf_link_type(device_dir, device), has_default_route=False, rdma_devices=(), pkey=None,
                   uio_devices=(), vdpa=None)


def _pf_link_type(device_dir: str, device: PciDevice) -> str:
    """The link type of a VF's PF (``""`` for a function that is no VF or whose PF has no
    interface, or one that cannot be read)."""
    if device.pf_address is None or device.pf_netdev is None:
        return ""
    try:
        return netdev_link_type(f"{device_dir}/physfn/net/{device.pf_netdev}")
    except SysfsError:
        return ""


def _iommufd_specs(sysfs_root: str, dev_root: str, records: Sequence[PciDetails],
                   backend: str) -> list[DeviceSpec] | None:
    """Each function's ``/dev/vfio/devices/vfioN`` and ``/dev/iommu`` for ``iommufd`` (or
    ``preferIommufd`` where the kernel made them); ``None``: the group's nodes."""
    if backend == VFIO_LEGACY:
        return None
    records = [_with_vfio_device(sysfs_root, record) for record in records]
    cdevs = [record.device.vfio_cdev for record in records]
    nodes = [f"/dev/vfio/devices/{cdev}" for cdev in cdevs if cdev is not None]
    available = len(nodes) == len(records) and os.path.exists(dev_root + IOMMU_NODE[len("/dev"):])
    if not available:
        if backend == VFIO_PREFER_IOMMUFD:
            return None
        missing = [r.device.address for r, cdev in zip(records, cdevs, strict=True) if cdev is None]
        raise AllocationError(f"{records[0].device.address}: the claim asks for {VFIO_IOMMUFD}, but the kernel gives "
                              + (f"{', '.join(missing)} no VFIO device node (vfio-dev/vfioN)" if missing
                                 else f"no {IOMMU_NODE}") + f"; ask for {VFIO_LEGACY} or {VFIO_PREFER_IOMMUFD}")
    for node in nodes:
        _wait_for_node(dev_root, node, records[0].device.address)
    return [DeviceSpec(node, node) for node in (*nodes, IOMMU_NODE)]


def _with_vfio_device(sysfs_root: str, record: PciDetails) -> PciDetails:
    """``record`` with its VFIO device as the probe left it: where the kernel has the class
    (``/sys/class/vfio-dev``, 6.1 on), its ``vfio-dev/vfioN`` follows the driver link, so wait for
    it; ``vfio_cdev`` then says whether it is a character device (6.6 on)."""
    device_dir = _device_dir(sysfs_root, record.device.address)
    if os.path.isdir(f"{sysfs_root}/class/vfio-dev"):
        _wait(lambda: bool(list_dir(device_dir + "/vfio-dev")), NODE_TIMEOUT,
              lambda: f"{record.device.address}: no vfio-dev entry within {NODE_TIMEOUT:g} s of its bind to "
                      f"{VFIO_DRIVER}")
    return replace(record, device=replace(record.device, vfio_cdev=vfio_cdev_of(device_dir)))


def _wait_for_node(dev_root: str, node: str, address: str) -> None:
    path = dev_root + node[len("/dev"):]
    _wait(lambda: os.path.exists(path), NODE_TIMEOUT,
          lambda: f"{address}: {node} did not appear within {NODE_TIMEOUT:g} s of the bind to {VFIO_DRIVER}")


def _device_dir(sysfs_root: str, address: str) -> str:
    return f"{sysfs_root}/bus/pci/devices/{address}"

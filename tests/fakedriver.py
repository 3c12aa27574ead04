"""A fake Linux PCI driver core over a FakeHost tree: the writes an operator makes to rebind a
function (``driver_override``, ``driver/unbind``, ``drivers/<name>/bind``, ``drivers_probe``) do,
a moment later, what the kernel does with them, and the uevents the kernel would send go to a
callback in the kernel's order (``to_seam``: on to a running daemon's ``unix:`` uevent seam).

    with FakeDriverCore(host, on_uevent=to_seam(seam), nvme_namespaces=True) as core:
        ...                              # the code under test writes the files and polls `driver`
        core.settle()                    # every write made so far has been handled
        assert [e.brief for e in core.uevents] == [...]

Sources: ``drivers/base/bus.c`` (``bind_store``, ``unbind_store``, ``drivers_probe_store``),
``drivers/base/dd.c`` (``really_probe``, ``__device_attach_driver``, ``device_driver_attach``,
``__device_release_driver``), ``drivers/pci/pci-driver.c`` (``pci_match_device``,
``pci_device_can_probe``, ``pci_device_probe``), ``driver_set_override``, ``drivers/vfio/group.c``
(the group device ``<n>``, ``noiommu-<n>``), ``drivers/nvme/host/core.c``, and the sequences
measured in shared/docs/real-kernel-devices.md §2, §5 and real-kernel-sriov.md.

What a write does (``…`` is ``sys/bus/pci``):

* ``…/devices/<bdf>/driver_override``: the one driver the function may bind to; the text up to
  its first new line, an empty one (``"\\n"``) clears it; it reads ``(null)`` while clear.
* ``…/drivers_probe`` ← address: an unbound function gets the driver_override driver if set,
  else the driver whose ID table has its ``PCI_ID`` (``id_table``; vfio-pci's has none). A VF
  under a PF whose ``sriov_drivers_autoprobe`` is 0 gets no driver unless driver_override is set.
  The write succeeds when nothing binds and when the probe fails (the kernel goes on to the next
  driver), and does nothing to a bound function; ENODEV only for an address with no function.
* ``…/drivers/<d>/bind`` ← address: ENODEV when ``<d>`` does not match (driver_override names
  another driver; none is set and ``<d>``'s ID table lacks the function), EBUSY when the function
  is bound, ENODEV for a VF under autoprobe 0 without driver_override (``pci_device_probe``
  refuses before the driver's probe: an explicit bind does *not* get around autoprobe 0, as
  real-kernel-sriov.md measured), the probe's errno when it fails, EINVAL from vfio-pci for a
  function without an IOMMU group.
* ``…/drivers/<d>/unbind`` (``<bdf>/driver/unbind`` resolves to it) ← address: ENODEV unless the
  function is bound to ``<d>``.

A bind (``really_probe``) makes the ``driver`` link and the driver's link back first, then what
the probe makes, then sends ``bind`` (``DRIVER=<d>``):

* vfio-pci: when no function of the IOMMU group is on vfio-pci yet, the group device
  ``devices/virtual/vfio/<n>`` (``noiommu-<n>`` for a group named ``vfio-noiommu``) and
  ``/dev/vfio/<n>``, uevent ``add``; with ``vfio_cdev`` also ``<bdf>/vfio-dev/vfio<i>`` with
  ``/dev/vfio/devices/vfio<i>`` and ``/dev/iommu`` (``FakeHost.add_vfio_cdev``), uevent ``add``.
* nvme, with ``nvme_namespaces``: the controller ``<bdf>/nvme/nvme<N>`` (``/dev/nvme<N>``,
  ``add`` before the ``bind``) and after the ``bind`` (the namespace scan is asynchronous) the
  namespace ``nvme<N>/nvme<N>n1`` (``dev`` = ``259:<m>``, ``/dev/nvme<N>n1``, ``add`` of subsystem
  ``block``). Functions on nvme when the emulator starts get theirs then, with no uevent.

An unbind (``__device_release_driver``) removes the ``driver`` link first, then the driver's
remove takes away what its probe made (namespace, controller; vfio-dev, the group device when
this was the group's last function on vfio-pci), then ``unbind`` (no ``DRIVER``).

``start`` takes the tree over as a booted kernel would show it: every function gets
``driver_override`` (``(null)`` unless the test wrote one), a PF with ``sriov_totalvfs`` gets
``sriov_drivers_autoprobe`` ``1`` unless it has one, every loaded driver (``drivers`` and each
directory under ``bus/pci/drivers``) its ``bind`` and ``unbind``, ``/dev/vfio/vfio`` is made when
vfio-pci is loaded, and so is the group device of every group with a function on vfio-pci.
Start it before the code under test writes; a function added later gets its ``driver_override``.

Limits, as a plain file cannot be a kernel attribute:

* **A write cannot fail.** Where the kernel's write(2) would return EBUSY, ENODEV or EINVAL
  nothing changes, and ``writes`` records the errno (``KernelWrite.errno``; ``refused()``).
* **A write returns at once** and the change follows within a millisecond or so, on the
  emulator's thread; the writer polls the ``driver`` link (as daemon/handlers/pci/_rebind.py
  does) instead of relying on write(2) returning after the probe. ``settle()`` waits until every
  write made before it has been handled.
* ``bind``, ``unbind`` and ``drivers_probe`` are FIFOs while the emulator runs, so no write is
  lost to the next one and each is handled in the order the writes were made, across files (one
  inotify queue); they are plain empty files again after ``stop``. Write one value per open, as
  the kernel wants: a second write on one open file is handled late.
* ``driver_override`` stays a plain file, read when the emulator comes to the write (change it
  again only once the writes before have shown their effect: the writer polls anyway) and
  rewritten as the kernel shows it. A write without ``O_TRUNC`` (``os.open(path, O_WRONLY)``)
  leaves the old text's tail behind it: what was written is taken to be what differs.
* The probe is atomic here: a failing one never shows a ``driver`` link (the kernel shows it
  during the probe, to a concurrent reader only). ``hold_unbind``: an unbind whose driver's
  remove waits (vfio-pci while user space holds the device); the ``driver`` link goes at once,
  as in the kernel, and every later write for that function waits behind it (the device lock).
* Not made: the ``DRIVER=`` line of a function's ``uevent`` file (FakeHost writes none),
  nvme-generic ``ng<N>n1``, ``bdi``, ``NVME_EVENT=connected``, native NVMe multipath (there the
  disk sits under ``devices/virtual/nvme-subsystem``: this is ``nvme_core.multipath=N``'s layout),
  vfio-dev devices without ``dev`` (Linux 6.1-6.5), group viability, ``new_id``.
"""

from __future__ import annotations

import errno
import os
import re
import select
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType

from inotify_simple import INotify
from inotify_simple import flags as in_flags

from daemon.core import UEvent
from daemon.sources.uevent_wire import parse_kernel_uevent
from tests.fakesysfs import FakeHost, relative_link, write_file
from tests.seam import Seam
from tests.uevents import kernel_message

VFIO_DRIVER = "vfio-pci"
NVME_DRIVER = "nvme"
NOT_ID_MATCHED = frozenset({VFIO_DRIVER, "pci-stub"})  # drivers that bind by driver_override/new_id only
VFIO_GROUP_MAJOR = 242  # dynamic on a real host (alloc_chrdev_region), like the two below
VFIO_DEVICE_MAJOR = 511  # FakeHost.add_vfio_cdev's
NVME_MAJOR = 240
BLOCK_EXT_MAJOR = 259  # NVMe namespaces get dynamic (extended) block numbers
NAMESPACE_SECTORS = 2097152  # 1 GiB in 512-byte sectors
ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
ADDRESS_WRITE = re.compile(r"([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\n?")  # sysfs_streq: one new line
NULL_OVERRIDE = "(null)"
FIFO_MASK = in_flags.OPEN | in_flags.CLOSE_WRITE  # an OPEN between two CLOSE_WRITEs keeps inotify from merging them
LEFTOVER_WAIT = 0.02  # seconds without events before a value written twice on one open is handled
STOP_TIMEOUT = 5.0


@dataclass(frozen=True)
class Uevent:
    """One uevent as the kernel sends it: ``properties`` in the kernel's order, ``SUBSYSTEM`` first
    and ``SEQNUM`` last (``ACTION`` and ``DEVPATH`` are added by ``message``)."""

    action: str
    devpath: str  # relative to /sys: /devices/pci0000:00/0000:00:04.0/0000:04:00.1
    subsystem: str
    properties: Mapping[str, str]

    @property
    def brief(self) -> str:
        """``action@devpath``, as ``udevadm monitor`` heads a message."""
        return f"{self.action}@{self.devpath}"

    def message(self) -> bytes:
        """The uevent in the kernel's wire format, as the daemon's ``unix:`` seam takes it."""
        return kernel_message(self.action, self.devpath, **self.properties)

    def event(self) -> UEvent:
        """The ``UEvent`` the daemon's kernel source makes of it (for a handler's ``fold``)."""
        return parse_kernel_uevent(self.message())


@dataclass(frozen=True)
class KernelWrite:
    """One write the emulator handled: the file (below ``sys/``), the value, and what write(2)
    would have returned on a real kernel (``errno`` 0: success), with what the kernel did."""

    path: str
    value: str
    errno: int
    note: str

    @property
    def refused(self) -> bool:
        return self.errno != 0


def to_seam(seam: Seam) -> Callable[[Uevent], None]:
    """An ``on_uevent`` callback that sends each uevent to a daemon's ``unix:`` uevent seam."""
    return lambda event: seam.send_message(event.message())


class Hold:
    """The next unbind of a function, held in its driver's remove for ``seconds`` (``None``:
    until ``release``). ``started`` is set when that unbind began (its ``driver`` link is gone),
    ``finished`` once it completed and what waited behind it was handled."""

    def __init__(self, core: FakeDriverCore, address: str, seconds: float | None) -> None:
        self.address = address
        self.seconds = seconds
        self.started = threading.Event()
        self.finished = threading.Event()
        self._core = core
        self._released = False
        self._deadline: float | None = None

    def release(self) -> None:
        """Let the held unbind complete (the kernel: user space closed the device)."""
        self._released = True
        self._core._wake()

    def _begin(self) -> None:
        if self.seconds is not None:
            self._deadline = time.monotonic() + self.seconds
        self.started.set()

    def _due(self, now: float) -> bool:
        return self._released or (self._deadline is not None and now >= self._deadline)


@dataclass
class _Fifo:
    """One write-only attribute made a FIFO: the read end, a writer of our own (so the read end
    never sees end-of-file) and what was read but not yet handled."""

    path: Path
    read_fd: int
    write_fd: int
    pending: str = ""


@dataclass
class _Request:
    kind: str  # override, probe, bind, unbind
    path: str  # below sys/
    value: str
    address: str | None
    driver: str | None = None


@dataclass
class _Releasing:
    """A function whose unbind waits in its driver's remove, and the writes that wait behind it."""

    driver: str
    hold: Hold
    backlog: list[_Request] = field(default_factory=list)


class FakeDriverCore:
    """The PCI driver core of ``host`` while it runs (a context manager; ``start``/``stop``).

    ``on_uevent`` gets every uevent, on the emulator's thread, in the kernel's order (they are
    kept in ``uevents`` too). ``drivers``: drivers loaded besides those with a directory under
    ``bus/pci/drivers`` already. ``id_table``: ``PCI_ID`` (``1B36:0010``, as the uevent shows it)
    to the driver whose ID table has it; a function bound to a driver other than vfio-pci or
    pci-stub when first looked at adds its own. ``nvme_namespaces``: nvme makes controllers and
    namespaces; ``vfio_cdev``: vfio-pci makes VFIO device cdevs (a kernel with IOMMUFD).
    """

    def __init__(
        self,
        host: FakeHost,
        *,
        on_uevent: Callable[[Uevent], None] | None = None,
        drivers: Iterable[str] = (VFIO_DRIVER,),
        id_table: Mapping[str, str] | None = None,
        nvme_namespaces: bool = False,
        vfio_cdev: bool = False,
    ) -> None:
        self.host = host
        self.uevents: list[Uevent] = []
        self.writes: list[KernelWrite] = []
        self._on_uevent = on_uevent
        self._drivers = tuple(drivers)
        self._id_table = {pci_id.upper(): driver for pci_id, driver in (id_table or {}).items()}
        self._nvme_namespaces = nvme_namespaces
        self._vfio_cdev = vfio_cdev
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._failures: dict[str, list[int]] = {}
        self._armed: dict[str, Hold] = {}
        self._releasing: dict[str, _Releasing] = {}
        self._overrides: dict[str, str | None] = {}
        self._override_files: dict[str, str] = {}  # what each driver_override file said when last read or written
        self._fifos: dict[Path, _Fifo] = {}
        self._device_dirs: dict[str, Path] = {}
        self._sys_real = host.sys.resolve()
        self._watches: dict[int, tuple[str, str]] = {}
        self._errors: list[BaseException] = []
        self._seqnum = 0
        self._diskseq = 0
        self._barriers_sent = 0
        self._barriers_seen = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._inotify: INotify | None = None
        self._wake_fds: tuple[int, int] | None = None
        self._barrier_dir: Path | None = None

    # -- life --------------------------------------------------------------------------------
    def __enter__(self) -> FakeDriverCore:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop(raise_errors=error is None)

    def start(self) -> None:
        """Take the tree over as the kernel has it now, then handle writes until ``stop``."""
        self._inotify = INotify(nonblocking=True)
        self._wake_fds = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._barrier_dir = Path(tempfile.mkdtemp(prefix="fakedriver"))
        self._watch(self._barrier_dir, in_flags.CLOSE_WRITE, "barrier", "")
        pci = self.host.sys / "bus" / "pci"
        for driver in self._drivers:
            (pci / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        self._watch(pci / "devices", in_flags.CREATE | in_flags.DELETE, "devices", "")
        self._watch(pci / "drivers", in_flags.CREATE | in_flags.ONLYDIR, "drivers", "")
        self._watch(pci, FIFO_MASK, "bus", "")
        self._make_fifo(pci / "drivers_probe")
        for driver_dir in sorted(p for p in (pci / "drivers").iterdir() if p.is_dir()):
            self._add_driver(driver_dir.name)
        for link in sorted((pci / "devices").iterdir()):
            self._add_function(link.name, at_start=True)
        if (pci / "drivers" / VFIO_DRIVER).is_dir():
            self._node("vfio/vfio")
        self._inotify.read(timeout=0)  # our own writes above; nothing else writes before start returns
        self._thread = threading.Thread(target=self._run, name="fakedriver", daemon=True)
        self._thread.start()

    def stop(self, *, raise_errors: bool = True) -> None:
        """Stop handling writes (what waits behind a hold is dropped), turn the FIFOs back into
        plain files and close everything; then raise the first error the thread met (a failing
        ``on_uevent``, a bug), unless ``raise_errors`` is false. The tree may be gone already."""
        if self._thread is not None:
            with self._lock:
                self._stopping = True
            self._wake()
            self._thread.join(STOP_TIMEOUT)
            if self._thread.is_alive():
                self._errors.append(RuntimeError("the fakedriver thread did not stop"))
            self._thread = None
        for fifo in self._fifos.values():  # plain files first: an open(2) of a FIFO without a reader blocks
            try:
                if stat.S_ISFIFO(os.lstat(fifo.path).st_mode):
                    fifo.path.unlink()
                    fifo.path.write_bytes(b"")
            except OSError:
                pass  # the tree is gone (or going): nothing to put back
        for fifo in self._fifos.values():
            os.close(fifo.read_fd)
            os.close(fifo.write_fd)
        self._fifos.clear()
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._wake_fds is not None:
            for descriptor in self._wake_fds:
                os.close(descriptor)
            self._wake_fds = None
        if self._barrier_dir is not None:
            shutil.rmtree(self._barrier_dir, ignore_errors=True)
            self._barrier_dir = None
        if raise_errors and self._errors:
            raise self._errors[0]

    # -- what a test arranges ------------------------------------------------------------------
    def fail_next_bind(self, address: str, error: int = errno.EIO) -> None:
        """The next probe of ``address`` (through any write) fails with ``error``, as a driver's
        probe that gives up: no ``driver`` link, no uevent. Calls add up, one probe each."""
        with self._lock:
            self._failures.setdefault(address, []).append(error)

    def hold_unbind(self, address: str, seconds: float | None = None) -> Hold:
        """The next unbind of ``address`` waits in the driver's remove for ``seconds`` (``None``:
        until ``Hold.release``); see ``Hold``."""
        hold = Hold(self, address, seconds)
        with self._lock:
            if address in self._armed:
                raise ValueError(f"{address}: an unbind hold is armed already")
            self._armed[address] = hold
        return hold

    def settle(self, timeout: float = 5.0) -> None:
        """Return once every write made before the call has been handled (or waits behind a
        hold); AssertionError after ``timeout`` seconds."""
        assert self._barrier_dir is not None, "the emulator is not running"
        with self._lock:
            self._barriers_sent += 1
            wanted = self._barriers_sent
        (self._barrier_dir / "barrier").write_text(str(wanted))
        with self._settled:
            if not self._settled.wait_for(lambda: self._barriers_seen >= wanted or self._stopping, timeout):
                raise AssertionError(f"the fake driver core did not settle within {timeout}s")

    def refused(self) -> list[KernelWrite]:
        """The writes a real kernel would have failed."""
        return [write for write in self.writes if write.refused]

    # -- the thread ----------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._wake_fds is not None:
            try:
                os.write(self._wake_fds[1], b"x")
            except BlockingIOError:
                pass  # a wake-up is pending already

    def _run(self) -> None:
        assert self._inotify is not None and self._wake_fds is not None
        poller = select.poll()
        poller.register(self._inotify.fileno(), select.POLLIN)
        poller.register(self._wake_fds[0], select.POLLIN)
        while True:
            ready = poller.poll(self._poll_timeout())
            with self._lock:
                if self._stopping:
                    self._settled.notify_all()
                    return
            try:
                while os.read(self._wake_fds[0], 512):
                    pass
            except BlockingIOError:
                pass
            handled = False
            for event in self._inotify.read(timeout=0):
                handled = True
                self._guarded(self._on_event, event.wd, event.mask, event.name)
            self._guarded(self._end_due_holds)
            if not ready and not handled:
                self._guarded(self._handle_leftovers)

    def _poll_timeout(self) -> int | None:
        now = time.monotonic()
        timeouts = []
        for releasing in self._releasing.values():
            if (deadline := releasing.hold._deadline) is not None:
                timeouts.append(max(0.0, deadline - now))
        if any(fifo.pending for fifo in self._fifos.values()):
            timeouts.append(LEFTOVER_WAIT)
        return None if not timeouts else int(min(timeouts) * 1000) + 1

    def _guarded(self, call: Callable[..., None], *args: object) -> None:
        try:
            call(*args)
        except FileNotFoundError:
            pass  # a function (or the whole tree, at teardown) removed under us: there is nothing to do
        except Exception as error:
            if self.host.sys.is_dir():
                self._errors.append(error)

    def _on_event(self, wd: int, mask: int, name: str) -> None:
        if mask & in_flags.IGNORED:
            self._watches.pop(wd, None)
            return
        if mask & in_flags.Q_OVERFLOW:
            raise RuntimeError("the fakedriver's inotify queue overflowed: writes were lost")
        kind, key = self._watches.get(wd, ("", ""))
        pci = self.host.sys / "bus" / "pci"
        closed = bool(mask & in_flags.CLOSE_WRITE)
        if kind == "barrier" and closed:
            text = (self._barrier_dir / name).read_text() if self._barrier_dir is not None else ""
            with self._settled:
                self._barriers_seen = max(self._barriers_seen, int(text or 0))
                self._settled.notify_all()
        elif kind == "bus" and closed and name == "drivers_probe":
            self._take(pci / name, "probe", None)
        elif kind == "driver" and closed and name in ("bind", "unbind"):
            self._take(pci / "drivers" / key / name, name, key)
        elif kind == "drivers" and mask & in_flags.CREATE and mask & in_flags.ISDIR:
            self._add_driver(name)
        elif kind == "devices" and mask & in_flags.CREATE:
            self._add_function(name, at_start=False)
        elif kind == "devices" and mask & in_flags.DELETE:
            self._overrides.pop(name, None)
            self._override_files.pop(name, None)
            self._device_dirs.pop(name, None)
        elif kind == "device" and closed and name == "driver_override":
            self._override_written(key)

    def _take(self, path: Path, kind: str, driver: str | None, *, read: bool = True) -> None:
        """The next value written to the FIFO ``path`` (``read``: reading what came meanwhile
        first): handle it."""
        fifo = self._fifos.get(path)
        if fifo is None:
            return
        if read:
            self._read_fifo(fifo)
        value, fifo.pending = _next_value(fifo.pending)
        if value is not None:
            address = value.rstrip("\n") if ADDRESS.fullmatch(value.rstrip("\n")) else None
            self._handle(_Request(kind, self._below_sys(path), value, address, driver))

    def _handle_leftovers(self) -> None:
        for path, fifo in list(self._fifos.items()):
            while fifo.pending:
                driver = path.parent.name if path.name in ("bind", "unbind") else None
                self._take(path, path.name if driver is not None else "probe", driver, read=False)

    @staticmethod
    def _read_fifo(fifo: _Fifo) -> None:
        try:
            while chunk := os.read(fifo.read_fd, 65536):
                fifo.pending += chunk.decode(errors="replace")
        except BlockingIOError:
            pass

    # -- the kernel ------------------------------------------------------------------------------
    def _handle(self, request: _Request) -> None:
        if request.address is not None and request.address in self._releasing:
            self._releasing[request.address].backlog.append(request)
            return
        if request.address is None or not self._exists(request.address):
            self._log(request, errno.ENODEV, f"no PCI function named {request.value!r}")
        elif request.kind == "override":
            self._set_override(request)
        elif request.kind == "probe":
            self._drivers_probe(request, request.address)
        elif request.kind == "bind":
            assert request.driver is not None
            self._bind_store(request, request.address, request.driver)
        else:
            assert request.driver is not None
            self._unbind_store(request, request.address, request.driver)

    def _set_override(self, request: _Request) -> None:
        assert request.address is not None
        value = request.value.split("\n", 1)[0]
        self._overrides[request.address] = value if value and value != NULL_OVERRIDE else None
        self._write_override_file(request.address)
        self._log(request, 0, f"driver_override {self._overrides[request.address] or 'cleared'}")

    def _drivers_probe(self, request: _Request, address: str) -> None:
        bound = self._driver_of(address)
        if bound is not None:
            self._log(request, 0, f"bound to {bound} already: nothing to do")
            return
        override = self._overrides.get(address)
        candidate = override if override is not None else self._id_driver(address)
        if candidate is None or not self._loaded(candidate):
            self._log(request, 0, "no driver matches" if candidate is None else f"{candidate} is not loaded")
            return
        error, note = self._probe(address, candidate)
        self._log(request, 0, note if not error else f"{note}; the kernel goes on to the next driver: none matches")

    def _bind_store(self, request: _Request, address: str, driver: str) -> None:
        override = self._overrides.get(address)
        if override is not None and override != driver:
            self._log(request, errno.ENODEV, f"driver_override is {override}: {driver} does not match")
        elif override is None and self._id_driver(address) != driver:
            self._log(request, errno.ENODEV, f"{driver}'s ID table does not have {self._pci_id(address)}")
        elif (bound := self._driver_of(address)) is not None:
            self._log(request, errno.EBUSY, f"bound to {bound} already")
        else:
            error, note = self._probe(address, driver)
            self._log(request, error, note)

    def _unbind_store(self, request: _Request, address: str, driver: str) -> None:
        bound = self._driver_of(address)
        if bound != driver:
            self._log(request, errno.ENODEV, f"not bound to {driver} (bound to {bound or 'no driver'})")
            return
        self._log(request, 0, f"unbound from {driver}")
        self._detach(address, driver)

    def _probe(self, address: str, driver: str) -> tuple[int, str]:
        """Bind ``address`` to ``driver`` (which matches it); (0, note) or (errno, why not)."""
        if not self._can_probe(address):
            return errno.ENODEV, "a VF of a PF with sriov_drivers_autoprobe 0 and no driver_override: not probed"
        with self._lock:
            failures = self._failures.get(address, [])
            failure = failures.pop(0) if failures else 0
        if failure:
            return failure, f"probe with driver {driver} failed with error -{failure}"
        if driver == VFIO_DRIVER and self._group_of(address) is None:
            return errno.EINVAL, "vfio-pci: no IOMMU group"
        self._attach(address, driver)
        return 0, f"bound to {driver}"

    def _attach(self, address: str, driver: str) -> None:
        self.host.bind(address, driver)  # driver_sysfs_add comes before the driver's probe
        if driver == VFIO_DRIVER:
            group = self._group_of(address)
            assert group is not None
            group_dir = self._vfio_group_dir(group)
            if not group_dir.is_dir():
                self._add_vfio_group(group_dir)
            if self._vfio_cdev:
                self._add_vfio_device(address)
        if driver == NVME_DRIVER and self._nvme_namespaces:
            controller = self._add_nvme_controller(address)
        self._send_pci("bind", address, driver)
        if driver == NVME_DRIVER and self._nvme_namespaces:
            self._add_namespace(controller)

    def _detach(self, address: str, driver: str) -> None:
        self.host.unbind(address)  # driver_sysfs_remove comes before the driver's remove
        with self._lock:
            hold = self._armed.pop(address, None)
        if hold is None:
            self._remove(address, driver)
            return
        self._releasing[address] = _Releasing(driver, hold)
        hold._begin()

    def _remove(self, address: str, driver: str) -> None:
        """The driver's remove, then the ``unbind`` uevent."""
        device_dir = self._device_dir(address)
        if driver == NVME_DRIVER:
            for controller in sorted((device_dir / "nvme").glob("nvme*")):
                for namespace in sorted(controller.glob(f"{controller.name}n*")):
                    self._remove_class_device(namespace, "block")
                self._remove_class_device(controller, "nvme")
            _prune(device_dir / "nvme")
        if driver == VFIO_DRIVER:
            for cdev in sorted((device_dir / "vfio-dev").glob("vfio*")):
                self._remove_class_device(cdev, "vfio-dev")
            _prune(device_dir / "vfio-dev")
            group = self._group_of(address)
            if group is not None and self._vfio_group_dir(group).is_dir() and not self._on_vfio(group, address):
                self._remove_class_device(self._vfio_group_dir(group), "vfio")
        self._send_pci("unbind", address, None)

    def _end_due_holds(self) -> None:
        now = time.monotonic()
        for address, releasing in list(self._releasing.items()):
            if releasing.hold._due(now):
                del self._releasing[address]
                self._remove(address, releasing.driver)
                for request in releasing.backlog:
                    self._handle(request)
                releasing.hold.finished.set()

    # -- facts about the tree ------------------------------------------------------------------
    def _device_dir(self, address: str) -> Path:
        """The function's directory, resolved once (a function never moves; resolving costs)."""
        if (known := self._device_dirs.get(address)) is not None:
            return known
        directory = self.host.device_dir(address)
        if directory.is_dir():
            self._device_dirs[address] = directory
        return directory

    def _exists(self, address: str) -> bool:
        return (self.host.sys / "bus" / "pci" / "devices" / address).is_dir()

    def _loaded(self, driver: str) -> bool:
        return (self.host.sys / "bus" / "pci" / "drivers" / driver).is_dir()

    def _driver_of(self, address: str) -> str | None:
        return _link_name(self.host.sys / "bus" / "pci" / "devices" / address / "driver")

    def _group_of(self, address: str) -> str | None:
        return _link_name(self.host.sys / "bus" / "pci" / "devices" / address / "iommu_group")

    def _pci_id(self, address: str) -> str:
        device_dir = self._device_dir(address)
        vendor, device = ((device_dir / name).read_text().strip().removeprefix("0x") for name in ("vendor", "device"))
        return f"{vendor}:{device}".upper()

    def _id_driver(self, address: str) -> str | None:
        """The driver whose ID table has the function: ``id_table``, or learned from a function
        with the same ``PCI_ID`` on a driver that binds by ID."""
        pci_id = self._pci_id(address)
        if pci_id not in self._id_table:
            for link in sorted((self.host.sys / "bus" / "pci" / "devices").iterdir()):
                driver = self._driver_of(link.name)
                if driver is not None and driver not in NOT_ID_MATCHED and self._pci_id(link.name) == pci_id:
                    self._id_table[pci_id] = driver
                    break
        return self._id_table.get(pci_id)

    def _can_probe(self, address: str) -> bool:
        """``pci_device_can_probe``: not a VF, or its PF autoprobes, or driver_override is set."""
        physfn = self._device_dir(address) / "physfn"
        if not physfn.is_symlink() or self._overrides.get(address) is not None:
            return True
        autoprobe = physfn.resolve() / "sriov_drivers_autoprobe"
        return not autoprobe.exists() or autoprobe.read_text().strip() != "0"

    def _on_vfio(self, group: str, leaving: str) -> bool:
        """Whether a function of ``group`` other than ``leaving`` is on vfio-pci (or leaving it)."""
        members = self.host.sys / "kernel" / "iommu_groups" / group / "devices"
        return any(name != leaving and (self._driver_of(name) == VFIO_DRIVER or (
            name in self._releasing and self._releasing[name].driver == VFIO_DRIVER))
            for name in os.listdir(members))

    def _vfio_group_dir(self, group: str) -> Path:
        name_file = self.host.sys / "kernel" / "iommu_groups" / group / "name"
        noiommu = name_file.exists() and name_file.read_text().strip() == "vfio-noiommu"
        return self._sys_real / "devices" / "virtual" / "vfio" / (f"noiommu-{group}" if noiommu else group)

    # -- taking the tree over ----------------------------------------------------------------
    def _watch(self, path: Path, mask: int, kind: str, key: str) -> None:
        assert self._inotify is not None
        self._watches[self._inotify.add_watch(path, mask)] = (kind, key)

    def _make_fifo(self, path: Path) -> None:
        if path in self._fifos:
            return
        if path.exists() or path.is_symlink():
            path.unlink()
        os.mkfifo(path, 0o600)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        write_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._fifos[path] = _Fifo(path, read_fd, write_fd)

    def _add_driver(self, driver: str) -> None:
        driver_dir = self.host.sys / "bus" / "pci" / "drivers" / driver
        self._watch(driver_dir, FIFO_MASK, "driver", driver)
        for name in ("bind", "unbind"):
            self._make_fifo(driver_dir / name)

    def _add_function(self, address: str, *, at_start: bool) -> None:
        """A function as the kernel has it: ``driver_override``; at start also a PF's
        ``sriov_drivers_autoprobe`` (1) and the group device and nvme children its driver made.
        A function added later may still be in the making (FakeHost): it gets its override only."""
        device_dir = self._device_dir(address)
        if not device_dir.is_dir():
            return
        self._watch(device_dir, in_flags.CLOSE_WRITE, "device", address)
        override_file = device_dir / "driver_override"
        text = override_file.read_text() if override_file.exists() else ""
        value = text.split("\n", 1)[0]
        self._overrides[address] = value if value and value != NULL_OVERRIDE else None
        self._write_override_file(address)
        if not at_start:
            return
        if (device_dir / "sriov_totalvfs").exists() and not (device_dir / "sriov_drivers_autoprobe").exists():
            write_file(device_dir / "sriov_drivers_autoprobe", "1\n")
        driver = self._driver_of(address)
        group = self._group_of(address)
        if driver == VFIO_DRIVER and group is not None and not self._vfio_group_dir(group).is_dir():
            self._add_vfio_group(self._vfio_group_dir(group), send=False)
        if driver == NVME_DRIVER and self._nvme_namespaces and not (device_dir / "nvme").is_dir():
            self._add_namespace(self._add_nvme_controller(address, send=False), send=False)

    def _override_text(self, address: str) -> str:
        """``driver_override`` as the kernel shows it."""
        return f"{self._overrides.get(address) or NULL_OVERRIDE}\n"

    def _write_override_file(self, address: str) -> None:
        path = self._device_dir(address) / "driver_override"
        if not path.exists() or path.read_text() != self._override_text(address):
            path.write_text(self._override_text(address))
        self._override_files[address] = self._override_text(address)

    def _override_written(self, address: str) -> None:
        """A close after a write of ``driver_override``: what was written is what differs from
        what the file said before (a write without O_TRUNC, as os.open(path, O_WRONLY) makes,
        leaves the old text's tail); nothing when it says the same (our own rewrite)."""
        path = self._device_dir(address) / "driver_override"
        text = path.read_text()
        before = self._override_files.get(address, "")
        self._override_files[address] = text
        if text != before:
            value = _written_over(before, text)
            self._handle(_Request("override", f"bus/pci/devices/{address}/driver_override", value, address))

    # -- what drivers make ---------------------------------------------------------------------
    def _add_vfio_group(self, group_dir: Path, *, send: bool = True) -> None:
        minor = _lowest_free(_minors(self.host.sys / "class" / "vfio"))
        self._add_class_device(group_dir, "vfio", f"vfio/{group_dir.name}", VFIO_GROUP_MAJOR, minor, {}, send)

    def _add_vfio_device(self, address: str) -> None:
        index = _lowest_free({int(name[4:]) for name in _names(self.host.sys / "class" / "vfio-dev")})
        self.host.add_vfio_cdev(address, index)
        cdev = self._device_dir(address) / "vfio-dev" / f"vfio{index}"
        properties = {"MAJOR": str(VFIO_DEVICE_MAJOR), "MINOR": str(index), "DEVNAME": f"vfio/devices/vfio{index}"}
        write_file(cdev / "uevent", "".join(f"{k}={v}\n" for k, v in properties.items()))
        relative_link(cdev / "subsystem", self.host.sys / "class" / "vfio-dev")
        self._send("add", cdev, "vfio-dev", properties)

    def _add_nvme_controller(self, address: str, *, send: bool = True) -> Path:
        taken = {int(name[4:]) for name in _names(self.host.sys / "class" / "nvme")}
        taken |= {int(name[4:]) for name in _names(self.host.dev) if re.fullmatch(r"nvme\d+", name)}
        instance = _lowest_free(taken)
        controller = self._device_dir(address) / "nvme" / f"nvme{instance}"
        self._add_class_device(controller, "nvme", f"nvme{instance}", NVME_MAJOR, instance,
                               {"NVME_TRTYPE": "pcie"}, send)
        return controller

    def _add_namespace(self, controller: Path, *, send: bool = True) -> None:
        minor = _lowest_free(_minors(self.host.sys / "class" / "block", BLOCK_EXT_MAJOR))
        self._diskseq += 1
        namespace = controller / f"{controller.name}n1"
        write_file(namespace / "size", f"{NAMESPACE_SECTORS}\n")
        self._add_class_device(namespace, "block", namespace.name, BLOCK_EXT_MAJOR, minor,
                               {"DEVTYPE": "disk", "DISKSEQ": str(self._diskseq)}, send)
        relative_link(self.host.sys / "block" / namespace.name, namespace)

    def _add_class_device(self, directory: Path, class_name: str, devname: str, major: int, minor: int,
                          extra: dict[str, str], send: bool) -> None:
        """A class device with a device number: ``dev``, ``uevent``, ``subsystem``, the class and
        ``dev/{char,block}`` links, its node under /dev; its ``add`` uevent when ``send``."""
        kind = "block" if class_name == "block" else "char"
        properties = {"MAJOR": str(major), "MINOR": str(minor), "DEVNAME": devname, **extra}
        write_file(directory / "dev", f"{major}:{minor}\n")
        write_file(directory / "uevent", "".join(f"{k}={v}\n" for k, v in properties.items()))
        relative_link(directory / "subsystem", self.host.sys / "class" / class_name)
        relative_link(self.host.sys / "class" / class_name / directory.name, directory)
        relative_link(self.host.sys / "dev" / kind / f"{major}:{minor}", directory)
        self._node(devname)
        if send:
            self._send("add", directory, class_name, properties)

    def _remove_class_device(self, directory: Path, class_name: str) -> None:
        """Send its ``remove`` (with what its ``uevent`` file says, as the kernel sends what the
        device had), then take it, its links and its node away."""
        properties = _read_properties(directory / "uevent")
        if "MAJOR" not in properties and (directory / "dev").exists():  # one a test made by hand
            major, minor = (directory / "dev").read_text().strip().split(":")
            properties = {"MAJOR": major, "MINOR": minor, "DEVNAME": directory.name}
        self._send("remove", directory, class_name, properties)
        shutil.rmtree(directory)
        kind = "block" if class_name == "block" else "char"
        for link in (self.host.sys / "class" / class_name / directory.name,
                     self.host.sys / "dev" / kind / f"{properties.get('MAJOR')}:{properties.get('MINOR')}",
                     self.host.sys / "block" / directory.name):
            if link.is_symlink() and not link.exists():
                link.unlink()
        if "DEVNAME" in properties:
            (self.host.dev / properties["DEVNAME"]).unlink(missing_ok=True)

    def _node(self, devname: str) -> None:
        if not (self.host.dev / devname).exists():
            self.host.add_dev_node(devname)

    # -- uevents and the log -------------------------------------------------------------------
    def _send_pci(self, action: str, address: str, driver: str | None) -> None:
        device_dir = self._device_dir(address)
        properties = {"DRIVER": driver} if driver is not None else {}
        properties.update((k, v) for k, v in _read_properties(device_dir / "uevent").items() if k != "DRIVER")
        if "MODALIAS" not in properties and (device_dir / "modalias").exists():
            properties["MODALIAS"] = (device_dir / "modalias").read_text().strip()
        self._send(action, device_dir, "pci", properties)

    def _send(self, action: str, directory: Path, subsystem: str, properties: dict[str, str]) -> None:
        self._seqnum += 1
        real = directory if directory.is_relative_to(self._sys_real) else directory.resolve()
        devpath = "/" + real.relative_to(self._sys_real).as_posix()
        event = Uevent(action, devpath, subsystem,
                       MappingProxyType({"SUBSYSTEM": subsystem, **properties, "SEQNUM": str(self._seqnum)}))
        self.uevents.append(event)
        if self._on_uevent is not None:
            self._on_uevent(event)

    def _log(self, request: _Request, error: int, note: str) -> None:
        self.writes.append(KernelWrite(request.path, request.value, error, note))

    def _below_sys(self, path: Path) -> str:
        try:
            return path.relative_to(self.host.sys).as_posix()
        except ValueError:
            return path.resolve().relative_to(self.host.sys.resolve()).as_posix()


def _next_value(pending: str) -> tuple[str | None, str]:
    """The first value written in ``pending`` (an address with its new line, or whatever else
    comes before the next address) and the rest."""
    if not pending:
        return None, pending
    if found := ADDRESS_WRITE.match(pending):
        return found.group(0), pending[found.end():]
    following = ADDRESS.search(pending, 1)
    end = following.start() if following is not None else len(pending)
    return pending[:end], pending[end:]


def _written_over(before: str, after: str) -> str:
    """What a write turned the file text ``before`` into ``after`` with: the shortest head of
    ``after`` beyond which both agree (a write that did not truncate overwrote only that), or
    all of ``after``."""
    for end in range(len(after) + 1):
        if after[end:] == before[end:]:
            return after[:end]
    return after


def _link_name(link: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(link))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_properties(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _names(directory: Path) -> list[str]:
    return os.listdir(directory) if directory.is_dir() else []


def _minors(class_dir: Path, major: int | None = None) -> set[int]:
    minors = set()
    for name in _names(class_dir):
        dev = class_dir / name / "dev"
        if dev.exists():
            device_major, minor = dev.read_text().strip().split(":")
            if major is None or int(device_major) == major:
                minors.add(int(minor))
    return minors


def _lowest_free(taken: set[int]) -> int:
    number = 0
    while number in taken:
        number += 1
    return number


def _prune(directory: Path) -> None:
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()

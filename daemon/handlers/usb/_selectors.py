"""usbDevice selectors: which USB devices a pool offers.

``{"vendors": ["0403"], "products": ["6001"], "serials": ["FT*"], "ports": ["1-2*"],
"interfaceClasses": ["ff"], "drivers": ["ftdi_sio"]}``: in one selector object every key given
must match, and a key matches when any of its values does; ``selectors`` may be a list of such
objects, a device matching any of them. ``vendors`` and ``products`` are exactly four hex digits
(``idVendor``/``idProduct``); ``serials`` and ``ports`` are globs over the sysfs ``serial`` and
the kernel name (the port path, ``1-2.1``); ``interfaceClasses`` (two hex digits) and
``drivers`` match any of the device's interfaces. Unknown keys are refused: this is our own
format, and a misspelt key would otherwise select every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from daemon.core import ConfigError, ConfigObject, Mismatch, wanted

from ._discovery import UsbDevice

KEYS = ("vendors", "products", "serials", "ports", "interfaceClasses", "drivers")
HEX = frozenset("0123456789abcdef")
EXAMPLES = {4: "0403", 2: "ff"}


@dataclass(frozen=True, slots=True)
class UsbSelector:
    vendors: tuple[str, ...] = ()
    products: tuple[str, ...] = ()
    serials: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    interface_classes: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()

    def matches(self, device: UsbDevice) -> bool:
        return self.mismatch(device) is None

    def mismatch(self, device: UsbDevice) -> Mismatch | None:
        """The first key that refuses ``device``, what it wants and what the device has; ``None``:
        it matches."""
        if self.vendors and device.vendor not in self.vendors:
            return Mismatch("vendors", wanted(self.vendors), device.vendor)
        if self.products and device.product not in self.products:
            return Mismatch("products", wanted(self.products), device.product)
        if self.serials and not (device.serial and any(fnmatchcase(device.serial, s) for s in self.serials)):
            return Mismatch("serials", wanted(self.serials), repr(device.serial) if device.serial else "no serial")
        if self.ports and not any(fnmatchcase(device.port, p) for p in self.ports):
            return Mismatch("ports", wanted(self.ports), device.port)
        classes = [interface.interface_class for interface in device.interfaces]
        if self.interface_classes and not any(c in self.interface_classes for c in classes):
            return Mismatch("interfaceClasses", wanted(self.interface_classes), wanted(classes))
        if self.drivers and not any(driver in self.drivers for driver in device.drivers):
            return Mismatch("drivers", wanted(self.drivers), wanted(device.drivers) if device.drivers else "no driver")
        return None


def _hex_ids(selector: ConfigObject, key: str, digits: int) -> tuple[str, ...]:
    values = []
    for index, value in enumerate(selector.string_list(key)):
        if len(value) != digits or set(value.lower()) - HEX:
            raise ConfigError(f"{selector.path_of(key)}[{index}]",
                              f"{value!r} is not {digits} hex digits, as sysfs writes them ({EXAMPLES[digits]!r})")
        values.append(value.lower())
    return tuple(values)


def parse_selector(selector: ConfigObject) -> UsbSelector:
    known = {key.casefold(): key for key in KEYS}
    for key in selector.keys():
        if key.casefold() not in known:
            raise ConfigError(selector.path_of(key), f"is not a usbDevice selector (one of {', '.join(KEYS)})")
    parsed = UsbSelector(
        vendors=_hex_ids(selector, "vendors", 4),
        products=_hex_ids(selector, "products", 4),
        serials=selector.string_list("serials"),
        ports=selector.string_list("ports"),
        interface_classes=_hex_ids(selector, "interfaceClasses", 2),
        drivers=selector.string_list("drivers"),
    )
    if parsed == UsbSelector():
        raise ConfigError(selector.json_path, f"selects nothing: give at least one of {', '.join(KEYS)}")
    return parsed

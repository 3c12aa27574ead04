"""ARPHRD numbers (``net/<if>/type``) to the link-type names the SR-IOV plugin's ``linkTypes``
selector compares with (netlink's EncapType strings)."""

from __future__ import annotations

from types import MappingProxyType

_NAMES = MappingProxyType(
    {
        0: "generic", 1: "ether", 2: "eether", 3: "ax25", 4: "pronet", 5: "chaos",
        6: "ieee802", 7: "arcnet", 8: "atalk", 15: "dlci", 19: "atm", 23: "metricom",
        24: "ieee1394", 32: "infiniband", 256: "slip", 257: "cslip", 258: "slip6",
        259: "cslip6", 260: "rsrvd", 264: "adapt", 270: "rose", 271: "x25", 272: "hwx25",
        512: "ppp", 513: "hdlc", 516: "lapb", 517: "ddcmp", 518: "rawhdlc", 768: "ipip",
        769: "tunnel6", 770: "frad", 771: "skip", 772: "loopback", 773: "ltalk", 774: "fddi",
        775: "bif", 776: "sit", 777: "ip/ddp", 778: "gre", 779: "pimreg", 780: "hippi",
        781: "ash", 782: "econet", 783: "irda", 784: "fcpp", 785: "fcal", 786: "fcpl",
        **{787 + n: f"fcfb{n}" for n in range(13)},
        800: "tr", 801: "ieee802.11", 802: "ieee802.11/prism", 803: "ieee802.11/radiotap",
        804: "ieee802.15.4", 65534: "none", 65535: "void",
    }
)


def link_type_name(arphrd: int) -> str:
    return _NAMES.get(arphrd, f"unknown{arphrd}")

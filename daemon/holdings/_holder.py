"""Who holds a device, said one way everywhere: in refusals, in ``devplugd list``, in logs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Holder kinds: the three roads' holders, and a book that could not be read
LEASE = "lease"  # a host lease (the host API)
CLAIM = "claim"  # a DRA ResourceClaim prepared on this node
KUBELET = "kubelet"  # a pod, through the device-plugin API (the kubelet's checkpoint)
LOST_LEASES = "lost-lease-book"  # the lease book could not be read: any device may be leased
LOST_CLAIMS = "lost-claim-book"  # the claim book could not be read: any DRA device may be claimed
LOST_KINDS = {"lease": LOST_LEASES, "claim": LOST_CLAIMS}  # a lost book (by its name) as a holder kind

CLEAR_COMMAND = "devplugd clear-lost"

DeviceKey = tuple[str, str]  # (resource, device ID)


@dataclass(frozen=True, slots=True)
class Holder:
    """One holder of a device. ``name`` says which (a lease ID, a claim's ``namespace/name``, a
    pod's ``uid/container``, a lost book's file) and ``detail`` what else is known of it (a
    lease's owner, a claim's UID); either is empty when only the tree's record is at hand."""

    kind: str
    name: str = ""
    detail: str = ""

    def describe(self) -> str:
        """The holder as a refusal names it: ``host lease lease-1a2b (owner ci@node1)``."""
        if self.kind == LEASE:
            return f"host lease {self.name} (owner {self.detail})" if self.name else "a host lease"
        if self.kind == CLAIM:
            if not self.name:
                return "a DRA claim"
            return f"the DRA claim {self.name} (UID {self.detail})" if self.detail else f"the DRA claim {self.name}"
        if self.kind == KUBELET:
            if self.name:
                return f"the kubelet ({self.name})"
            if self.detail:  # the checkpoint cannot be read: any device may be a pod's
                return f"a pod through the device-plugin API, as far as anyone can tell ({self.detail})"
            return "a pod through the device-plugin API (the kubelet's checkpoint)"
        book = "lease" if self.kind == LOST_LEASES else "claim"
        return f"the lost {book} book ({self.detail or 'unreadable'}; `{CLEAR_COMMAND} {book}s` once it is known free)"


@dataclass(frozen=True)
class LostBook:
    """A book (leases or claims) whose file could not be read at start: nobody can tell which
    devices it held. ``moved_to`` is where the file was moved aside for the operator (``None``:
    it could not be moved, and is never written over)."""

    book: str  # "lease" or "claim"
    path: Path
    reason: str
    moved_to: Path | None
    since: float

    def __str__(self) -> str:
        where = f"; moved aside to {self.moved_to}" if self.moved_to is not None else ""
        return f"the {self.book} book {self.path} {self.reason}{where}"

    def holder(self) -> Holder:
        return Holder(LOST_KINDS[self.book], str(self.moved_to or self.path), f"{self.path} {self.reason}")

"""Protobuf wire encoding, where the daemon builds a big message from parts it keeps.

A message with thousands of entries in one repeated field (a ListAndWatch list, a DRA health
list) is cheaper to make by joining the entries' encodings, kept from the last message, and
parsing the result in one C call than by copying thousands of messages into the field.
"""

from __future__ import annotations


def framed(field_number: int, body: bytes) -> bytes:
    """``body`` (a serialized message) as one element of length-delimited field
    ``field_number`` (at most 15: a one-byte tag): the tag, the length as a varint, the body."""
    if not 1 <= field_number <= 15:
        raise ValueError(f"field number {field_number} needs a tag of more than one byte")
    size, prefix = len(body), bytearray([field_number << 3 | 2])
    while size > 0x7F:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + body

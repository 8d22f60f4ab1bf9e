"""Reading msgpack structure without building it: headers, type names, object boundaries.

The tolerant decoder uses these to size a payload up before decoding any of it generically:
a container's declared length says how many objects would be built, so a hostile payload
(millions of one-byte objects, absurd declared lengths) is refused or cut at a limit at
the cost of reading a header, not of materialising it. Pure functions over bytes; no
recursion anywhere (a deeply nested payload costs a loop, not the stack).
"""

from __future__ import annotations

__all__ = ["ScanError", "container_len", "skip", "type_name"]


class ScanError(ValueError):
    """The bytes are not msgpack (truncated, or a byte that starts no object)."""


# Fixed-size heads: first byte -> bytes after it (nil, bool, float and int forms).
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED.update({0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8})
# Length-prefixed bodies: first byte -> bytes of the length (str 8/16/32, bin 8/16/32).
_SIZED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
# Fixext: first byte -> body bytes, the type byte included.
_FIXEXT = {0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # ext 8/16/32: length bytes; a type byte follows
_ARRAY = {0xDC: 2, 0xDD: 4}
_MAP = {0xDE: 2, 0xDF: 4}


def _uint(buf: bytes | memoryview, pos: int, size: int) -> int:
    if pos + size > len(buf):
        raise ScanError(f"truncated at byte {pos}")
    return int.from_bytes(buf[pos : pos + size], "big")


def container_len(buf: bytes | memoryview, pos: int = 0) -> tuple[str, int, int] | None:
    """``(kind, declared length, offset of the first element)`` of the array or map
    (kind ``"array"``/``"map"``; a map's length counts pairs) starting at ``pos``; None
    when the object there is not a container."""
    if pos >= len(buf):
        raise ScanError(f"truncated at byte {pos}")
    first = buf[pos]
    if 0x90 <= first <= 0x9F:
        return ("array", first & 0x0F, pos + 1)
    if 0x80 <= first <= 0x8F:
        return ("map", first & 0x0F, pos + 1)
    if first in _ARRAY:
        size = _ARRAY[first]
        return ("array", _uint(buf, pos + 1, size), pos + 1 + size)
    if first in _MAP:
        size = _MAP[first]
        return ("map", _uint(buf, pos + 1, size), pos + 1 + size)
    return None


def _advance(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """``(offset after the head and body of the object at pos, objects it contains)``."""
    first = buf[pos]
    if first <= 0x7F or first >= 0xE0:
        return pos + 1, 0
    if 0xA0 <= first <= 0xBF:
        return pos + 1 + (first & 0x1F), 0
    head = container_len(buf, pos)
    if head is not None:
        kind, count, start = head
        return start, count * 2 if kind == "map" else count
    if first in _FIXED:
        return pos + 1 + _FIXED[first], 0
    if first in _SIZED:
        size = _SIZED[first]
        return pos + 1 + size + _uint(buf, pos + 1, size), 0
    if first in _FIXEXT:
        return pos + 1 + _FIXEXT[first], 0
    if first in _EXT:
        size = _EXT[first]
        return pos + 2 + size + _uint(buf, pos + 1, size), 0
    raise ScanError(f"byte {first:#04x} at {pos} starts no msgpack object")


def skip(buf: bytes | memoryview, pos: int = 0, count: int = 1) -> int:
    """The offset just after the ``count`` consecutive objects starting at ``pos``.

    One loop turn per object, containers' contents included: linear in the objects
    skipped, whatever their nesting.
    """
    pending = count
    end = len(buf)
    while pending:
        if pos >= end:
            raise ScanError(f"truncated at byte {pos}")
        pos, inner = _advance(buf, pos)
        pending += inner - 1
    if pos > end:
        raise ScanError(f"truncated at byte {end}")
    return pos


_NAMES = {0xC0: "NoneType", 0xC2: "bool", 0xC3: "bool", 0xCA: "float", 0xCB: "float"}


def type_name(buf: bytes | memoryview, pos: int = 0) -> str:
    """The Python type name the object at ``pos`` would decode to (``"list"``, ``"dict"``,
    ``"str"``, ...), from its first byte only."""
    first = buf[pos]
    if first in _NAMES:
        return _NAMES[first]
    if first <= 0x7F or first >= 0xE0 or 0xCC <= first <= 0xD3:
        return "int"
    if 0xA0 <= first <= 0xBF or 0xD9 <= first <= 0xDB:
        return "str"
    if 0xC4 <= first <= 0xC6:
        return "bytes"
    head = container_len(buf, pos)
    if head is not None:
        return "list" if head[0] == "array" else "dict"
    return "Ext" if first != 0xC1 else "invalid"

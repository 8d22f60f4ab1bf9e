"""The JSON scanners of HTTP request bodies in plain Python: the reference for ``_jsonscan.c``.

What the differential tests compare the C module to. The service does not run it: without the
C module, ``token_ids`` are decoded together with the rest of a body
(:func:`kvevents.http._query.json_packers`), cheaper than this scan and a second pass.
"""

from __future__ import annotations

import msgspec

from kvevents.index.keys import pack_tokens

__all__ = ["IMPLEMENTATION", "pack_json_member", "pack_json_tokens"]

IMPLEMENTATION = "python"

_json_tokens = msgspec.json.Decoder(list[int])


def pack_json_tokens(raw: bytes | str, /) -> bytes | None:
    """A JSON array of ints in ``0 .. 2**32 - 1`` as packed uint32 LE; None otherwise."""
    try:
        return pack_tokens(_json_tokens.decode(raw))
    except (msgspec.DecodeError, OverflowError):
        return None


_WS = b" \t\r\n"


def _ws(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in _WS:
        i += 1
    return i


def _skip_string(body: bytes, i: int) -> int | None:
    i += 1
    while i < len(body):
        if body[i] == 0x5C:  # backslash: skip the escaped byte
            i += 2
            continue
        if body[i] == 0x22:
            return i + 1
        i += 1
    return None


def _skip_value(body: bytes, i: int) -> int | None:
    if i >= len(body):
        return None
    if body[i] not in b'{["':
        while i < len(body) and body[i] not in b",}]" + _WS:
            i += 1
        return i
    depth = 0
    while i < len(body):
        c = body[i]
        if c == 0x22:
            end = _skip_string(body, i)
            if end is None:
                return None
            if depth == 0:
                return end
            i = end
            continue
        if c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def pack_json_member(body: bytes, key: bytes, /) -> tuple[bytes, int, int] | None:
    """The packed tokens of the first top-level member ``key`` (unescaped) of a JSON object,
    with the byte span of its value: ``(packed, start, end)``. None when the body is not an
    object, the key is absent, or its value is not a flat array of ints in ``0 .. 2**32 - 1``.
    The scan does not validate the rest of the body: the caller decodes that."""
    body, key = bytes(body), bytes(key)
    i = _ws(body, 0)
    if i >= len(body) or body[i] != 0x7B:
        return None
    i = _ws(body, i + 1)
    while i < len(body) and body[i] == 0x22:
        name_end = _skip_string(body, i)
        if name_end is None:
            return None
        match = body[i + 1 : name_end - 1] == key
        i = _ws(body, name_end)
        if i >= len(body) or body[i] != 0x3A:
            return None
        value = _ws(body, i + 1)
        if match:
            if value >= len(body) or body[value] != 0x5B:
                return None
            close = body.find(b"]", value)
            if close < 0:
                return None
            packed = pack_json_tokens(body[value : close + 1])
            return None if packed is None else (packed, value, close + 1)
        end = _skip_value(body, value)
        if end is None:
            return None
        i = _ws(body, end)
        if i < len(body) and body[i] == 0x2C:
            i = _ws(body, i + 1)
        else:
            break
    return None

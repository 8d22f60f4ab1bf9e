"""The prefix index's storage primitives in pure Python: the reference for ``_blocktable.c``.

The C module (``kvevents.index._blocktable``) implements exactly this API and these semantics with
compact open-addressing tables (16 bytes per slot, no Python objects per entry); this module
is what runs where it could not be compiled, and what the differential tests compare it to.
:mod:`kvevents.index.table` picks one.

Keys of a :class:`U64Map` are 64-bit patterns: any int in ``-2**63 .. 2**64 - 1``; a negative
key and its two's-complement unsigned value are the same key (msgpack carries engine hashes as
int64 or uint64, so on the wire they are the same 64 bits). Keys read back are signed once the
map has stored a negative key, unsigned before. Values are ints in ``0 .. 2**64 - 1``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import msgspec
import xxhash

__all__ = [
    "IMPLEMENTATION",
    "U64Map",
    "chain_hashes",
    "drop_holder",
    "extend",
    "ingest_events",
    "pack_json_member",
    "pack_json_tokens",
    "pack_msgpack_tokens",
    "remove_blocks",
    "store_chain",
    "walk",
]

IMPLEMENTATION = "python"

_U64 = 2**64
_I64_MIN = -(2**63)
_MASK60 = 2**60 - 1
_MISSING: Any = object()
_T = TypeVar("_T")
_xxh3 = xxhash.xxh3_64_intdigest
_msgpack_tokens = msgspec.msgpack.Decoder(list[int])
_json_tokens = msgspec.json.Decoder(list[int])
_BIG_ENDIAN = sys.byteorder == "big"


def _key(k: int) -> int:
    if k < 0:
        if k < _I64_MIN:
            raise OverflowError(f"key {k} is outside -2**63 .. 2**64-1")
        return k + _U64
    if k >= _U64:
        raise OverflowError(f"key {k} is outside -2**63 .. 2**64-1")
    return k


def _value(v: int) -> int:
    if not 0 <= v < _U64:
        raise OverflowError(f"value {v} is outside 0 .. 2**64-1")
    return v


class U64Map:
    """A map of 64-bit keys to 64-bit unsigned values (see the module docstring)."""

    __slots__ = ("_d", "_signed")

    def __init__(self) -> None:
        self._d: dict[int, int] = {}
        self._signed = False

    def _out(self, k: int) -> int:
        return k - _U64 if self._signed and k >= 2**63 else k

    def _in(self, k: int) -> int:
        key = _key(k)
        if k < 0:
            self._signed = True
        return key

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, k: int) -> bool:
        return _key(k) in self._d

    def __getitem__(self, k: int) -> int:
        return self._d[_key(k)]

    def __setitem__(self, k: int, v: int) -> None:
        self._d[self._in(k)] = _value(v)

    def __delitem__(self, k: int) -> None:
        del self._d[_key(k)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys())

    @overload
    def get(self, k: int) -> int | None: ...
    @overload
    def get(self, k: int, default: _T) -> int | _T: ...
    def get(self, k: int, default: Any = None) -> Any:
        return self._d.get(_key(k), default)

    @overload
    def pop(self, k: int) -> int: ...
    @overload
    def pop(self, k: int, default: _T) -> int | _T: ...
    def pop(self, k: int, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            return self._d.pop(_key(k))
        return self._d.pop(_key(k), default)

    def keys(self) -> list[int]:
        return [self._out(k) for k in self._d]

    def values(self) -> list[int]:
        return list(self._d.values())

    def items(self) -> list[tuple[int, int]]:
        return [(self._out(k), v) for k, v in self._d.items()]

    def clear(self) -> None:
        self._d.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the table (here: the dict and its key ints; values are mostly shared)."""
        return sys.getsizeof(self._d) + 32 * len(self._d)


def chain_hashes(packed: bytes, block_size: int, seed: int) -> list[int]:
    """``h[i] = xxh3_64(block_i, seed=h[i-1]) & (2**60 - 1)``, ``h[-1] = seed``, full blocks only.

    ``packed`` holds uint32 little-endian tokens; ``block_size`` is in tokens (> 0).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    step = block_size * 4
    end = len(packed) - len(packed) % step
    out: list[int] = []
    h = seed
    for start in range(0, end, step):
        h = _xxh3(packed[start : start + step], h) & _MASK60
        out.append(h)
    return out


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed little-endian uint32 bytes (``OverflowError`` outside that range)."""
    packed = array("I")
    packed.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _pack(tokens: list[int]) -> bytes | None:
    try:
        return pack_tokens(tokens)
    except (OverflowError, TypeError):
        return None


def pack_msgpack_tokens(raw: bytes) -> bytes | None:
    """A msgpack array of ints in ``0 .. 2**32 - 1`` as packed uint32 LE; None otherwise."""
    try:
        tokens = _msgpack_tokens.decode(raw)
    except msgspec.DecodeError:
        return None
    return _pack(tokens)


def pack_json_tokens(raw: bytes) -> bytes | None:
    """A JSON array of ints in ``0 .. 2**32 - 1`` as packed uint32 LE; None otherwise."""
    try:
        tokens = _json_tokens.decode(raw)
    except msgspec.DecodeError:
        return None
    return _pack(tokens)


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


def pack_json_member(body: bytes, key: bytes) -> tuple[bytes, int, int] | None:
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


def store_chain(
    blocks: U64Map, engine: U64Map, bit: int, engine_hashes: Sequence[int], ours: Sequence[int]
) -> list[int] | None:
    """Store a chain of fresh blocks for one holder; None (and no change) unless all are fresh.

    Fresh: no engine hash is in ``engine`` yet and none repeats within ``engine_hashes``. Then
    ``engine[eh] = oh`` for each pair, and ``bit`` is set in ``blocks[oh]``. Returns our hashes
    whose bit was already set (the holder holds those tokens under another engine hash), in
    order, for the caller's reference counts.
    """
    if len(engine_hashes) != len(ours):
        raise ValueError("engine_hashes and ours differ in length")
    if len(set(map(_key, engine_hashes))) != len(engine_hashes):
        return None
    if any(eh in engine for eh in engine_hashes):
        return None
    shared: list[int] = []
    for eh, oh in zip(engine_hashes, ours, strict=True):
        engine[eh] = oh
        mask = blocks.get(oh)
        if mask is None:
            blocks[oh] = bit
        elif mask & bit:
            shared.append(oh)
        else:
            blocks[oh] = mask | bit
    return shared


def remove_blocks(
    blocks: U64Map, engine: U64Map, tombs: U64Map, bit: int, engine_hashes: Sequence[int]
) -> list[int]:
    """Remove blocks of a holder with no reference counts; returns the unknown engine hashes.

    For each known engine hash: pop it from ``engine``, remember ``tombs[eh] = oh``, and clear
    ``bit`` in ``blocks[oh]`` (deleting the entry when no bit is left).
    """
    unknown: list[int] = []
    for eh in engine_hashes:
        oh = engine.pop(eh, None)
        if oh is None:
            unknown.append(eh)
            continue
        tombs[eh] = oh
        mask = blocks.get(oh)
        if mask is not None and mask & bit:
            mask ^= bit
            if mask:
                blocks[oh] = mask
            else:
                del blocks[oh]
    return unknown


def drop_holder(blocks: U64Map, engine: U64Map, bit: int) -> None:
    """Clear ``bit`` in ``blocks`` for every block of ``engine``, then empty ``engine``."""
    for oh in engine.values():
        mask = blocks.get(oh)
        if mask is not None and mask & bit:
            mask ^= bit
            if mask:
                blocks[oh] = mask
            else:
                del blocks[oh]
    engine.clear()


def ingest_events(
    payload: bytes, stream: object, root_seed: int, tombstones: int
) -> tuple[int, int, float, int, int, int]:
    """The index's fast lane: apply the leading events of a batch ``payload`` to ``stream`` (a
    ``kvevents.index.prefix._Stream``), in order, stopping at the first it is not sure of; returns
    ``(applied, events, ts, stored, removed, clears)``: events applied, events in the batch
    (-1 when the payload is not one it reads) and its ``ts``, and the counts of what it did.

    This reference applies none, which is correct by that contract: the caller applies every
    event not applied here. The C module applies the common events (see ``_blocktable.c``).
    """
    return 0, -1, 0.0, 0, 0, 0


def walk(blocks: U64Map, hashes: Sequence[int], allowed: int) -> list[tuple[int, int]]:
    """Longest-prefix walk: ``(bits, depth)`` for each group of holders whose match ends at
    ``depth`` blocks, in increasing depth; holders outside ``allowed`` are ignored."""
    out: list[tuple[int, int]] = []
    count = len(hashes)
    alive = blocks.get(hashes[0], 0) & allowed if count else 0
    depth = 1
    while alive and depth < count:
        mask = blocks.get(hashes[depth], 0) & alive
        if mask != alive:
            out.append((alive ^ mask, depth))
            alive = mask
        depth += 1
    if alive:
        out.append((alive, depth))
    return out


def extend(blocks: U64Map, hashes: Sequence[int], depth: int, mask: int) -> int:
    """The first depth ``>= depth`` whose block no holder of ``mask`` has (or ``len(hashes)``)."""
    count = len(hashes)
    while depth < count and blocks.get(hashes[depth], 0) & mask:
        depth += 1
    return depth

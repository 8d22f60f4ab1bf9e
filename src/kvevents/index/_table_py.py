"""The prefix index's table primitives in plain Python: the reference for ``_blocktable.c``.

This is what runs where the C module could not be built (or with ``KVEVENTS_PURE_PYTHON=1``),
and what the differential tests compare the C module to. :mod:`kvevents.index.table` picks one.

A :class:`U64Map` here is a dict. Its keys are engine hashes or our own hashes, ints that an
engine writes either as signed 64-bit (SGLang, TensorRT-LLM) or as unsigned 64-bit (vLLM);
values are ints in ``0 .. 2**64 - 1``. The C map stores 64-bit patterns, so it also takes a
negative key and its two's-complement unsigned value as one key, and checks ranges; both agree
whenever the keys of one map are in one form, which is what one engine's stream gives.

None of these functions knows an index rule (reference counts, orphans, tombstone limits):
they are bulk operations on tables, and :mod:`kvevents.index.prefix` decides when to use them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import msgspec
import xxhash

__all__ = [
    "IMPLEMENTATION",
    "U64Map",
    "chain_hashes",
    "chain_walk",
    "drop_holder",
    "extend",
    "pack_msgpack_tokens",
    "pack_tokens",
    "remove_blocks",
    "store_chain",
    "store_run",
    "walk",
]

IMPLEMENTATION = "python"

_MASK60 = 2**60 - 1
_xxh3 = xxhash.xxh3_64_intdigest
_msgpack_tokens = msgspec.msgpack.Decoder(list[int])
_BIG_ENDIAN = sys.byteorder == "big"


class U64Map(dict[int, int]):
    """A dict of 64-bit keys to 64-bit unsigned values, with the C map's ``nbytes``.

    ``keys()``, ``values()`` and ``items()`` return lists, copies as the C map's are: a caller
    may copy a table under a lock and read the copy after (the service's ``/dump`` does).
    """

    __slots__ = ()

    def keys(self) -> list[int]:  # type: ignore[override]
        return list(super().keys())

    def values(self) -> list[int]:  # type: ignore[override]
        return list(super().values())

    def items(self) -> list[tuple[int, int]]:  # type: ignore[override]
        return list(super().items())

    @property
    def nbytes(self) -> int:
        """Bytes held: the dict and one int object per key (values are mostly shared ints)."""
        return sys.getsizeof(self) + 32 * len(self)

    @property
    def readers(self) -> int:
        """Walks reading the table without the GIL: never any here."""
        return 0


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


def pack_msgpack_tokens(raw: bytes) -> bytes | None:
    """A msgpack array of ints in ``0 .. 2**32 - 1`` as packed uint32 LE; None otherwise."""
    try:
        return pack_tokens(_msgpack_tokens.decode(raw))
    except (msgspec.DecodeError, OverflowError):
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
    if len(set(engine_hashes)) != len(engine_hashes) or any(eh in engine for eh in engine_hashes):
        return None
    shared: list[int] = []
    for eh, oh in zip(engine_hashes, ours, strict=True):
        engine[eh] = oh
        mask = blocks.get(oh, 0)
        if mask & bit:
            shared.append(oh)
        else:
            blocks[oh] = mask | bit
    return shared


def store_run(
    blocks: U64Map,
    engine: U64Map,
    bit: int,
    engine_hashes: Sequence[int],
    packed: bytes,
    block_size: int,
    seed: int,
) -> list[int] | None:
    """:func:`store_chain` of ``chain_hashes(packed, block_size, seed)`` in one call.

    ``packed`` must hold exactly one block per engine hash (``ValueError`` otherwise).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(packed) != 4 * block_size * len(engine_hashes):
        raise ValueError(
            f"packed holds {len(packed)} bytes, not {len(engine_hashes)} blocks of "
            f"block_size {block_size} tokens"
        )
    ours = chain_hashes(packed, block_size, seed)
    return store_chain(blocks, engine, bit, engine_hashes, ours)


def _clear_bit(blocks: U64Map, oh: int, bit: int) -> None:
    mask = blocks.get(oh, 0)
    if mask & bit:
        if mask == bit:
            del blocks[oh]
        else:
            blocks[oh] = mask ^ bit


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
        _clear_bit(blocks, oh, bit)
    return unknown


def drop_holder(blocks: U64Map, engine: U64Map, bit: int) -> None:
    """Clear ``bit`` in ``blocks`` for every block of ``engine``, then empty ``engine``."""
    if blocks is not engine:
        for oh in engine.values():
            _clear_bit(blocks, oh, bit)
    engine.clear()


def walk(
    blocks: U64Map, hashes: Sequence[int], allowed: int, nogil: bool = False
) -> list[tuple[int, int]]:
    """Longest-prefix walk: ``(bits, depth)`` for each group of holders whose match ends at
    ``depth`` blocks, in increasing depth; holders outside ``allowed`` are ignored.

    ``nogil``: the C walk converts every key, then walks without the GIL, while writes to
    ``blocks`` raise ``RuntimeError``; here it changes nothing (Python holds the GIL)."""
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


def chain_walk(
    blocks: U64Map, packed: bytes, block_size: int, seed: int, allowed: int, nogil: bool = False
) -> list[tuple[int, int]]:
    """:func:`walk` over ``chain_hashes(packed, block_size, seed)``. The C walk hashes each
    block only when it gets to it and makes no int per block; ``nogil`` as for :func:`walk`."""
    return walk(blocks, chain_hashes(packed, block_size, seed), allowed)


def extend(blocks: U64Map, hashes: Sequence[int], depth: int, mask: int) -> int:
    """The first depth ``>= depth`` whose block no holder of ``mask`` has (or ``len(hashes)``)."""
    count = len(hashes)
    while depth < count and blocks.get(hashes[depth], 0) & mask:
        depth += 1
    return depth

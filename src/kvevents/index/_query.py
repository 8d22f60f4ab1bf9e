"""The prefix index's query walk: how far each holder and each stream matches a request.

A request's chained hashes are walked once per page of holders (the table primitives
:func:`kvevents.index._table.walk` and, from packed tokens, ``chain_walk`` follow every holder
of the page at once); a stream whose prefix continues on another tier (GPU blocks, then CPU
ones) is then extended over the union of its tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvevents.events import StreamKey
from kvevents.index import _table as bt
from kvevents.index._groups import cut
from kvevents.index._holders import PAGE_SHIFT, Holder, Stream
from kvevents.index._keys import Extras, chain_hashes, chain_keys
from kvevents.index._records import HolderKey

__all__ = ["match_all", "record", "walk", "walk_packed"]

#: The index's tables: pages of block tables, holders by id, streams by (worker, rank).
Tables = tuple[Sequence[bt.U64Map], Mapping[int, Holder], Mapping[StreamKey, Stream]]


_chain_walk = bt.chain_walk


def match_all(
    tables: Tables,
    sizes: Mapping[tuple[int, int], Mapping[int, int]],
    packed: bytes,
    seed: int,
    extras_of: Callable[[int, int], Sequence[Extras] | None],
) -> tuple[dict[HolderKey, int], dict[StreamKey, int], dict[int, int]]:
    """Blocks matched per holder and per stream, and the request's full blocks per block
    size, over the streams of every ``(block_size, lookahead)`` in ``sizes`` (page -> mask).

    ``extras_of(blocks, block_size)`` gives the request's extras per block. A stream keyed
    with lookahead matches a block only when the request holds the tokens after it.
    """
    pages, by_id, streams = tables
    holders: dict[HolderKey, int] = {}
    prefixes: dict[StreamKey, int] = {}
    request_blocks: dict[int, int] = {}
    tokens = len(packed) // 4
    for (size, ahead), masks in sizes.items():
        request_blocks[size] = tokens // size
        blocks = max(0, tokens - ahead) // size
        extras = extras_of(blocks, size)
        keys: list[int] | None = None
        if extras is None and not ahead:  # the common case: the walk hashes the tokens
            found, deepest = walk_packed(pages, by_id, streams, (packed, size, seed), masks)
        else:
            end = 4 * size * blocks
            keys = chain_keys(packed[:end], size, seed, extras or (), packed[end : end + 4 * ahead])
            found, deepest = walk(pages, by_id, streams, keys, masks)
        for skey, depth in deepest.items():
            tails = streams[skey].tails
            if tails and depth:  # a hybrid model's stream: what its other groups allow
                keys = chain_hashes(packed, size, seed) if keys is None else keys
                deepest[skey] = cut(depth, keys, list(tails.values()))
        holders.update(found)
        prefixes.update(deepest)
    return holders, prefixes, request_blocks


def walk(
    pages: Sequence[bt.U64Map],
    by_id: Mapping[int, Holder],
    streams: Mapping[StreamKey, Stream],
    hashes: Sequence[int],
    masks: Mapping[int, int],
) -> tuple[dict[HolderKey, int], dict[StreamKey, int]]:
    """Blocks matched per holder and per stream, for the holders of ``masks`` (page -> bits)."""
    holders: dict[HolderKey, int] = {}
    for page, allowed in masks.items():
        for bits, depth in bt.walk(pages[page], hashes, allowed):
            record(by_id, page, bits, depth, holders)
    return holders, _stream_prefixes(pages, streams, hashes, holders)


def walk_packed(
    pages: Sequence[bt.U64Map],
    by_id: Mapping[int, Holder],
    streams: Mapping[StreamKey, Stream],
    run: tuple[bytes, int, int],
    masks: Mapping[int, int],
) -> tuple[dict[HolderKey, int], dict[StreamKey, int]]:
    """:func:`walk` from packed tokens, ``run = (packed, block_size, seed)``: hashed by the
    walk itself, and hashed again only when a matched stream has blocks on several tiers."""
    packed, size, seed = run
    holders: dict[HolderKey, int] = {}
    for page, allowed in masks.items():
        for bits, depth in _chain_walk(pages[page], packed, size, seed, allowed):
            record(by_id, page, bits, depth, holders)
    out = _deepest(holders)
    tiered = [skey for skey in out if len(streams[skey].holders) > 1]
    if tiered:
        hashes = chain_hashes(packed, size, seed)
        for skey in tiered:
            out[skey] = _extend(pages, streams[skey].masks, hashes, out[skey])
    return holders, out


def record(
    by_id: Mapping[int, Holder], page: int, bits: int, depth: int, out: dict[HolderKey, int]
) -> None:
    """``out[key] = depth`` for every holder whose bit is set in ``bits`` of ``page``."""
    base = page << PAGE_SHIFT
    while bits:
        low = bits & -bits
        out[by_id[base + low.bit_length() - 1].key] = depth
        bits ^= low


def _stream_prefixes(
    pages: Sequence[bt.U64Map],
    streams: Mapping[StreamKey, Stream],
    hashes: Sequence[int],
    holders: Mapping[HolderKey, int],
) -> dict[StreamKey, int]:
    out = _deepest(holders)
    for skey, depth in out.items():
        stream = streams[skey]
        if len(stream.holders) > 1:
            out[skey] = _extend(pages, stream.masks, hashes, depth)
    return out


def _deepest(holders: Mapping[HolderKey, int]) -> dict[StreamKey, int]:
    """The longest match of each (worker, rank) over its tiers."""
    out: dict[StreamKey, int] = {}
    for key, depth in holders.items():
        skey = (key.worker_id, key.rank)
        if out.get(skey, 0) < depth:
            out[skey] = depth
    return out


def _extend(
    pages: Sequence[bt.U64Map], masks: Mapping[int, int], hashes: Sequence[int], depth: int
) -> int:
    # Blocks of one prefix may sit on different tiers (GPU then CPU): walk the union.
    if len(masks) == 1:
        [(page, mask)] = masks.items()
        return bt.extend(pages[page], hashes, depth, mask)
    while depth < len(hashes) and any(
        pages[page].get(hashes[depth], 0) & mask for page, mask in masks.items()
    ):
        depth += 1
    return depth

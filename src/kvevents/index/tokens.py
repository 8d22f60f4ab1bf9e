"""A store's tokens in every form real engines send, read for its keys (:mod:`.keys`).

Nearly every store carries plain int ``token_ids`` and takes the index's packed fast path;
this module reads the others, each keyed as its engine reuses it:

- vLLM with lookahead-aware hashing (EAGLE-style drafters; vLLM PR 50897, the successor token
  enters a block's hash): int tokens plus ``lookahead_token_ids``, the tokens after the last
  block. Every block's key covers the tokens after it.
- SGLang with EAGLE (``python/sglang/srt/mem_cache/radix_cache.py``: ``convert_to_bigram_key``
  makes key ``i`` the pair ``(t[i], t[i+1])``, and a store's ``token_ids`` are a page of such
  pairs): ``P`` pairs are the ``P`` tokens of the block and the one after it, so they read
  as int tokens with one lookahead token (the same keys as vLLM's for the same tokens).
- TensorRT-LLM multimodal stores: ints mixed with an item's hex digest where its tokens are;
  a digest enters its block's key (:func:`.keys.digest_extras`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvevents.events import MAX_DIGEST
from kvevents.index import table as bt
from kvevents.index.extras import store_extras
from kvevents.index.keys import (
    Extras,
    chain_hashes,
    chain_keys,
    digest_extras,
    merge_extras,
    pack_tokens,
)
from kvevents.index.orphans import Stored
from kvevents.wire import PackedStored

__all__ = ["Run", "lookahead_of", "read_run", "special_run", "store_keys"]

_decode = msgspec.msgpack.Decoder().decode


class Run(NamedTuple):
    """A store's tokens as the keys need them."""

    packed: bytes  #: the blocks' tokens, uint32 LE (a digest token packs as 0)
    after: bytes  #: the packed tokens after the last block that its key covers (lookahead)
    digests: list[Extras] | None  #: per block, its digest tokens as extras


def lookahead_of(event: Stored) -> list[Any]:
    """The event's ``lookahead_token_ids`` (empty when absent)."""
    value = event.lookahead_token_ids
    return value if isinstance(value, list) else []


def read_run(event: Stored, block_size: int) -> Run | str:
    """The store's :class:`Run`, or the reason it cannot be read (a bad event)."""
    tokens: Any = event.token_ids
    if type(event) is PackedStored:
        tokens = _decode(tokens)
    if not isinstance(tokens, list):
        return "token_ids is not an array"
    after = lookahead_of(event)
    if tokens and isinstance(tokens[0], list):
        unpaired = _unbigram(tokens)
        if isinstance(unpaired, str):
            return unpaired
        tokens, after = unpaired
    return _run(tokens, _one_successor(tokens, after, block_size), block_size)


def _one_successor(tokens: list[Any], after: list[Any], block_size: int) -> list[Any]:
    """``after`` as the tokens following the last block. A list of one successor per block
    (each block's first token after it, the last one's included) says the same thing and
    is read as its last entry."""
    blocks = len(tokens) // block_size
    if 1 < blocks == len(after) and all(
        after[i] == tokens[(i + 1) * block_size] for i in range(blocks - 1)
    ):
        return after[-1:]
    return after


def _run(tokens: list[Any], after: list[Any], block_size: int) -> Run | str:
    if any(isinstance(t, str) and len(t) > MAX_DIGEST for t in tokens):
        return f"a digest token is longer than {MAX_DIGEST} characters"
    try:
        packed, digests = digest_extras(tokens, block_size)
        tail = pack_tokens(after)
    except (OverflowError, TypeError):
        return "token_ids holds a token that is neither an int in 0..2**32-1 nor a digest"
    return Run(packed, tail, digests if any(digests) else None)


def _unbigram(pairs: list[Any]) -> tuple[list[Any], list[Any]] | str:
    """SGLang's bigram keys as tokens plus the one token after them; each pair must start
    with the token the previous one ended with."""
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        return "bigram token_ids must all be [a, b] pairs"
    if any(pairs[i][1] != pairs[i + 1][0] for i in range(len(pairs) - 1)):
        return "bigram token_ids do not chain: a pair must start with the previous one's end"
    return [p[0] for p in pairs], [pairs[-1][1]]


def special_run(event: Stored, block_size: int) -> Run | str | None:
    """:func:`read_run` for a store that is not plain int tokens without lookahead, else None."""
    if not lookahead_of(event) and _plain(event):
        return None
    return read_run(event, block_size)


def _plain(event: Stored) -> bool:
    if type(event) is PackedStored:
        return bt.pack_msgpack_tokens(event.token_ids) is not None
    return all(type(t) is int for t in event.token_ids)


def store_keys(
    event: Stored, packed: bytes, block_size: int, seed: int, run: Run | None = None
) -> list[int]:
    """Our keys of a store's blocks, chained from ``seed``: its extras (checked beforehand:
    :func:`kvevents.index.extras.store_extras` raises on bad ones), digest tokens and lookahead
    included. ``run`` is the store's :class:`Run` when it is not plain int tokens."""
    extras = store_extras(event)
    if run is not None:
        merged = merge_extras(extras, run.digests)
        return chain_keys(run.packed, block_size, seed, merged, run.after)
    if extras is None:
        return chain_hashes(packed, block_size, seed)
    return chain_keys(packed, block_size, seed, extras)

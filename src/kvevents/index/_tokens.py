"""The first step of a store: its blocks' keys, read once from the event.

:func:`key_store` reads everything of a ``BlockStored`` that enters its blocks' keys
(:mod:`.keys`) and nothing else: its tokens in every form real engines send, its extras
(vLLM's ``extra_keys``, SGLang's ``cache_salt``: :mod:`.extras`), its LoRA adapter (the
root seed) and its lookahead. The answer, :class:`StoreKeys`, lacks only the parent's key,
which the placement step (:class:`~kvevents.index.PrefixIndex`) resolves in the stream;
``StoreKeys.chain(seed)`` then gives the keys, and an orphan keeps its ``StoreKeys`` until its
parent arrives, so no store is read twice.

Nearly every store carries plain int ``token_ids`` with no extras (``StoreKeys.plain``): its
keys are chained by the table primitives, in C, as it is placed. The other forms:

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

from collections.abc import Sequence
from typing import Any

import msgspec

from kvevents.events import MAX_DIGEST, PackedStored
from kvevents.index import _table as bt
from kvevents.index._extras import has_extras, store_extras
from kvevents.index._keys import (
    ROOT_SEED,
    Extras,
    chain_hashes,
    chain_keys,
    digest_extras,
    merge_extras,
    pack_tokens,
    root_seed,
)
from kvevents.index._records import Stored

__all__ = ["StoreKeys", "Unkeyable", "key_store", "pack_ints"]

_decode = msgspec.msgpack.Decoder().decode
# The feed's hot path calls it once per store: a module global, not an attribute lookup.
_pack_msgpack = bt.pack_msgpack_tokens


class Unkeyable(ValueError):
    """A store whose keys cannot be read (a bad event: the index skips and counts it); the
    message says why."""


# A msgspec struct: one is made per store on the feed's hot path, and it builds in C.
class StoreKeys(msgspec.Struct, frozen=True, gc=False):
    """What a store's keys are made of, but its parent's key (module docstring)."""

    packed: bytes  #: the blocks' tokens, uint32 LE (a digest token packs as 0)
    block_size: int
    root: int  #: the seed of a run starting at token 0 (the LoRA adapter's)
    extras: list[Extras] | None  #: per block, its extra inputs (digests included)
    after: bytes | None  #: the packed tokens after the last block (None: not a special form)

    @property
    def plain(self) -> bool:
        """Plain int tokens, no extras, no lookahead: keys chained by the tables alone."""
        return self.extras is None and self.after is None

    def chain(self, seed: int) -> list[int]:
        """The blocks' keys, chained from ``seed`` (the parent's key, or :attr:`root`)."""
        if self.extras is None and not self.after:
            return chain_hashes(self.packed, self.block_size, seed)
        return chain_keys(self.packed, self.block_size, seed, self.extras or (), self.after or b"")


def key_store(event: Stored, roots: dict[str | int, int]) -> StoreKeys:
    """The store's :class:`StoreKeys`; :class:`Unkeyable` saying why when it cannot be keyed.
    ``roots`` caches the root seeds of LoRA adapters."""
    size = event.block_size
    if type(event) is PackedStored:
        packed = _pack_msgpack(event.token_ids)
    else:
        packed = pack_ints(event.token_ids)
    blocks = len(event.block_hashes)
    # Once per store on the feed's hot path: the common case is inline.
    no_lora = event.lora_name is None and event.lora_id is None
    root = ROOT_SEED if no_lora else _root(event, roots)
    if packed is not None and not event.lookahead_token_ids:
        if len(packed) != 4 * size * blocks:
            raise Unkeyable("token_ids length is not block_size * len(block_hashes)")
        if not has_extras(event, blocks):
            return StoreKeys(packed, size, root, None, None)
        return _with_extras(event, packed, size, root, None, None)
    packed, after, digests = _read_run(event, size)
    if len(packed) != 4 * size * blocks:
        raise Unkeyable("token_ids length is not block_size * len(block_hashes)")
    return _with_extras(event, packed, size, root, digests, after)


def _with_extras(
    event: Stored,
    packed: bytes,
    size: int,
    root: int,
    digests: list[Extras] | None,
    after: bytes | None,
) -> StoreKeys:
    try:
        extras = store_extras(event)
    except ValueError as exc:
        raise Unkeyable(str(exc)) from exc
    if digests is not None:
        extras = merge_extras(extras, digests)
    return StoreKeys(packed, size, root, extras, after)


def _root(event: Stored, roots: dict[str | int, int]) -> int:
    """The root seed of a store with a LoRA adapter (its name, else its id)."""
    lora = event.lora_name if event.lora_name is not None else event.lora_id
    assert lora is not None
    seed = roots.get(lora)
    if seed is None:
        seed = roots[lora] = root_seed(lora)
    return seed


def pack_ints(token_ids: Sequence[int | str]) -> bytes | None:
    """Int token ids as packed uint32 LE, None when one is not an int in range."""
    try:
        return pack_tokens(token_ids)  # type: ignore[arg-type]  # a str raises TypeError
    except (OverflowError, TypeError):
        return None


# ----------------------------------------------------------------- tokens in other forms


# Token lists here are as engines sent them, each checked where it is read (ints, digest
# strings, or SGLang's [a, b] pairs): hence list[Any].


def _read_run(event: Stored, block_size: int) -> tuple[bytes, bytes, list[Extras] | None]:
    """A special store's packed tokens, the packed tokens after it its keys cover, and its
    digest tokens as extras per block (None: none); :class:`Unkeyable` when unreadable."""
    tokens: Any = event.token_ids  # a list (checked below) or packed msgpack bytes
    if type(event) is PackedStored:
        tokens = _decode(tokens)
    if not isinstance(tokens, list):
        raise Unkeyable("token_ids is not an array")
    after = _lookahead_of(event)
    if tokens and isinstance(tokens[0], list):
        tokens, after = _unbigram(tokens)
    return _packed_run(tokens, _one_successor(tokens, after, block_size), block_size)


def _lookahead_of(event: Stored) -> list[Any]:  # as sent: see above
    value = event.lookahead_token_ids
    return value if isinstance(value, list) else []


def _one_successor(tokens: list[Any], after: list[Any], block_size: int) -> list[Any]:  # as sent
    """``after`` as the tokens following the last block. A list of one successor per block
    (each block's first token after it, the last one's included) says the same thing and
    is read as its last entry."""
    blocks = len(tokens) // block_size
    if 1 < blocks == len(after) and all(
        after[i] == tokens[(i + 1) * block_size] for i in range(blocks - 1)
    ):
        return after[-1:]
    return after


def _packed_run(
    tokens: list[Any],  # as engines sent them: see the note above
    after: list[Any],  # as engines sent them: see the note above
    block_size: int,  # as sent: checked by the packers
) -> tuple[bytes, bytes, list[Extras] | None]:
    if any(isinstance(t, str) and len(t) > MAX_DIGEST for t in tokens):
        raise Unkeyable(f"a digest token is longer than {MAX_DIGEST} characters")
    try:
        packed, digests = digest_extras(tokens, block_size)
        tail = pack_tokens(after)
    except (OverflowError, TypeError):
        raise Unkeyable(
            "token_ids holds a token that is neither an int in 0..2**32-1 nor a digest"
        ) from None
    return packed, tail, digests if any(digests) else None


def _unbigram(pairs: list[Any]) -> tuple[list[Any], list[Any]]:  # as sent: checked here
    """SGLang's bigram keys as tokens plus the one token after them; each pair must start
    with the token the previous one ended with."""
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise Unkeyable("bigram token_ids must all be [a, b] pairs")
    if any(pairs[i][1] != pairs[i + 1][0] for i in range(len(pairs) - 1)):
        raise Unkeyable(
            "bigram token_ids do not chain: a pair must start with the previous one's end"
        )
    return [p[0] for p in pairs], [pairs[-1][1]]

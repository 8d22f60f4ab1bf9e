"""The wire schema: one home for the event and batch structs (WIRE.md section 2).

Consumers import these; nobody copies them. Tags are explicit strings, so renaming a class
never changes bytes. New fields go at the end with defaults.

Encoding rules pinned by golden-bytes tests:

- events are msgpack maps whose ``"type"`` key holds the tag, keys in declaration order;
- the always-present keys (``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name``) are
  written even when nil, because vLLM-typed decoders reject a map without them;
- optional keys (``extra_keys``, ``group_idx``, ``kv_cache_spec_*``, and the newer keys real
  engines send) default to ``UNSET`` and are omitted until set;
- a batch is a 3-element array ``[ts, events, data_parallel_rank]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, TypeAlias

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = [
    "MAX_DIGEST",
    "UNSET",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Digest",
    "Event",
    "KVEventBatch",
    "PackedStored",
    "StreamKey",
    "UnsetType",
]

#: ``(worker_id, rank)``: one engine rank's stream of batches (WIRE.md section 5), and so
#: what names a subscriber's stream, an index's stream and a router's target alike.
StreamKey: TypeAlias = tuple[str, int]


#: Longest digest token, in characters (a SHA-512 hex digest is 128).
MAX_DIGEST = 256

#: A token that is a multimodal item's digest (TensorRT-LLM writes one where the item's tokens
#: are); a longer string is not a digest but a malformed event.
Digest = Annotated[str, Meta(max_length=MAX_DIGEST)]


# gc=False: these records hold only ints, strings and lists of them, so they can never be part
# of a reference cycle; leaving them untracked cuts decoding time by about a quarter on a busy
# subscriber (fewer objects for the cyclic collector to walk).
class BlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, frozen=True, gc=False
):
    """New full blocks entered the cache.

    ``block_hashes`` are the engine's hashes in token order; ``parent_block_hash`` is the hash
    of the block before ``block_hashes[0]`` (None when the run starts at token 0);
    ``token_ids`` holds ``block_size * len(block_hashes)`` ids: ints, or a multimodal item's
    digest (a str) for each of its tokens (TensorRT-LLM). SGLang's EAGLE bigram stores (pairs
    ``[t[i], t[i+1]]``) decode to their first tokens, with the last pair's second token as
    ``lookahead_token_ids``: the same block, as vLLM's lookahead-aware stores send it.
    """

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: Sequence[int | Digest]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # vLLM's extra keys: any msgpack values, per block.
    extra_keys: list[Any] | UnsetType | None = UNSET
    group_idx: int | UnsetType = UNSET
    kv_cache_spec_kind: str | UnsetType = UNSET
    kv_cache_spec_sliding_window: int | UnsetType = UNSET
    # Read so consumers have them. The index keys blocks by cache_salt (with extra_keys) and
    # lookahead_token_ids; session_id names the request that caused the store, not an owner
    # of the block, so the index ignores it. Fifteen keys at most, the tag included: msgspec
    # writes a struct of more with a longer map header, which would change the pinned bytes
    # of every store. vLLM's ``locality`` and ``ownership`` are therefore declared on
    # PackedStored (below: what decode_batch_packed returns) and on BlockRemoved.
    lookahead_token_ids: list[int] | UnsetType | None = UNSET
    session_id: str | UnsetType | None = UNSET
    cache_salt: str | UnsetType | None = UNSET


#: An absent ``extra_keys`` of a :class:`PackedStored` (msgpack nil), compared by identity.
NIL = msgspec.Raw(b"\xc0")
_any_decoder = msgspec.msgpack.Decoder()


class PackedStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True, frozen=True, gc=False
):
    """A :class:`BlockStored` as :func:`kvevents.wire.decode_batch_packed` reads it:
    ``token_ids`` is still the msgpack array (a ``msgspec.Raw``), so a consumer that packs
    tokens itself (the prefix index) makes no int object per token. ``extra_keys`` stays
    encoded too (the index reads it only when some block has extras: :meth:`extras`); the
    other optional keys are decoded, vLLM 0.33's ``locality`` and ``ownership`` included
    (as on :class:`BlockRemoved`; :class:`BlockStored` cannot declare them without changing
    the pinned bytes of every store, see its last fields)."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lookahead_token_ids: list[int] | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None

    def extras(self) -> Any:  # a decoded msgpack value: checked where it is read
        """``extra_keys`` decoded (None when absent or nil); raises ``msgspec.DecodeError``
        only for bytes a typed decode already accepted, i.e. never in practice."""
        return None if self.extra_keys is NIL else _any_decoder.decode(self.extra_keys)


class BlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True, frozen=True, gc=False
):
    """Blocks left the cache (``medium``: the tier they left, None for the default tier).

    ``locality`` (``"LOCAL"``/``"REMOTE"`` relative to the publisher) and ``ownership`` (the
    secondary offloading tier that generated the event) are vLLM 0.33's, kept for consumers.
    """

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | UnsetType = UNSET
    locality: str | UnsetType | None = UNSET
    ownership: str | UnsetType | None = UNSET


class AllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True, gc=False
):
    """The whole cache was reset."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One engine step's events on one rank: ``[ts, events, data_parallel_rank]`` on the wire.

    ``ts`` is seconds since the epoch when the step built the batch. An empty ``events`` list
    is a heartbeat.
    """

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None

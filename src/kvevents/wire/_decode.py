"""The tolerant batch decoder (WIRE.md section 2). Pure functions, no sockets.

:func:`decode_batch` reads every variant peers emit: map and array events in one stream,
missing and unknown keys, unknown tags, signed/unsigned/bytes hashes, 2- to n-element batches.
A malformed event costs only itself (it is skipped and reported); a malformed message raises
:class:`~kvevents.errors.DecodeError` saying what and where.

Hostile input is bounded (:class:`DecodeLimits`): events past ``max_events`` and events with
more than ``max_tokens`` tokens are skipped and counted, the rest of the batch kept. The
generic path never builds a payload whole: it reads each event's fields with typed decoders
after sizing them from their msgpack headers (:mod:`kvevents.wire._scan`), so its time and
memory are linear in the payload with a small factor, whatever the payload claims. Nesting
too deep for the decoder is a :class:`~kvevents.errors.DecodeError`, not a RecursionError.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvevents.errors import DecodeError
from kvevents.events import (
    NIL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    PackedStored,
)
from kvevents.wire._generic import decode_generic
from kvevents.wire._records import (
    DEFAULT_LIMITS,
    Applied,
    DecodedBatch,
    DecodeLimits,
    SkippedEvent,
    tail,
    too_many_tokens,
)
from kvevents.wire._scan import container_len

__all__ = [
    "DEFAULT_LIMITS",
    "Applied",
    "DecodeLimits",
    "DecodedBatch",
    "PackedStored",
    "SkippedEvent",
    "decode_batch",
    "decode_batch_packed",
]

_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


# Typed shapes of the array-form events (vLLM up to 0.23, SGLang before its map change).
# Older eras are prefixes of the newest, so every trailing field has a default.
class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # vLLM's extra keys: any msgpack values, per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)


# Probes: the tokens and extra_keys of every event, still encoded, for a large payload's
# typed paths (decoded whole, 3-byte tokens cost 12 bytes per byte and empty lists in the
# free-form extra_keys 64). An absent one is NIL.
# Below this size a payload cannot cost more than a few megabytes whatever it holds.
_PROBE_FROM = 64 * 1024


class _MapProbe(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    token_ids: msgspec.Raw = NIL
    extra_keys: msgspec.Raw = NIL


class _MapProbeRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    pass


class _MapProbeCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _ArrayProbe(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    # The seven fields before extra_keys, unread.
    f1: msgspec.Raw = NIL
    f2: msgspec.Raw = NIL
    token_ids: msgspec.Raw = NIL
    f4: msgspec.Raw = NIL
    f5: msgspec.Raw = NIL
    f6: msgspec.Raw = NIL
    f7: msgspec.Raw = NIL
    extra_keys: msgspec.Raw = NIL


class _ArrayProbeRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    pass


class _ArrayProbeCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _MapProbeBatch(msgspec.Struct, array_like=True, gc=False):
    ts: msgspec.Raw
    events: list[_MapProbe | _MapProbeRemoved | _MapProbeCleared]


class _ArrayProbeBatch(msgspec.Struct, array_like=True, gc=False):
    ts: msgspec.Raw
    events: list[_ArrayProbe | _ArrayProbeRemoved | _ArrayProbeCleared]


_probes = (msgspec.msgpack.Decoder(_MapProbeBatch), msgspec.msgpack.Decoder(_ArrayProbeBatch))


def _too_large_for_typed(payload: bytes, limits: DecodeLimits) -> bool:
    """True when an event's tokens or extra_keys exceed the limits: the generic path, which
    skips such events without building them, must read the payload instead of the typed
    ones (which would build them whole first)."""
    for probe in _probes:
        try:
            events = probe.decode(payload).events
        except msgspec.DecodeError:
            continue  # not this form (a mixed batch is read by the generic path anyway)
        return any(_over(e, limits) for e in events)
    return False


def _over(event: object, limits: DecodeLimits) -> bool:
    extra = getattr(event, "extra_keys", NIL)
    if len(extra) > limits.max_extra_bytes:
        return True
    tokens = getattr(event, "token_ids", NIL)
    head = container_len(memoryview(tokens)) if len(tokens) > limits.max_tokens else None
    return head is not None and head[1] > limits.max_tokens


def decode_batch(
    payload: bytes, *, seq: int | None = None, limits: DecodeLimits = DEFAULT_LIMITS
) -> DecodedBatch:
    """Decode one batch payload of any known variant, within ``limits``.

    Well-formed map-form batches take a single typed msgspec pass; anything else falls back to
    reading each event on its own, skipping the ones it cannot read.
    """
    try:
        return _decode(payload, seq, limits)
    except RecursionError:
        raise DecodeError("payload is nested too deeply to decode", seq=seq) from None


def _decode(payload: bytes, seq: int | None, limits: DecodeLimits) -> DecodedBatch:
    if len(payload) > _PROBE_FROM and _too_large_for_typed(payload, limits):
        return decode_generic(payload, seq, limits)
    try:
        return _within(_batch_decoder.decode(payload), len(payload), limits)
    except msgspec.DecodeError:
        pass
    try:
        batch = _from_array_batch(_array_decoder.decode(payload))
        return _within(batch, len(payload), limits)
    except msgspec.DecodeError:
        pass
    return decode_generic(payload, seq, limits)


class _PackedBatch(KVEventBatch, array_like=True, frozen=True, gc=False):
    # Narrows the base's field to the packed store (msgspec decodes by this annotation).
    events: list[PackedStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_packed_decoder = msgspec.msgpack.Decoder(_PackedBatch)


def decode_batch_packed(
    payload: bytes, *, seq: int | None = None, limits: DecodeLimits = DEFAULT_LIMITS
) -> DecodedBatch:
    """:func:`decode_batch`, except that map-form ``BlockStored`` events come back as
    :class:`PackedStored` (tokens left as msgpack bytes): about 4x less decoding for a typical
    batch. Every other form is decoded by :func:`decode_batch` and keeps its ``BlockStored``
    events, so a consumer handles both."""
    try:
        return _within(_packed_decoder.decode(payload), len(payload), limits)
    except msgspec.DecodeError:
        return decode_batch(payload, seq=seq, limits=limits)
    except RecursionError:
        raise DecodeError("payload is nested too deeply to decode", seq=seq) from None


def _within(batch: KVEventBatch, size: int, limits: DecodeLimits) -> DecodedBatch:
    """``batch`` as decoded, or cut to ``limits``. A token takes at least a byte, so a
    payload smaller than ``max_tokens`` bytes needs no look at its events."""
    if len(batch.events) <= limits.max_events and size <= min(
        limits.max_tokens, limits.max_extra_bytes
    ):
        return DecodedBatch(batch)
    kept: list[Any] = []  # events as decoded: kept ones of any event type
    skipped: list[SkippedEvent] = []
    for index, event in enumerate(batch.events[: limits.max_events]):
        tokens = _token_count(event)
        extra = len(event.extra_keys) if isinstance(event, PackedStored) else 0
        if tokens > limits.max_tokens:
            path = f"$[1][{index}].token_ids"
            skipped.append(SkippedEvent(index, path, too_many_tokens(tokens, limits)))
        elif extra > limits.max_extra_bytes:
            reason = f"extra_keys is {extra} bytes, over the limit of {limits.max_extra_bytes}"
            skipped.append(SkippedEvent(index, f"$[1][{index}].extra_keys", reason))
        else:
            kept.append(event)
    skipped += tail(len(batch.events), limits)
    return DecodedBatch(msgspec.structs.replace(batch, events=kept), tuple(skipped))


def _token_count(event: object) -> int:
    if isinstance(event, BlockStored):
        return len(event.token_ids)
    if isinstance(event, PackedStored):
        head = container_len(memoryview(event.token_ids))
        return 0 if head is None else head[1]
    return 0


def _unset_if_none(value: Any) -> Any:  # any decoded field value
    return msgspec.UNSET if value is None else value


def _from_array_event(event: _ArrayStored | _ArrayRemoved | _ArrayCleared) -> Event:
    if isinstance(event, _ArrayStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=_unset_if_none(event.extra_keys),
            group_idx=_unset_if_none(event.group_idx),
            kv_cache_spec_kind=_unset_if_none(event.kv_cache_spec_kind),
            kv_cache_spec_sliding_window=_unset_if_none(event.kv_cache_spec_sliding_window),
        )
    if isinstance(event, _ArrayRemoved):
        return BlockRemoved(
            block_hashes=event.block_hashes,
            medium=event.medium,
            group_idx=_unset_if_none(event.group_idx),
        )
    return AllBlocksCleared()


def _from_array_batch(raw: _ArrayBatch) -> KVEventBatch:
    events = [_from_array_event(event) for event in raw.events]
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)

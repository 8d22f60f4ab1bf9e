"""The tolerant decoder's generic path: any batch the typed decoders refuse (WIRE.md section 2).

Every value is read from a ``msgspec.Raw`` (a view of the payload): sized from its msgpack
header first, then decoded with a typed decoder, so no hostile shape (millions of one-byte
objects, absurd declared lengths) is ever built whole. Time and memory are linear in the
payload, with a small factor, whatever it claims.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvevents._types import Document
from kvevents.errors import DecodeError
from kvevents.events import (
    MAX_DIGEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from kvevents.wire._records import (
    DecodedBatch,
    DecodeLimits,
    Skip,
    SkippedEvent,
    tail,
    too_many_tokens,
)
from kvevents.wire._scan import ScanError, container_len, skip, type_name

__all__ = ["decode_generic"]

_any_decoder = msgspec.msgpack.Decoder()


class _LooseBatch(msgspec.Struct, array_like=True):
    ts: msgspec.Raw
    events: msgspec.Raw
    data_parallel_rank: msgspec.Raw = msgspec.Raw(b"\xc0")


class _Opaque:
    """A value too large to be the scalar it should be: only its type is known."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_loose_decoder = msgspec.msgpack.Decoder(_LooseBatch)
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
_raw_map = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_int_list = msgspec.msgpack.Decoder(list[int])
_opt_int_list = msgspec.msgpack.Decoder(list[int] | None)
_mixed_list = msgspec.msgpack.Decoder(list[int | str])
_pair_list = msgspec.msgpack.Decoder(list[tuple[int, int]])
_hash_list = msgspec.msgpack.Decoder(list[int | bytes])
_hash_one = msgspec.msgpack.Decoder(int | bytes | None)
_opt_str_decoder = msgspec.msgpack.Decoder(str | None)
# Up to this size a payload is checked whole first, at most a few MB however it is built: a
# byte that is not msgpack (a string that is not UTF-8 included) fails the message, as the
# index's C lane decides. Larger payloads are only read where fields are used.
_CHECK_WHOLE_BELOW = 64 * 1024
_SCALAR_BYTES = 64  # a scalar field larger than this is not the number or tag it should be
_MAX_FIELDS = 64  # the longest event era has 12; more is not an event
# msgspec's names for what it got, as the Python type names the rest of the reasons use.
_MSGSPEC_NAMES = {"None": "NoneType", "array": "list", "object": "dict", "ext": "Ext"}
_GOT = re.compile(r"got `([^`]+)` - at `\$\[(\d+)\]`")


def _scalar(raw: msgspec.Raw | None) -> Any:  # a decoded msgpack scalar: checked by the caller
    if raw is None:
        return None
    if len(raw) > _SCALAR_BYTES:
        return _Opaque(type_name(memoryview(raw)))
    try:
        return _any_decoder.decode(raw)
    except msgspec.DecodeError:  # e.g. a string that is not UTF-8: not the scalar wanted
        return _Opaque(type_name(memoryview(raw)))


def _name(value: object) -> str:
    return value.name if isinstance(value, _Opaque) else type(value).__name__


def decode_generic(payload: bytes, seq: int | None, limits: DecodeLimits) -> DecodedBatch:
    """Decode ``payload`` event by event, skipping what cannot be read (see the module)."""
    if len(payload) <= _CHECK_WHOLE_BELOW:
        try:  # what is not msgpack anywhere (bad UTF-8 too) fails the message, as in C
            _any_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"payload is not msgpack: {exc}", seq=seq) from None
    try:
        loose = _loose_decoder.decode(payload)
    except msgspec.ValidationError:
        raise DecodeError("batch is not an array [ts, events, rank?]", seq=seq) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}", seq=seq) from None
    ts = _scalar(loose.ts)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise DecodeError(f"ts is {_name(ts)}, expected a number", seq=seq, path="$[0]")
    rank = _scalar(loose.data_parallel_rank)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError(
            f"data_parallel_rank is {_name(rank)}, expected int or nil", seq=seq, path="$[2]"
        )
    raw_events, count = _event_raws(loose.events, seq, limits)
    events: list[Event] = []
    skipped: list[SkippedEvent] = []
    for index, raw in enumerate(raw_events):
        try:
            events.append(_event(raw, f"$[1][{index}]", limits))
        except Skip as bad:
            skipped.append(SkippedEvent(index=index, path=bad.path, reason=bad.reason))
        except msgspec.DecodeError as exc:  # a field msgspec cannot read (bad UTF-8, ...)
            reason = f"event cannot be read: {exc}"
            skipped.append(SkippedEvent(index=index, path=f"$[1][{index}]", reason=reason))
    skipped += tail(count, limits)
    batch = KVEventBatch(ts=float(ts), events=events, data_parallel_rank=rank)
    return DecodedBatch(batch, tuple(skipped))


def _event_raws(
    events: msgspec.Raw, seq: int | None, limits: DecodeLimits
) -> tuple[list[msgspec.Raw], int]:
    """The first ``max_events`` events, each still encoded, and how many were declared."""
    view = memoryview(events)
    head = container_len(view)
    if head is None or head[0] != "array":
        raise DecodeError(f"events is {type_name(view)}, expected an array", seq=seq, path="$[1]")
    _, count, start = head
    if count <= limits.max_events:
        return _raw_list.decode(events), count
    try:  # msgspec read the whole array already: these bounds hold
        end = skip(view, start, limits.max_events)
    except ScanError as exc:
        raise DecodeError(f"events cannot be read: {exc}", seq=seq, path="$[1]") from None
    cut = _array_head(limits.max_events) + bytes(view[start:end])
    return _raw_list.decode(cut), count


def _array_head(count: int) -> bytes:
    if count <= 15:
        return bytes([0x90 | count])
    if count <= 0xFFFF:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


# Positional field names of array-form events, by tag (the longest era; older ones are
# prefixes). SGLang puts a metadata map where vLLM has lora_name: decided by type below.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
# Optional string keys of newer map-form stores, kept for consumers (the index reads only
# cache_salt; BlockStored has no room for vLLM's locality and ownership, see
# kvevents.events: decode_batch_packed's PackedStored keeps them).
_OPTIONAL_STR = ("session_id", "cache_salt")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# vLLM 0.33's placement keys: kept on BlockRemoved and PackedStored (BlockStored is full).
_PLACEMENT = ("locality", "ownership")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}
Fields = dict[str, msgspec.Raw]


def _event(raw: msgspec.Raw, path: str, limits: DecodeLimits) -> Event:
    tag, fields = _tag_and_fields(raw, path)
    if tag == "BlockStored":
        return _stored(fields, path, limits)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields, path),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields, "group_idx", path),
            **{k: _opt_str(fields[k]) for k in _PLACEMENT if k in fields},
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise Skip(path, f"unknown event tag {tag!r}")


# The tag as decoded: checked by the caller.
def _tag_and_fields(raw: msgspec.Raw, path: str) -> tuple[Any, Fields]:
    view = memoryview(raw)
    head = container_len(view)
    if head is None or (head[1] == 0 and head[0] == "array"):
        raise Skip(path, f"event is {type_name(view)}, expected a map or a tagged array")
    kind, count, _ = head
    if count > _MAX_FIELDS:
        raise Skip(path, f"event has {count} fields; an event has at most {_MAX_FIELDS}")
    if kind == "map":
        try:
            fields = _raw_map.decode(raw)
        except msgspec.ValidationError:
            raise Skip(path, "event map keys must be strings") from None
        return _scalar(fields.get("type")), fields
    items = _raw_list.decode(raw)
    tag = _scalar(items[0])
    names = _FIELDS.get(tag) if isinstance(tag, str) else None
    return tag, dict(zip(names or (), items[1:], strict=False))


def _stored(fields: Fields, path: str, limits: DecodeLimits) -> BlockStored:
    token_ids, after = _tokens(fields.get("token_ids"), path, limits)
    block_size: Any = _scalar(fields.get("block_size"))  # as decoded: checked below
    if not _is_int(block_size) or block_size <= 0:
        raise Skip(f"{path}.block_size", f"block_size must be a positive int, got {block_size!r}")
    lora_id = _scalar(fields.get("lora_id"))
    kind = _opt_str(fields.get("kv_cache_spec_kind"))
    return BlockStored(
        block_hashes=_hashes(fields, path),
        parent_block_hash=_parent(fields.get("parent_block_hash"), f"{path}.parent_block_hash"),
        token_ids=token_ids,
        block_size=block_size,
        lora_id=lora_id if _is_int(lora_id) else None,
        medium=_opt_str(fields.get("medium")),
        # SGLang's salted array stores carry a metadata map here instead of a name.
        lora_name=_opt_str(fields.get("lora_name")),
        extra_keys=_extra(fields.get("extra_keys"), path, limits),
        group_idx=_opt_int(fields, "group_idx", path),
        kv_cache_spec_kind=msgspec.UNSET if kind is None else kind,
        kv_cache_spec_sliding_window=_opt_int(fields, "kv_cache_spec_sliding_window", path),
        **_optional(fields, path, limits, after),
    )


def _optional(fields: Fields, path: str, limits: DecodeLimits, after: list[int] | None) -> Document:
    """The newer optional keys a store may carry (vLLM 0.33, SGLang), where present;
    ``after`` is the lookahead a bigram store's last pair carries."""
    out: Document = {k: _opt_str(fields[k]) for k in _OPTIONAL_STR if k in fields}
    raw = fields.get("lookahead_token_ids")
    if after is not None:
        out["lookahead_token_ids"] = after
    elif raw is not None:
        out["lookahead_token_ids"] = _lookahead(raw, f"{path}.lookahead_token_ids", limits)
    return out


def _lookahead(raw: msgspec.Raw, path: str, limits: DecodeLimits) -> list[int] | None:
    head = container_len(memoryview(raw))
    if head is not None and head[0] == "array" and head[1] > limits.max_tokens:
        raise Skip(path, f"{head[1]} lookahead tokens, over the limit of {limits.max_tokens}")
    try:
        return _opt_int_list.decode(raw)
    except msgspec.ValidationError:
        raise Skip(path, "lookahead_token_ids must be a list of ints or null") from None


def _tokens(
    raw: msgspec.Raw | None, path: str, limits: DecodeLimits
) -> tuple[list[int | str], list[int] | None]:
    """A store's token ids, and the lookahead token of SGLang's EAGLE bigram form: its
    ``[a, b]`` pairs (pair ``i`` is tokens ``i`` and ``i + 1``) read as their first tokens
    plus the last pair's second. TensorRT-LLM's multimodal digest tokens stay strings."""
    where = f"{path}.token_ids"
    head = None if raw is None else container_len(memoryview(raw))
    if raw is None or head is None or head[0] != "array":
        raise Skip(where, _TOKENS_RULE)
    if head[1] > limits.max_tokens:
        raise Skip(where, too_many_tokens(head[1], limits))
    try:
        # A list of int, as _int_list declares: mypy sees msgspec's decoder return as Any.
        return _int_list.decode(raw), None  # type: ignore[return-value]
    except msgspec.ValidationError:
        pass
    try:
        return _digest_tokens(_mixed_list.decode(raw), where), None
    except msgspec.ValidationError:
        pass
    try:
        pairs = _pair_list.decode(raw)
    except msgspec.ValidationError:
        raise Skip(where, _TOKENS_RULE) from None
    if any(pairs[i][1] != pairs[i + 1][0] for i in range(len(pairs) - 1)):
        raise Skip(where, "bigram token_ids do not chain: a pair must start with the last's end")
    return [p[0] for p in pairs], [pairs[-1][1]] if pairs else None


_TOKENS_RULE = "token_ids must be a list of ints, of ints and digest strings, or of [a, b] pairs"


def _digest_tokens(tokens: list[int | str], where: str) -> list[int | str]:
    for i, token in enumerate(tokens):
        if isinstance(token, str) and len(token) > MAX_DIGEST:
            raise Skip(f"{where}[{i}]", f"a digest token is longer than {MAX_DIGEST} characters")
    return tokens


# Decoded msgpack extras: checked by the caller.
def _extra(raw: msgspec.Raw | None, path: str, limits: DecodeLimits) -> Any:
    if raw is None:
        return msgspec.UNSET
    view = memoryview(raw)
    head = container_len(view)
    if head is None or head[0] != "array":
        return msgspec.UNSET if type_name(view) == "NoneType" else None
    if len(raw) > limits.max_extra_bytes:
        raise Skip(
            f"{path}.extra_keys",
            f"extra_keys is {len(raw)} bytes, over the limit of {limits.max_extra_bytes}",
        )
    return _any_decoder.decode(raw)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_str(raw: msgspec.Raw | None) -> str | None:
    if raw is None:
        return None
    try:
        return _opt_str_decoder.decode(raw)
    except msgspec.ValidationError:
        return None


def _opt_int(fields: Fields, key: str, path: str) -> Any:  # a decoded int or None: checked here
    value = _scalar(fields.get(key))
    if value is None:
        return msgspec.UNSET
    if not _is_int(value):
        raise Skip(f"{path}.{key}", f"{key} must be an int, got {_name(value)}")
    return value


def _hashes(fields: Fields, path: str) -> list[int]:
    raw = fields.get("block_hashes")
    head = None if raw is None else container_len(memoryview(raw))
    if raw is None or head is None or head[0] != "array":
        raise Skip(f"{path}.block_hashes", "block_hashes must be a list")
    try:
        hashes = _hash_list.decode(raw)
    except msgspec.ValidationError as exc:
        got = _GOT.search(str(exc))
        name, index = (got.group(1), got.group(2)) if got else ("unknown", "?")
        name = _MSGSPEC_NAMES.get(name, name)
        where = f"{path}.block_hashes[{index}]"
        raise Skip(where, f"hash is {name}, expected int or bytes") from None
    if all(type(h) is int for h in hashes):  # the common case
        return hashes  # type: ignore[return-value]  # every element an int: checked above
    return [_hash(h, f"{path}.block_hashes[{i}]") for i, h in enumerate(hashes)]


def _parent(raw: msgspec.Raw | None, path: str) -> int | None:
    if raw is None:
        return None
    try:
        value = _hash_one.decode(raw)
    except msgspec.ValidationError:
        raise Skip(path, f"hash is {type_name(memoryview(raw))}, expected int or bytes") from None
    return None if value is None else _hash(value, path)


def _hash(value: int | bytes, path: str) -> int:
    if type(value) is int:  # msgpack cannot carry ints outside the int64/uint64 range
        return value
    if isinstance(value, bytes) and value:
        # A digest (vLLM with int hashes off sends 32 bytes). Its last 8 bytes, big-endian,
        # are exactly the integer vLLM sends for the same block in int mode.
        return int.from_bytes(value[-8:], "big")
    raise Skip(path, f"hash is {type(value).__name__}, expected int or bytes")

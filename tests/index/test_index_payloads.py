"""Payloads through ``PrefixIndex.ingest_payload`` against the same events with int tokens.

``ingest_payload`` decodes with :func:`~kvevents.wire.decode_batch_packed`, which leaves a
store's tokens as msgpack bytes for the table's token packer and ``store_run`` (in C where it
is built). The oracle is a second index fed the same decoded batch with every store's tokens
turned into ints first, so it takes the other road: ``pack_tokens`` in Python, then
``chain_hashes`` and ``store_chain``. Whatever the payload, both must end exactly alike.

Payloads are written by hand here (a small msgpack writer) so that they can carry what no
encoder of ours emits: ints of needless width, duplicate keys, ext values, stray bytes.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.errors import DecodeError
from kvevents.events import AllBlocksCleared, BlockStored
from kvevents.index._prefix import PrefixIndex
from kvevents.wire import Applied, PackedStored, decode_batch_packed

BS = 2
# Token ids of every msgpack width: fixints, then uint16 (prompt 1's tail), uint32 (prompt 2).
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 300, 301, 302, 2**16 - 1],
    [70_000, 70_001, 2**32 - 1, 7, 7, 7, 1, 1],
]
BLOCKS = 4
STREAMS = [("w", 0), ("w", 1), ("v", 0)]  # ("w", 1) is not registered: it adopts a size


# --------------------------------------------------------------------------- msgpack writer


@dataclass(frozen=True)
class Wide:
    """An int written with a given msgpack type byte, however small it is."""

    value: int
    code: int


@dataclass(frozen=True)
class F32:
    value: float


@dataclass(frozen=True)
class Raw:
    """Bytes spliced into the payload as they are."""

    data: bytes


@dataclass(frozen=True)
class Map:
    """A msgpack map as its pairs, in order (so keys may repeat)."""

    pairs: tuple[tuple[Any, Any], ...]


_WIDE = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i"}
_WIDE[0xD3] = ">q"


def _head(n: int, fix: int, small: int, codes: tuple[int, int]) -> bytes:
    if n < small:
        return bytes([fix | n])
    return (
        bytes([codes[0]]) + struct.pack(">H", n)
        if n < 2**16
        else bytes([codes[1]]) + (struct.pack(">I", n))
    )


def mp(obj: Any) -> bytes:
    """msgpack bytes of obj (None, bool, int, float, str, bytes, list, dict and the above)."""
    if isinstance(obj, Raw):
        return obj.data
    if obj is None:
        return b"\xc0"
    if obj is True or obj is False:
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, Wide):
        return bytes([obj.code]) + struct.pack(_WIDE[obj.code], obj.value)
    if isinstance(obj, F32):
        return b"\xca" + struct.pack(">f", obj.value)
    if isinstance(obj, int):
        if 0 <= obj < 128 or -32 <= obj < 0:
            return struct.pack(">b" if obj < 0 else ">B", obj)
        if obj >= 0:
            for code, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q")):
                if obj < 256 ** struct.calcsize(fmt):
                    return bytes([code]) + struct.pack(fmt, obj)
        for code, fmt in ((0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
            if obj >= -(2 ** (8 * struct.calcsize(fmt) - 1)):
                return bytes([code]) + struct.pack(fmt, obj)
        raise OverflowError(obj)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        data = obj.encode()
        if len(data) < 32:
            return bytes([0xA0 | len(data)]) + data
        return b"\xd9" + bytes([len(data)]) + data
    if isinstance(obj, bytes):
        return b"\xc4" + bytes([len(obj)]) + obj
    if isinstance(obj, (list, tuple)):
        return _head(len(obj), 0x90, 16, (0xDC, 0xDD)) + b"".join(mp(x) for x in obj)
    if isinstance(obj, dict):
        obj = Map(tuple(obj.items()))
    if isinstance(obj, Map):
        head = _head(len(obj.pairs), 0x80, 16, (0xDE, 0xDF))
        return head + b"".join(mp(k) + mp(v) for k, v in obj.pairs)
    raise TypeError(type(obj))


# --------------------------------------------------------------------------- events


def engine_hash(prompt: int, block: int, scheme: int) -> int:
    """Engine hashes of a (prompt, block) under a few schemes: two agree on nothing (the same
    tokens under two engine hashes), one is negative, one above 2**63."""
    base = prompt * 100 + block
    return [1000 + base, 5000 + base, -(7000 + base), 2**64 - 1 - base][scheme]


def tokens_of(prompt: int, start: int, count: int) -> list[int]:
    return PROMPTS[prompt][start * BS : (start + count) * BS]


Pick = Callable[[Sequence[Any]], Any]  # one of a sequence: hypothesis' draw or random.choice

MEDIUMS = [None] * 6 + ["GPU", "CPU", "CPU", "cpu", "absent"]
STORE_TWISTS = [
    "orphan",
    "dup_hash",
    "bytes_hash",
    "short_tokens",
    "big_token",
    "neg_token",
    "float_token",
    "wide_tokens",
    "wide_hashes",
    "size_mismatch",
    "size_zero",
    "lora_id",
    "lora_name",
    "lora_nil",
    "group_bad",
    "group_ok",
    "extra",
    "repeat_key",
    "no_hashes",
    "empty",
    "parent_absent",
    "type_last",
    "ext",
    "non_ascii",
]
REMOVE_TWISTS = ["unknown", "repeat", "bytes", "group", "empty"]
CLEARS = [
    {"type": "AllBlocksCleared"},
    Map((("type", "AllBlocksCleared"), ("group_idx", "whatever"))),
]
MALFORMED = [
    "junk",
    5,
    None,
    {"type": "Nope", "block_hashes": [1]},
    {"block_hashes": [1000]},
    {"type": 3},
    {"type": "BlockRemoved", "block_hashes": "x"},
    {"type": "BlockStored", "block_hashes": [1000], "token_ids": "ab", "block_size": BS},
    ["BlockRemoved", [1000], None],
    ["BlockStored", [1000], None, [1, 2], BS, None, None],
    {"type": "BlockStored", "block_hashes": [1000], "block_size": BS},
]


def make_store(
    pick: Pick,
    prompt: int,
    start: int,
    count: int,
    scheme: int,
    parent_scheme: int,
    medium: Any,
    twist: str,
) -> Map:
    """A BlockStored of blocks start..start+count of a prompt, bent by one twist."""
    hashes: list[Any] = [engine_hash(prompt, b, scheme) for b in range(start, start + count)]
    tokens: list[Any] = tokens_of(prompt, start, count)
    parent: Any = None if start == 0 else engine_hash(prompt, start - 1, parent_scheme)
    size: Any = BS
    if twist == "orphan":
        parent = 999_999
    elif twist == "dup_hash":
        hashes = hashes + hashes[:1]
        tokens = tokens + tokens[:BS]
    elif twist == "bytes_hash":
        hashes[0] = (hashes[0] % 2**64).to_bytes(8, "big")
    elif twist == "short_tokens":
        tokens = tokens[:-1]
    elif twist == "big_token":
        tokens[-1] = 2**32
    elif twist == "neg_token":
        tokens[0] = -1
    elif twist == "float_token":
        tokens[0] = 1.0
    elif twist == "wide_tokens":
        top = max(tokens)
        codes = [0xCF, 0xD3] + [0xCD] * (top < 2**16) + [0xD0] * (top < 2**7)
        tokens = [Wide(t, pick(codes)) for t in tokens]
    elif twist == "wide_hashes":
        hashes = [Wide(h, 0xD3 if h < 0 else 0xCF) for h in hashes]
    elif twist == "size_mismatch":
        size = BS + 1
    elif twist == "size_zero":
        size = 0
    elif twist == "empty":
        hashes, tokens = [], []
    fields: list[tuple[Any, Any]] = [
        ("type", "BlockStored"),
        ("block_hashes", hashes),
        ("parent_block_hash", parent),
        ("token_ids", tokens),
        ("block_size", size),
        ("lora_id", 7 if twist == "lora_id" else None),
    ]
    if medium != "absent":
        fields.append(("medium", medium))
    fields.append(("lora_name", "adapter" if twist == "lora_name" else None))
    if twist == "lora_nil":
        fields = [f for f in fields if f[0] not in ("lora_id", "lora_name")]
    elif twist == "parent_absent" and parent is None:
        fields = [f for f in fields if f[0] != "parent_block_hash"]
    elif twist == "group_bad":
        fields.append(("group_idx", "zero"))
    elif twist == "group_ok":
        fields += [("group_idx", 0), ("kv_cache_spec_sliding_window", None)]
    elif twist == "extra":
        fields += [("extra_keys", [1, "x"]), ("kv_cache_spec_kind", 3), ("zzz", {"a": [1.5]})]
    elif twist == "repeat_key":
        fields.append(("block_size", BS))
    elif twist == "no_hashes":
        fields = [f for f in fields if f[0] != "block_hashes"]
    elif twist == "type_last":
        fields = fields[1:] + fields[:1]
    elif twist == "ext":
        fields.append(("zzz", Raw(b"\xd4\x01\x00")))
    elif twist == "non_ascii":
        fields.append(("zzz", "h\u00e9"))
    return Map(tuple(fields))


def make_remove(pick: Pick, blocks: Sequence[tuple[int, int, int]], medium: Any, twist: str) -> Map:
    """A BlockRemoved of (prompt, block, scheme) blocks, bent by one twist."""
    hashes: list[Any] = [engine_hash(*block) for block in blocks]
    if twist == "unknown":
        hashes.append(424_242)
    elif twist == "repeat" and hashes:
        hashes.append(hashes[0])
    elif twist == "bytes" and hashes:
        hashes[0] = (hashes[0] % 2**64).to_bytes(8, "big")
    elif twist == "empty":
        hashes = []
    fields: list[tuple[Any, Any]] = [("type", "BlockRemoved"), ("block_hashes", hashes)]
    if medium != "absent":
        fields.append(("medium", medium))
    if twist == "group":
        fields.append(("group_idx", pick([1, None, "x"])))
    return Map(tuple(fields))


def to_array_form(ev: Any) -> Any:
    """An event as an array-form event (vLLM up to 0.23), when it is one we can write."""
    if not isinstance(ev, Map):
        return ev
    fields = dict(ev.pairs)
    tag = fields.get("type")
    if tag == "BlockStored":
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
        return [tag, *(fields.get(name) for name in names), fields.get("medium")]
    if tag == "BlockRemoved":
        return [tag, fields.get("block_hashes"), fields.get("medium")]
    if tag == "AllBlocksCleared":
        return [tag]
    return ev


def make_payload(pick: Pick, events: list[Any], odd: bool) -> bytes:
    """The batch of events as a payload: the map form, or (when odd) another or a broken one."""
    ts: Any = pick([1.25, 7, F32(2.5), -3, 2**40, math.inf])
    form = pick(["map", "array", "two", "four", "bad"]) if odd else "map"
    if form == "array":
        events = [to_array_form(ev) for ev in events]
    items: list[Any] = [ts, events, pick([None, None, 0, 3])]
    if form == "two":
        items = items[:2]
    elif form == "four":
        items.append({"extra": [1, 2]})
    data = mp(items)
    if form != "bad":
        return data
    broken: list[bytes] = [
        data + b"\x00",
        data[:-1],
        mp([ts, events, True]),
        mp(["ts", events]),
        mp([ts]),
        mp({"ts": ts}),
        mp([ts, events, None, Raw(b"\xa2\xff\xfe")]),
        mp([ts, [*events, {"type": "X", "k": Raw(b"\xa2\xff\xfe")}], None]),
    ]
    return pick(broken)  # type: ignore[no-any-return]


@st.composite
def payload(draw: st.DrawFn) -> tuple[tuple[str, int], bytes]:
    """Any batch: each event drawn on its own (mostly orphans and unknown removals)."""

    def pick(seq: Sequence[Any]) -> Any:
        return draw(st.sampled_from(seq))

    events: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(["store"] * 4 + ["remove"] * 2 + ["clear", "bad"]))):
        if kind == "store":
            start = pick([0, 0, 1, 2, 3])
            scheme = pick([0, 0, 0, 1, 2, 3])
            events.append(
                make_store(
                    pick,
                    pick(range(len(PROMPTS))),
                    start,
                    pick(range(1, BLOCKS - start + 1)),
                    scheme,
                    pick([scheme, scheme, 0, 1]),
                    pick(MEDIUMS),
                    pick(["none"] * 8 + STORE_TWISTS),
                )
            )
        elif kind == "remove":
            blocks = draw(
                st.lists(
                    st.tuples(
                        st.integers(0, len(PROMPTS) - 1),
                        st.integers(0, BLOCKS - 1),
                        st.sampled_from([0, 0, 0, 1, 2, 3]),
                    ),
                    min_size=1,
                    max_size=4,
                )
            )
            events.append(
                make_remove(pick, blocks, pick(MEDIUMS), pick(["none"] * 4 + REMOVE_TWISTS))
            )
        else:
            events.append(pick(CLEARS if kind == "clear" else MALFORMED))
    return pick(STREAMS), make_payload(pick, events[:6], draw(st.booleans()))


def coherent_payloads(rng: random.Random, count: int) -> list[tuple[tuple[str, int], bytes]]:
    """Batches as an engine sends them, mostly: chains continued, held blocks evicted from
    their ends, seldom a clear; now and then a twisted event or an odd payload."""
    held: dict[tuple[tuple[str, int], str, int], int] = {}  # (stream, tier, prompt) -> blocks
    out = []
    for _ in range(count):
        stream = rng.choice(STREAMS)
        events: list[Any] = []
        for _ in range(rng.choice([1, 1, 1, 2, 3, 5])):
            medium = rng.choice(MEDIUMS)
            tier = "CPU" if medium in ("CPU", "cpu") else "GPU"
            prompt = rng.randrange(len(PROMPTS))
            have = held.get((stream, tier, prompt), 0)
            roll = rng.random()
            if roll < 0.55:
                start = have if have < BLOCKS and rng.random() < 0.8 else 0
                count_ = rng.randint(1, BLOCKS - start)
                twist = rng.choice(STORE_TWISTS) if rng.random() < 0.08 else "none"
                scheme = 0 if rng.random() < 0.9 else rng.choice([1, 2, 3])
                events.append(
                    make_store(rng.choice, prompt, start, count_, scheme, scheme, medium, twist)
                )
                held[(stream, tier, prompt)] = max(have, start + count_)
            elif roll < 0.93:
                if have:
                    cut = rng.randrange(have)
                    blocks = [(prompt, b, 0) for b in range(have - 1, cut - 1, -1)]
                else:
                    blocks = [(prompt, rng.randrange(BLOCKS), 0)]
                    cut = 0
                twist = rng.choice(REMOVE_TWISTS) if rng.random() < 0.08 else "none"
                events.append(make_remove(rng.choice, blocks, medium, twist))
                held[(stream, tier, prompt)] = min(have, cut)
            elif roll < 0.97:
                events.append(rng.choice(CLEARS))
                for key in list(held):
                    if key[0] == stream:
                        del held[key]
            else:
                events.append(rng.choice(MALFORMED))
        out.append((stream, make_payload(rng.choice, events, rng.random() < 0.05)))
    return out


# --------------------------------------------------------------------------- the comparison


def make_index() -> PrefixIndex:
    index = PrefixIndex(max_orphan_blocks=5, tombstones=3, clock=lambda: 0.0)
    index.register_worker("w", block_size=BS)
    index.register_worker("v", block_size=BS)
    return index


def state(index: PrefixIndex) -> tuple[Any, ...]:
    dump = sorted(
        (str(h["worker_id"]), h["rank"], str(h["tier"]), sorted(h["blocks"]))  # type: ignore[arg-type]
        for h in index.dump()
    )
    matches = [
        (index.match(prompt), index.match(prompt, lora="adapter"), index.match(prompt, lora=7))
        for prompt in PROMPTS
    ]
    return index.snapshot(), index.stats(), index.streams(), dump, matches


_int_tokens = msgspec.msgpack.Decoder(list[int])


def with_int_tokens(event: Any) -> Any:
    """A packed store as a BlockStored; tokens that are not all ints become [-1] (refused)."""
    if type(event) is not PackedStored:
        return event
    try:
        tokens = _int_tokens.decode(event.token_ids)
    except msgspec.DecodeError:
        tokens = [-1]
    names = set(BlockStored.__struct_fields__) - {"token_ids"}
    fields = {f: getattr(event, f) for f in event.__struct_fields__ if f in names}
    fields["extra_keys"] = event.extras()
    return BlockStored(token_ids=tokens, **fields)


def apply_ints(index: PrefixIndex, stream: tuple[str, int], data: bytes) -> Applied:
    """The oracle: the decoded batch with int tokens, applied by ``ingest``."""
    decoded = decode_batch_packed(data)
    batch = decoded.batch
    events = [with_int_tokens(e) for e in batch.events]
    index.ingest(stream[0], stream[1], msgspec.structs.replace(batch, events=events))
    clears = any(type(e) is AllBlocksCleared for e in events)
    return Applied(batch.ts, len(events), len(decoded.skipped), clears)


def outcome(apply: Callable[[], Applied]) -> Applied | str:
    """What applying did; an exception by its type, as both paths must raise alike."""
    try:
        return apply()
    except Exception as exc:
        return type(exc).__name__


def same_applied(got: Applied | str, want: Applied | str) -> bool:
    if isinstance(got, str) or isinstance(want, str):
        return got == want
    ts_same = got.ts == want.ts or (math.isnan(got.ts) and math.isnan(want.ts))
    return ts_same and (got.events, got.skipped, got.clears) == (
        want.events,
        want.skipped,
        want.clears,
    )


def run_both(payloads: Sequence[tuple[tuple[str, int], bytes]]) -> PrefixIndex:
    packed, whole = make_index(), make_index()
    for stream, data in payloads:
        got = outcome(lambda: packed.ingest_payload(stream[0], stream[1], data))  # noqa: B023
        want = outcome(lambda: apply_ints(whole, stream, data))  # noqa: B023
        assert same_applied(got, want), (got, want, data)
        assert packed.snapshot() == whole.snapshot(), data
    assert state(packed) == state(whole)
    return packed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(payload(), max_size=25))
def test_payloads_leave_the_index_as_decoded_events(
    payloads: list[tuple[tuple[str, int], bytes]],
) -> None:
    """Random batches (valid, odd and broken) leave both indexes in exactly one state."""
    run_both(payloads)


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_engine_like_streams_leave_one_state(rng: random.Random) -> None:
    """Engine-like streams (chains, evictions, tiers, clears, with twists) agree too."""
    run_both(coherent_payloads(rng, 60))


# --------------------------------------------------------------------------- targeted


def stored(prompt: int, start: int, count: int, *, medium: Any = None, scheme: int = 0) -> Map:
    parent = None if start == 0 else engine_hash(prompt, start - 1, scheme)
    return Map(
        (
            ("type", "BlockStored"),
            ("block_hashes", [engine_hash(prompt, b, scheme) for b in range(start, start + count)]),
            ("parent_block_hash", parent),
            ("token_ids", tokens_of(prompt, start, count)),
            ("block_size", BS),
            ("lora_id", None),
            ("medium", medium),
            ("lora_name", None),
        )
    )


def removed(prompt: int, blocks: Sequence[int], *, medium: Any = None) -> dict[str, Any]:
    hashes = [engine_hash(prompt, b, 0) for b in blocks]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch_bytes(*events: Any, ts: float = 1.5) -> bytes:
    return mp([ts, list(events), None])


def test_an_unreadable_payload_changes_nothing() -> None:
    """A payload the decoder refuses raises DecodeError and leaves the index as it was."""
    index = make_index()
    index.ingest_payload("w", 0, batch_bytes(stored(0, 0, 2)))
    before = state(index)
    with pytest.raises(DecodeError):
        index.ingest_payload("w", 0, batch_bytes(stored(0, 2, 2)) + b"\x00")
    assert state(index) == before
    weird = mp([1.0, [stored(0, 2, 2)], None, Raw(b"\xd4\x01\x00")])  # an ext value
    assert index.ingest_payload("w", 0, weird) == Applied(1.0, 1, 0, False)
    assert index.stats().entries == 4


def test_applied_reports_the_batch() -> None:
    """ts, event count, skipped events and clears of the batch applied."""
    index = make_index()
    index.ingest_payload("w", 0, batch_bytes(stored(0, 0, 1)))
    got = index.ingest_payload(
        "w", 0, batch_bytes(stored(0, 1, 1), {"type": "AllBlocksCleared"}, ts=9.5)
    )
    assert got == Applied(9.5, 2, 0, True)
    got = index.ingest_payload("w", 0, batch_bytes(stored(0, 0, 1), 5, ts=3))
    assert got == Applied(3.0, 1, 1, False)
    assert index.streams()[0].batches == 3 and index.streams()[0].last_batch_ts == 3.0

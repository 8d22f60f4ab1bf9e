"""The decoder under hostile payloads: deep nesting, amplification, declared lengths, limits."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest

from kvevents.errors import DecodeError
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.wire import DecodeLimits, decode_batch, decode_batch_packed, encode_batch
from kvevents.wire._scan import ScanError, container_len, skip, type_name

HEAD = b"\x92\xcb" + bytes(8)  # [0.0, ...: a batch array of two with its ts
pack = msgspec.msgpack.encode


def events_of(count: int, one: bytes) -> bytes:
    """A batch declaring ``count`` events, each the encoded object ``one``."""
    return HEAD + b"\xdd" + count.to_bytes(4, "big") + one * count


def stored(tokens: list[int], extra: Any = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": tokens,
        "block_size": 1,
        "extra_keys": extra,
    }


def peak_of(payload: bytes, **kwargs: Any) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        result = decode_batch(payload, **kwargs)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"])
def test_deep_nesting_is_a_decode_error(opener: bytes) -> None:
    """A 100 KB deeply nested payload raises DecodeError, not RecursionError."""
    nest = opener * 100_000 + b"\xc0"
    for payload in (nest, HEAD + nest, b"\x92" + nest + b"\x90"):
        with pytest.raises(DecodeError) as caught:
            decode_batch(payload, seq=5)
        assert caught.value.seq == 5
        with pytest.raises(DecodeError):
            decode_batch_packed(payload, seq=5)


def test_deep_nesting_inside_one_event_costs_that_event_or_the_message() -> None:
    """Deep nesting inside extra_keys of one event never escapes as RecursionError."""
    deep = b"\x91" * 50_000 + b"\xc0"
    good = pack({"type": "AllBlocksCleared"})
    event = pack(stored([1]))[:-1] + deep  # extra_keys (the last key) replaced by the nest
    payload = HEAD + b"\x92" + good + event
    with pytest.raises(DecodeError, match="nested too deeply"):
        decode_batch(payload)


def test_many_one_byte_events_cost_bounded_time_and_memory() -> None:
    """4 MB of one-byte events: cut at max_events, the rest counted, memory bounded."""
    limits = DecodeLimits(max_events=1000)
    payload = events_of(4_000_000, b"\xc0")
    got, peak = peak_of(payload, limits=limits)
    assert got.batch.events == []
    assert got.skipped_count == 4_000_000
    assert len(got.skipped) == 1001  # 1000 examined, one record for the other 3,999,000
    tail = got.skipped[-1]
    assert (tail.index, tail.count, tail.path) == (1000, 3_999_000, "$[1][1000:]")
    assert "over the limit of 1000 events" in tail.reason
    assert peak < 2 * len(payload)  # was 300x: 1.25 GB for these 4 MB


def test_events_past_the_limit_are_skipped_and_the_first_ones_kept() -> None:
    """A typed batch over max_events keeps the first max_events events and counts the rest."""
    batch = [1.0, [{"type": "BlockRemoved", "block_hashes": [i]} for i in range(50)], 0]
    for payload in (pack(batch), pack([1.0, [["BlockRemoved", [i]] for i in range(50)]])):
        got = decode_batch(payload, limits=DecodeLimits(max_events=20))
        assert [e.block_hashes[0] for e in got.batch.events] == list(range(20))
        assert got.skipped_count == 30 and got.skipped[0].index == 20
    got = decode_batch_packed(pack(batch), limits=DecodeLimits(max_events=20))
    assert len(got.batch.events) == 20 and got.skipped_count == 30


def test_generic_path_cuts_at_max_events_and_keeps_the_rank() -> None:
    """An unknown event forces the generic path: the cut keeps order, counts, rank."""
    events = [{"type": "BlockRemoved", "block_hashes": [i]} for i in range(30)]
    events[3] = {"type": "Unknown"}
    got = decode_batch(pack([1.0, events, 7]), limits=DecodeLimits(max_events=10))
    assert [e.block_hashes[0] for e in got.batch.events] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert got.batch.data_parallel_rank == 7
    assert [s.index for s in got.skipped] == [3, 10] and got.skipped_count == 21


@pytest.mark.parametrize("form", ["map", "array", "generic"])
def test_event_over_the_token_limit_is_skipped_and_the_rest_kept(form: str) -> None:
    """An event with more tokens than max_tokens is skipped; the others are delivered."""
    big, small = list(range(5000)), [1, 2]
    if form == "array":
        raw: list[Any] = [["BlockStored", [1], None, t, 1] for t in (small, big, small)]
    else:
        raw = [stored(small), stored(big), stored(small)]
    if form == "generic":
        raw.append({"type": "Unknown"})
    got = decode_batch(pack([1.0, raw]), limits=DecodeLimits(max_tokens=4096))
    assert [e.token_ids for e in got.batch.events] == [small, small]  # type: ignore[union-attr]
    skipped = got.skipped[0]
    assert (skipped.index, skipped.path) == (1, "$[1][1].token_ids")
    assert "5000 tokens, over the limit of 4096" in skipped.reason


def test_packed_events_over_the_token_limit_are_skipped() -> None:
    """decode_batch_packed counts tokens of its undecoded token arrays too."""
    got = decode_batch_packed(
        pack([1.0, [stored([1] * 5000), stored([1])]]), limits=DecodeLimits(max_tokens=4096)
    )
    assert len(got.batch.events) == 1 and got.skipped[0].index == 0


@pytest.mark.parametrize("form", ["map", "array"])
def test_huge_extra_keys_cost_their_event_not_a_gigabyte(form: str) -> None:
    """extra_keys of millions of empty lists: the event is skipped, memory stays bounded."""
    extra = [[]] * 2_000_000
    if form == "map":
        bad: Any = stored([1], extra)
    else:
        bad = ["BlockStored", [1], None, [1], 1, None, None, None, extra]
    payload = pack([1.0, [{"type": "AllBlocksCleared"}, bad]])
    got, peak = peak_of(payload)
    assert got.batch.events == [AllBlocksCleared()]
    assert "extra_keys is" in got.skipped[0].reason
    assert peak < 4 * len(payload)  # decoded whole it takes 64 bytes per byte


def test_huge_declared_lengths_are_errors_not_allocations() -> None:
    """Arrays, maps and strings claiming 4 G elements in a few bytes are rejected cheaply."""
    for claim in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        payload = HEAD + claim + b"\xc0" * 16
        got_error = False
        try:
            decode_batch(payload)
        except DecodeError:
            got_error = True
        assert got_error
    event = {"type": "BlockStored", "block_hashes": [1], "block_size": 1, "token_ids": "x"}
    payload = pack([1.0, [event]])
    payload = payload.replace(b"\xa1x", b"\xdd\x7f\xff\xff\xff")  # token_ids claims 2 G ints
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_limits_leave_typical_batches_untouched() -> None:
    """Well-formed batches of every form decode exactly as before under the defaults."""
    raw = [
        stored(list(range(8192)), [None]),
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]},
        {"type": "AllBlocksCleared"},
    ]
    got = decode_batch(pack([1.0, raw, 0]))
    assert got.skipped == () and len(got.batch.events) == 3
    assert isinstance(got.batch.events[0], BlockStored)
    assert got.batch.events[1] == BlockRemoved(block_hashes=[int.from_bytes(b"\x01" * 8, "big")])
    assert decode_batch(encode_batch(got.batch)).batch == got.batch


def test_limits_are_checked() -> None:
    """A limit below 1 is refused, naming the fields."""
    with pytest.raises(ValueError, match="max_events"):
        DecodeLimits(max_events=0)


def test_scan_skips_iteratively_and_names_types() -> None:
    """The scanner walks any nesting without recursion and refuses truncated input."""
    nested = b"\x91" * 200_000 + b"\xc0"
    assert skip(nested) == len(nested)
    value = pack([{"a": [1, 2.5, "s", b"b", None, True]}, -3, 2**40])
    assert skip(value) == len(value)
    assert container_len(value) == ("array", 3, 1)
    names = [type_name(pack(v)) for v in (1, -1, 2.5, "s", b"b", None, True, [1], {"a": 1})]
    assert names == ["int", "int", "float", "str", "bytes", "NoneType", "bool", "list", "dict"]
    with pytest.raises(ScanError):
        skip(b"\x92\x01")
    with pytest.raises(ScanError):
        skip(b"\xc1")

"""The tolerant decoder reads every variant peers emit and skips bad events one at a time."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch
from kvevents.wire import decode_batch, encode_batch

pack = msgspec.msgpack.encode
TOKENS = [11, 12, 13, 14]


def stored_fields(n: int) -> list[Any]:
    """The first n positional BlockStored fields of the longest (vLLM 0.23) array era."""
    full = [[1, 2], None, TOKENS, 2, None, "GPU", None, None, 0, "full_attention", None]
    return full[:n]


# Array-form events of every era in WIRE.md section 2, with the batch shape of that era.
ARRAY_ERAS = {
    "vllm-0.9": ([1.0, [["BlockStored", *stored_fields(5)], ["BlockRemoved", [1]]]], None),
    "vllm-0.10.2": (
        [1.0, [["BlockStored", *stored_fields(6)], ["BlockRemoved", [1], "GPU"]], 0],
        "GPU",
    ),
    "vllm-0.16": (
        [1.0, [["BlockStored", *stored_fields(7)], ["BlockRemoved", [1], "GPU"]], 0],
        "GPU",
    ),
    "vllm-0.20": (
        [1.0, [["BlockStored", *stored_fields(9)], ["BlockRemoved", [1], "GPU", 0]], 0],
        "GPU",
    ),
    "vllm-0.23": (
        [1.0, [["BlockStored", *stored_fields(11)], ["BlockRemoved", [1], "GPU", 0]], 0],
        "GPU",
    ),
    "sglang-array": (
        [
            1.0,
            [["BlockStored", *stored_fields(6), {"cache_salt": "x"}], ["BlockRemoved", [1], "GPU"]],
            0,
        ],
        "GPU",
    ),
}


@pytest.mark.parametrize("era", sorted(ARRAY_ERAS))
def test_array_eras_decode(era: str) -> None:
    """Tagged-array events of every vLLM and SGLang era decode to the same structs."""
    raw, medium = ARRAY_ERAS[era]
    got = decode_batch(pack(raw))
    assert got.skipped == ()
    stored, removed = got.batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        [1, 2],
        None,
        TOKENS,
        2,
    )
    assert stored.medium == medium
    assert stored.lora_name is None
    assert removed == BlockRemoved(
        block_hashes=[1], medium=removed.medium, group_idx=removed.group_idx
    )
    assert removed.medium == medium


def test_vllm_023_array_keeps_optional_fields() -> None:
    """Trailing array fields (group_idx, kv_cache_spec_kind) are kept when present."""
    stored = decode_batch(pack(ARRAY_ERAS["vllm-0.23"][0])).batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention"


def test_two_element_batch_has_no_rank() -> None:
    """Old vLLM batches [ts, events] decode with data_parallel_rank None."""
    got = decode_batch(pack([3.0, []]))
    assert got.batch == KVEventBatch(ts=3.0, events=[], data_parallel_rank=None)


def test_extra_trailing_batch_elements_are_ignored() -> None:
    """A batch with more than three elements keeps the first three."""
    got = decode_batch(pack([3.0, [{"type": "AllBlocksCleared"}], 1, "future", {"x": 1}]))
    assert got.batch == KVEventBatch(ts=3.0, events=[AllBlocksCleared()], data_parallel_rank=1)


def test_sglang_map_without_nil_keys() -> None:
    """SGLang maps omit lora_name and medium when nil and add cache_salt/session_id."""
    event = {
        "type": "BlockStored",
        "block_hashes": [-5, 7],
        "parent_block_hash": -4,
        "token_ids": TOKENS,
        "block_size": 2,
        "lora_id": None,
        "cache_salt": "s",
        "session_id": "abc",
    }
    got = decode_batch(pack([1.0, [event], 0]))
    stored = got.batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [-5, 7]
    assert stored.parent_block_hash == -4
    assert (stored.medium, stored.lora_name) == (None, None)


def test_newer_optional_keys_do_not_break_decoding() -> None:
    """Keys a newer engine adds do not break decoding: a removal keeps its locality, reads an
    ownership that is not a string as None, and ignores a key it has no field for."""
    event = {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": "CPU",
        "locality": "local",
        "ownership": {"a": 1},
        "lookahead_token_ids": [1, 2],
    }
    got = decode_batch(pack([1.0, [event], 0]))
    assert got.batch.events == [
        BlockRemoved(block_hashes=[1], medium="CPU", locality="local", ownership=None)
    ]


def test_bytes_hashes_map_to_vllm_int_hashes() -> None:
    """A 32-byte digest hash decodes to the int vLLM sends for it in int mode (its last 8 bytes)."""
    digest = hashlib.sha256(b"block").digest()
    event = {
        "type": "BlockStored",
        "block_hashes": [digest],
        "parent_block_hash": digest,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    stored = decode_batch(pack([1.0, [event], 0])).batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [int.from_bytes(digest[-8:], "big")]
    assert stored.parent_block_hash == int.from_bytes(digest[-8:], "big")


def test_mixed_maps_and_arrays_in_one_batch() -> None:
    """Array and map events may share one stream and even one batch."""
    raw = [1.0, [["BlockRemoved", [1], None], {"type": "BlockRemoved", "block_hashes": [2]}], 0]
    got = decode_batch(pack(raw))
    assert [e.block_hashes for e in got.batch.events if isinstance(e, BlockRemoved)] == [[1], [2]]


def test_empty_event_list_is_a_heartbeat() -> None:
    """An empty batch decodes to zero events, not an error."""
    assert decode_batch(pack([1.0, [], 0])).batch.events == []


BAD_EVENTS: list[tuple[Any, str]] = [
    ({"type": "BlockMoved", "block_hashes": [1]}, "unknown event tag 'BlockMoved'"),
    (["Future", 1, 2], "unknown event tag 'Future'"),
    (42, "expected a map or a tagged array"),
    ({"type": "BlockRemoved", "block_hashes": ["x"]}, "hash is str"),
    ({"type": "BlockRemoved", "block_hashes": [1.5]}, "hash is float"),
    ({"type": "BlockRemoved", "block_hashes": [b""]}, "hash is bytes"),
    ({"type": "BlockRemoved", "block_hashes": 5}, "block_hashes must be a list"),
    (
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1]},
        "block_size must be a positive int",
    ),
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": "ab", "block_size": 1}, "token_ids"),
    ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "g"}, "group_idx must be an int"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_EVENTS)
def test_bad_event_costs_only_itself(bad: Any, reason: str) -> None:
    """One unreadable event is skipped and reported; the events around it survive."""
    good_before = {"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU"}
    good_after = {"type": "AllBlocksCleared"}
    got = decode_batch(pack([1.0, [good_before, bad, good_after], 4]), seq=17)
    assert got.batch.events == [BlockRemoved(block_hashes=[10], medium="GPU"), AllBlocksCleared()]
    assert got.batch.data_parallel_rank == 4
    assert len(got.skipped) == 1
    assert got.skipped[0].index == 1
    assert got.skipped[0].path.startswith("$[1][1]")
    assert reason in got.skipped[0].reason


@pytest.mark.parametrize(
    ("payload", "path", "text"),
    [
        (b"\xc1", "$", "not msgpack"),
        (pack({"ts": 1}), "$", "not an array"),
        (pack([1.0]), "$", "not an array"),
        (pack(["now", []]), "$[0]", "ts is str"),
        (pack([True, []]), "$[0]", "ts is bool"),
        (pack([1.0, {"a": 1}]), "$[1]", "events is dict"),
        (pack([1.0, [], "zero"]), "$[2]", "data_parallel_rank is str"),
    ],
)
def test_malformed_message_raises_with_what_and_where(payload: bytes, path: str, text: str) -> None:
    """A message that is not a batch raises DecodeError naming the sequence and the path."""
    with pytest.raises(DecodeError) as exc:
        decode_batch(payload, seq=99)
    assert exc.value.seq == 99
    assert exc.value.path == path
    assert text in str(exc.value)
    assert "seq 99" in str(exc.value)


def test_integer_ts_is_accepted_as_float() -> None:
    """An integer timestamp (some encoders drop the fraction) decodes as float."""
    got = decode_batch(pack([5, [], 0]))
    assert got.batch.ts == 5.0
    assert isinstance(got.batch.ts, float)


def test_fast_path_result_equals_generic_path() -> None:
    """The typed fast path and the per-event path agree on a well-formed batch."""
    batch = KVEventBatch(
        ts=1.25,
        events=[
            BlockStored(
                block_hashes=[1, 2],
                parent_block_hash=9,
                token_ids=TOKENS,
                block_size=2,
                lora_id=4,
                medium="GPU",
                lora_name="a",
                extra_keys=[None, ["mm"]],
                group_idx=1,
            ),
            BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    fast = decode_batch(encode_batch(batch))
    # A trailing unknown event forces the generic path for the same content.
    raw = msgspec.msgpack.decode(encode_batch(batch))
    raw[1].append({"type": "Unknown"})
    slow = decode_batch(pack(raw))
    assert fast.batch == batch
    assert slow.batch == batch
    assert len(slow.skipped) == 1

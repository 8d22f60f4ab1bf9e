"""Golden bytes: the exact encoding our publisher emits, pinned byte for byte."""

from __future__ import annotations

import struct

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire import encode_batch


def s(text: str) -> bytes:
    """msgpack fixstr, written out by hand so the test does not trust the encoder under test."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


NIL = b"\xc0"


def test_block_removed_bytes() -> None:
    """BlockRemoved is a 3-key map: type, block_hashes, medium (nil written, not omitted)."""
    got = encode_batch(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[3])]))
    event = (
        b"\x83"
        + s("type")
        + s("BlockRemoved")
        + s("block_hashes")
        + b"\x91\x03"
        + s("medium")
        + NIL
    )
    assert got == b"\x93" + b"\xcb" + b"\x00" * 8 + b"\x91" + event + NIL


def test_all_blocks_cleared_bytes() -> None:
    """AllBlocksCleared carries only its tag."""
    got = encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=2))
    assert (
        got == b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81" + s("type") + s("AllBlocksCleared") + b"\x02"
    )


def test_block_stored_bytes_with_extreme_hashes() -> None:
    """Always-present keys are written as nil; hashes use the full uint64/int64 range."""
    event = BlockStored(
        block_hashes=[2**64 - 1, -(2**63)],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
    )
    got = encode_batch(KVEventBatch(ts=1.5, events=[event], data_parallel_rank=None))
    body = (
        b"\x88"
        + s("type")
        + s("BlockStored")
        + s("block_hashes")
        + b"\x92\xcf"
        + b"\xff" * 8
        + b"\xd3\x80"
        + b"\x00" * 7
        + s("parent_block_hash")
        + NIL
        + s("token_ids")
        + b"\x94\x01\x02\x03\x04"
        + s("block_size")
        + b"\x02"
        + s("lora_id")
        + NIL
        + s("medium")
        + NIL
        + s("lora_name")
        + NIL
    )
    assert got == b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91" + body + NIL


def test_block_stored_optional_keys_appear_only_when_set() -> None:
    """Optional keys are appended after lora_name, in declaration order, once set."""
    event = BlockStored(
        block_hashes=[7],
        parent_block_hash=6,
        token_ids=[9],
        block_size=1,
        lora_id=3,
        medium="GPU",
        lora_name="ad",
        group_idx=1,
        kv_cache_spec_kind="full_attention",
    )
    got = encode_batch(KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0))
    body = (
        b"\x8a"
        + s("type")
        + s("BlockStored")
        + s("block_hashes")
        + b"\x91\x07"
        + s("parent_block_hash")
        + b"\x06"
        + s("token_ids")
        + b"\x91\x09"
        + s("block_size")
        + b"\x01"
        + s("lora_id")
        + b"\x03"
        + s("medium")
        + s("GPU")
        + s("lora_name")
        + s("ad")
        + s("group_idx")
        + b"\x01"
        + s("kv_cache_spec_kind")
        + s("full_attention")
    )
    assert got == b"\x93\xcb" + b"\x00" * 8 + b"\x91" + body + b"\x00"


def test_typical_batch_is_a_three_element_array() -> None:
    """A batch is always [ts, events, rank] (Dynamo reads a fixed 3-tuple)."""
    batch = KVEventBatch(
        ts=2.0,
        events=[
            BlockStored(block_hashes=[1], token_ids=[0, 0], block_size=2, medium="GPU"),
            BlockRemoved(block_hashes=[1], medium="GPU"),
        ],
    )
    got = encode_batch(batch)
    assert got[0] == 0x93
    assert got[1:10] == b"\xcb" + struct.pack(">d", 2.0)
    assert got[10] == 0x92
    assert got.endswith(NIL)

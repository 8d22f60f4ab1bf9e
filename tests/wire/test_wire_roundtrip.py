"""Property-based round trips over every event type."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire import decode_batch, encode_batch

hashes = st.integers(min_value=-(2**63), max_value=2**64 - 1)
mediums = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "CPU_PINNED"])
optional_int = st.just(msgspec.UNSET) | st.integers(min_value=0, max_value=2**31)


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    block_size = draw(st.integers(min_value=1, max_value=4))
    block_hashes = draw(st.lists(hashes, min_size=1, max_size=4))
    tokens = draw(
        st.lists(
            st.integers(min_value=0, max_value=2**31),
            min_size=block_size * len(block_hashes),
            max_size=block_size * len(block_hashes),
        )
    )
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=draw(st.none() | hashes),
        token_ids=tokens,
        block_size=block_size,
        lora_id=draw(st.none() | st.integers(min_value=0, max_value=100)),
        medium=draw(mediums),
        lora_name=draw(st.none() | st.text(max_size=5)),
        group_idx=draw(optional_int),
        kv_cache_spec_kind=draw(
            st.just(msgspec.UNSET) | st.sampled_from(["full_attention", "mamba"])
        ),
        kv_cache_spec_sliding_window=draw(optional_int),
    )


removed = st.builds(
    BlockRemoved, block_hashes=st.lists(hashes, max_size=4), medium=mediums, group_idx=optional_int
)
events = st.lists(stored() | removed | st.just(AllBlocksCleared()), max_size=6)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=events,
    data_parallel_rank=st.none() | st.integers(min_value=0, max_value=1024),
)


@settings(max_examples=200, deadline=None)
@given(batches)
def test_encode_decode_round_trip(batch: KVEventBatch) -> None:
    """Every batch we can build decodes back to itself with nothing skipped."""
    got = decode_batch(encode_batch(batch))
    assert got.skipped == ()
    assert got.batch == batch


@settings(max_examples=100, deadline=None)
@given(batches)
def test_generic_path_agrees_with_fast_path(batch: KVEventBatch) -> None:
    """The per-event fallback reads what the typed path reads, event for event."""
    raw = msgspec.msgpack.decode(encode_batch(batch))
    raw[1].append({"type": "NotAnEvent"})
    got = decode_batch(msgspec.msgpack.encode(raw))
    assert got.batch == batch
    assert [s.index for s in got.skipped] == [len(batch.events)]

"""The recorder enforces each producer rule of WIRE.md section 7 on its own."""

from __future__ import annotations

import pytest

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.publish._recorder import EventRecorder

BS = 4


def toks(i: int) -> list[int]:
    return [i * 10 + k for k in range(BS)]


def rec(**kw: object) -> EventRecorder:
    return EventRecorder(BS, rank=3, clock=lambda: 123.0, **kw)  # type: ignore[arg-type]


def test_empty_step_yields_no_batch() -> None:
    """A step with no mutation publishes nothing, but still counts as a step."""
    r = rec()
    assert r.flush() is None
    assert r.stats().steps == 1 and r.stats().batches == 0


def test_batch_carries_rank_and_ts() -> None:
    """The batch has the recorder's rank and the given ts (or the clock's)."""
    r = rec()
    r.record_stored(1, None, toks(1))
    batch = r.flush()
    assert batch is not None and batch.data_parallel_rank == 3 and batch.ts == 123.0
    r.record_stored(2, 1, toks(2))
    assert r.flush(ts=5.0).ts == 5.0  # type: ignore[union-attr]


def test_partial_block_is_never_announced() -> None:
    """A block with fewer than block_size tokens is suppressed and counted."""
    r = rec()
    assert not r.record_stored(1, None, [1, 2])
    assert r.flush() is None
    assert r.stats().partial_blocks == 1


def test_oversized_block_is_a_caller_error() -> None:
    """More tokens than block_size in one store is a bug in the caller, said loudly."""
    with pytest.raises(ValueError, match="more than block_size 4"):
        rec().record_stored(1, None, list(range(8)))


def test_block_announced_once() -> None:
    """Storing an announced block again is suppressed and counted."""
    r = rec()
    assert r.record_stored(1, None, toks(1))
    r.flush()
    assert not r.record_stored(1, None, toks(1))
    assert r.flush() is None
    assert r.stats().duplicate_stores == 1


def test_same_hash_in_two_media_is_two_announcements() -> None:
    """Dedup is per medium: a block may be announced on GPU and on CPU."""
    r = rec()
    assert r.record_stored(1, None, toks(1))
    assert r.record_stored(1, None, toks(1), medium="CPU")
    events = r.flush().events  # type: ignore[union-attr]
    assert [e.medium for e in events] == ["GPU", "CPU"]  # type: ignore[union-attr]


def test_removal_only_for_announced_blocks() -> None:
    """Removing a block never announced (or partial, or in another medium) is suppressed."""
    r = rec()
    r.record_stored(9, None, [1])
    assert not r.record_removed(9)
    r.record_stored(1, None, toks(1))
    assert not r.record_removed(1, medium="CPU")
    assert r.record_removed(1)
    assert not r.record_removed(1)
    events = r.flush().events  # type: ignore[union-attr]
    assert events[-1] == BlockRemoved(block_hashes=[1], medium="GPU")
    assert r.stats().unknown_removals == 3


def test_removed_block_can_be_announced_again() -> None:
    """After a removal the same hash is a new block and is announced again."""
    r = rec()
    r.record_stored(1, None, toks(1))
    r.record_removed(1)
    assert r.record_stored(1, None, toks(1))
    assert len(r.flush().events) == 3  # type: ignore[union-attr]


def test_orphan_fails_closed_and_its_children_too() -> None:
    """A child whose parent was never announced is suppressed, and so are its descendants."""
    r = rec()
    assert not r.record_stored(2, 1, toks(2))
    assert not r.record_stored(3, 2, toks(3))
    assert r.flush() is None
    assert r.stats().orphan_stores == 2


def test_child_of_removed_parent_fails_closed() -> None:
    """A parent removed earlier no longer lets a child through (consumers dropped it too)."""
    r = rec()
    r.record_stored(1, None, toks(1))
    r.record_removed(1)
    assert not r.record_stored(2, 1, toks(2), medium="CPU")
    assert r.stats().orphan_stores == 1


def test_parent_held_in_another_medium_places_the_child() -> None:
    """A CPU store whose parent is held on GPU is announced: the parent rule spans media."""
    r = rec()
    r.record_stored(1, None, toks(1))
    assert r.record_stored(2, 1, toks(2), medium="CPU")


def test_chain_within_step_merges() -> None:
    """Stores continuing a chain in one step become one BlockStored with every token."""
    r = rec(lora_id=7, lora_name="ad")
    for h in (1, 2, 3):
        r.record_stored(h, h - 1 if h > 1 else None, toks(h))
    (event,) = r.flush().events  # type: ignore[union-attr]
    assert event == BlockStored(
        block_hashes=[1, 2, 3],
        parent_block_hash=None,
        token_ids=toks(1) + toks(2) + toks(3),
        block_size=BS,
        lora_id=7,
        medium="GPU",
        lora_name="ad",
    )
    assert r.stats().blocks_stored == 3 and r.stats().stored_events == 1


def test_non_chained_or_different_stores_do_not_merge() -> None:
    """A new root, another medium or another LoRA starts a new BlockStored."""
    r = rec()
    r.record_stored(1, None, toks(1))
    r.record_stored(2, None, toks(2))
    r.record_stored(3, 2, toks(3), medium="CPU")
    r.record_stored(4, 3, toks(4), medium="CPU", lora_name="x")
    events = r.flush().events  # type: ignore[union-attr]
    assert [e.block_hashes for e in events] == [[1], [2], [3], [4]]  # type: ignore[union-attr]


def test_chains_do_not_merge_across_steps() -> None:
    """Each step's batch stands alone: a chain continued next step is a new event."""
    r = rec()
    r.record_stored(1, None, toks(1))
    r.flush()
    r.record_stored(2, 1, toks(2))
    (event,) = r.flush().events  # type: ignore[union-attr]
    assert event.parent_block_hash == 1  # type: ignore[union-attr]


def test_consecutive_removals_merge_and_order_is_kept() -> None:
    """Removals merge only when consecutive and same medium; stores and removals keep order."""
    r = rec()
    for h in (1, 2, 3):
        r.record_stored(h, None, toks(h))
    r.record_removed(1)
    r.record_removed(2)
    r.record_stored(4, None, toks(4))
    r.record_removed(3)
    kinds = [(type(e).__name__, getattr(e, "block_hashes", None)) for e in r.flush().events]  # type: ignore[union-attr]
    assert kinds == [
        ("BlockStored", [1]),
        ("BlockStored", [2]),
        ("BlockStored", [3]),
        ("BlockRemoved", [1, 2]),
        ("BlockStored", [4]),
        ("BlockRemoved", [3]),
    ]


def test_clear_emits_all_blocks_cleared_and_supersedes_the_step() -> None:
    """A clear drops the step's earlier events, emits AllBlocksCleared, forgets every block."""
    r = rec()
    r.record_stored(1, None, toks(1))
    r.flush()
    r.record_stored(2, 1, toks(2))
    r.record_cleared()
    assert r.flush().events == [AllBlocksCleared()]  # type: ignore[union-attr]
    assert not r.record_removed(1)
    assert not r.record_stored(3, 2, toks(3))  # parent forgotten by the clear
    assert r.record_stored(1, None, toks(1))
    stats = r.stats()
    assert (stats.clears, stats.superseded_events, stats.orphan_stores) == (1, 1, 1)


def test_events_after_clear_in_same_step_are_kept() -> None:
    """Stores after a clear in the same step follow the AllBlocksCleared."""
    r = rec()
    r.record_cleared()
    r.record_stored(1, None, toks(1))
    events = r.flush().events  # type: ignore[union-attr]
    assert events == [
        AllBlocksCleared(),
        BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=toks(1), block_size=BS, medium="GPU"
        ),
    ]


def test_announced_view_tracks_held_blocks() -> None:
    """announced() is what a consumer holds: stores minus removals, per medium."""
    r = rec(medium=None)
    r.record_stored(1, None, toks(1))
    r.record_stored(2, 1, toks(2))
    r.record_removed(1)
    assert r.announced() == {2} and r.is_announced(2) and not r.is_announced(1)
    assert r.announced("GPU") == frozenset()

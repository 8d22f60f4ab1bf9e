"""The prefix index: one test per rule (kvevents.index._prefix)."""

from __future__ import annotations

import logging

import pytest

from kvevents.events import BlockRemoved, BlockStored
from kvevents.index._keys import block_hashes
from kvevents.index._prefix import HolderKey, PrefixIndex
from kvevents.testing.index import (
    batch,
    clear_event,
    engine_hashes,
    remove_event,
    store_event,
)

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks of 4 tokens


def make_index(**kwargs: object) -> PrefixIndex:
    index = PrefixIndex(BS, **kwargs)  # type: ignore[arg-type]
    index.register_worker("a", block_size=BS)
    index.register_worker("b", block_size=BS)
    return index


def gpu(worker: str, rank: int = 0) -> HolderKey:
    return HolderKey(worker, rank, "GPU")


def assert_empty(index: PrefixIndex) -> None:
    assert all(len(page) == 0 for page in index._pages)
    for stream in index._streams.values():
        pen = stream.orphans
        assert pen.waiting == {} and pen.blocks == {} and pen.held == 0
        for holder in stream.holders.values():
            assert len(holder.engine) == 0 and holder.dups == {} and holder.shared == {}


def test_longest_prefix_per_worker() -> None:
    """Each worker's match is the length of its cached prefix of the request."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    index.apply("b", 0, batch(store_event(PROMPT, BS, end_block=2)))
    result = index.match([*PROMPT, 1, 2, 3, 4])
    assert result.holders == {gpu("a"): 6, gpu("b"): 2}
    assert result.streams == {("a", 0): 6, ("b", 0): 2}
    assert result.request_blocks == {BS: 7}
    assert index.match([9] * 8).holders == {}


def test_match_hashes_equals_match() -> None:
    """Precomputed block hashes give the same answer as token ids."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=3)))
    by_tokens = index.match(PROMPT)
    by_hashes = index.match_hashes(block_hashes(PROMPT, BS))
    assert by_tokens.holders == by_hashes.holders == {gpu("a"): 3}


def test_no_cap_on_holders_per_block() -> None:
    """Hundreds of holders of one block are all indexed and all matched."""
    index = PrefixIndex(BS)
    workers = [f"w{i}" for i in range(300)]
    for worker in workers:
        index.apply(worker, 0, batch(store_event(PROMPT, BS, end_block=1 + len(worker) % 5)))
    result = index.match(PROMPT)
    assert len(result.holders) == 300
    assert result.streams[("w7", 0)] == 1 + len("w7") % 5
    assert len(index.holders_of(block_hashes(PROMPT, BS)[0])) == 300


def test_engine_hash_schemes_agree() -> None:
    """A vLLM-style and an SGLang-style engine holding the same tokens share our block keys."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, style="vllm")))
    index.apply("b", 0, batch(store_event(PROMPT, BS, style="sglang")))
    assert index.stats().blocks == 6
    assert index.match(PROMPT).holders == {gpu("a"): 6, gpu("b"): 6}


def test_store_continuing_a_chain_is_placed_after_its_parent() -> None:
    """A store whose parent is cached continues that prefix (not re-rooted at token 0)."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2)))
    assert index.match(PROMPT).holders == {gpu("a"): 6}
    assert index.match(PROMPT[8:]).holders == {}


def test_duplicate_stores_are_reference_counted() -> None:
    """A block stored twice stays until removed twice."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    result = index.apply("a", 0, batch(store_event(PROMPT, BS)))
    assert result.duplicate_stores == 6
    index.apply("a", 0, batch(remove_event(PROMPT, BS)))
    assert index.match(PROMPT).holders == {gpu("a"): 6}
    index.apply("a", 0, batch(remove_event(PROMPT, BS)))
    assert index.match(PROMPT).holders == {}
    assert index.stats().duplicate_stores == 6
    assert_empty(index)


def test_removal_of_unknown_block_is_counted_and_harmless() -> None:
    """Removing a block never stored changes nothing but a counter."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    result = index.apply("a", 0, batch(BlockRemoved(block_hashes=[1, 2, 3])))
    assert (result.unknown_removals, result.removed_blocks) == (3, 0)
    index.apply("b", 0, batch(remove_event(PROMPT, BS)))  # known hashes, wrong worker
    assert index.stats().unknown_removals == 9
    assert index.match(PROMPT).holders == {gpu("a"): 6}


def test_removal_in_the_middle_shortens_the_prefix() -> None:
    """Removing block 3 leaves a 3-block prefix; the holder's other blocks stay indexed."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, start_block=3, end_block=4)))
    assert index.match(PROMPT).holders == {gpu("a"): 3}
    assert index.stats().entries == 5


def test_all_blocks_cleared_drops_only_that_stream() -> None:
    """AllBlocksCleared empties one (worker, rank); other workers keep their blocks."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    index.apply("b", 0, batch(store_event(PROMPT, BS)))
    result = index.apply("a", 0, batch(clear_event()))
    assert result.clears == 1
    assert index.match(PROMPT).holders == {gpu("b"): 6}
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=1)))
    assert index.match(PROMPT).holders == {gpu("a"): 1, gpu("b"): 6}


def test_remove_worker_leaves_nothing_behind() -> None:
    """Removing workers empties every internal map and frees holder ids for reuse."""
    index = make_index()
    index.register_worker("c", block_size=BS, ranks=2)
    for worker, rank in [("a", 0), ("b", 0), ("c", 0), ("c", 1)]:
        index.apply(worker, rank, batch(store_event(PROMPT, BS)))
        index.apply(worker, rank, batch(store_event(PROMPT, BS, medium="CPU")))
    index.apply("a", 0, batch(store_event(PROMPT[:4] + [1] * 4, BS, start_block=1)))
    index.remove_worker("c", rank=1)
    assert ("c", 1) not in index.targets()
    assert index.match(PROMPT).streams == {("a", 0): 6, ("b", 0): 6, ("c", 0): 6}
    for worker in ["a", "b", "c"]:
        index.remove_worker(worker)
    assert all(len(page) == 0 for page in index._pages)
    assert index._streams == {} and index._by_id == {}
    assert index.stats().entries == 0
    index.apply("d", 0, batch(store_event(PROMPT, BS)))
    assert min(h.id for s in index._streams.values() for h in s.holders.values()) == 0


def test_orphan_is_held_then_placed_exactly_once() -> None:
    """A store whose parent is unknown waits, then lands at its true position."""
    index = make_index()
    orphaned = index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2)))
    assert orphaned.orphaned_blocks == 4 and orphaned.stored_blocks == 0
    assert index.match(PROMPT).holders == {}
    assert index.match(PROMPT[8:]).holders == {}  # never re-rooted at token 0
    placed = index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    assert placed.orphans_placed == 4
    assert index.match(PROMPT).holders == {gpu("a"): 6}
    stats = index.stats()
    assert (stats.orphans_held, stats.orphans_placed, stats.stored_blocks) == (0, 4, 6)
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))  # parent again
    assert index.stats().orphans_placed == 4
    assert index.stats().entries == 6


def test_chain_of_orphans_is_placed_in_one_go() -> None:
    """Grandchild, then child, then parent: all land once the root arrives."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=4)))
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2, end_block=4)))
    assert index.stats().orphans_held == 4
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    assert index.match(PROMPT).holders == {gpu("a"): 6}
    stats = index.stats()
    assert (stats.orphans_held, stats.orphans_placed) == (0, 4)


def test_orphan_removed_while_held_is_not_placed() -> None:
    """A held block removed before its parent arrives is never indexed; its child still is."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2)))
    result = index.apply("a", 0, batch(remove_event(PROMPT, BS, start_block=5)))
    assert (result.removed_blocks, result.unknown_removals) == (1, 0)
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    assert index.match(PROMPT).holders == {gpu("a"): 5}
    assert index.stats().entries == 5


def test_held_child_of_a_block_removed_while_held_is_still_placed() -> None:
    """Two held orphans, the first one's last block removed while held: when the root arrives
    the first is placed without that block, and the second still lands at its true position
    (it chains through the removed block, as after any eviction)."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2, end_block=4)))
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=4)))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, start_block=3, end_block=4)))
    placed = index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    assert placed.orphans_placed == 4 and index.stats().orphans_held == 0
    assert index.match(PROMPT).holders == {gpu("a"): 3}  # blocks 0-2; block 3 is gone
    assert index.snapshot()[gpu("a")] == frozenset(
        h for i, h in enumerate(engine_hashes(PROMPT, BS)) if i != 3
    )


def test_orphans_are_bounded_and_dropped_oldest_first() -> None:
    """Past the bound the oldest orphan is dropped and counted, never silently."""
    index = make_index(max_orphan_blocks=4)
    other = list(range(500, 524))
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=3)))
    index.apply("a", 0, batch(store_event(other, BS, start_block=3)))
    stats = index.stats()
    assert (stats.orphans_held, stats.orphans_dropped) == (3, 3)
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=3)))
    index.apply("a", 0, batch(store_event(other, BS, end_block=3)))
    assert index.match(PROMPT).holders == {gpu("a"): 3}
    assert index.match(other).holders == {gpu("a"): 6}


def test_reset_stream_drops_state_and_orphans() -> None:
    """reset_stream forgets one stream's blocks and held orphans (counted as dropped)."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    index.apply("a", 0, batch(store_event(list(range(900, 912)), BS, start_block=1)))
    index.apply("b", 0, batch(store_event(PROMPT, BS)))
    index.reset_stream("a", 0)
    stats = index.stats()
    assert (stats.orphans_dropped, stats.orphans_held, stats.stream_resets) == (2, 0, 1)
    assert index.match(PROMPT).holders == {gpu("b"): 6}
    index.apply("a", 0, batch(store_event(PROMPT, BS)))  # the rebuild after a reset
    assert index.match(PROMPT).holders == {gpu("a"): 6, gpu("b"): 6}


def test_child_of_a_just_evicted_parent_is_placed() -> None:
    """A store whose parent was removed a moment ago still lands after that parent."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, end_block=2)))
    result = index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2)))
    assert (result.stored_blocks, result.orphaned_blocks) == (4, 0)
    assert index.match(PROMPT).holders == {}  # blocks 0-1 are gone
    assert index.holders_of(block_hashes(PROMPT, BS)[2]) == [gpu("a")]


def test_block_size_mismatch_is_loud_and_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    """A store with another block size is skipped, counted and logged once per interval."""
    now = [0.0]
    index = make_index(clock=lambda: now[0], log_interval=10.0)
    wrong = store_event(PROMPT, 8)
    with caplog.at_level(logging.ERROR, logger="kvevents.index.prefix"):
        results = [index.apply("a", 0, batch(wrong)) for _ in range(3)]
        now[0] = 11.0
        index.apply("a", 0, batch(wrong))
    assert [r.block_size_mismatches for r in results] == [1, 1, 1]
    assert index.stats().block_size_mismatches == 4
    assert index.stats().blocks == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "worker a rank 0: BlockStored with block_size 8" in messages[0]
    assert "block_size is 4" in messages[0]
    assert index.streams()[0].block_size_mismatches == 4


def test_block_size_is_adopted_from_the_first_store() -> None:
    """An unregistered worker takes the block size of its first store, then enforces it."""
    index = PrefixIndex()
    index.apply("x", 0, batch(store_event(PROMPT, 8)))
    index.apply("x", 0, batch(store_event(PROMPT, 4)))
    assert index.stream_block_size("x", 0) == 8
    assert index.stats().block_size_mismatches == 1
    assert index.match(PROMPT).holders == {gpu("x"): 3}


def test_token_count_mismatch_is_skipped_and_counted() -> None:
    """token_ids must hold block_size tokens per block hash, else the event is skipped."""
    index = make_index()
    event = store_event(PROMPT, BS)
    bad = BlockStored(block_hashes=event.block_hashes, token_ids=PROMPT[:-1], block_size=BS)
    result = index.apply("a", 0, batch(bad, store_event(PROMPT[:4], BS)))
    assert (result.bad_events, result.stored_blocks) == (1, 1)
    assert index.stats().bad_events == 1
    assert index.streams()[0].bad_events == 1


def test_tiers_are_held_and_removed_separately() -> None:
    """GPU and CPU copies are distinct holders; a removal names its tier."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, medium="GPU")))
    index.apply("a", 0, batch(store_event(PROMPT, BS, medium="cpu")))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, start_block=3, medium="GPU")))
    result = index.match(PROMPT)
    assert result.holders == {gpu("a"): 3, HolderKey("a", 0, "CPU"): 6}
    assert result.streams == {("a", 0): 6}


def test_prefix_spanning_tiers_counts_for_the_worker() -> None:
    """Blocks 0-1 on GPU and 2-5 on CPU make a 6-block prefix for that (worker, rank)."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    index.apply("a", 0, batch(store_event(PROMPT, BS, start_block=2, medium="CPU")))
    result = index.match(PROMPT)
    assert result.holders == {gpu("a"): 2}
    assert result.streams == {("a", 0): 6}


def test_default_tier_is_gpu() -> None:
    """A store without medium and a removal with medium GPU name the same holder."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, medium="GPU")))
    assert_empty(index)


def test_ranks_are_separate_holders() -> None:
    """Each attention-DP rank of a worker is its own stream and routing target."""
    index = PrefixIndex(BS)
    index.register_worker("a", block_size=BS, ranks=2)
    index.apply("a", 1, batch(store_event(PROMPT, BS)))
    assert index.targets() == [("a", 0), ("a", 1)]
    assert index.match(PROMPT).holders == {HolderKey("a", 1, "GPU"): 6}


def test_lora_blocks_do_not_match_the_base_model() -> None:
    """Blocks stored under a LoRA adapter only match queries for that adapter."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, lora_name="fr")))
    assert index.match(PROMPT).holders == {}
    assert index.match(PROMPT, lora="fr").holders == {gpu("a"): 6}


def test_mixed_block_sizes_are_matched_each_in_their_own_blocks() -> None:
    """Workers with different block sizes are matched with hashes of their own size."""
    index = PrefixIndex()
    index.register_worker("a", block_size=4)
    index.register_worker("b", block_size=8)
    index.apply("a", 0, batch(store_event(PROMPT, 4)))
    index.apply("b", 0, batch(store_event(PROMPT, 8, end_block=2)))
    result = index.match(PROMPT)
    assert result.holders == {gpu("a"): 6, gpu("b"): 2}
    assert result.request_blocks == {4: 6, 8: 3}
    with pytest.raises(ValueError, match="pass block_size"):
        index.match_hashes([1])


def test_shared_tokens_under_two_engine_hashes_are_reference_counted() -> None:
    """Two engine hashes naming the same tokens on one holder keep the block until both go."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, salt=b"one")))
    index.apply("a", 0, batch(store_event(PROMPT, BS, salt=b"two")))
    index.apply("a", 0, batch(remove_event(PROMPT, BS, salt=b"one")))
    assert index.match(PROMPT).holders == {gpu("a"): 6}
    index.apply("a", 0, batch(remove_event(PROMPT, BS, salt=b"two")))
    assert_empty(index)


def test_reregistering_with_another_block_size_drops_the_stream() -> None:
    """Blocks hashed under the old block size cannot stay once the size changes."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS)))
    index.register_worker("a", block_size=8)
    assert index.match(PROMPT).holders == {}
    assert index.stream_block_size("a", 0) == 8


def test_snapshot_and_dump_show_engine_hashes() -> None:
    """snapshot() and dump() expose what each holder holds, by engine hash."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    expected = engine_hashes(PROMPT, BS)[:2]
    assert index.snapshot() == {gpu("a"): frozenset(expected)}
    (dumped,) = [d for d in index.dump() if d["blocks"]]
    assert dumped["worker_id"] == "a"
    assert [pair[0] for pair in dumped["blocks"]] == expected  # type: ignore[attr-defined]


def test_stream_info_reports_batches_and_tiers() -> None:
    """streams() reports per-tier block counts and the last batch timestamp."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS), ts=12.5))
    info = {(s.worker_id, s.rank): s for s in index.streams()}[("a", 0)]
    assert (info.tiers, info.batches, info.last_batch_ts, info.registered) == (
        {"GPU": 6},
        1,
        12.5,
        True,
    )


def test_bytes_per_block_is_measured_and_the_estimate_is_honest() -> None:
    """tracemalloc agrees with stats().memory_bytes, and a block costs under 200 bytes."""
    import gc
    import tracemalloc

    from kvevents.testing.index import random_worker_batches

    tracemalloc.start()
    try:
        index = PrefixIndex(16)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for worker, batches in random_worker_batches(2, 1000, blocks_per_event=16).items():
            for item in batches:
                index.apply(worker, 0, item)
        del batches, item
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stats = index.stats()
    assert stats.entries == 32000
    per_block = measured / stats.entries
    assert 0.75 * stats.bytes_per_block <= per_block <= 1.1 * stats.bytes_per_block
    assert per_block < 200


def test_batches_survive_the_wire() -> None:
    """Batches encoded and decoded by kvevents.wire index exactly like the originals."""
    from kvevents.wire import decode_batch, encode_batch

    index = make_index()
    for style, worker in [("vllm", "a"), ("sglang", "b")]:
        for item in [
            batch(store_event(PROMPT, BS, end_block=3, style=style)),  # type: ignore[arg-type]
            batch(store_event(PROMPT, BS, start_block=3, style=style)),  # type: ignore[arg-type]
            batch(remove_event(PROMPT, BS, start_block=5, style=style)),  # type: ignore[arg-type]
        ]:
            index.apply(worker, 0, decode_batch(encode_batch(item)).batch)
    assert index.match(PROMPT).holders == {gpu("a"): 5, gpu("b"): 5}


def test_holder_blocks_is_one_holders_pairs() -> None:
    """holder_blocks lists one holder's (engine hash, our hash) pairs, as dump() does."""
    index = make_index()
    index.apply("a", 0, batch(store_event(PROMPT, BS, end_block=2)))
    ours = block_hashes(PROMPT, BS)[:2]
    pairs = index.holder_blocks(gpu("a"))
    assert sorted(oh for _, oh in pairs) == sorted(ours)
    assert sorted(eh for eh, _ in pairs) == sorted(index.snapshot()[gpu("a")])
    assert index.holder_blocks(gpu("b")) == [] and index.holder_blocks(gpu("zz")) == []

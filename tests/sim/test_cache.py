"""The reference prefix cache: references, LRU eviction, the CPU tier, resets, ground truth."""

from __future__ import annotations

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.sim._cache import CPU, GPU, RankCache
from kvevents.sim._hashing import engine_chain_hashes
from kvevents.testing.engine import BlockSets, small_cache

BS = 2


def admit(cache: RankCache, tokens: list[int]) -> tuple[list[int], int] | None:
    """Run one request's prefill through the cache; None if it does not fit."""
    hashes = engine_chain_hashes(tokens, BS)
    hit = cache.acquire(hashes)
    need = -(-len(tokens) // BS) - hit.blocks
    if not cache.allocate(need):
        cache.release(hashes[: hit.blocks])
        return None
    for i in range(hit.blocks, len(hashes)):
        cache.commit(hashes[i], hashes[i - 1] if i else None, tokens[i * BS : (i + 1) * BS])
    return hashes, len(tokens) % BS and 1


def step(cache: RankCache, sets: BlockSets) -> None:
    batch = cache.recorder.flush(ts=0.0)
    if batch is not None:
        sets.apply(batch)


def test_shared_prefix_is_a_hit_and_stored_once() -> None:
    """A second request with the same prefix hits the cached blocks; nothing is re-announced."""
    cache = small_cache(8, BS)[0]
    first = admit(cache, [1, 2, 3, 4, 5])
    assert first is not None and cache.stats().stored_blocks == 2
    batch = cache.recorder.flush()
    assert batch is not None and batch.events[0].block_hashes == first[0]  # type: ignore[union-attr]
    assert cache.match(first[0]) == 2
    second = admit(cache, [1, 2, 3, 4, 9, 9])
    assert second is not None and cache.stats().gpu_hit_blocks == 2
    (event,) = cache.recorder.flush().events  # type: ignore[union-attr]
    assert event.parent_block_hash == first[0][1]  # type: ignore[union-attr]


def test_referenced_blocks_are_never_evicted() -> None:
    """With every block referenced, allocation fails instead of evicting."""
    cache = small_cache(2, BS)[0]
    assert admit(cache, [1, 2, 3, 4]) is not None
    assert not cache.allocate(1)
    assert cache.stats().failed_allocations == 1 and cache.stats().evicted_blocks == 0


def test_lru_evicts_oldest_unreferenced_tail_first() -> None:
    """Released blocks are evicted oldest first, and a request's tail before its prefix."""
    cache = small_cache(4, BS)[0]
    a = admit(cache, [1, 2, 3, 4])
    b = admit(cache, [5, 6, 7, 8])
    assert a and b
    cache.release(a[0])
    cache.release(b[0])
    cache.recorder.flush()
    assert cache.allocate(1)
    (event,) = cache.recorder.flush().events  # type: ignore[union-attr]
    assert event == BlockRemoved(block_hashes=[a[0][1]], medium=GPU)


def test_eviction_moves_blocks_to_cpu_before_removing_from_gpu() -> None:
    """A GPU eviction stores on CPU (parent first, merged), then removes from GPU."""
    cache = small_cache(2, BS, cpu_capacity_blocks=4)[0]
    a = admit(cache, [1, 2, 3, 4])
    assert a
    cache.release(a[0])
    cache.recorder.flush()
    assert cache.allocate(2)
    stored, removed = cache.recorder.flush().events  # type: ignore[union-attr]
    assert isinstance(stored, BlockStored) and stored.medium == CPU
    assert stored.block_hashes == a[0] and stored.parent_block_hash is None
    assert removed == BlockRemoved(block_hashes=[a[0][1], a[0][0]], medium=GPU)
    assert cache.cached_blocks(CPU) == set(a[0]) and cache.cached_blocks(GPU) == set()


def test_cpu_hit_loads_back_to_gpu_and_keeps_cpu_copy() -> None:
    """A prefix found on CPU is loaded to GPU (BlockStored GPU) and counted as a CPU hit."""
    cache = small_cache(2, BS, cpu_capacity_blocks=4)[0]
    a = admit(cache, [1, 2, 3, 4])
    assert a
    cache.release(a[0])
    assert cache.allocate(2)
    cache.release([], private=2)
    cache.recorder.flush()
    hit = cache.acquire(a[0])
    assert (hit.gpu_blocks, hit.cpu_blocks) == (0, 2)
    (event,) = cache.recorder.flush().events  # type: ignore[union-attr]
    assert event.medium == GPU and event.block_hashes == a[0]  # type: ignore[union-attr]
    assert cache.cached_blocks(CPU) == set(a[0])


def test_cpu_tier_drops_by_its_own_lru() -> None:
    """When the CPU tier is full, its oldest block is removed (medium CPU) to make room."""
    cache = small_cache(1, BS, cpu_capacity_blocks=1)[0]
    a = admit(cache, [1, 2])
    assert a
    cache.release(a[0])
    b = admit(cache, [3, 4])
    assert b
    cache.release(b[0])
    cache.recorder.flush()
    assert cache.allocate(1)
    events = cache.recorder.flush().events  # type: ignore[union-attr]
    assert events[0] == BlockRemoved(block_hashes=a[0], medium=CPU)
    assert cache.stats().cpu_dropped_blocks == 1


def test_reset_clears_both_tiers_only_when_idle() -> None:
    """reset() is refused while blocks are in use, and emits AllBlocksCleared when idle."""
    cache = small_cache(4, BS, cpu_capacity_blocks=2)[0]
    a = admit(cache, [1, 2, 3])
    assert a
    assert not cache.reset()
    cache.release(a[0], private=a[1])
    assert cache.reset()
    assert cache.recorder.flush().events == [AllBlocksCleared()]  # type: ignore[union-attr]
    assert cache.cached_blocks(GPU) == set() and cache.free_blocks == 4
    assert cache.stats().refused_resets == 1


def test_concurrent_duplicate_compute_is_shared() -> None:
    """Two requests computing the same block keep one copy; the second is not announced."""
    cache = small_cache(8, BS)[0]
    h = engine_chain_hashes([1, 2], BS)
    assert cache.allocate(2)
    cache.commit(h[0], None, [1, 2])
    cache.commit(h[0], None, [1, 2])
    assert cache.stats().shared_blocks == 1 and cache.free_blocks == 7
    sets = BlockSets()
    step(cache, sets)
    assert sets.blocks(0, GPU) == {h[0]} and sets.violations == []

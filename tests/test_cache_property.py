"""Property: events applied to plain sets reproduce the cache's block sets after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.cache import CPU, GPU, PrefixCache
from kvevents.hashing import chain_hashes
from kvevents.testing.engine import BlockSets

BS = 2
RANKS = 2

tokens = st.lists(st.integers(0, 2), max_size=12)
ops = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, RANKS - 1), tokens),
    st.tuples(st.just("release"), st.integers(0, 50), st.just([])),
    st.tuples(st.just("reset"), st.integers(0, RANKS - 1), st.just([])),
    st.tuples(st.just("release_all"), st.just(0), st.just([])),
)
Running = list[tuple[int, list[int], int]]


def admit(cache: PrefixCache, rank: int, toks: list[int], running: Running) -> None:
    rc = cache[rank]
    hashes = chain_hashes(toks, BS)
    hit = rc.acquire(hashes)
    if not rc.allocate(-(-len(toks) // BS) - hit.blocks):
        rc.release(hashes[: hit.blocks])
        return
    for i in range(hit.blocks, len(hashes)):
        rc.commit(hashes[i], hashes[i - 1] if i else None, toks[i * BS : (i + 1) * BS])
    running.append((rank, hashes, len(toks) % BS and 1))


def apply_op(cache: PrefixCache, op: tuple[str, int, list[int]], running: Running) -> None:
    kind, arg, toks = op
    if kind == "admit":
        admit(cache, arg, toks, running)
    elif kind == "release" and running:
        rank, hashes, private = running.pop(arg % len(running))
        cache[rank].release(hashes, private)
    elif kind == "release_all":
        while running:
            rank, hashes, private = running.pop()
            cache[rank].release(hashes, private)
    elif kind == "reset":
        cache[arg].reset()


def check(cache: PrefixCache, sets: BlockSets) -> None:
    for rank in range(RANKS):
        batch = cache[rank].recorder.flush(ts=0.0)
        if batch is not None:
            sets.apply(batch)
        for medium in (GPU, CPU):
            assert sets.blocks(rank, medium) == cache.cached_blocks(rank, medium), (rank, medium)
    assert sets.violations == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, max_size=40),
    st.integers(3, 10),
    st.sampled_from([0, 2, 5]),
    st.integers(1, 3),
)
def test_events_reproduce_ground_truth(
    workload: list[tuple[str, int, list[int]]], capacity: int, cpu: int, ops_per_step: int
) -> None:
    """After every step, per (rank, medium) sets rebuilt from events equal the cache's sets."""
    cache = PrefixCache(capacity, BS, ranks=RANKS, cpu_capacity_blocks=cpu)
    sets = BlockSets()
    running: Running = []
    for i, op in enumerate(workload):
        apply_op(cache, op, running)
        if i % ops_per_step == 0:
            check(cache, sets)
    check(cache, sets)
    for rank in range(RANKS):
        stats = cache[rank].recorder.stats()
        assert stats.orphan_stores == stats.duplicate_stores == stats.unknown_removals == 0
        assert stats.partial_blocks == 0

"""Property: whatever the workload, the engine's events rebuild its caches after every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.sim._records import Request
from kvevents.testing.engine import BlockSets

RANKS = 2
COVERAGE: list[SimulatedEngine] = []


def prompt(rng: random.Random) -> list[int]:
    base = [rng.randrange(2) for _ in range(3)] if rng.random() < 0.3 else [7, 7, 7]
    return base + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    capacity=st.integers(8, 20),
    cpu=st.sampled_from([0, 4]),
    budget=st.integers(2, 16),
    decode_blocks=st.booleans(),
)
def test_engine_events_match_ground_truth(
    seed: int, capacity: int, cpu: int, budget: int, decode_blocks: bool
) -> None:
    """Random submissions, steps and resets: per (rank, medium) sets equal the truth."""
    rng = random.Random(seed)
    cfg = EngineConfig(
        block_size=2,
        capacity_blocks=capacity,
        cpu_capacity_blocks=cpu,
        ranks=RANKS,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        cache_decode_blocks=decode_blocks,
    )
    engine = SimulatedEngine(cfg)
    sets = BlockSets()
    for i in range(80):
        if rng.random() < 0.4:
            rank = rng.choice([None, 0, 1])
            engine.submit(Request(f"r{i}", prompt(rng), rng.randrange(1, 6)), rank)
        if rng.random() < 0.05:
            engine.reset_cache(rng.choice([None, 0, 1]))
        for batch in engine.step().batches:
            sets.apply(batch)
        for rank in range(RANKS):
            for medium in ("GPU", "CPU"):
                assert sets.blocks(rank, medium) == engine.cached_blocks(rank, medium)
    assert sets.violations == []
    COVERAGE.append(engine)
    for rank in range(RANKS):
        stats = engine.recorder_stats(rank)
        assert stats.orphan_stores == stats.duplicate_stores == stats.unknown_removals == 0


def test_property_workload_covers_pressure_paths() -> None:
    """The random workloads above really preempt, evict, offload, hit and reset."""
    if not COVERAGE:
        test_engine_events_match_ground_truth()
    caches = [e.cache_stats(r) for e in COVERAGE for r in range(RANKS)]
    assert sum(e.metrics().preemptions for e in COVERAGE) > 0
    assert sum(e.metrics().cached_tokens for e in COVERAGE) > 0
    for name in ("evicted_blocks", "offloaded_blocks", "cpu_hit_blocks", "resets"):
        assert sum(getattr(c, name) for c in caches) > 0, name

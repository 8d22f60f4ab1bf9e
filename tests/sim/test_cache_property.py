"""Property: events applied to plain sets reproduce the cache's block sets after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.sim._cache import CPU, GPU, PrefixCache
from kvevents.sim._hashing import engine_chain_hashes
from kvevents.testing.engine import BlockSets

BS = 2
RANKS = 2


@dataclass
class Workload:
    """Random requests over a few shared prompts: hits, evictions, tier moves, resets."""

    cache: PrefixCache
    rng: random.Random
    sets: BlockSets = field(default_factory=BlockSets)
    running: list[tuple[int, list[int], int]] = field(default_factory=list)

    def tokens(self) -> list[int]:
        base = self.rng.randrange(4)
        prompt = [base, *(self.rng.randrange(3) for _ in range(15))]
        cut = self.rng.randrange(len(prompt) + 1)
        return prompt[:cut] + [self.rng.randrange(3) for _ in range(self.rng.randrange(4))]

    def admit(self, rank: int, toks: list[int]) -> None:
        rc = self.cache[rank]
        hashes = engine_chain_hashes(toks, BS)
        hit = rc.acquire(hashes)
        if not rc.allocate(-(-len(toks) // BS) - hit.blocks):
            rc.release(hashes[: hit.blocks])
            return
        for i in range(hit.blocks, len(hashes)):
            rc.commit(hashes[i], hashes[i - 1] if i else None, toks[i * BS : (i + 1) * BS])
        self.running.append((rank, hashes, len(toks) % BS and 1))

    def release(self, index: int) -> None:
        rank, hashes, private = self.running.pop(index)
        self.cache[rank].release(hashes, private)

    def op(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            self.admit(self.rng.randrange(RANKS), self.tokens())
        elif roll < 0.9 and self.running:
            self.release(self.rng.randrange(len(self.running)))
        elif roll < 0.97:
            while self.running:
                self.release(len(self.running) - 1)
        else:
            self.cache[self.rng.randrange(RANKS)].reset()

    def check(self) -> None:
        for rank in range(RANKS):
            batch = self.cache[rank].recorder.flush(ts=0.0)
            if batch is not None:
                self.sets.apply(batch)
            for medium in (GPU, CPU):
                truth = self.cache.cached_blocks(rank, medium)
                assert self.sets.blocks(rank, medium) == truth, (rank, medium)
        assert self.sets.violations == []


def run(seed: int, capacity: int, cpu: int, ops: int, ops_per_step: int) -> Workload:
    w = Workload(
        PrefixCache(capacity, BS, ranks=RANKS, cpu_capacity_blocks=cpu), random.Random(seed)
    )
    for i in range(ops):
        w.op()
        if i % ops_per_step == 0:
            w.check()
    w.check()
    return w


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**32),
    st.integers(4, 16),
    st.sampled_from([0, 3, 8]),
    st.integers(20, 200),
    st.integers(1, 4),
)
def test_events_reproduce_ground_truth(
    seed: int, capacity: int, cpu: int, ops: int, ops_per_step: int
) -> None:
    """After every step, per (rank, medium) sets rebuilt from events equal the cache's sets."""
    w = run(seed, capacity, cpu, ops, ops_per_step)
    for rank in range(RANKS):
        stats = w.cache[rank].recorder.stats()
        assert stats.orphan_stores == stats.duplicate_stores == stats.unknown_removals == 0
        assert stats.partial_blocks == 0


def test_workload_exercises_every_mutation() -> None:
    """The property's workload really evicts, offloads, drops from CPU, loads back and resets."""
    totals: dict[str, int] = {}
    for seed in range(10):
        w = run(seed, capacity=8, cpu=3, ops=150, ops_per_step=2)
        for rank in range(RANKS):
            for name, value in vars(w.cache[rank].stats()).items():
                totals[name] = totals.get(name, 0) + value
    for name in (
        "gpu_hit_blocks",
        "cpu_hit_blocks",
        "evicted_blocks",
        "offloaded_blocks",
        "cpu_dropped_blocks",
        "resets",
    ):
        assert totals[name] > 0, name

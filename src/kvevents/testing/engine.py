"""Fixtures for engine-side tests: a recording sink, a consumer-side block set, small caches.

- :class:`RecordingSink` stands in for a publisher: it keeps every batch and returns a sequence
  number, like ``Publisher.publish``.
- :class:`BlockSets` is the simplest possible consumer: it applies batches per
  ``(rank, medium)`` to plain sets, so a test can compare it to a cache's ground truth.
- :func:`small_cache` builds a :class:`~kvevents.sim.PrefixCache` sized for tests.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.sim import PrefixCache

__all__ = ["BlockSets", "RecordingSink", "small_cache"]


class RecordingSink:
    """A publisher stand-in that records batches; ``publish`` returns the batch's seq."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> int:
        self.batches.append(batch)
        return len(self.batches) - 1

    def events(self) -> list[object]:
        """Every event of every recorded batch, in order."""
        return [event for batch in self.batches for event in batch.events]


class BlockSets:
    """A consumer's view: block hashes per ``(rank, medium)`` rebuilt from events alone.

    Stores of a hash already held, stores whose parent is not held (in any medium of the
    rank), token counts that do not match, and removals of a hash not held are recorded as
    violations instead of raising, so a test can assert that a producer never sends them.
    """

    def __init__(self) -> None:
        self.sets: dict[tuple[int | None, str | None], set[int]] = {}
        self.violations: list[str] = []

    def apply(self, batch: KVEventBatch) -> None:
        rank = batch.data_parallel_rank
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(rank, event)
            elif isinstance(event, BlockRemoved):
                self._remove(rank, event)
            elif isinstance(event, AllBlocksCleared):
                for key in [k for k in self.sets if k[0] == rank]:
                    del self.sets[key]

    def apply_all(self, batches: Iterable[KVEventBatch]) -> None:
        for batch in batches:
            self.apply(batch)

    def blocks(self, rank: int | None, medium: str | None) -> set[int]:
        return self.sets.get((rank, medium), set())

    def _store(self, rank: int | None, event: BlockStored) -> None:
        held = self.sets.setdefault((rank, event.medium), set())
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            self.violations.append(f"rank {rank}: token count of {event.block_hashes}")
        parent = event.parent_block_hash
        if parent is not None and not any(
            parent in held for key, held in self.sets.items() if key[0] == rank
        ):
            self.violations.append(f"rank {rank}: parent {parent} of {event.block_hashes} unheld")
        for h in event.block_hashes:
            if h in held:
                self.violations.append(f"rank {rank}: {h} stored twice in {event.medium}")
            held.add(h)

    def _remove(self, rank: int | None, event: BlockRemoved) -> None:
        held = self.sets.setdefault((rank, event.medium), set())
        for h in event.block_hashes:
            if h not in held:
                self.violations.append(f"rank {rank}: {h} removed from {event.medium} unheld")
            held.discard(h)


def small_cache(
    capacity_blocks: int = 8,
    block_size: int = 4,
    *,
    ranks: int = 1,
    cpu_capacity_blocks: int = 0,
) -> PrefixCache:
    """A cache small enough that a short test exercises eviction and tier moves."""
    return PrefixCache(
        capacity_blocks, block_size, ranks=ranks, cpu_capacity_blocks=cpu_capacity_blocks
    )

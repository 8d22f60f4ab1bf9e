"""Honest yardsticks for a routing evaluation: how much reuse was there to win at all?

Every policy's prefix reuse is printed next to two references computed from the same trace
and cluster shape (docs/evaluation.md):

- **infinite cache** (an upper bound): every block any earlier request computed is still
  cached somewhere and the request goes where it is. No router over finite caches beats it.
- **pooled cache** (the reference a router is measured against): one engine holding the whole
  cluster's cache (every rank's blocks, step budgets and sequence slots added up) serves the
  trace. Eviction still happens, but nothing is lost to splitting the cache between engines,
  so it is what a perfect router over the same total memory would get, up to scheduling.

Both count cached tokens the way the engines do: whole blocks of the prompt's tokens but its
last (the last token is always computed, so a block-aligned prompt found whole in cache still
computes its last block), requests that cannot fit skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvevents._types import Document
from kvevents.sim._cluster import ClusterConfig
from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.sim._trace import TraceRow, row_tokens, trace_request

__all__ = ["Yardsticks", "infinite_cache_reuse", "pooled_cache_reuse", "yardsticks"]


@dataclass(frozen=True)
class Yardsticks:
    """Reuse (cached over input prompt tokens) of the two references on one trace."""

    infinite_cache: float
    pooled_cache: float

    def to_dict(self) -> Document:
        return {"infinite_cache": self.infinite_cache, "pooled_cache": self.pooled_cache}


def _arrival_order(rows: Sequence[TraceRow]) -> list[int]:
    return sorted(range(len(rows)), key=lambda i: rows[i].timestamp)


def _fits(row: TraceRow, config: ClusterConfig) -> bool:
    """Whether one rank of the cluster can hold the request (else every policy rejects it)."""
    blocks = -(-(row.input_length + max(1, row.output_length)) // config.block_size)
    return blocks <= config.capacity_blocks


def infinite_cache_reuse(rows: Sequence[TraceRow], config: ClusterConfig) -> float:
    """Reuse if every full block computed before a request were still cached."""
    engine = SimulatedEngine(config.engine_config())
    seen: set[int] = set()
    cached = total = 0
    for i in _arrival_order(rows):
        if not _fits(rows[i], config):
            continue
        tokens = row_tokens(rows[i])
        hashes = engine.block_hashes(tokens)
        hittable = (len(tokens) - 1) // config.block_size
        hit = 0
        while hit < hittable and hashes[hit] in seen:
            hit += 1
        cached += hit * config.block_size
        total += len(tokens)
        seen.update(hashes)
    return cached / total if total else 0.0


def pooled_config(config: ClusterConfig) -> EngineConfig:
    """One rank with the cluster's total cache, step budget and sequence slots."""
    per_engine = config.engine_config()
    ranks = config.workers * config.ranks
    return EngineConfig(
        block_size=config.block_size,
        capacity_blocks=config.capacity_blocks * ranks,
        cpu_capacity_blocks=config.cpu_capacity_blocks * ranks,
        ranks=1,
        max_num_batched_tokens=config.max_num_batched_tokens * ranks,
        max_num_seqs=per_engine.max_num_seqs * ranks,
    )


def pooled_cache_reuse(rows: Sequence[TraceRow], config: ClusterConfig) -> float:
    """Reuse of one engine holding the whole cluster's cache, serving the same trace."""
    engine = SimulatedEngine(pooled_config(config))
    for i in _arrival_order(rows):
        if not _fits(rows[i], config):
            continue
        while engine.has_work() and engine.now < rows[i].arrival:
            engine.step()
        engine.advance_to(rows[i].arrival)
        engine.submit(trace_request(rows[i], i))
    while engine.has_work():
        engine.step()
    metrics = engine.metrics()
    cached = metrics.cached_tokens + metrics.cpu_cached_tokens
    return cached / metrics.input_tokens if metrics.input_tokens else 0.0


def yardsticks(rows: Sequence[TraceRow], config: ClusterConfig) -> Yardsticks:
    """Both references for ``rows`` on a cluster shaped like ``config``."""
    return Yardsticks(infinite_cache_reuse(rows, config), pooled_cache_reuse(rows, config))

"""Sweeps of the routing evaluation over cluster sizes and cache sizes.

A policy that wins on one shape can lose on another: :func:`sweep` runs every policy, and the
pooled-cache reference, for each (engines, cache) pair on the same rows, so the report and the
chart (:func:`~kvevents.sim.sweep_svg`) show where each policy stands against the
reference as the cluster grows and the cache shrinks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvevents._types import Document
from kvevents.sim._simulate import SimulationConfig, run_policy
from kvevents.sim._trace import TraceRow
from kvevents.sim._yardsticks import pooled_cache_reuse

__all__ = ["SweepPoint", "format_sweep", "sweep", "sweep_series"]


@dataclass(frozen=True)
class SweepPoint:
    """One policy on one cluster shape."""

    engines: int
    capacity_blocks: int
    policy: str
    reuse: float
    pooled_reuse: float  #: the pooled-cache reference on the same shape
    balance: float  #: max over mean requests per engine
    ttft_p50: float | None
    ttft_p99: float | None

    @property
    def ratio_to_pooled(self) -> float:
        return self.reuse / self.pooled_reuse if self.pooled_reuse else 0.0

    def to_dict(self) -> Document:
        return {**self.__dict__, "ratio_to_pooled": self.ratio_to_pooled}


def sweep(
    rows: Sequence[TraceRow],
    policies: Sequence[str],
    base: SimulationConfig,
    *,
    engines: Sequence[int] = (4, 8, 16),
    capacities: Sequence[int] = (4096, 16384),
    progress: Callable[[str], None] | None = None,
) -> list[SweepPoint]:
    """Every policy on every (engines, capacity) shape, each on a fresh cluster."""
    points = []
    for count in engines:
        for capacity in capacities:
            cluster = replace(base.cluster, workers=count, capacity_blocks=capacity)
            config = replace(base, cluster=cluster)
            pooled = pooled_cache_reuse(rows, cluster)
            for policy in policies:
                if progress is not None:
                    progress(f"{count} engines x {capacity} blocks: {policy}")
                report = run_policy(rows, policy, config)
                points.append(
                    SweepPoint(
                        count,
                        capacity,
                        policy,
                        report.reuse,
                        pooled,
                        report.balance,
                        report.ttft_p50,
                        report.ttft_p99,
                    )
                )
    return points


def sweep_series(points: Sequence[SweepPoint]) -> dict[str, list[tuple[int, float]]]:
    """Reuse against engine count, one series per (policy, cache) and per cache's reference."""
    series: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        series.setdefault(f"{p.policy}, {p.capacity_blocks} blocks", []).append(
            (p.engines, p.reuse)
        )
        ref = series.setdefault(f"pooled cache, {p.capacity_blocks} blocks", [])
        if (p.engines, p.pooled_reuse) not in ref:
            ref.append((p.engines, p.pooled_reuse))
    return series


def format_sweep(points: Sequence[SweepPoint], *, markdown: bool = False) -> str:
    """One row per point: shape, policy, reuse, its share of the pooled reference, balance."""
    header = [
        "engines",
        "blocks/engine",
        "policy",
        "reuse",
        "pooled ref",
        "vs pooled",
        "max/mean requests",
        "TTFT p50 / p99 ms",
    ]
    rows = [header] + [
        [
            str(p.engines),
            str(p.capacity_blocks),
            p.policy,
            f"{p.reuse:.1%}",
            f"{p.pooled_reuse:.1%}",
            f"{p.ratio_to_pooled:.1%}",
            f"{p.balance:.2f}",
            f"{_ms(p.ttft_p50)} / {_ms(p.ttft_p99)}",
        ]
        for p in points
    ]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "---|" * len(header))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"

"""Every policy on one trace, compared with the oracle: the routing evaluation's report.

:func:`evaluate` runs :func:`~kvevents.sim.run_policy` once per policy, each on a fresh
cluster built from the same :class:`~kvevents.sim.SimulationConfig`, and
:func:`format_table` renders the result for a terminal or a Markdown file.

The default cluster (8 workers, blocks of 64 tokens, 16,384 blocks = 1 Mi tokens per rank,
8,192 tokens per step) is sized so routing matters on the Mooncake synthetic trace: its
43,924 distinct 512-token blocks are 22.5 M tokens, and the whole cluster caches 8.4 M of
them, so a request's prefix is reused only where the router sent its earlier turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvevents._types import Document
from kvevents.sim._simulate import (
    POLICY_NAMES,
    PolicyReport,
    Progress,
    SimulationConfig,
    run_policy,
)
from kvevents.sim._trace import TraceRow
from kvevents.sim._yardsticks import Yardsticks, yardsticks

__all__ = [
    "Evaluation",
    "evaluate",
    "format_table",
]


@dataclass(frozen=True)
class Evaluation:
    """Reports of several policies on the same rows and cluster shape."""

    rows: int
    config: SimulationConfig
    reports: tuple[PolicyReport, ...]
    yardsticks: Yardsticks | None = None

    def report(self, policy: str) -> PolicyReport | None:
        for report in self.reports:
            if report.policy == policy:
                return report
        return None

    def ratio_to_oracle(self, policy: str) -> float | None:
        """A policy's reuse over the oracle's (None without an oracle run or reuse)."""
        mine, oracle = self.report(policy), self.report("oracle")
        if mine is None or oracle is None or not oracle.reuse:
            return None
        return mine.reuse / oracle.reuse

    def ratio_to_pooled(self, policy: str) -> float | None:
        """A policy's reuse over the pooled-cache reference's (None without yardsticks)."""
        mine = self.report(policy)
        if mine is None or self.yardsticks is None or not self.yardsticks.pooled_cache:
            return None
        return mine.reuse / self.yardsticks.pooled_cache

    def to_dict(self) -> Document:
        cluster = self.config.cluster
        return {
            "rows": self.rows,
            "yardsticks": None if self.yardsticks is None else self.yardsticks.to_dict(),
            "config": {
                "workers": cluster.workers,
                "ranks": cluster.ranks,
                "block_size": cluster.block_size,
                "capacity_blocks": cluster.capacity_blocks,
                "max_num_batched_tokens": cluster.max_num_batched_tokens,
                "transport": cluster.transport,
                "drop_rate": cluster.drop_rate,
                "seed": self.config.seed,
                "staleness": self.config.staleness,
                "check_every": self.config.check_every,
            },
            "policies": {
                r.policy: {
                    **r.to_dict(),
                    "ratio_to_oracle": self.ratio_to_oracle(r.policy),
                    "ratio_to_pooled": self.ratio_to_pooled(r.policy),
                }
                for r in self.reports
            },
        }


def evaluate(
    rows: Sequence[TraceRow],
    policies: Sequence[str] = POLICY_NAMES,
    config: SimulationConfig | None = None,
    *,
    progress: Progress | None = None,
    with_yardsticks: bool = True,
) -> Evaluation:
    """Run each of ``policies`` over ``rows`` on its own fresh cluster, and (unless told not
    to) the infinite-cache bound and the pooled-cache reference on the same rows."""
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICY_NAMES)}")
    config = config or SimulationConfig()
    reports = tuple(run_policy(rows, p, config, progress=progress) for p in policies)
    marks = yardsticks(rows, config.cluster) if with_yardsticks else None
    return Evaluation(len(rows), config, reports, marks)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _row(ev: Evaluation, r: PolicyReport) -> list[str]:
    acc = r.accuracy
    counts = r.per_target.values()
    return [
        r.policy,
        str(r.requests),
        str(r.rejected),
        f"{r.reuse:.1%}",
        _pct(ev.ratio_to_pooled(r.policy)),
        _pct(ev.ratio_to_oracle(r.policy)),
        f"{_ms(r.ttft_mean)} / {_ms(r.ttft_p50)} / {_ms(r.ttft_p99)}",
        f"{min(counts, default=0)}-{max(counts, default=0)} ({r.balance:.2f})",
        f"{r.busy_balance:.2f}",
        f"{acc.exact_holders}/{len(acc.holders)} exact, P {acc.precision:.3f} R {acc.recall:.3f}"
        + (f", {r.exact_checks}/{r.checks} checks" if r.checks else ""),
        f"{r.feed.gaps}/{r.feed.replays}/{r.feed.unrecoverable}",
        f"{r.wall_seconds:.1f}",
    ]


_HEADERS = [
    "policy",
    "requests",
    "rejected",
    "prefix reuse",
    "vs pooled",
    "vs oracle",
    "TTFT ms mean / p50 / p99",
    "requests per worker (max/mean)",
    "busy max/mean",
    "index fidelity (holders)",
    "gaps/replays/lost",
    "wall s",
]


def _yardstick_rows(ev: Evaluation) -> list[list[str]]:
    """The references as rows of their own: reuse only, every other cell blank."""
    if ev.yardsticks is None:
        return []
    pooled = ev.yardsticks.pooled_cache
    marks = [("bound: infinite cache", ev.yardsticks.infinite_cache), ("ref: pooled cache", pooled)]
    return [
        [name, "", "", f"{reuse:.1%}", _pct(reuse / pooled if pooled else None)]
        + [""] * (len(_HEADERS) - 5)
        for name, reuse in marks
    ]


def format_table(ev: Evaluation, *, markdown: bool = False) -> str:
    """One line per policy; ``markdown`` gives a GitHub table."""
    cells = [_HEADERS, *(_row(ev, r) for r in ev.reports), *_yardstick_rows(ev)]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "|".join("---" for _ in _HEADERS) + "|")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADERS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )

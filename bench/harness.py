"""Tiny benchmark harness: rows of figures with an optional same-run baseline and ratio."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One figure. ``baseline`` is measured in the same run; ``ratio`` = value / baseline."""

    section: str
    case: str
    metric: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    target: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline  # type: ignore[operator]


def throughput(fn: Callable[[], object], *, min_time: float = 0.3, repeat: int = 3) -> float:
    """Calls per second of ``fn``: the best of ``repeat`` runs of at least ``min_time`` each."""
    best = 0.0
    for _ in range(repeat):
        n = 0
        start = time.perf_counter()
        elapsed = 0.0
        while elapsed < min_time:
            for _ in range(64):
                fn()
            n += 64
            elapsed = time.perf_counter() - start
        best = max(best, n / elapsed)
    return best


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``samples``."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")

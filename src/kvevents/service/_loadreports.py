"""Load reports kept for the router, each for a bounded time. Pure: no sockets, no clock of its own.

Engines (or a sidecar next to them) report each (worker, rank)'s load with ``POST /load``; the
service's :class:`~kvevents.index.Router` reads it from its
:class:`~kvevents.index.LoadBook`. A report is trusted for ``ttl`` seconds only: a
reporter that died must not pin its worker as busy (or as idle, at the load it last had) for
ever. After ``ttl`` without a new report the target's load is dropped, and it routes as idle.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvevents.events import StreamKey
from kvevents.index import LoadBook

__all__ = ["DEFAULT_LOAD_TTL", "LoadLedger", "LoadReport"]

#: Seconds a load report counts for: a reporter sending every second or two misses a few
#: reports before its load is dropped.
DEFAULT_LOAD_TTL = 10.0


@dataclass(frozen=True)
class LoadReport:
    """One target's load, in KV blocks (the terms of :class:`~kvevents.index.Load`)."""

    worker_id: str
    rank: int
    queued_blocks: int
    active_blocks: int


class LoadLedger:
    """When each target's load was reported; drops those older than ``ttl`` from ``book``.

    Not thread-safe: the service calls it under its lock.
    """

    def __init__(
        self,
        book: LoadBook,
        ttl: float = DEFAULT_LOAD_TTL,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"load ttl must be > 0 seconds, got {ttl}")
        self.book = book
        self.ttl = ttl
        self._clock = clock if clock is not None else time.monotonic
        # In report order, oldest first: expiry pops from the front and stops at the first
        # fresh one, so a query pays for what expired, not for every target.
        self._reported: OrderedDict[StreamKey, float] = OrderedDict()

    def apply(self, report: LoadReport) -> None:
        """Set the target's load and restart its time to live."""
        target = (report.worker_id, report.rank)
        self._reported[target] = self._clock()
        self._reported.move_to_end(target)
        self.book.set(
            report.worker_id,
            report.rank,
            queued_blocks=report.queued_blocks,
            active_blocks=report.active_blocks,
        )

    def expire(self) -> int:
        """Drop the loads reported more than ``ttl`` seconds ago; how many were dropped."""
        if not self._reported:
            return 0
        cutoff = self._clock() - self.ttl
        dropped = 0
        while self._reported:
            target, at = next(iter(self._reported.items()))
            if at > cutoff:
                break
            del self._reported[target]
            self.book.remove(*target)
            dropped += 1
        return dropped

    def forget(self, worker_id: str, rank: int | None = None) -> None:
        """Stop tracking a worker's (or one rank's) reports (it was unregistered)."""
        for target in [t for t in self._reported if t[0] == worker_id and rank in (None, t[1])]:
            del self._reported[target]

    def reported(self) -> dict[StreamKey, float]:
        """Each tracked target's report time, by the ledger's clock."""
        return dict(self._reported)

"""The index service's read views: health, workers with their streams, holders, dumps.

:class:`ServiceViews` is a base of :class:`kvevents.service.core.IndexService`: the views
read the state the service keeps (declared here, set by the service) and take its lock for
as short a time as a copy needs. Nothing here changes that state, except that reading the
loads drops the expired ones, as every read of them does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec

from kvevents.index.prefix import HolderKey, IndexStats, PrefixIndex
from kvevents.index.router import Router
from kvevents.service.feed import Feed, WorkerRegistration
from kvevents.service.loadreports import LoadLedger
from kvevents.service.state import Persisted
from kvevents.subscribe.streams import FeedHealth, StreamKey, StreamStats

__all__ = ["ServiceViews", "builtins"]


class ServiceViews:
    """Read-only views over an index service's state (a base class of ``IndexService``)."""

    index: PrefixIndex
    router: Router
    lock: threading.Lock
    _workers: dict[str, WorkerRegistration]
    _loads: LoadLedger
    _counts: dict[str, int]
    _consumer_error: str | None
    _persisted: Persisted

    @property
    def feed(self) -> Feed:
        raise NotImplementedError  # the service's own

    def index_stats(self) -> IndexStats:
        with self.lock:
            return self.index.stats()

    def health(self) -> FeedHealth:
        """Whether the feed is serving: the feed's own health, ``"dead"`` when the service's
        consumer thread stopped on a feed error, ``"starting"`` while it registers the workers
        of its state file again (serving only some of them would look healthy)."""
        if self._consumer_error is not None:
            return FeedHealth("dead", False, 0.0, self._consumer_error)
        progress = self._persisted.restore_progress
        if progress is not None:
            why = f"restoring the state file: {progress[0]} of {progress[1]} workers registered"
            return FeedHealth("starting", True, 0.0, why)
        return self.feed.health()

    def stream_health(self) -> dict[StreamKey, StreamStats]:
        """The feed's per-stream stats."""
        return self.feed.stream_stats()

    def workers(self) -> list[WorkerRegistration]:
        return list(self._workers.values())

    def workers_view(self) -> list[dict[str, Any]]:
        """Workers with their per-rank index state, stream health and reported load
        (``GET /workers``)."""
        with self.lock:
            streams = {(s.worker_id, s.rank): s for s in self.index.streams()}
            degraded = dict(self.router.degraded)
            self._counts["loads_expired"] += self._loads.expire()
            loads = self.router.loads.snapshot()
        health = self.stream_health()
        now = time.time()
        out = []
        for reg in list(self._workers.values()):
            ranks = []
            for rank in reg.ranks:
                info = streams.get((reg.worker_id, rank))
                row: dict[str, Any] = {"rank": rank}
                if info is not None:
                    row.update(builtins(info))
                    last = info.last_batch_ts
                    row["lag_seconds"] = None if last is None else max(0.0, now - last)
                row["stream"] = builtins(health.get((reg.worker_id, rank)))
                row["degraded"] = degraded.get((reg.worker_id, rank))
                load = loads.get((reg.worker_id, rank))
                row["load"] = None if load is None else load._asdict()  # None: no report
                ranks.append(row)
            own = [e._asdict() for e in reg.own_endpoints]
            out.append({**builtins(reg), "ranks": ranks, "own_endpoints": own})
        return out

    def holders(self) -> list[tuple[HolderKey, int | None]]:
        """Every holder with its stream's block size, taken under the lock (cheap)."""
        with self.lock:
            return [
                (HolderKey(s.worker_id, s.rank, tier), s.block_size)
                for s in self.index.streams()
                for tier in s.tiers
            ]

    def holder_blocks(self, key: HolderKey) -> list[tuple[int, int]]:
        """One holder's ``(engine_hash, our_hash)`` pairs, copied under the lock.

        The lock is held for one holder's copy (about 0.2 s per million blocks in C), not for
        a walk of the whole index, and nothing is encoded under it.
        """
        with self.lock:
            return _holder_pairs(self.index, key)

    def dump(self) -> dict[str, Any]:
        """Every holder's blocks and the index stats, in memory (``GET /dump`` streams it)."""
        holders = [
            {**_holder_header(key, size), "blocks": [list(p) for p in self.holder_blocks(key)]}
            for key, size in self.holders()
        ]
        return {"holders": holders, "stats": builtins(self.index_stats())}


def _holder_header(key: HolderKey, block_size: int | None) -> dict[str, Any]:
    return {
        "worker_id": key.worker_id,
        "rank": key.rank,
        "tier": key.tier,
        "block_size": block_size,
    }


def _holder_pairs(index: PrefixIndex, key: HolderKey) -> list[tuple[int, int]]:
    # The index has no per-holder accessor; its dump() walks every holder in one go, which
    # would hold the service lock for seconds on a large index. Reading one holder's table
    # here keeps each hold short. (To move into PrefixIndex as a public method.)
    stream = index._streams.get((key.worker_id, key.rank))
    holder = None if stream is None else stream.holders.get(key.tier)
    return [] if holder is None else holder.engine.items()


def builtins(value: Any) -> Any:
    """Dataclasses, structs and named tuples as plain JSON-ready values."""
    return msgspec.to_builtins(value, builtin_types=None, str_keys=True)

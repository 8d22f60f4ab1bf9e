"""The index service's read views as JSON-ready rows: workers with their streams, holders.

Pure functions of what :class:`~kvevents.service.IndexService` copies under its lock
(its registrations, the index's stream records, the feed's stream stats, the router's marks
and loads): nothing here takes a lock or changes state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.index import HolderKey, Load, StreamInfo
from kvevents.service._feed import WorkerRegistration
from kvevents.subscribe import StreamStats

__all__ = ["builtins", "holder_header", "worker_rows"]


def worker_rows(
    workers: Iterable[WorkerRegistration],
    streams: Mapping[StreamKey, StreamInfo],
    health: Mapping[StreamKey, StreamStats],
    degraded: Mapping[StreamKey, str],
    loads: Mapping[StreamKey, Load],
    now: float,
) -> list[Document]:
    """``GET /workers``: each worker with, per rank, its index state, stream health, degraded
    mark and reported load (None: no report)."""
    out = []
    for reg in workers:
        ranks = []
        for rank in reg.ranks:
            key = (reg.worker_id, rank)
            row: Document = {"rank": rank}
            info = streams.get(key)
            if info is not None:
                row.update(builtins(info))
                last = info.last_batch_ts
                row["lag_seconds"] = None if last is None else max(0.0, now - last)
            row["stream"] = builtins(health.get(key))
            row["degraded"] = degraded.get(key)
            load = loads.get(key)
            # The terms a load report sets (POST /load); pinned blocks are a front door's own.
            row["load"] = None if load is None else _reported(load)
            ranks.append(row)
        own = [e._asdict() for e in reg.own_endpoints]
        out.append({**builtins(reg), "ranks": ranks, "own_endpoints": own})
    return out


def _reported(load: Load) -> Document:
    return {
        "queued_blocks": load.queued_blocks,
        "active_blocks": load.active_blocks,
        "requests": load.requests,
    }


def holder_header(key: HolderKey, block_size: int | None) -> Document:
    """A holder's fields in a dump, without its blocks."""
    return {
        "worker_id": key.worker_id,
        "rank": key.rank,
        "tier": key.tier,
        "block_size": block_size,
    }


def builtins(value: object) -> Any:  # plain JSON-ready values of the record's shape
    """Dataclasses, structs and named tuples as plain JSON-ready values."""
    return msgspec.to_builtins(value, builtin_types=None, str_keys=True)

"""Trimming the stream: only below what the newest snapshot covers and every live replica
has acknowledged.

A message may go once a replica starting now would not need it (it loads the newest
snapshot, and reads from the sequence after it) and no running replica still has to apply it
(each one's durable consumer acknowledges what it applied; the server deletes the consumer of
a replica that stopped fetching after ``inactive_threshold``). So the stream is purged below
``min(newest snapshot, every consumer's acknowledged floor) + 1``.

No lock is taken. Each replica computes that bound from what the server says now, and a
purge below a bound only removes what a later, higher bound would remove too: two replicas
purging at once both purge safely, the later one possibly a little less. A replica starting
while another trims checks, after creating its consumer, that the stream still begins at or
before its start, and loads the newer snapshot if not (:meth:`Replica._subscribe`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvevents.scaleout.jetstream import JetStreamOptions

__all__ = ["newest_snapshots", "trim", "trim_point"]

log = logging.getLogger("kvevents.scaleout.retention")


async def newest_snapshots(store: Any) -> list[tuple[str, int]]:
    """Snapshots in the bucket as ``(name, seq)``, newest first (empty when none)."""
    from nats.js.errors import NotFoundError

    try:
        infos = await store.list(ignore_deletes=True)
    except NotFoundError:
        return []
    found = []
    for info in infos:
        try:
            seq = int(json.loads(info.description or "{}")["seq"])
        except (ValueError, KeyError, TypeError):
            continue  # not ours
        found.append((info.name, seq))
    return sorted(found, key=lambda item: -item[1])


def trim_point(snapshot_seq: int, ack_floors: list[int]) -> int:
    """The first sequence to keep: the one after what the snapshot and every replica cover."""
    return min([snapshot_seq, *ack_floors]) + 1


async def trim(js: Any, store: Any, options: JetStreamOptions) -> bool:
    """Purge the stream below :func:`trim_point`; True when something was purged."""
    snapshots = await newest_snapshots(store)
    if not snapshots:
        return False
    floors = [c.ack_floor.stream_seq or 0 for c in await js.consumers_info(options.stream)]
    keep = trim_point(snapshots[0][1], floors)
    first = (await js.stream_info(options.stream)).state.first_seq
    if keep <= first:
        return False
    await js.purge_stream(options.stream, seq=keep)
    log.info("stream %s trimmed below seq %d", options.stream, keep)
    return True

"""Trimming the stream: only below what a snapshot just saved covers and every live replica
has acknowledged.

A message may go once a replica starting now would not need it (it loads the newest
snapshot, and reads from the sequence after it) and no running replica still has to apply it
(each one's durable consumer acknowledges what it applied; the server deletes the consumer of
a replica that stopped fetching after ``inactive_threshold``). So after saving a snapshot a
replica purges the stream below ``min(that snapshot, every consumer's acknowledged floor) + 1``:
its own snapshot, just written whole, never another one's description it has not read (the
newest may be unreadable, or of another stream sharing the bucket).

No lock is taken. Each replica computes that bound from what the server says now, and a
purge below a bound only removes what a later, higher bound would remove too: two replicas
purging at once both purge safely, the later one possibly a little less. A replica starting
while another trims checks, after creating its consumer, that the stream still begins at or
before its start, and loads the newer snapshot if not (:meth:`Replica._subscribe`).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from kvevents.scaleout._jetstream import JetStreamOptions

if TYPE_CHECKING:
    from nats.js.api import ConsumerInfo
    from nats.js.object_store import ObjectStore

__all__ = ["ack_floor", "newest_snapshots", "trim", "trim_point"]

log = logging.getLogger("kvevents.scaleout.retention")


async def newest_snapshots(store: ObjectStore, stream: str) -> list[tuple[str, int]]:
    """Snapshots of ``stream`` in the bucket as ``(name, seq)``, newest first (empty when none).

    Replicas of several streams may share a bucket: a snapshot is ``stream``'s when its
    description names it or, for one saved before descriptions named their stream, when its
    object is ``<stream>.<replica>`` (stream and replica names hold no ``.``).
    """
    from nats.js.errors import NotFoundError

    try:
        infos = await store.list(ignore_deletes=True)
    except NotFoundError:
        return []
    found = []
    for info in infos:
        described = _described(info.description)
        if described is None:
            continue  # not ours
        seq, owner = described
        if (owner or str(info.name).split(".", 1)[0]) == stream:
            found.append((info.name, seq))
    return sorted(found, key=lambda item: -item[1])


def _described(description: str | None) -> tuple[int, str | None] | None:
    """The ``(seq, stream)`` a snapshot's description gives, None if it is not one."""
    try:
        about = json.loads(description or "{}")
        seq = int(about["seq"])
        owner = about.get("stream")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return seq, owner if isinstance(owner, str) else None


def trim_point(snapshot_seq: int, ack_floors: list[int]) -> int:
    """The first sequence to keep: the one after what the snapshot and every replica cover."""
    return min([snapshot_seq, *ack_floors]) + 1


def ack_floor(consumer: ConsumerInfo) -> int:
    """The stream sequence ``consumer`` has acknowledged up to; 0 where the server did not
    say (nats-py's ``ack_floor`` is optional): such a consumer keeps the whole stream rather
    than fail every trim."""
    floor = consumer.ack_floor
    return floor.stream_seq if floor is not None and floor.stream_seq > 0 else 0


# nats-py's JetStream context, untyped here.
async def trim(js: Any, options: JetStreamOptions, saved_seq: int) -> bool:
    """Purge the stream below :func:`trim_point` of ``saved_seq`` (the snapshot this replica
    just saved); True when something was purged."""
    floors = [ack_floor(c) for c in await js.consumers_info(options.stream)]
    keep = trim_point(saved_seq, floors)
    first = (await js.stream_info(options.stream)).state.first_seq
    if keep <= first:
        return False
    await js.purge_stream(options.stream, seq=keep)
    log.info("stream %s trimmed below seq %d", options.stream, keep)
    return True

"""A router replica's records: its options, its stats, and the feed its service is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvevents.scaleout.cursor import DEFAULT_WINDOW
from kvevents.subscribe.streams import (
    FeedHealth,
    StreamKey,
    StreamSpec,
    StreamStats,
    SubscriberStats,
)

__all__ = ["JetStreamFeed", "ReplicaOptions", "ReplicaStats"]


@dataclass(frozen=True)
class ReplicaOptions:
    """``name``: the replica's durable consumer (unique per replica); ``snapshot_batches``
    and ``snapshot_interval``: save a snapshot after that many applied messages or seconds
    (0 turns either off); ``trim``: trim the stream after each snapshot; ``fetch``: messages
    per fetch; ``fetch_timeout``: seconds a fetch waits for messages on a quiet stream;
    ``inactive_threshold``: seconds after which the server deletes the consumer of a replica
    that stopped fetching (it then no longer holds the stream back); ``window``: batches
    remembered per stream to drop late copies (:mod:`kvevents.scaleout.cursor`);
    ``stall_after``: seconds one turn of the consume loop may last before ``health()`` says
    ``stalled``; ``restart_delay``: seconds before a consume loop that ended is started
    again."""

    name: str = "replica"
    snapshot_batches: int = 100_000
    snapshot_interval: float = 60.0
    trim: bool = True
    fetch: int = 512
    inactive_threshold: float = 30.0
    window: int = DEFAULT_WINDOW
    start_timeout: float = 30.0
    fetch_timeout: float = 0.5
    stall_after: float = 30.0
    restart_delay: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ". *>\t"):
            raise ValueError(
                f"name must be a plain token (no '.', '*', '>', spaces): {self.name!r}"
            )
        if self.fetch < 1 or self.snapshot_batches < 0 or self.snapshot_interval < 0:
            raise ValueError("fetch must be >= 1, snapshot_batches and snapshot_interval >= 0")
        if min(self.fetch_timeout, self.stall_after, self.restart_delay) <= 0 or self.window < 1:
            raise ValueError(
                "fetch_timeout, stall_after and restart_delay must be > 0, window >= 1"
            )


@dataclass(frozen=True)
class ReplicaStats:
    """What the replica read. ``applied``: batches applied; ``duplicates``: copies dropped
    (beyond JetStream's duplicate window); ``stale``: batches too old to place, dropped;
    ``restarts``: engine restarts applied (announced by a relay or seen in the sequence);
    ``losses``: loss records that cost this replica batches; ``gaps``: batches that came
    after a hole in their stream's sequence no loss record announced (the stream degraded);
    ``rewinds``: streams reset because batches went on below a sequence that had jumped
    ahead by more than ``window`` (a forged ``Kv-Seq``); ``malformed``: messages that are not
    relay records (or break a bound); ``undecodable``: batches the decoder refused;
    ``unregistered``: batches of workers with no registration; ``apply_errors``: records
    that raised while applied (logged, skipped); ``registrations``: workers registered;
    ``snapshots``: snapshots saved; ``snapshot_errors``: snapshots not taken or not saved;
    ``trims``: purges of the stream; ``trim_errors``: purges that failed; ``fetch_errors``:
    fetches that failed (the server restarting, the consumer gone); ``consume_errors``:
    turns of the consume loop that raised outside a record (logged; the loop goes on);
    ``consume_restarts``: times the consume loop ended and was started again;
    ``rebinds``: consumers recreated where the replica was, after the server lost them;
    ``loaded_seq``: the sequence of the snapshot loaded at start (0: none); ``covered_seq``:
    the last stream sequence applied; ``start_gap``: messages trimmed before this replica
    could read them (its streams are degraded); ``degraded_streams``: streams whose matches
    the router does not trust now."""

    GAUGES: ClassVar[frozenset[str]] = frozenset({"covered_seq", "loaded_seq", "degraded_streams"})

    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    restarts: int = 0
    losses: int = 0
    malformed: int = 0
    undecodable: int = 0
    unregistered: int = 0
    registrations: int = 0
    snapshots: int = 0
    snapshot_errors: int = 0
    trims: int = 0
    loaded_seq: int = 0
    covered_seq: int = 0
    start_gap: int = 0
    gaps: int = 0
    rewinds: int = 0
    apply_errors: int = 0
    trim_errors: int = 0
    fetch_errors: int = 0
    consume_errors: int = 0
    consume_restarts: int = 0
    rebinds: int = 0
    degraded_streams: int = 0


class JetStreamFeed:
    """The service's feed when JetStream feeds it: the replica applies messages itself, so
    there is nothing to subscribe to; ``health`` is the replica's."""

    def __init__(self, health: Callable[[], FeedHealth]) -> None:
        self._health = health

    def add_stream(self, spec: StreamSpec) -> None:
        pass

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get(self, timeout: float | None = None) -> None:
        return None

    def stats(self) -> SubscriberStats:
        return SubscriberStats(streams=0, incomplete=0, queued=0, callback_errors=0, max_lag=None)

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        return {}

    def health(self) -> FeedHealth:
        return self._health()

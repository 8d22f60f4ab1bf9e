"""The subscriber's data: which streams to read, what it hands out, what it counts.

Pure records, no sockets. :class:`StreamSpec` names one (worker, rank) stream;
:func:`worker_streams` expands a worker's base endpoints into all its ranks (WIRE.md section
5). :class:`Delivery`, :class:`StreamReset` and :class:`StreamStatus` are the items a
subscriber hands out; :class:`StreamStats` and :class:`SubscriberStats` are frozen counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, Literal, TypeAlias

import msgspec

from kvevents.errors import LayoutError
from kvevents.events import KVEventBatch
from kvevents.subscribe.cursor import CursorState
from kvevents.wire import DEFAULT_LIMITS, Applied, DecodeLimits
from kvevents.wire.endpoints import parse_endpoint, rank_endpoint

if TYPE_CHECKING:  # records only: importing them here must not load zmq
    from kvevents.security import CurveClient

__all__ = [
    "STREAM_COUNTERS",
    "Delivery",
    "FeedHealth",
    "FeedState",
    "Item",
    "ReplayOptions",
    "ResetReason",
    "StreamCounters",
    "StreamKey",
    "StreamReset",
    "StreamSpec",
    "StreamState",
    "StreamStats",
    "StreamStatus",
    "SubscriberOptions",
    "SubscriberStats",
    "worker_streams",
]

StreamKey: TypeAlias = tuple[str, int]
#: Where a stream stands: the cursor's states, plus ``"failed"`` (the stream hit an error of
#: its own and was detached; remove and add it again).
StreamState: TypeAlias = Literal[CursorState, "failed"]
#: Why a :class:`StreamReset` was sent.
ResetReason: TypeAlias = Literal["restart", "removed"]
#: The feed's health: serving, serving with some streams known incomplete (a router replica's
#: feed), stuck on work for too long, or not running; ``starting`` is the index service's
#: alone: it is still registering the workers of its state file (``IndexService.restore``).
FeedState: TypeAlias = Literal["ok", "degraded", "stalled", "dead", "starting"]


#: The largest message a subscriber accepts by default (``SubscriberOptions.max_message_size``):
#: 8 MiB holds about 180 prefills of 8k tokens (45 KB each: 5 bytes a token, 9 a block hash)
#: in one batch, twenty times what a step of 64k batched tokens can store.
DEFAULT_MAX_MESSAGE_SIZE = 8 * 1024 * 1024

#: Payload bytes a subscriber queues for its consumer by default: decoded, a batch takes 7
#: (typical) to 13 (many blocks) times its payload, so about 110 MB of objects at most; 8,000
#: typical 1 KB batches, about what ``queue_size`` holds.
DEFAULT_QUEUE_BYTES = 8 * 1024 * 1024
#: Payload bytes one stream holds while a replay fills the hole before them.
DEFAULT_MAX_BUFFERED_BYTES = 16 * 1024 * 1024

#: The subscriber's default socket limit: 8,192 covers 8,000 streams (a SUB each) plus the
#: replay DEALERs and the wake-up pair, about twice the 4,096 streams it is meant to serve.
DEFAULT_MAX_SOCKETS = 8192


@dataclass(frozen=True)
class ReplayOptions:
    """Timeouts and limits of the replay client (seconds)."""

    # Generous enough that a replay server stalled by a busy host is retried, not abandoned.
    idle_timeout: float = 5.0
    total_timeout: float = 60.0
    max_attempts: int = 4
    max_concurrent: int = 4
    backoff_initial: float = 0.05
    backoff_max: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_concurrent < 1:
            raise ValueError("max_attempts and max_concurrent must be >= 1")
        if min(self.idle_timeout, self.total_timeout) <= 0:
            raise ValueError("idle_timeout and total_timeout must be > 0")


def _check_connectable(endpoint: str, rank: int) -> None:
    try:
        parsed = parse_endpoint(endpoint)
    except LayoutError as exc:
        raise LayoutError(str(exc), endpoint=endpoint, rank=rank, rule=exc.rule) from None
    if parsed.scheme != "tcp":
        return
    if parsed.host == "*":
        raise LayoutError(
            f"endpoint {endpoint!r} for rank {rank}: a subscriber connects, so it needs the "
            "publisher's host, not '*'",
            endpoint=endpoint,
            rank=rank,
            rule="host",
        )
    if parsed.port == 0:
        raise LayoutError(
            f"endpoint {endpoint!r} for rank {rank}: port 0 cannot be connected to; use the "
            "port the publisher bound",
            endpoint=endpoint,
            rank=rank,
            rule="port",
        )


@dataclass(frozen=True)
class StreamSpec:
    """One stream: the rank ``rank`` of worker ``worker_id``.

    ``endpoint`` is the rank's PUB endpoint and ``replay_endpoint`` its ROUTER (None: no
    replay, every gap is unrecoverable). ``topic`` filters by byte prefix, like ZeroMQ does.
    ``curve``: read a CURVE publisher (both sockets); None: ``SubscriberOptions.curve``.
    """

    worker_id: str
    rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    curve: CurveClient | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise LayoutError(
                f"rank must be >= 0, got {self.rank}",
                endpoint=self.endpoint,
                rank=self.rank,
                rule="rank",
            )
        _check_connectable(self.endpoint, self.rank)
        if self.replay_endpoint is not None:
            _check_connectable(self.replay_endpoint, self.rank)

    @property
    def key(self) -> StreamKey:
        """``(worker_id, rank)``: what identifies the stream inside a subscriber."""
        return (self.worker_id, self.rank)


def worker_streams(
    worker_id: str,
    endpoint: str,
    replay_endpoint: str | None = None,
    *,
    ranks: int | Iterable[int] = 1,
    topic: str = "",
    curve: CurveClient | None = None,
) -> list[StreamSpec]:
    """Every rank's stream of one worker, from its base endpoints (rank r: port + r).

    ``ranks`` is a count (ranks 0..n-1) or the explicit ranks to read.
    """
    numbers = range(ranks) if isinstance(ranks, int) else list(ranks)
    return [
        StreamSpec(
            worker_id=worker_id,
            rank=rank,
            endpoint=rank_endpoint(endpoint, rank),
            replay_endpoint=None
            if replay_endpoint is None
            else rank_endpoint(replay_endpoint, rank),
            topic=topic,
            curve=curve,
        )
        for rank in numbers
    ]


# A msgspec struct rather than a frozen dataclass: one is made per batch, and it builds in a
# tenth of the time (35 ns against 300 ns measured). Immutable, positional or keyword arguments.
class Delivery(msgspec.Struct, frozen=True, gc=False):
    """Batch ``seq`` of ``stream``: apply it. Per stream, deliveries come in sequence order."""

    stream: StreamSpec
    seq: int
    batch: KVEventBatch


@dataclass(frozen=True, slots=True)
class StreamReset:
    """Drop everything held for ``stream``; the deliveries that follow rebuild it.

    ``reason``: ``"restart"`` (the publisher restarted; it is rebuilt by a replay from 0)
    or ``"removed"`` (the stream was removed from the subscriber; nothing follows).
    """

    stream: StreamSpec
    reason: ResetReason


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """The stream's state changed: ``"live"``, ``"replaying"``, ``"incomplete"`` or
    ``"failed"`` (detached after an error of its own: remove it and add it again).

    ``missing`` is the sequence range ``[start, end)`` lost for good when the state is
    ``"incomplete"`` because of it.
    """

    stream: StreamSpec
    state: StreamState
    missing: tuple[int, int] | None = None


Item: TypeAlias = Delivery | StreamReset | StreamStatus


@dataclass(frozen=True, kw_only=True)
class StreamCounters:
    """The running counters of a stream; :class:`SubscriberStats` holds their sums.

    ``received``: live messages read. ``delivered``: batches handed out (live or replayed).
    ``duplicates``: repeated batches ignored. ``gaps``: holes found, a late join included.
    ``replays``: replay requests started. ``replayed``: batches delivered from a replay.
    ``unrecoverable``: holes that could not be filled; ``missing``: batches in them.
    ``restarts``: publisher restarts seen. ``decode_errors``: messages that could not be
    read at all. ``skipped_events``: events skipped inside otherwise good batches.
    ``events``: events delivered. ``failures``: errors of the stream's own that detached it
    (its state is then ``"failed"``). ``shed``: batches dropped because the consumer was
    behind (``SubscriberOptions.queue_bytes``); each run of them is replayed. ``oversized``:
    batches over ``SubscriberOptions.max_message_size``, dropped undecoded (and lost).
    """

    received: int = 0
    delivered: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replayed: int = 0
    unrecoverable: int = 0
    missing: int = 0
    restarts: int = 0
    decode_errors: int = 0
    skipped_events: int = 0
    events: int = 0
    failures: int = 0
    shed: int = 0
    oversized: int = 0


#: The names of :class:`StreamCounters`, in order.
STREAM_COUNTERS = tuple(f.name for f in fields(StreamCounters))


@dataclass(frozen=True, kw_only=True)
class StreamStats(StreamCounters):
    """One stream since it was added: its counters, plus where it stands.

    ``state``: ``"new"``, ``"live"``, ``"replaying"``, ``"incomplete"`` or ``"failed"``. ``last_seq``: the
    last delivered sequence. ``lag_seconds``: seconds from the ``ts`` of the last delivered batch to
    now (None before one).
    """

    #: Fields that are levels (Prometheus gauges); every other number only grows.
    GAUGES: ClassVar[frozenset[str]] = frozenset({"lag_seconds", "last_seq"})

    worker_id: str
    rank: int
    state: StreamState
    last_seq: int | None
    lag_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class SubscriberStats(StreamCounters):
    """Totals over every stream, plus what belongs to the subscriber itself.

    ``streams``: streams read now; ``incomplete``: how many are incomplete; ``failed``: how
    many are failed (detached); ``queued``: items waiting for the consumer;
    ``queued_bytes``: the payload bytes of those items;
    ``callback_errors``: exceptions raised by callbacks; ``add_errors``: streams that could
    not be added (:class:`~kvevents.errors.StreamAddError`); ``max_lag``: the largest stream
    lag. The counters sum :class:`StreamStats` over current streams. ``replay_*``: what the
    replay client did: requests sent, resumes (a fresh request after a skip or silence),
    timeouts (idle or total), trimmed replies (the server's ring had moved on), malformed
    reply messages, replays completed and failed.
    """

    #: Fields that are levels (Prometheus gauges); every other number only grows.
    GAUGES: ClassVar[frozenset[str]] = frozenset(
        {"failed", "incomplete", "max_lag", "queued", "queued_bytes", "streams"}
    )

    streams: int
    incomplete: int
    failed: int = 0
    queued: int
    queued_bytes: int = 0
    callback_errors: int
    add_errors: int = 0
    max_lag: float | None
    replay_requests: int = 0
    replay_resumes: int = 0
    replay_timeouts: int = 0
    replay_trimmed: int = 0
    replay_malformed: int = 0
    replay_completed: int = 0
    replay_failed: int = 0


@dataclass(frozen=True)
class FeedHealth:
    """Whether the subscriber's I/O thread is serving (``Subscriber.health()``).

    ``state``: ``"ok"``; ``"stalled"`` when the thread has been inside one turn of work for
    more than ``SubscriberOptions.stall_after`` seconds (most often: the outbox is full
    because the consumer is not reading); ``"dead"`` when the thread is not running (not
    started, closed, or died: ``error`` says why). A router replica's feed
    (:meth:`kvevents.scaleout.Replica.health`) may also say ``"degraded"``: serving, with some
    streams known incomplete (``error`` names one). ``alive``: the thread is running.
    ``stalled_for``: seconds the current turn has lasted while it had work; 0.0 when idle.
    """

    state: FeedState
    alive: bool
    stalled_for: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class SubscriberOptions:
    """Tuning knobs of a subscriber.

    ``queue_size``: items waiting for the consumer; when full the I/O thread waits.
    ``rcvhwm``: messages ZeroMQ reads ahead per stream (its own default, 1,000); past it
    the connection is not read, so the backlog waits in the publisher's queue (its ``hwm``,
    100,000 in vLLM, SGLang and ours) and is dropped there only once that is full, which
    shows up as gaps that are replayed. Reading further ahead buys no speed and costs
    memory: read 100,000 ahead, 16 pre-queued streams were ingested about 20% slower
    (docs/subscriber.md). ``queue_bytes``: payload bytes waiting for the consumer; past it
    batches are shed (counted in ``shed``), the stream reported ``"incomplete"`` and rebuilt by a
    replay from the first shed batch once the queue is half empty. ``callback``: called on
    the I/O thread with every item instead of queueing it (keep it quick). ``on_status``:
    called on the I/O thread with every :class:`StreamStatus`; ``status_items`` also queues
    them. ``max_buffered``: live messages held per stream during a replay, and
    ``max_buffered_bytes`` their payload bytes (past either the replay is abandoned and the
    hole reported unrecoverable). ``duplicate_window``: delivered batches remembered per
    stream to tell a duplicate from a restart. ``gap_log_interval``: at most one gap warning
    per stream per that many seconds. ``wall_clock``: the clock ``lag_seconds`` is measured with.
    ``curve``: the CURVE client of every stream whose spec has none (``docs/security.md``).
    ``on_payload``: called on the I/O thread
    with ``(stream, seq, payload)`` of every batch due for delivery, before decoding; a
    consumer that applies the payload itself returns an :class:`Applied` and no
    :class:`Delivery` is made, one that returns None gets the usual delivery (the index
    service applies payloads this way). A ``DecodeError`` it raises counts as undecodable.
    ``add_timeout``: seconds :meth:`Subscriber.add_stream` waits for the I/O thread to set a
    stream up. ``stall_after``: seconds one turn of the I/O thread may last before
    :meth:`Subscriber.health` says ``"stalled"``. ``max_sockets``: the ZeroMQ context's socket
    limit (libzmq's default, 1023, is exhausted by about 1,020 streams); it bounds the
    streams read at once to ``max_sockets - replay.max_concurrent - 2``.
    ``max_message_size``: the largest batch payload accepted. A larger one is never decoded:
    it is counted in ``oversized`` and reported unrecoverable (the stream incomplete). Replay
    sockets enforce it in ZeroMQ (``MAXMSGSIZE``: the reply's connection is dropped and the
    replay retried, then failed); live SUB sockets check after receipt, because libzmq never
    reconnects a SUB whose connection it dropped for an oversized frame. ``max_events_per_batch`` and ``max_tokens_per_event``: events
    past the first ``max_events_per_batch`` of a batch, and events with more tokens, are
    skipped and counted in ``skipped_events`` (the rest of the batch is delivered).
    """

    queue_size: int = 10_000
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    rcvhwm: int = 1_000
    replay: ReplayOptions = field(default_factory=ReplayOptions)
    max_buffered: int = 100_000
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    duplicate_window: int = 1024
    callback: Callable[[Delivery | StreamReset], None] | None = None
    on_status: Callable[[StreamStatus], None] | None = None
    status_items: bool = False
    gap_log_interval: float = 5.0
    wall_clock: Callable[[], float] = time.time
    curve: CurveClient | None = None
    on_payload: Callable[[StreamSpec, int, bytes], Applied | None] | None = None
    add_timeout: float = 10.0
    stall_after: float = 10.0
    max_sockets: int = DEFAULT_MAX_SOCKETS
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_events_per_batch: int = DEFAULT_LIMITS.max_events
    max_tokens_per_event: int = DEFAULT_LIMITS.max_tokens

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.rcvhwm < 0:
            raise ValueError("queue_size must be >= 1 and rcvhwm >= 0")
        if self.add_timeout <= 0 or self.stall_after <= 0:
            raise ValueError("add_timeout and stall_after must be > 0")
        if self.queue_bytes < 1 or self.max_buffered_bytes < 1:
            raise ValueError("queue_bytes and max_buffered_bytes must be >= 1")
        if self.max_message_size < 1024:
            raise ValueError("max_message_size must be >= 1024 bytes")
        if min(self.max_events_per_batch, self.max_tokens_per_event) < 1:
            raise ValueError("max_events_per_batch and max_tokens_per_event must be >= 1")
        if self.max_sockets < self.replay.max_concurrent + 3:
            raise ValueError("max_sockets must leave room for a stream, the replays and 2 more")

    @property
    def decode_limits(self) -> DecodeLimits:
        """The decoder's limits these options set."""
        return DecodeLimits(
            max_events=self.max_events_per_batch, max_tokens=self.max_tokens_per_event
        )

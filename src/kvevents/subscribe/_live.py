"""One stream as the subscriber's I/O thread holds it: its SUB socket, cursor and counters."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvevents.security import apply_client
from kvevents.subscribe._commands import AddFailed
from kvevents.subscribe._cursor import Cursor
from kvevents.subscribe._recv import Burst, burst_receiver_for
from kvevents.subscribe._streams import (
    STREAM_COUNTERS,
    StreamSpec,
    StreamState,
    StreamStats,
    SubscriberOptions,
)

__all__ = ["LiveStream", "StreamCounts", "open_stream"]

log = logging.getLogger("kvevents.subscribe.subscriber")


@dataclass(slots=True)
class StreamCounts:
    """A stream's running counters, kept by the I/O thread: the mutable twin of
    :class:`~kvevents.subscribe._streams.StreamCounters` (same fields, each documented there),
    so that a counter's name is checked by mypy, not found at run time."""

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

    def frozen(self) -> dict[str, int]:
        """The counters by name, as :class:`StreamCounters` takes them."""
        return {name: getattr(self, name) for name in STREAM_COUNTERS}


@dataclass
class LiveStream:
    """One stream as the I/O thread holds it: its socket, its cursor, its counters."""

    spec: StreamSpec
    cursor: Cursor
    sub: zmq.Socket[bytes]
    receive: Burst
    ticket: int = 0
    state: StreamState = "new"
    counts: StreamCounts = field(default_factory=StreamCounts)
    last_seq: int | None = None
    last_ts: float | None = None
    # The first sequence shed in this turn (the outbox was over its byte budget): every later
    # delivery of the turn is shed too, so that the replay rebuilds them in order.
    shed_from: int | None = None

    def stats(self, now: float) -> StreamStats:
        """A snapshot of the counters (read from another thread: approximate)."""
        lag = None if self.last_ts is None else now - self.last_ts
        return StreamStats(
            worker_id=self.spec.worker_id,
            rank=self.spec.rank,
            state="failed" if self.state == "failed" else self.cursor.state,
            last_seq=self.last_seq,
            lag_seconds=lag,
            **self.counts.frozen(),
        )


def open_stream(
    context: zmq.Context[zmq.Socket[bytes]], spec: StreamSpec, options: SubscriberOptions
) -> LiveStream:
    """A connected SUB for ``spec`` and its cursor; :class:`AddFailed` (nothing left open)
    when ZeroMQ refuses."""
    try:
        sub = context.socket(zmq.SUB)
    except zmq.ZMQError as exc:
        raise AddFailed(f"cannot open a socket: {exc}") from exc
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, options.rcvhwm)
        # No MAXMSGSIZE here: libzmq 4.3 drops a SUB's connection on an oversized frame
        # and never reconnects it, so one large batch would silence the stream for good.
        # The loop drops oversized batches after receipt instead (counted, reported lost).
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        apply_client(sub, spec.curve or options.curve)
        sub.connect(spec.endpoint)
    except (zmq.ZMQError, ValueError, TypeError) as exc:
        sub.close(linger=0)
        raise AddFailed(f"cannot connect: {exc}") from exc
    cursor = Cursor(
        can_replay=spec.replay_endpoint is not None,
        max_buffered=options.max_buffered,
        max_buffered_bytes=options.max_buffered_bytes,
        window=options.duplicate_window,
        digest=payload_digest(),
    )
    return LiveStream(spec, cursor, sub, burst_receiver_for(sub))


@functools.cache
def payload_digest() -> Callable[[bytes], int]:
    """The digest a cursor remembers delivered payloads by: xxh3 where the ``xxhash`` package
    is installed (73 ns for a 1.5 KiB batch), else Python's ``hash`` (520 ns)."""
    try:
        from xxhash import xxh3_64_intdigest
    except ImportError:
        return hash
    return xxh3_64_intdigest

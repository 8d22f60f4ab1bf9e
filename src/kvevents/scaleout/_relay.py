"""The relay: engines' ZeroMQ streams in, one JetStream stream out.

A :class:`Relay` reads every rank of its workers with the library's
:class:`~kvevents.subscribe.Subscriber` (gaps replayed, restarts detected, late
joins replayed from 0) and appends, per stream and in its order, each engine batch as it came
off the wire, plus records of what the subscriber saw (:mod:`kvevents.scaleout._records`):
a ``reset`` before the first batch of a restarted engine, a ``loss`` for batches it could not
replay, ``live`` when a stream is whole again, a ``worker`` record per registration.

The relay is its subscriber's :class:`~kvevents.subscribe.Sink`: on the I/O thread,
:meth:`Relay.apply` checks each batch and queues it, :meth:`Relay.reset` and
:meth:`Relay.status` queue the records they call for. A task on the relay's event loop publishes windows
of up to ``window`` messages without waiting for each acknowledgement, then waits for all of
them. A window that is not fully acknowledged (the server restarting, a timeout) is sent again,
whole and in order: the message ids make the copies harmless. While ``max_pending`` messages
wait, the I/O thread waits too, and the engines' own buffers and replay rings take the slack.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvevents.events import AllBlocksCleared, StreamKey
from kvevents.scaleout._jetstream import JetStreamOptions, LoopThread, connect, ensure_stream
from kvevents.scaleout._records import (
    Outgoing,
    batch_record,
    live_record,
    loss_record,
    payload_digest,
    reset_record,
    worker_record,
)
from kvevents.service import WorkerRegistration, default_stream_specs
from kvevents.subscribe import (
    ResetReason,
    StreamSpec,
    StreamStatus,
    SubscriberOptions,
    SubscriberStats,
)
from kvevents.wire import Applied, decode_batch_packed

if TYPE_CHECKING:
    from nats.js.api import PubAck

    from kvevents.subscribe import Subscriber

__all__ = ["Relay", "RelayCounts", "RelayOptions", "RelayStats"]

log = logging.getLogger("kvevents.scaleout.relay")


@dataclass(frozen=True)
class RelayOptions:
    """``window``: messages published before waiting for their acknowledgements;
    ``max_pending``: messages queued before the subscriber's thread waits; ``ack_timeout``:
    seconds a window's acknowledgements may take before it is sent again; ``name``: the
    connection's name in the server's monitoring."""

    window: int = 512
    max_pending: int = 50_000
    # Short: acknowledgements lost with a connection never come, and a window sent again
    # costs only the copies JetStream drops (a server restart measured 5.3 s of delay at 5 s).
    ack_timeout: float = 1.0
    retry_backoff: float = 0.1
    name: str = "kvevents-relay"

    def __post_init__(self) -> None:
        if self.window < 1 or self.max_pending < self.window:
            raise ValueError("window must be >= 1 and max_pending >= window")


@dataclass(frozen=True)
class RelayStats:
    """What the relay wrote. ``batches``: engine batches acknowledged by JetStream;
    ``duplicates``: messages JetStream recognised as copies (by their id); ``resets``,
    ``losses``, ``lives``, ``workers``: records written; ``retries``: windows sent again;
    ``pending``: messages waiting; ``dropped``: messages given up at close (not written)."""

    batches: int = 0
    duplicates: int = 0
    resets: int = 0
    losses: int = 0
    lives: int = 0
    workers: int = 0
    retries: int = 0
    pending: int = 0
    dropped: int = 0
    published_bytes: int = 0

    #: Fields that are levels (Prometheus gauges); every other number only grows.
    GAUGES: ClassVar[frozenset[str]] = frozenset({"pending"})


@dataclass(slots=True)
class RelayCounts:
    """The relay's running counters (each documented on :class:`RelayStats`), typed so that
    mypy checks their names; :meth:`frozen` is the stats record."""

    batches: int = 0
    duplicates: int = 0
    resets: int = 0
    losses: int = 0
    lives: int = 0
    workers: int = 0
    retries: int = 0
    pending: int = 0
    dropped: int = 0
    published_bytes: int = 0

    def written(self, kind: str, size: int) -> None:
        """Count one record of ``kind`` acknowledged, ``size`` bytes of payload."""
        if kind == "batch":
            self.batches += 1
        elif kind == "reset":
            self.resets += 1
        elif kind == "loss":
            self.losses += 1
        elif kind == "live":
            self.lives += 1
        else:
            self.workers += 1
        self.published_bytes += size

    def frozen(self, queued: int) -> RelayStats:
        """The stats record, ``queued`` more messages pending."""
        stats = RelayStats(**dataclasses.asdict(self))
        return dataclasses.replace(stats, pending=stats.pending + queued)


class Relay:
    """Engines' streams to JetStream (see the module's docstring).

    ``workers``: the registrations to read (every rank); ``subscriber_options``: the
    subscriber's knobs. The relay is the subscriber's sink (:meth:`apply`, :meth:`reset`,
    :meth:`status`, called on its I/O thread).
    """

    def __init__(
        self,
        url: str,
        workers: Iterable[WorkerRegistration] = (),
        *,
        jetstream: JetStreamOptions | None = None,
        options: RelayOptions | None = None,
        subscriber_options: SubscriberOptions | None = None,
    ) -> None:
        self.url = url
        self.js_options = jetstream or JetStreamOptions()
        self.options = options or RelayOptions()
        self._workers = list(workers)
        self._sub_options = subscriber_options or SubscriberOptions()
        self._queue: collections.deque[Outgoing] = collections.deque()
        self._room = threading.Condition()
        self._pending_reset: set[StreamKey] = set()
        self._last_seq: dict[StreamKey, int] = {}
        self._counts = RelayCounts()
        self._aio: LoopThread | None = None
        self._nc: Any = None  # nats-py's client: Any, not Optional, as start() sets it first
        self._js: Any = None  # its JetStream context: the same
        self._wake: asyncio.Event | None = None
        self._sleeping = False
        self._closing = False
        self._pump: concurrent.futures.Future[None] | None = None
        self._subscriber: Subscriber | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Relay:
        """Connect, create the stream if needed, write the registrations, start reading."""
        from kvevents.subscribe import Subscriber

        self._aio = LoopThread("kvevents-relay-nats")
        self._aio.run(self._connect(), self.js_options.connect_timeout + 5.0)
        self._pump = self._aio.submit(self._run())
        self._subscriber = Subscriber(sink=self, options=self._sub_options)
        self._subscriber.start()
        for reg in self._workers:
            self.add_worker(reg)
        return self

    async def _connect(self) -> None:
        self._nc = await connect(self.url, self.js_options, self.options.name)
        self._js = self._nc.jetstream()
        await ensure_stream(self._js, self.js_options, writes=True)
        self._wake = asyncio.Event()

    def add_worker(self, reg: WorkerRegistration) -> list[StreamSpec]:
        """Write ``reg`` to the stream and read its ranks; ``LayoutError`` on bad endpoints,
        :class:`~kvevents.scaleout._records.RecordError` (naming the field and the rule) for a
        registration a replica would refuse (the bounds of ``POST /register``)."""
        specs = default_stream_specs(reg)
        record = worker_record(self.js_options.prefix, reg)
        self._enqueue(record)
        for spec in specs:
            self.subscriber.add_stream(spec)
        return specs

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued message is acknowledged; False if ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._room:
            while self._queue or self._counts.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop reading, write what is queued (up to ``timeout``), disconnect."""
        if self._subscriber is not None:
            self._subscriber.close()
        if self._aio is None:
            return
        self.flush(timeout)
        self._closing = True
        with self._room:
            self._room.notify_all()
        self._wake_pump()
        if self._pump is not None:
            try:
                self._pump.result(timeout)
            except Exception:
                log.exception("the relay's publisher stopped with an error")
        try:
            self._aio.run(self._disconnect(), timeout)
        except Exception:
            log.warning("relay: the NATS connection did not close cleanly", exc_info=True)
        self._aio.close()
        self._aio = None

    async def _disconnect(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- the sink (I/O thread)

    def apply(self, spec: StreamSpec, seq: int, payload: bytes) -> Applied:
        """Queue batch ``seq`` as it came off the wire (after a ``reset`` record when the
        engine restarted); ``DecodeError`` (nothing queued) when it cannot be read."""
        # Decoded only to check it and fill the subscriber's stats: what goes out is the
        # payload as the engine wrote it. A DecodeError is the subscriber's to count.
        decoded = decode_batch_packed(payload, seq=seq, limits=self._sub_options.decode_limits)
        batch = decoded.batch
        key = spec.key
        prefix = self.js_options.prefix
        if key in self._pending_reset:
            self._pending_reset.discard(key)
            self._enqueue(reset_record(prefix, *key, seq, payload_digest(payload)))
        self._enqueue(batch_record(prefix, *key, seq, payload))
        self._last_seq[key] = seq
        cleared = any(type(e) is AllBlocksCleared for e in batch.events)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def reset(self, spec: StreamSpec, reason: ResetReason) -> None:
        """An engine restarted: its next batch goes out after a ``reset`` record. (A stream
        removed from the relay writes nothing: replicas keep its blocks until it returns.)"""
        if reason == "restart":
            self._pending_reset.add(spec.key)

    def status(self, status: StreamStatus) -> None:
        """A loss the subscriber could not replay is a ``loss`` record; a stream whole again
        after one, a ``live`` record."""
        key, prefix = status.stream.key, self.js_options.prefix
        if status.state == "incomplete" and status.missing is not None:
            start, end = status.missing
            self._enqueue(loss_record(prefix, *key, start, end))
        elif status.state == "live" and key in self._last_seq:
            self._enqueue(live_record(prefix, *key, self._last_seq[key]))

    def _enqueue(self, message: Outgoing) -> None:
        limit = self.options.max_pending
        if len(self._queue) >= limit:
            with self._room:
                while len(self._queue) >= limit and not self._closing:
                    self._room.wait(0.1)  # bounded: re-checks closing
        self._queue.append(message)
        if self._sleeping:
            self._sleeping = False
            self._wake_pump()

    def _wake_pump(self) -> None:
        aio, wake = self._aio, self._wake
        if aio is not None and wake is not None and not aio.loop.is_closed():
            aio.loop.call_soon_threadsafe(wake.set)

    # ----------------------------------------------------------------- the loop's side

    async def _run(self) -> None:
        assert self._wake is not None
        queue = self._queue
        while not (self._closing and not queue):
            if not queue:
                self._wake.clear()
                self._sleeping = True
                if not queue:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                self._sleeping = False
                continue
            size = min(len(queue), self.options.window)
            self._counts.pending = size  # before the pops: flush() never sees both empty
            window = [queue.popleft() for _ in range(size)]
            await self._send(window)
            self._counts.pending = 0
            with self._room:
                self._room.notify_all()

    async def _send(self, window: Sequence[Outgoing]) -> None:
        """Publish ``window`` until every message is acknowledged (or the relay closes)."""
        while True:
            futures: list[asyncio.Future[PubAck]] = []
            try:
                for subject, payload, headers in window:
                    futures.append(await self._js.publish_async(subject, payload, headers=headers))
                acks = await asyncio.wait_for(asyncio.gather(*futures), self.options.ack_timeout)
            except Exception as exc:
                for future in futures:
                    future.cancel()  # frees its slot in the client's pending limit
                if self._closing:
                    self._counts.dropped += len(window)
                    return
                self._counts.retries += 1
                log.warning(
                    "relay: %d message(s) not acknowledged (%r); sending again", len(window), exc
                )
                await asyncio.sleep(self.options.retry_backoff)
                continue
            self._count(window, acks)
            return

    def _count(self, window: Sequence[Outgoing], acks: Sequence[PubAck]) -> None:
        counts = self._counts
        for (_, payload, headers), ack in zip(window, acks, strict=True):
            if ack.duplicate:
                counts.duplicates += 1
            else:
                counts.written(headers["Kv-Kind"], len(payload))

    # ----------------------------------------------------------------- reads

    def stats(self) -> RelayStats:
        return self._counts.frozen(len(self._queue))

    def subscriber_stats(self) -> SubscriberStats:
        return self.subscriber.stats()

    @property
    def subscriber(self) -> Subscriber:
        """The relay's :class:`~kvevents.subscribe.Subscriber` (for metrics); once started."""
        if self._subscriber is None:
            raise RuntimeError("the relay is not started")
        return self._subscriber

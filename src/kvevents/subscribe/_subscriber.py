"""The router-side subscriber: many engines, every rank, one ordered and honest feed.

A :class:`Subscriber` reads any number of (worker, rank) streams on one background I/O thread
and feeds a :class:`~kvevents.subscribe.Sink`, per stream in sequence order: each batch
(``apply``), each reset (``reset``: the publisher restarted, or the stream was removed; the
batches that follow rebuild it) and each change of a stream's state (``status``).

Gaps are replayed, late joins replay from 0, duplicates are dropped, restarts reset the
stream. What cannot be recovered is delivered around, counted, marks the stream
``"incomplete"`` in :meth:`Subscriber.stream_stats`, and is reported as a
:class:`StreamStatus`. See docs/subscriber.md for what a consumer should do with each.

Without a sink of its own, a subscriber feeds its queue
(:class:`~kvevents.subscribe._queueing.QueueSink`): :class:`Delivery` and
:class:`StreamReset` items (and :class:`StreamStatus` ones with ``status_items=True``),
consumed with :meth:`Subscriber.get`, by iterating (blocking, until
:meth:`Subscriber.close`), or with ``async for`` over an :class:`AsyncSubscriber`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from types import TracebackType

from kvevents.errors import StreamAddError, SubscriberClosed, SubscriberError
from kvevents.events import StreamKey
from kvevents.subscribe._loop import Loop
from kvevents.subscribe._outbox import Outbox
from kvevents.subscribe._queueing import QueueSink
from kvevents.subscribe._sink import Sink
from kvevents.subscribe._streams import (
    STREAM_COUNTERS,
    FeedHealth,
    Item,
    StreamSpec,
    StreamStats,
    SubscriberOptions,
    SubscriberStats,
)

__all__ = ["AsyncSubscriber", "Subscriber"]

_START_TIMEOUT = 30.0


class Subscriber:
    """Reads many streams on one I/O thread and feeds ``sink``; see the module docstring.

    Construction has no side effect; :meth:`start` (or ``with``) connects. The sink is called
    on the I/O thread (keep it quick: a slow one holds every stream back). Without one, ``get``
    and iteration may be used from any one consumer thread at a time.
    """

    def __init__(
        self,
        streams: Iterable[StreamSpec] = (),
        *,
        sink: Sink | None = None,
        options: SubscriberOptions | None = None,
    ) -> None:
        self.options = options or SubscriberOptions()
        self._outbox: Outbox[Item] = Outbox(self.options.queue_size)
        self._queue: QueueSink | None = None
        if sink is None:
            sink = self._queue = QueueSink(self._outbox, self.options)
        self._sink = sink
        self._specs: dict[StreamKey, StreamSpec] = {}
        self._lock = threading.Lock()
        self._loop: Loop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._add_errors = 0
        for spec in streams:
            self._register(spec)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the I/O thread and connect every stream; idempotent."""
        with self._lock:
            if self._closed:
                raise SubscriberClosed("subscriber was closed; create a new one")
            if self._thread is not None:
                return
            loop = Loop(list(self._specs.values()), self.options, self._sink, self._queue)
            ready = threading.Event()
            failure: list[BaseException] = []
            thread = threading.Thread(
                target=loop.run, args=(ready, failure), name="kvevents-subscriber", daemon=True
            )
            thread.start()
            ready.wait(_START_TIMEOUT)
            if failure:
                thread.join()
                loop.close_waker()
                self._add_errors += 1
                raise failure[0]
            self._loop, self._thread = loop, thread

    def close(self) -> None:
        """Stop the I/O thread and close every socket; items already queued stay readable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        self._outbox.close()
        if loop is not None and thread is not None:
            loop.stop()
            thread.join()
            loop.close_waker()

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ streams

    def add_stream(self, spec: StreamSpec) -> None:
        """Start reading ``spec``; ValueError if its (worker, rank) is already read.

        Once started, returns when the I/O thread has set the stream up (at most
        ``SubscriberOptions.add_timeout`` seconds), or raises
        :class:`~kvevents.errors.StreamAddError` saying why it could not be (the stream is
        then not read; every other stream goes on).
        """
        with self._lock:
            self._register(spec)
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return
            if thread.is_alive():
                why = loop.add(spec)
            else:
                why = f"the I/O thread is not running ({loop.error or 'stopped'})"
            if why is None:
                return
            del self._specs[spec.key]
            self._add_errors += 1
        raise StreamAddError(
            worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=why
        )

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        """Stop reading a worker's rank (every rank when None); a ``StreamReset`` follows."""
        with self._lock:
            keys = [k for k in self._specs if k[0] == worker_id and rank in (None, k[1])]
            if not keys:
                raise KeyError(f"no stream for worker {worker_id!r} rank {rank}")
            for key in keys:
                del self._specs[key]
            if self._loop is not None:
                self._loop.remove(worker_id, rank)

    def streams(self) -> list[StreamSpec]:
        """The streams currently read."""
        with self._lock:
            return list(self._specs.values())

    def _register(self, spec: StreamSpec) -> None:
        if spec.key in self._specs:
            raise ValueError(f"worker {spec.worker_id!r} rank {spec.rank} is already subscribed")
        self._specs[spec.key] = spec

    # ------------------------------------------------------------------ consuming

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item; None after ``timeout`` seconds; SubscriberClosed once closed and drained.

        Only without a sink of one's own (else :class:`~kvevents.errors.SubscriberError`)."""
        self._check_queued()
        ok, item = self._outbox.get(timeout)
        if ok:
            return item
        if self._outbox.closed:
            raise SubscriberClosed("subscriber was closed")
        return None

    def get_nowait(self) -> Item | None:
        """The next item if one is waiting, else None."""
        return self.get(0)

    def __iter__(self) -> Iterator[Item]:
        """Every item, blocking, until the subscriber is closed and drained."""
        self._check_queued()
        while True:
            ok, item = self._outbox.get(None)
            if not ok:
                return
            yield item  # type: ignore[misc]  # ok: the outbox handed an item, never None

    def _check_queued(self) -> None:
        if self._queue is None:
            raise SubscriberError(
                "this subscriber feeds the sink it was given: it queues nothing to get"
            )

    # ------------------------------------------------------------------ stats

    def health(self) -> FeedHealth:
        """Whether the I/O thread is serving: ``"ok"``, ``"stalled"`` or ``"dead"``."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._closed:
            why = (loop and loop.error) or ("closed" if self._closed else "not started")
            return FeedHealth("dead", False, 0.0, why)
        return loop.health(thread.is_alive())

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        """Counters of every stream read now, by (worker_id, rank)."""
        loop = self._loop
        if loop is None:
            return {}
        return {key: loop.stream_stats(s) for key, s in list(loop.streams.items())}

    def stats(self) -> SubscriberStats:
        """Totals over every stream, plus queue depth and sink errors."""
        per_stream = list(self.stream_stats().values())
        lags = [s.lag_seconds for s in per_stream if s.lag_seconds is not None]

        totals = {name: sum(getattr(s, name) for s in per_stream) for name in STREAM_COUNTERS}
        loop = self._loop
        replay = {} if loop is None else dataclasses.asdict(loop.replays.counters)
        return SubscriberStats(
            streams=len(per_stream),
            incomplete=sum(1 for s in per_stream if s.state == "incomplete"),
            failed=sum(1 for s in per_stream if s.state == "failed"),
            **totals,
            queued=len(self._outbox),
            queued_bytes=self._outbox.bytes,
            sink_errors=0 if loop is None or loop.courier is None else loop.courier.sink_errors,
            add_errors=self._add_errors,
            max_lag=max(lags) if lags else None,
            **{f"replay_{name}": value for name, value in replay.items()},
        )


class AsyncSubscriber:
    """The asyncio face of :class:`Subscriber`: ``async for item in sub``, ``await aclose()``.

    The I/O thread is the same; only waiting for items happens on the event loop.
    """

    def __init__(
        self, streams: Iterable[StreamSpec] = (), *, options: SubscriberOptions | None = None
    ) -> None:
        self.sync = Subscriber(streams, options=options)
        self._ready: asyncio.Event | None = None

    def start(self) -> None:
        """Start the I/O thread (connecting is quick; this does not block for long)."""
        self.sync.start()

    async def aclose(self) -> None:
        """Close the subscriber; waiting for the I/O thread happens off the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.sync.close)

    async def __aenter__(self) -> AsyncSubscriber:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def add_stream(self, spec: StreamSpec) -> None:
        """See :meth:`Subscriber.add_stream`; the wait for the I/O thread happens off the
        event loop (the I/O thread may itself be waiting for this loop to take items)."""
        await asyncio.get_running_loop().run_in_executor(None, self.sync.add_stream, spec)

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        """See :meth:`Subscriber.remove_stream`."""
        self.sync.remove_stream(worker_id, rank)

    def stats(self) -> SubscriberStats:
        """See :meth:`Subscriber.stats`."""
        return self.sync.stats()

    def health(self) -> FeedHealth:
        """See :meth:`Subscriber.health`."""
        return self.sync.health()

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        """See :meth:`Subscriber.stream_stats`."""
        return self.sync.stream_stats()

    async def get(self, timeout: float | None = None) -> Item | None:
        """The next item; None after ``timeout``; SubscriberClosed once closed and drained."""
        try:
            return await asyncio.wait_for(self._next(), timeout)
        except asyncio.TimeoutError:
            return None

    def __aiter__(self) -> AsyncIterator[Item]:
        return self

    async def __anext__(self) -> Item:
        try:
            return await self._next()
        except SubscriberClosed:
            raise StopAsyncIteration from None

    async def _next(self) -> Item:
        ready = self._event()
        outbox = self.sync._outbox
        while True:
            ok, item = outbox.get(0)
            if ok:
                return item  # type: ignore[return-value]  # ok: an item, not None
            if outbox.closed:
                raise SubscriberClosed("subscriber was closed")
            ready.clear()
            ok, item = outbox.get(0)  # a put between the check and clear() must not be lost
            if ok:
                return item  # type: ignore[return-value]  # ok: an item, not None
            await ready.wait()

    def _event(self) -> asyncio.Event:
        if self._ready is None:
            loop = asyncio.get_running_loop()
            event = asyncio.Event()

            def wake() -> None:
                # A closed event loop raises RuntimeError: nobody is waiting any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(event.set)

            self._ready = event
            self.sync._outbox.listener = wake
        return self._ready

"""The subscriber's I/O thread: it owns every socket, runs the cursors, decodes and hands out.

One SUB per stream (sequences are comparable only within a stream, and a SUB connected to
several endpoints cannot tell which one a message came from), one wake-up PAIR for commands
from other threads, and the replay client's DEALERs, all on one poller. What becomes of each
message once its stream's cursor has judged it is the :class:`~kvevents.subscribe._courier.Courier`'s
job: to the sink, or replayed.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq

from kvevents.errors import DecodeError, StreamAddError
from kvevents.events import StreamKey
from kvevents.ratelimit import RateLimitedWarning
from kvevents.subscribe._commands import (
    AddFailed,
    AddRequest,
    Command,
    Mailbox,
    RemoveStreams,
    Stop,
)
from kvevents.subscribe._courier import Courier
from kvevents.subscribe._cursor import Deliver
from kvevents.subscribe._fdlimit import room_for_stream
from kvevents.subscribe._live import LiveStream, open_stream
from kvevents.subscribe._queueing import QueueSink
from kvevents.subscribe._replay import ReplayBatch, ReplayClient, ReplayEvent
from kvevents.subscribe._sink import Sink
from kvevents.subscribe._streams import (
    FeedHealth,
    StreamSpec,
    StreamStats,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import parse_live

log = logging.getLogger("kvevents.subscribe.subscriber")

# Live messages read from one SUB before looking at the others (fairness across streams),
# and the bytes of them held at once (at least one message is always read).
_READ_BURST = 256
_READ_BYTES = 4 << 20
# Upper bound of one poll, so a missed wake-up can never hang the thread for long.
_MAX_POLL_MS = 1000


class Loop:
    """The body of the I/O thread. Other threads only call :meth:`command` and read stats.

    It feeds ``sink``; ``queue`` is the sink again when it is the subscriber's own queue
    (then shed batches are replayed once it has room). What becomes of each message once the
    cursor has judged it is the :class:`~kvevents.subscribe._courier.Courier`'s (made when the
    thread starts, with the replay client).
    """

    def __init__(
        self,
        specs: list[StreamSpec],
        options: SubscriberOptions,
        sink: Sink,
        queue: QueueSink | None = None,
    ) -> None:
        self.options = options
        self.streams: dict[StreamKey, LiveStream] = {}
        self.courier: Courier | None = None
        self._sink = sink
        self._queue = queue
        # Why the thread died (None while it runs or after a clean stop).
        self.error: str | None = None
        # When the current turn of work began (None while waiting for work): stall detection.
        self.busy_since: float | None = None
        self._initial = specs
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Before the first socket: libzmq fixes the limit when it creates its socket table.
        self._ctx.set(zmq.MAX_SOCKETS, options.max_sockets)
        self._warnings = RateLimitedWarning(
            log, interval=options.gap_log_interval, clock=options.wall_clock
        )
        self._mailbox = Mailbox(self._ctx)
        self._by_socket: dict[zmq.Socket[bytes], LiveStream] = {}
        self._running = True
        if queue is not None:
            queue.outbox.on_low = self.wake

    # ------------------------------------------------------------------ other threads

    def command(self, command: Command) -> None:
        """Queue a command for the I/O thread and wake it."""
        self._mailbox.send(command)

    def wake(self) -> None:
        """Make the I/O thread run a turn now (the outbox calls it when it has room again)."""
        self._mailbox.wake()

    def add(self, spec: StreamSpec) -> str | None:
        """Have the I/O thread set ``spec`` up: None once done, else why it was not."""
        request = AddRequest(spec)
        self.command(request)
        return request.wait(self.options.add_timeout)

    def remove(self, worker_id: str, rank: int | None) -> None:
        """Have the I/O thread drop a worker's rank (every rank when None)."""
        self.command(RemoveStreams(worker_id, rank))

    def stop(self) -> None:
        """Have the I/O thread stop."""
        self.command(Stop())

    def health(self, alive: bool) -> FeedHealth:
        """The I/O thread's health, ``alive`` telling whether the thread runs."""
        if not alive:
            return FeedHealth("dead", False, 0.0, self.error or "stopped")
        since = self.busy_since
        stalled_for = 0.0 if since is None else max(0.0, time.monotonic() - since)
        if stalled_for > self.options.stall_after:
            return FeedHealth("stalled", True, stalled_for)
        return FeedHealth("ok", True, stalled_for)

    def close_waker(self) -> None:
        """Close the caller side once the I/O thread has stopped, then the context."""
        self._mailbox.close()
        self._ctx.term()

    # ------------------------------------------------------------------ I/O thread

    def run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        """Connect, report ready (or the error), then serve until told to stop."""
        poller = zmq.Poller()
        wake = self._mailbox.open_inbox(self._ctx)
        poller.register(wake, zmq.POLLIN)
        self.poller = poller
        self.replays = ReplayClient(
            self._ctx,
            poller,
            options=self.options.replay,
            max_message_size=self.options.max_message_size,
        )
        self.courier = Courier(
            self._sink, self._queue, self.replays, self.streams, self.options, self._warnings
        )
        for spec in self._initial:
            try:
                self._add(spec)
            except AddFailed as exc:
                failure.append(_add_error(spec, str(exc)))
                self._running = False
                break
        ready.set()
        try:
            while self._running:
                self._step(wake)
        except BaseException as exc:
            # Not one stream's failure (those are caught below): the thread cannot go on.
            self.error = f"{type(exc).__name__}: {exc}"
            log.critical("subscriber I/O thread died; no stream is read any more", exc_info=True)
        finally:
            self.busy_since = None
            self._teardown(wake)

    def _step(self, wake: zmq.Socket[bytes]) -> None:
        due = self.replays.timeout()
        ms = _MAX_POLL_MS if due is None else min(_MAX_POLL_MS, math.ceil(due * 1000))
        ready = self.poller.poll(ms)
        self.busy_since = time.monotonic()
        for sock, _ in ready:
            if sock is wake:
                self._on_wake(wake)
            elif sock in self._by_socket:
                stream = self._by_socket[sock]
                try:
                    self._read_live(stream)
                except Exception as exc:
                    self._stream_failed(stream, exc)
            else:
                self._on_replay_events(self.replays.handle(sock))
        self._on_replay_events(self.replays.tick())
        self._courier.end_turn()
        self.busy_since = None

    def _on_wake(self, wake: zmq.Socket[bytes]) -> None:
        for command in self._mailbox.take(wake):
            if isinstance(command, Stop):
                self._running = False
            elif isinstance(command, AddRequest):
                self._answer(command)
            else:
                self._remove(command.worker_id, command.rank)

    def _answer(self, request: AddRequest) -> None:
        with request.lock:
            if request.abandoned:
                return  # the caller gave up and told its own caller the stream is not added
            try:
                self._add(request.spec)
            except AddFailed as exc:
                request.error = str(exc)
            except Exception as exc:  # never let one stream's setup take the thread down
                request.error = f"{type(exc).__name__}: {exc}"
            request.done.set()

    def _teardown(self, wake: zmq.Socket[bytes]) -> None:
        self.replays.close()
        for stream in list(self.streams.values()):
            self._detach(stream)
        self.streams.clear()
        self._by_socket.clear()
        wake.close(linger=0)

    # ------------------------------------------------------------------ streams

    def _add(self, spec: StreamSpec) -> None:
        """Set ``spec`` up; :class:`AddFailed` (nothing left open) when it cannot be."""
        if spec.key in self.streams:
            raise AddFailed("already subscribed")
        self._check_room()
        stream = open_stream(self._ctx, spec, self.options)
        sub = stream.sub
        self.streams[spec.key] = stream
        self._by_socket[sub] = stream
        self.poller.register(sub, zmq.POLLIN)

    def _check_room(self) -> None:
        why = room_for_stream(len(self.streams), self.options.max_sockets, self.options.replay)
        if why is not None:
            raise AddFailed(why)

    def _remove(self, worker_id: str, rank: int | None) -> None:
        for stream_key in [k for k in self.streams if k[0] == worker_id]:
            if rank is not None and stream_key[1] != rank:
                continue
            stream = self.streams.pop(stream_key)
            self._detach(stream)
            self._courier.reset(stream, "removed")

    def _detach(self, stream: LiveStream) -> None:
        """Close the stream's sockets (its replay's too); idempotent."""
        self.replays.cancel(stream.spec.key)
        if self._by_socket.pop(stream.sub, None) is not None:
            self.poller.unregister(stream.sub)
            stream.sub.close(linger=0)

    def _stream_failed(self, stream: LiveStream, exc: Exception) -> None:
        """An error of the stream's own: it costs that stream only. It is detached (a broken
        socket would otherwise fail again on every turn), counted, logged once, and
        reported ``"failed"``; removing and adding it again starts it afresh."""
        stream.counts.failures += 1
        self._detach(stream)
        spec = stream.spec
        log.error(
            "worker %s rank %d: stream failed and was detached (remove and add it again): %s",
            spec.worker_id,
            spec.rank,
            exc,
            exc_info=exc,
        )
        stream.state = "failed"
        self._courier.status(StreamStatus(spec, "failed"))

    # ------------------------------------------------------------------ messages

    def _read_live(self, stream: LiveStream) -> None:
        # The hot path of the whole subscriber: one call receives a burst, and a shortcut
        # takes the common case (a batch delivered in order on a live stream).
        cursor = stream.cursor
        courier = self._courier
        messages = stream.receive(_READ_BURST, _READ_BYTES)
        stream.counts.received += len(messages)
        for message in messages:
            if isinstance(message, tuple):
                seq, payload = message
                if stream.state == "live" and cursor.accept(seq, payload):
                    courier.deliver(stream, seq, payload)
                    continue
                actions = cursor.on_live(seq, payload)
            else:
                try:
                    msg = parse_live(message)  # says what is wrong
                except DecodeError as exc:
                    courier.decode_failed(stream, exc)
                    continue
                actions = cursor.on_live(msg.seq, msg.payload)
            if len(actions) == 1 and type(actions[0]) is Deliver and stream.state == "live":
                # Changes neither the state nor the streams.
                courier.deliver(stream, actions[0].seq, actions[0].payload)
                continue
            courier.carry_out(stream, actions)
            if stream.spec.key not in self.streams:
                return

    def _on_replay_events(self, events: list[ReplayEvent]) -> None:
        for event in events:
            # The replay client keys replays by what it is handed (Hashable): here StreamKeys.
            stream = self.streams.get(event.key)  # type: ignore[call-overload]
            if stream is None or event.ticket != stream.ticket or stream.state == "failed":
                continue  # a removed stream, or a replay that was replaced
            try:
                if isinstance(event, ReplayBatch):
                    self._courier.replayed(stream, event.seq, event.payload)
                else:
                    self._courier.carry_out(stream, stream.cursor.on_replay_end(event.ok))
            except Exception as exc:
                self._stream_failed(stream, exc)

    @property
    def _courier(self) -> Courier:
        courier = self.courier
        assert courier is not None, "the I/O thread has not started"
        return courier

    # ------------------------------------------------------------------ stats

    def stream_stats(self, stream: LiveStream) -> StreamStats:
        """A snapshot of one stream's counters (read from another thread: approximate)."""
        return stream.stats(self.options.wall_clock())


def _add_error(spec: StreamSpec, reason: str) -> StreamAddError:
    return StreamAddError(
        worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=reason
    )

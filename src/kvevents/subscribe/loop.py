"""The subscriber's I/O thread: it owns every socket, runs the cursors, decodes and hands out.

One SUB per stream (sequences are comparable only within a stream, and a SUB connected to
several endpoints cannot tell which one a message came from), one wake-up PAIR for commands
from other threads, and the replay client's DEALERs, all on one poller.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq

from kvevents.errors import DecodeError, StreamAddError
from kvevents.events import AllBlocksCleared
from kvevents.ratelimit import RateLimitedWarning
from kvevents.subscribe.commands import (
    AddFailed,
    AddRequest,
    Command,
    Mailbox,
    RemoveStreams,
    Stop,
)
from kvevents.subscribe.cursor import (
    Action,
    Deliver,
    Duplicate,
    Gap,
    ReplayDone,
    Restart,
    Unrecoverable,
)
from kvevents.subscribe.fdlimit import room_for_stream
from kvevents.subscribe.handover import Handover
from kvevents.subscribe.live import LiveStream, open_stream
from kvevents.subscribe.outbox import Outbox
from kvevents.subscribe.replay import ReplayBatch, ReplayClient, ReplayEvent
from kvevents.subscribe.streams import (
    Delivery,
    FeedHealth,
    Item,
    StreamKey,
    StreamReset,
    StreamSpec,
    StreamStats,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import Applied, decode_batch, parse_live

log = logging.getLogger("kvevents.subscribe.subscriber")

# Live messages read from one SUB before looking at the others: fairness across streams.
_READ_BURST = 256
# Upper bound of one poll, so a missed wake-up can never hang the thread for long.
_MAX_POLL_MS = 1000


class Loop:
    """The body of the I/O thread. Other threads only call :meth:`command` and read stats."""

    def __init__(self, specs: list[StreamSpec], options: SubscriberOptions, outbox: Outbox[Item]):
        self.options = options
        self.outbox = outbox
        self.streams: dict[StreamKey, LiveStream] = {}
        self.callback_errors = 0
        # Why the thread died (None while it runs or after a clean stop).
        self.error: str | None = None
        # When the current turn of work began (None while waiting for work): stall detection.
        self.busy_since: float | None = None
        self._initial = specs
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Before the first socket: libzmq fixes the limit when it creates its socket table.
        self._ctx.set(zmq.MAX_SOCKETS, options.max_sockets)
        self._limits = options.decode_limits
        self._warnings = RateLimitedWarning(
            log, interval=options.gap_log_interval, clock=options.wall_clock
        )
        self._mailbox = Mailbox(self._ctx)
        self._by_socket: dict[zmq.Socket[bytes], LiveStream] = {}
        self._running = True
        self._turn = Handover(outbox, options.queue_bytes)
        outbox.on_low = self.wake

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
        self._turn.flush()
        self._after_shedding()
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
            self._emit(StreamReset(stream.spec, "removed"))

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
        stream.add("failures")
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
        self._publish_status(StreamStatus(spec, "failed"))

    # ------------------------------------------------------------------ messages

    def _read_live(self, stream: LiveStream) -> None:
        # The hot path of the whole subscriber: locals, and a shortcut for the common case
        # (a well-formed message delivered in order on a live stream).
        recv, cursor, counts = stream.recv, stream.cursor, stream.counts
        for _ in range(_READ_BURST):
            frames = recv()
            if frames is None:
                return
            counts["received"] += 1
            if len(frames) == 3 and len(frames[1]) == 8:
                seq = int.from_bytes(frames[1], "big")
                if stream.state == "live" and cursor.accept(seq, frames[2]):
                    self._deliver_payload(stream, seq, frames[2])
                    continue
                actions = cursor.on_live(seq, frames[2])
            else:
                try:
                    msg = parse_live(frames)  # says what is wrong
                except DecodeError as exc:
                    self._decode_failed(stream, exc)
                    continue
                actions = cursor.on_live(msg.seq, msg.payload)
            if len(actions) == 1 and type(actions[0]) is Deliver and stream.state == "live":
                self._deliver(stream, actions[0])  # changes neither the state nor the streams
                continue
            self._apply(stream, actions)
            if stream.spec.key not in self.streams:
                return

    def _on_replay_events(self, events: list[ReplayEvent]) -> None:
        for event in events:
            stream = self.streams.get(event.key)  # type: ignore[call-overload]
            if stream is None or event.ticket != stream.ticket or stream.state == "failed":
                continue  # a removed stream, or a replay that was replaced
            try:
                self._on_replay_event(stream, event)
            except Exception as exc:
                self._stream_failed(stream, exc)

    def _on_replay_event(self, stream: LiveStream, event: ReplayEvent) -> None:
        if isinstance(event, ReplayBatch):
            actions = stream.cursor.on_replay(event.seq, event.payload)
            if any(type(a) is Deliver and a.seq == event.seq for a in actions):
                stream.add("replayed")
        else:
            actions = stream.cursor.on_replay_end(event.ok)
        self._apply(stream, actions)

    def _apply(self, stream: LiveStream, actions: list[Action]) -> None:
        for action in actions:
            if type(action) is Deliver:
                self._deliver(stream, action)
            elif isinstance(action, Gap):
                self._gap(stream, action)
            elif isinstance(action, ReplayDone):
                self.replays.cancel(stream.spec.key)
            elif isinstance(action, Duplicate):
                stream.add("duplicates")
            elif isinstance(action, Restart):
                self._restart(stream, action)
            elif isinstance(action, Unrecoverable):
                self._unrecoverable(stream, action)
        if stream.cursor.state != stream.state and stream.shed_from is None:
            self._status(stream)

    def _deliver(self, stream: LiveStream, action: Deliver) -> None:
        self._deliver_payload(stream, action.seq, action.payload)

    def _deliver_payload(self, stream: LiveStream, seq: int, payload: bytes) -> None:
        if len(payload) > self.options.max_message_size:
            self._oversized(stream, seq, len(payload))
            return
        if self.options.on_payload is not None and self._consumer_applied(stream, seq, payload):
            return
        if stream.shed_from is not None or (
            self.options.callback is None and self._turn.over_budget(len(payload))
        ):
            self._shed_one(stream, seq)
            return
        try:
            decoded = decode_batch(payload, seq=seq, limits=self._limits)
        except DecodeError as exc:
            self._decode_failed(stream, exc)
            return
        except Exception as exc:  # a decoder bug must cost this payload only
            self._decode_failed(stream, DecodeError(f"decoder failed: {exc!r}", seq=seq))
            return
        batch = decoded.batch
        clears = not stream.cursor.complete and any(
            isinstance(e, AllBlocksCleared) for e in batch.events
        )  # only an incomplete stream needs to know
        self._account(
            stream, seq, Applied(batch.ts, len(batch.events), decoded.skipped_count, clears)
        )
        self._emit(Delivery(stream.spec, seq, batch), len(payload))

    def _consumer_applied(self, stream: LiveStream, seq: int, payload: bytes) -> bool:
        """Offer the payload to ``on_payload``: True when the consumer applied it (or failed
        on it, counted), False when it wants the usual delivery."""
        assert self.options.on_payload is not None
        try:
            applied = self.options.on_payload(stream.spec, seq, payload)
        except DecodeError as exc:
            self._decode_failed(stream, exc)
            return True
        except Exception:
            self.callback_errors += 1
            key = stream.spec.key
            log.exception("worker %s rank %s: on_payload failed on seq %d", *key, seq)
            applied = Applied(stream.last_ts or 0.0, 0)
        if applied is None:
            return False
        self._account(stream, seq, applied)
        return True

    def _account(self, stream: LiveStream, seq: int, applied: Applied) -> None:
        """The stats of a delivered batch (or one the on_payload consumer applied)."""
        counts = stream.counts
        counts["delivered"] += 1
        counts["events"] += applied.events
        if applied.skipped:
            counts["skipped_events"] += applied.skipped
        stream.last_seq = seq
        stream.last_ts = applied.ts
        if applied.clears and not stream.cursor.complete:
            # Everything before a cache reset is void: the view is whole again from here.
            stream.cursor.mark_complete()

    def _request_replay(self, stream: LiveStream, start: int) -> None:
        spec = stream.spec
        assert spec.replay_endpoint is not None  # the cursor only asks when it can replay
        stream.ticket = self.replays.request(
            spec.key, spec.replay_endpoint, start, curve=spec.curve or self.options.curve
        )

    def _gap(self, stream: LiveStream, gap: Gap) -> None:
        spec = stream.spec
        stream.add("gaps")
        stream.add("replays")
        self._request_replay(stream, gap.start)
        if gap.start == 0 and stream.last_seq is None:
            # Joining a stream that already started is routine, not a loss: no warning.
            log.info(
                "worker %s rank %d: joined at seq %d, replaying from 0",
                spec.worker_id,
                spec.rank,
                gap.end,
            )
            return
        self._warn(stream, "gap", "missing seq %d..%d, replaying", gap.start, gap.end - 1)

    def _restart(self, stream: LiveStream, restart: Restart) -> None:
        self.replays.cancel(stream.spec.key)
        stream.ticket = 0
        stream.add("restarts")
        self._warn(
            stream,
            "restart",
            "restarted (seq %d after %s); rebuilding",
            restart.seq,
            stream.last_seq,
        )
        self._emit(StreamReset(stream.spec, "restart"))

    def _unrecoverable(
        self, stream: LiveStream, lost: Unrecoverable, why: str | None = None
    ) -> None:
        stream.add("unrecoverable")
        stream.add("missing", lost.end - lost.start)
        spec = stream.spec
        if why is None:
            why = "replay did not have them" if spec.replay_endpoint else "no replay endpoint"
        self._warn(
            stream,
            "unrecoverable",
            "seq %d..%d cannot be recovered (%s); stream incomplete",
            lost.start,
            lost.end - 1,
            why,
        )
        stream.state = "incomplete"
        self._publish_status(StreamStatus(spec, "incomplete", (lost.start, lost.end)))

    def _status(self, stream: LiveStream) -> None:
        stream.state = stream.cursor.state
        if stream.state != "new":
            self._publish_status(StreamStatus(stream.spec, stream.state))

    def _oversized(self, stream: LiveStream, seq: int, size: int) -> None:
        stream.add("oversized")
        stream.cursor.complete = False  # the consumer never sees this batch
        why = f"{size} bytes, over max_message_size={self.options.max_message_size}"
        self._unrecoverable(stream, Unrecoverable(seq, seq + 1), f"dropped undecoded: {why}")

    def _decode_failed(self, stream: LiveStream, exc: DecodeError) -> None:
        stream.add("decode_errors")
        self._warn(stream, "decode", "undecodable message skipped: %s", exc)

    # ------------------------------------------------------------------ shedding

    def _shed_one(self, stream: LiveStream, seq: int) -> None:
        """Drop batch ``seq`` instead of queueing it: counted, and the stream marked
        incomplete until a replay from ``seq`` (once there is room) rebuilds it."""
        if self._turn.shed(stream, seq):
            self._warn(stream, "shed", "consumer behind (queue_bytes full): shed from %d", seq)
            stream.state = "incomplete"
            self._publish_status(StreamStatus(stream.spec, "incomplete"))

    def _after_shedding(self) -> None:
        """End of a turn: rewind the streams that shed; replay them once there is room."""
        shed, self._turn.shed_this_turn = self._turn.shed_this_turn, []
        for stream in shed:
            start, stream.shed_from = stream.shed_from, None
            if start is None or self.streams.get(stream.spec.key) is not stream:
                continue
            actions = stream.cursor.rewind(start)
            if actions and isinstance(actions[0], Gap):
                self.replays.cancel(stream.spec.key)
                stream.ticket = 0  # the running replay's answers are stale now
                self._turn.rebuilds[stream.spec.key] = actions[0]
            else:
                self._apply(stream, actions)
        if self._turn.room_to_rebuild():
            self._start_rebuilds()

    def _start_rebuilds(self) -> None:
        rebuilds, self._turn.rebuilds = self._turn.rebuilds, {}
        for key, gap in rebuilds.items():
            stream = self.streams.get(key)
            if stream is None or stream.cursor.next_seq != gap.start:
                continue  # removed, failed or restarted meanwhile: nothing to rebuild
            stream.add("replays")
            self._request_replay(stream, gap.start)

    # ------------------------------------------------------------------ output

    def _emit(self, item: Delivery | StreamReset, size: int = 0) -> None:
        callback = self.options.callback
        if callback is None:
            self._turn.add(item, size)
            return
        try:
            callback(item)
        except Exception:
            self.callback_errors += 1
            log.exception("subscriber callback failed on %r", type(item).__name__)

    def _publish_status(self, status: StreamStatus) -> None:
        if self.options.on_status is not None:
            try:
                self.options.on_status(status)
            except Exception:
                self.callback_errors += 1
                log.exception("subscriber status callback failed")
        if self.options.status_items:
            self._turn.add(status)

    def _warn(self, stream: LiveStream, kind: str, fmt: str, *args: object) -> None:
        """At most one warning per stream and kind per ``gap_log_interval`` seconds: a lossy
        link or a flapping publisher must not flood the log."""
        spec = stream.spec
        key = f"{spec.worker_id}/{spec.rank}/{kind}"
        self._warnings(key, "worker %s rank %d: " + fmt, spec.worker_id, spec.rank, *args)

    # ------------------------------------------------------------------ stats

    def stream_stats(self, stream: LiveStream) -> StreamStats:
        """A snapshot of one stream's counters (read from another thread: approximate)."""
        return stream.stats(self.options.wall_clock())


def _add_error(spec: StreamSpec, reason: str) -> StreamAddError:
    return StreamAddError(
        worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=reason
    )

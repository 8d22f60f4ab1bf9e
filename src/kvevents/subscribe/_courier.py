"""What the subscriber's I/O thread does with a cursor's verdicts: to the sink, or replayed.

The I/O thread's :class:`~kvevents.subscribe._loop.Loop` reads each stream's socket and
asks its :class:`~kvevents.subscribe._cursor.Cursor`; a :class:`Courier` carries out what the
cursor answers (deliver, gap, duplicate, restart, unrecoverable): batches, resets and state
changes go to the :class:`~kvevents.subscribe.Sink`, holes become replay requests,
everything is counted per stream, and losses are warned about (rate-limited). With the
subscriber's own queue as the sink, batches over its byte budget are shed and replayed once
it has room (:mod:`kvevents.subscribe._queueing`).

So a batch's way reads: socket -> :meth:`Loop._read_live` -> cursor -> :meth:`Courier.deliver`
-> :meth:`Sink.apply`.
"""

from __future__ import annotations

import logging

from kvevents.errors import DecodeError
from kvevents.events import StreamKey
from kvevents.ratelimit import RateLimitedWarning
from kvevents.subscribe._cursor import (
    Action,
    Deliver,
    Duplicate,
    Gap,
    ReplayDone,
    Restart,
    Unrecoverable,
)
from kvevents.subscribe._live import LiveStream
from kvevents.subscribe._queueing import QueueFull, QueueSink
from kvevents.subscribe._replay import ReplayClient
from kvevents.subscribe._sink import Sink
from kvevents.subscribe._streams import ResetReason, StreamStatus, SubscriberOptions
from kvevents.wire import Applied

__all__ = ["Courier"]

log = logging.getLogger("kvevents.subscribe.subscriber")


class Courier:
    """The cursor's verdicts carried out for the I/O thread (see the module docstring).

    ``streams`` is the loop's own table of streams (read here, never changed); ``queue`` is
    the sink again when it is the subscriber's own queue, the only sink that sheds.
    """

    def __init__(
        self,
        sink: Sink,
        queue: QueueSink | None,
        replays: ReplayClient,
        streams: dict[StreamKey, LiveStream],
        options: SubscriberOptions,
        warnings: RateLimitedWarning,
    ) -> None:
        self.sink = sink
        self.queue = queue
        self.replays = replays
        self.streams = streams
        self.options = options
        self._warnings = warnings
        #: Exceptions the sink raised (other than a DecodeError), logged: the thread goes on.
        self.sink_errors = 0
        # Streams that shed this turn, and shed streams waiting for room to replay.
        self._shed_this_turn: list[LiveStream] = []
        self._rebuilds: dict[StreamKey, Gap] = {}

    def carry_out(self, stream: LiveStream, actions: list[Action]) -> None:
        """Carry out ``actions`` in order, then report a change of the stream's state."""
        for action in actions:
            if type(action) is Deliver:
                self.deliver(stream, action.seq, action.payload)
            elif isinstance(action, Gap):
                self._gap(stream, action)
            elif isinstance(action, ReplayDone):
                self.replays.cancel(stream.spec.key)
            elif isinstance(action, Duplicate):
                stream.counts.duplicates += 1
            elif isinstance(action, Restart):
                self._restart(stream, action)
            elif isinstance(action, Unrecoverable):
                self._unrecoverable(stream, action)
        if stream.cursor.state != stream.state and stream.shed_from is None:
            stream.state = stream.cursor.state
            if stream.state != "new":
                self.status(StreamStatus(stream.spec, stream.state))

    def deliver(self, stream: LiveStream, seq: int, payload: bytes) -> None:
        """Hand batch ``seq`` to the sink and count what it applied."""
        # Once per batch: the checks and the sink call are inline, not through helpers.
        if len(payload) > self.options.max_message_size:
            self._oversized(stream, seq, len(payload))
            return
        if stream.shed_from is not None:  # the rest of a turn that shed is shed too
            self._shed_one(stream, seq)
            return
        try:
            applied = self.sink.apply(stream.spec, seq, payload)
        except QueueFull:
            self._shed_one(stream, seq)
            return
        except DecodeError as exc:
            self.decode_failed(stream, exc)
            return
        except Exception:
            self.sink_errors += 1
            log.exception("worker %s rank %s: the sink failed on seq %d", *stream.spec.key, seq)
            applied = Applied(stream.last_ts or 0.0, 0)
        counts = stream.counts
        counts.delivered += 1
        counts.events += applied.events
        if applied.skipped:
            counts.skipped_events += applied.skipped
        stream.last_seq = seq
        stream.last_ts = applied.ts
        if applied.clears and not stream.cursor.complete:
            # Everything before a cache reset is void: the view is whole again from here.
            stream.cursor.mark_complete()

    def reset(self, stream: LiveStream, reason: ResetReason) -> None:
        """Tell the sink to drop the stream (a failing sink is counted, not fatal)."""
        try:
            self.sink.reset(stream.spec, reason)
        except Exception:
            self.sink_errors += 1
            log.exception("worker %s rank %s: the sink failed on a reset", *stream.spec.key)

    def status(self, status: StreamStatus) -> None:
        """Tell the sink of a change of state (a failing sink is counted, not fatal)."""
        try:
            self.sink.status(status)
        except Exception:
            self.sink_errors += 1
            log.exception("worker %s rank %s: the sink failed on a status", *status.stream.key)

    def replayed(self, stream: LiveStream, seq: int, payload: bytes) -> None:
        """A replayed batch: the cursor places it, counted when it is delivered now."""
        actions = stream.cursor.on_replay(seq, payload)
        if any(type(a) is Deliver and a.seq == seq for a in actions):
            stream.counts.replayed += 1
        self.carry_out(stream, actions)

    def decode_failed(self, stream: LiveStream, exc: DecodeError) -> None:
        stream.counts.decode_errors += 1
        self._warn(stream, "decode", "undecodable message skipped: %s", exc)

    # ------------------------------------------------------------------ verdicts

    def _request_replay(self, stream: LiveStream, start: int) -> None:
        spec = stream.spec
        assert spec.replay_endpoint is not None  # the cursor only asks when it can replay
        stream.ticket = self.replays.request(
            spec.key, spec.replay_endpoint, start, curve=spec.curve or self.options.curve
        )

    def _gap(self, stream: LiveStream, gap: Gap) -> None:
        spec = stream.spec
        stream.counts.gaps += 1
        stream.counts.replays += 1
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
        stream.counts.restarts += 1
        self._warn(
            stream,
            "restart",
            "restarted (seq %d after %s); rebuilding",
            restart.seq,
            stream.last_seq,
        )
        self.reset(stream, "restart")

    def _unrecoverable(
        self, stream: LiveStream, lost: Unrecoverable, why: str | None = None
    ) -> None:
        stream.counts.unrecoverable += 1
        stream.counts.missing += lost.end - lost.start
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
        self.status(StreamStatus(spec, "incomplete", (lost.start, lost.end)))

    def _oversized(self, stream: LiveStream, seq: int, size: int) -> None:
        stream.counts.oversized += 1
        stream.cursor.complete = False  # the sink never sees this batch
        why = f"{size} bytes, over max_message_size={self.options.max_message_size}"
        self._unrecoverable(stream, Unrecoverable(seq, seq + 1), f"dropped undecoded: {why}")

    # ------------------------------------------------------------------ shedding

    def _shed_one(self, stream: LiveStream, seq: int) -> None:
        """Drop batch ``seq`` instead of queueing it: counted, and the stream marked
        incomplete until a replay from ``seq`` (once there is room) rebuilds it."""
        stream.counts.shed += 1
        if stream.shed_from is not None:
            return
        stream.shed_from = seq
        self._shed_this_turn.append(stream)
        self._warn(stream, "shed", "consumer behind (queue_bytes full): shed from %d", seq)
        stream.state = "incomplete"
        self.status(StreamStatus(stream.spec, "incomplete"))

    def end_turn(self) -> None:
        """Hand the turn's items over; rewind the streams that shed and replay them once
        the queue has room."""
        queue = self.queue
        if queue is None:
            return
        queue.flush()
        shed, self._shed_this_turn = self._shed_this_turn, []
        for stream in shed:
            start, stream.shed_from = stream.shed_from, None
            if start is None or self.streams.get(stream.spec.key) is not stream:
                continue
            actions = stream.cursor.rewind(start)
            if actions and isinstance(actions[0], Gap):
                self.replays.cancel(stream.spec.key)
                stream.ticket = 0  # the running replay's answers are stale now
                self._rebuilds[stream.spec.key] = actions[0]
            else:
                self.carry_out(stream, actions)
        if self._rebuilds and queue.has_room():
            self._start_rebuilds()

    def _start_rebuilds(self) -> None:
        rebuilds, self._rebuilds = self._rebuilds, {}
        for key, gap in rebuilds.items():
            stream = self.streams.get(key)
            if stream is None or stream.cursor.next_seq != gap.start:
                continue  # removed, failed or restarted meanwhile: nothing to rebuild
            stream.counts.replays += 1
            self._request_replay(stream, gap.start)

    def _warn(self, stream: LiveStream, kind: str, fmt: str, *args: object) -> None:
        """At most one warning per stream and kind per ``gap_log_interval`` seconds: a lossy
        link or a flapping publisher must not flood the log."""
        spec = stream.spec
        key = f"{spec.worker_id}/{spec.rank}/{kind}"
        self._warnings(key, "worker %s rank %d: " + fmt, spec.worker_id, spec.rank, *args)

"""What the subscriber's I/O thread does with a cursor's verdicts: deliver, replay, shed, warn.

:class:`Actions` is the half of :class:`~kvevents.subscribe.loop.Loop` that turns the
cursor's actions (deliver, gap, duplicate, restart, unrecoverable) into deliveries, replay
requests, counters, status items and rate-limited warnings, and sheds batches while the
consumer is behind. The other half (the sockets, the poller, the commands) stays in loop.py.
"""

from __future__ import annotations

import logging

from kvevents.errors import DecodeError
from kvevents.events import AllBlocksCleared, StreamKey
from kvevents.ratelimit import RateLimitedWarning
from kvevents.subscribe.cursor import (
    Action,
    Deliver,
    Duplicate,
    Gap,
    ReplayDone,
    Restart,
    Unrecoverable,
)
from kvevents.subscribe.handover import Handover
from kvevents.subscribe.live import LiveStream
from kvevents.subscribe.replay import ReplayClient
from kvevents.subscribe.streams import (
    Delivery,
    StreamReset,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import Applied, DecodeLimits, decode_batch

__all__ = ["Actions"]

log = logging.getLogger("kvevents.subscribe.subscriber")


class Actions:
    """The cursor's actions carried out; mixed into the I/O thread's :class:`Loop`, which
    sets these attributes up."""

    options: SubscriberOptions
    streams: dict[StreamKey, LiveStream]
    replays: ReplayClient
    callback_errors: int
    _turn: Handover
    _limits: DecodeLimits
    _warnings: RateLimitedWarning

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
        # Once per batch: the on_payload consumer is called here, not through a helper.
        options = self.options
        if len(payload) > options.max_message_size:
            self._oversized(stream, seq, len(payload))
            return
        on_payload = options.on_payload
        if on_payload is not None:
            try:
                applied = on_payload(stream.spec, seq, payload)
            except DecodeError as exc:
                self._decode_failed(stream, exc)
                return
            except Exception:
                self.callback_errors += 1
                key = stream.spec.key
                log.exception("worker %s rank %s: on_payload failed on seq %d", *key, seq)
                applied = Applied(stream.last_ts or 0.0, 0)
            if applied is not None:  # the consumer applied it (or failed on it, counted)
                self._account(stream, seq, applied)
                return
        if stream.shed_from is not None or (
            options.callback is None and self._turn.over_budget(len(payload))
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

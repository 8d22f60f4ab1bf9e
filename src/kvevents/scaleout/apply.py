"""A replica's records applied to its index service, one message at a time, none fatal.

:class:`RecordApplier` holds what a replica knows per stream (its cursor, its spec) and turns
each JetStream message into calls on the :class:`~kvevents.service.core.IndexService`: a
``worker`` record registers, a ``batch`` is applied when its cursor says so, ``reset``,
``loss`` and ``live`` change the stream's state. A message that is not a relay record, or
whose record breaks a bound, is counted as ``malformed``; a record that raises anyway is
counted in ``apply_errors`` and logged (rate-limited); in both cases the next message is
applied. Nothing a message on the subject carries can stop a replica.

A batch's payload is decoded before its cursor moves (:meth:`StreamCursor.judge` decides,
:meth:`StreamCursor.accept` notes): an undecodable payload, whatever sequence it claims,
leaves the stream as it was.
"""

from __future__ import annotations

import logging

from kvevents.errors import DecodeError, LayoutError
from kvevents.ratelimit import RateLimitedWarning
from kvevents.scaleout.cursor import BatchVerdict, CursorState, StreamCursor
from kvevents.scaleout.records import RecordError, RelayRecord, parse_record
from kvevents.scaleout.snapshot import Snapshot
from kvevents.service.core import IndexService
from kvevents.service.feed import WorkerRegistration
from kvevents.subscribe.streams import StreamKey, StreamReset, StreamSpec, StreamStatus
from kvevents.wire import decode_batch_packed
from kvevents.wire.endpoints import rank_endpoint

__all__ = ["RecordApplier"]

log = logging.getLogger("kvevents.scaleout.replica")
# A stream of hostile messages is one line per kind of fault per 10 s, with a count.
_warn = RateLimitedWarning(log, 10.0)


class RecordApplier:
    """Records in, index service calls out (the replica's event loop thread only).

    ``counts`` is the replica's stats dict (the fields of ``ReplicaStats``); ``service`` is
    set by the replica once it is made (the service's stream specs come from here).
    """

    def __init__(self, counts: dict[str, int], window: int, name: str) -> None:
        self.counts = counts
        self.window = window
        self.name = name
        self.service: IndexService
        self.cursors: dict[StreamKey, StreamCursor] = {}
        self._specs: dict[StreamKey, StreamSpec] = {}
        self._registering = False

    def stream_specs(self, reg: WorkerRegistration) -> list[StreamSpec]:
        """No streams: the relay reads the engines. A registration from anywhere but the
        stream (``POST /register``) is refused, naming where workers are registered."""
        if not self._registering:
            raise LayoutError(
                "this service is a replica fed by NATS JetStream: register workers with the "
                "relay (kvevents relay)",
                endpoint=reg.endpoint,
                rank=None,
                rule="replica",
            )
        return []

    # ----------------------------------------------------------------- one message

    def apply(self, headers: dict[str, str] | None, body: bytes, seq: int = 0) -> None:
        """Apply one message (stream sequence ``seq``); counts and logs what it cannot."""
        try:
            record = parse_record(headers, body)
        except RecordError as exc:
            self.counts["malformed"] += 1
            _warn("malformed", "replica %s: message %d skipped: %s", self.name, seq, exc)
            return
        try:
            self._apply(record)
        except Exception as exc:  # a defect or a bound we missed: this record only
            self.counts["apply_errors"] += 1
            _warn(
                "apply",
                "replica %s: message %d (%s of %r rank %d) not applied: %r",
                self.name,
                seq,
                record.kind,
                record.worker_id[:64],
                record.rank,
                exc,
            )

    def _apply(self, record: RelayRecord) -> None:
        if record.kind == "worker":
            self._register(record.registration())
            return
        spec = self._spec(record.key)
        if spec is None:
            self.counts["unregistered"] += 1
            return
        cursor = self.cursor(record.key)
        if record.kind == "batch":
            self._batch(spec, cursor, record)
        elif record.kind == "reset":
            self._reset_record(spec, cursor, record)
        elif record.kind == "loss":
            self._loss(spec, cursor, record)
        else:
            self._live(spec, cursor, record)

    def cursor(self, key: StreamKey) -> StreamCursor:
        cursor = self.cursors.get(key)
        if cursor is None:
            cursor = self.cursors[key] = StreamCursor(self.window)
        return cursor

    # ----------------------------------------------------------------- registrations

    def _register(self, reg: WorkerRegistration) -> None:
        current = {r.worker_id: r for r in self.service.workers()}.get(reg.worker_id)
        if current is not None and _indexed_as(current) == _indexed_as(reg):
            return  # a relay restarted: the same registration again keeps the blocks
        self.register_worker(reg)
        for rank in reg.ranks:
            self._specs.pop((reg.worker_id, rank), None)
        self.counts["registrations"] += 1

    def register_worker(self, reg: WorkerRegistration) -> None:
        self._registering = True
        try:
            self.service.register(reg, persist=False)
        finally:
            self._registering = False

    def _spec(self, key: StreamKey) -> StreamSpec | None:
        spec = self._specs.get(key)
        if spec is not None:
            return spec
        reg = {r.worker_id: r for r in self.service.workers()}.get(key[0])
        if reg is None or key[1] not in reg.ranks:
            return None
        spec = StreamSpec(key[0], key[1], rank_endpoint(reg.endpoint, key[1]))
        self._specs[key] = spec
        return spec

    # ----------------------------------------------------------------- stream records

    def _batch(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        verdict = cursor.judge(record.seq, record.digest)
        if verdict == "duplicate" or verdict == "stale":
            self.counts["duplicates" if verdict == "duplicate" else "stale"] += 1
            return
        if verdict in ("restart", "rewind") and not self._decodable(record):
            return  # a reset for a payload nobody can read would only lose the stream
        if verdict in ("restart", "rewind"):
            self._reset(spec)
        try:
            self.service.apply_payload(spec, record.seq, record.body)
        except DecodeError:
            self.counts["undecodable"] += 1
            return
        cursor.accept(record.seq, record.digest, verdict)
        self.counts["applied"] += 1
        self._after(spec, cursor, verdict, record.seq)

    def _decodable(self, record: RelayRecord) -> bool:
        try:
            decode_batch_packed(record.body, seq=record.seq)
        except DecodeError:
            self.counts["undecodable"] += 1
            return False
        return True

    def _after(
        self, spec: StreamSpec, cursor: StreamCursor, verdict: BatchVerdict, seq: int
    ) -> None:
        """What a verdict tells beyond the batch: a gap degrades the stream, a rewind is
        counted and logged."""
        if verdict == "gap" and cursor.gap is not None:
            self.counts["gaps"] += 1
            self._degrade(spec, cursor, cursor.gap)
            _warn(
                "gap",
                "replica %s: worker %r rank %d: batches %d..%d never arrived (no loss record): "
                "the stream is degraded",
                self.name,
                spec.worker_id[:64],
                spec.rank,
                cursor.gap[0],
                cursor.gap[1] - 1,
            )
        elif verdict == "rewind":
            self.counts["rewinds"] += 1
            log.warning(
                "replica %s: worker %r rank %d went on at seq %d, below a sequence that had "
                "jumped ahead (a forged or misnumbered message): the stream is rebuilt from here",
                self.name,
                spec.worker_id[:64],
                spec.rank,
                seq,
            )

    def _reset_record(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if cursor.reset(record.seq, record.digest):
            self._reset(spec)

    def _reset(self, spec: StreamSpec) -> None:
        self.service.consume(StreamReset(spec, "restart"))
        self.service.on_status(StreamStatus(spec, "live"))
        self.counts["restarts"] += 1

    def _loss(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if not cursor.loss(record.seq, record.end):
            return
        self.counts["losses"] += 1
        if record.seq > 0:
            self._degrade(spec, cursor, (record.seq, record.end))
        else:  # from 0: it hides stores only, the index under-matches (as on_status says)
            self.service.on_status(StreamStatus(spec, "incomplete", (record.seq, record.end)))

    def _degrade(self, spec: StreamSpec, cursor: StreamCursor, missing: tuple[int, int]) -> None:
        """The service degrades the stream in routing; the cursor keeps why, for snapshots."""
        self.service.on_status(StreamStatus(spec, "incomplete", missing))
        cursor.degraded = f"lost seq {missing[0]}..{missing[1] - 1}"

    def _live(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if cursor.degraded is not None and record.seq >= cursor.last_seq:
            cursor.degraded = None
            self.service.on_status(StreamStatus(spec, "live"))

    # ----------------------------------------------------------------- the replica's view

    def load(self, loaded: Snapshot) -> None:
        """Register the snapshot's workers, take its cursors and degrade in routing the
        streams it saved as degraded (the replica restores the index itself)."""
        for reg in loaded.workers():
            self.register_worker(reg)
        for state in loaded.cursors:
            key = (state.worker_id, state.rank)
            self.cursors[key] = StreamCursor.restored(state, self.window)
            if state.degraded is not None:
                self._mark(key, state.degraded)

    def mark_hole(self, first: int, end: int) -> int:
        """Degrade every stream known: messages ``first`` .. ``end - 1`` of the JetStream
        stream are gone unread, and any of them may have been its. How many were marked."""
        why = f"messages {first}..{end - 1} of the JetStream stream were trimmed unread"
        keys = [(reg.worker_id, rank) for reg in self.service.workers() for rank in reg.ranks]
        for key in keys:
            self.cursor(key).degraded = why
            self._mark(key, why)
        return len(keys)

    def _mark(self, key: StreamKey, why: str) -> None:
        with self.service.lock:
            self.service.router.mark_degraded(*key, why)

    def states(self) -> list[CursorState]:
        return [c.state(*key) for key, c in self.cursors.items()]

    def degraded(self) -> tuple[int, str | None]:
        """How many streams are degraded in routing, and one of them with why."""
        with self.service.lock:
            marks = self.service.router.degraded
            first = next(iter(marks.items()), None)
            count = len(marks)
        if first is None:
            return 0, None
        (worker_id, rank), why = first
        return count, f"worker {worker_id[:64]!r} rank {rank}: {why}"


def _indexed_as(reg: WorkerRegistration) -> tuple[object, ...]:
    """What of a registration the replica's index depends on (not its endpoints)."""
    return (reg.block_size, reg.ranks, reg.model_name, reg.report_mode)

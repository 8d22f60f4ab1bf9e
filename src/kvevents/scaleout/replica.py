"""A router replica: an :class:`~kvevents.service.core.IndexService` fed from JetStream.

At start a :class:`Replica` loads the newest snapshot (:mod:`kvevents.scaleout.snapshot`) of
its stream, creates its durable consumer at the sequence after it, and from then on fetches
messages in order, applies them through the service (the same index, router and HTTP API as
with ZeroMQ), and acknowledges the last of each fetch. Every ``snapshot_batches`` applied
messages or ``snapshot_interval`` seconds it saves a snapshot and trims the stream below what
every live replica has acknowledged and the newest snapshot covers
(:mod:`kvevents.scaleout.retention`).

The consumer is the replica's bookmark for retention, not for resuming: the index lives in
memory, so a restarted replica starts again from the newest snapshot and recreates its
consumer there. Messages are applied on the replica's event loop thread, one at a time under
the service's lock; snapshots are taken between fetches, so a snapshot's sequence is exactly
what its index holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any

from kvevents.errors import DecodeError, LayoutError
from kvevents.index.digest import IndexDigest
from kvevents.scaleout import snapshot as snap
from kvevents.scaleout.cursor import StreamCursor
from kvevents.scaleout.digest import service_digest
from kvevents.scaleout.jetstream import JetStreamOptions, LoopThread, connect, ensure_stream
from kvevents.scaleout.records import RecordError, RelayRecord, parse_record
from kvevents.scaleout.replica_records import JetStreamFeed, ReplicaOptions, ReplicaStats
from kvevents.scaleout.retention import newest_snapshots, trim
from kvevents.service.core import IndexService
from kvevents.service.feed import WorkerRegistration
from kvevents.subscribe.streams import (
    FeedHealth,
    StreamKey,
    StreamReset,
    StreamSpec,
    StreamStatus,
)
from kvevents.wire.endpoints import rank_endpoint

__all__ = ["Replica", "ReplicaOptions", "ReplicaStats"]

log = logging.getLogger("kvevents.scaleout.replica")


class Replica:
    """A JetStream consumer applying the relay's stream to an index service."""

    def __init__(
        self,
        url: str,
        service: IndexService | None = None,
        *,
        jetstream: JetStreamOptions | None = None,
        options: ReplicaOptions | None = None,
    ) -> None:
        self.url = url
        self.js_options = jetstream or JetStreamOptions()
        self.options = options or ReplicaOptions()
        self.service = service or self.new_service()
        self._cursors: dict[StreamKey, StreamCursor] = {}
        self._specs: dict[StreamKey, StreamSpec] = {}
        self._counts = {f.name: 0 for f in dataclasses.fields(ReplicaStats)}
        self._aio: LoopThread | None = None
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._task: Any = None
        self._closing = False
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        self._registering = False

    def new_service(self, **kwargs: Any) -> IndexService:
        """An index service this replica can feed (``kwargs`` go to IndexService)."""
        return IndexService(feed=JetStreamFeed(self.health), pushes=True,
                            stream_specs=self._stream_specs, **kwargs)  # fmt: skip

    def _stream_specs(self, reg: WorkerRegistration) -> list[StreamSpec]:
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

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Replica:
        """Connect, load the newest snapshot, create the consumer and start applying."""
        self._aio = LoopThread(f"kvevents-replica-{self.options.name}")
        try:
            self._aio.run(self._start(), self.options.start_timeout)
        except BaseException:
            self.close()
            raise
        self.service.start()
        return self

    async def _start(self) -> None:
        self._nc = await connect(self.url, self.js_options, f"kvevents-{self.options.name}")
        self._js = self._nc.jetstream()
        await ensure_stream(self._js, self.js_options)
        self._store = await _object_store(self._js, self.js_options)
        psub = await self._subscribe()
        self._task = asyncio.get_running_loop().create_task(self._consume(psub))

    async def _subscribe(self) -> Any:
        """Load the newest snapshot and bind a fresh consumer after it; when the stream was
        trimmed past that snapshot meanwhile (another replica saved a newer one), again."""
        for _ in range(5):
            loaded, start = await self._newest_snapshot()
            await self._recreate_consumer(start)
            first = (await self._js.stream_info(self.js_options.stream)).state.first_seq
            if first <= start or loaded is None:
                break
        if first > start:
            self._counts["start_gap"] = first - start
            log.error("replica %s: the stream starts at %d, after the snapshot's %d: %d "
                      "message(s) lost", self.options.name, first, start - 1, first - start)  # fmt: skip
        if loaded is not None:
            self._load(loaded)
        return await self._js.pull_subscribe_bind(
            durable=self.options.name, stream=self.js_options.stream
        )

    async def _newest_snapshot(self) -> tuple[snap.Snapshot | None, int]:
        """The newest readable snapshot and the sequence to start after it (1: none)."""
        for name, _seq in await newest_snapshots(self._store):
            try:
                result = await self._store.get(name)
                loaded = snap.decode(result.data, name)
                return loaded, loaded.seq + 1
            except Exception as exc:  # replaced or unreadable: the next newest will do
                log.warning("replica %s: snapshot %s not loaded: %s", self.options.name, name, exc)
        return None, 1

    async def _recreate_consumer(self, start: int) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        name, stream = self.options.name, self.js_options.stream
        with contextlib.suppress(NotFoundError):
            await self._js.delete_consumer(stream, name)
        config = ConsumerConfig(
            durable_name=name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=AckPolicy.ALL,
            max_ack_pending=-1,
            inactive_threshold=self.options.inactive_threshold,
        )
        await self._js.add_consumer(stream, config)

    def _load(self, loaded: snap.Snapshot) -> None:
        service = self.service
        for reg in loaded.workers():
            self._register_worker(reg)
        with service.lock:
            snap.restore(service.index, loaded)
        for state in loaded.cursors:
            key = (state.worker_id, state.rank)
            self._cursors[key] = StreamCursor.restored(state, self.options.window)
            if state.degraded is not None:
                service.router.mark_degraded(*key, state.degraded)
        self._counts["loaded_seq"] = self._counts["covered_seq"] = loaded.seq
        log.info("replica %s: loaded snapshot of seq %d (%d blocks)", self.options.name,
                 loaded.seq, loaded.blocks)  # fmt: skip

    def close(self, timeout: float = 5.0) -> None:
        """Stop applying and disconnect (the consumer stays until it is inactive)."""
        self._closing = True
        if self._aio is None:
            return
        if self._task is not None:
            self._aio.loop.call_soon_threadsafe(self._task.cancel)
        try:
            self._aio.run(self._disconnect(), timeout)
        except Exception:
            log.warning("replica: the NATS connection did not close cleanly", exc_info=True)
        self._aio.close()
        self._aio = None
        self.service.close()

    async def _disconnect(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- consuming

    async def _consume(self, psub: Any) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while not self._closing:
            try:
                msgs = await psub.fetch(batch=self.options.fetch, timeout=0.5)
            except (NatsTimeout, asyncio.TimeoutError):
                await self._maybe_snapshot()
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server restarting: the client reconnects
                log.info("replica %s: fetch failed (%r); again", self.options.name, exc)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                self._apply(msg.headers, msg.data)
            self._counts["covered_seq"] = msgs[-1].metadata.sequence.stream
            self._since_snapshot += len(msgs)
            await self._ack(msgs[-1])
            await self._maybe_snapshot()

    async def _ack(self, msg: Any) -> None:
        try:
            await msg.ack()  # acknowledges every message before it too (AckPolicy.ALL)
        except Exception as exc:  # redelivered later: the cursors drop the copies
            log.info("replica %s: ack failed (%r)", self.options.name, exc)

    def _apply(self, headers: dict[str, str] | None, body: bytes) -> None:
        try:
            record = parse_record(headers, body)
        except RecordError as exc:
            self._counts["malformed"] += 1
            log.debug("replica %s: message skipped: %s", self.options.name, exc)
            return
        if record.kind == "worker":
            self._register(record)
            return
        spec = self._spec(record.key)
        if spec is None:
            self._counts["unregistered"] += 1
            return
        cursor = self._cursors.get(record.key)
        if cursor is None:
            cursor = self._cursors[record.key] = StreamCursor(self.options.window)
        _APPLY[record.kind](self, spec, cursor, record)

    def _register(self, record: RelayRecord) -> None:
        try:
            reg = record.registration()
        except RecordError:
            self._counts["malformed"] += 1
            return
        current = {r.worker_id: r for r in self.service.workers()}.get(reg.worker_id)
        same = current is not None and (current.block_size, current.ranks) == (
            reg.block_size,
            reg.ranks,
        )
        if same:
            return  # a relay restarted: the same registration again keeps the blocks
        self._register_worker(reg)
        for rank in reg.ranks:
            self._specs.pop((reg.worker_id, rank), None)
        self._counts["registrations"] += 1

    def _register_worker(self, reg: WorkerRegistration) -> None:
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

    def _batch(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        verdict = cursor.batch(record.seq, record.digest)
        if verdict == "duplicate" or verdict == "stale":
            self._counts["duplicates" if verdict == "duplicate" else "stale"] += 1
            return
        if verdict == "restart":
            self._reset(spec)
        try:
            self.service.apply_payload(spec, record.seq, record.body)
        except DecodeError:
            self._counts["undecodable"] += 1
            return
        self._counts["applied"] += 1

    def _reset_record(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if cursor.reset(record.seq, record.digest):
            self._reset(spec)

    def _reset(self, spec: StreamSpec) -> None:
        self.service.consume(StreamReset(spec, "restart"))
        self.service.on_status(StreamStatus(spec, "live"))
        self._counts["restarts"] += 1

    def _loss(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if not cursor.loss(record.seq, record.end):
            return
        self._counts["losses"] += 1
        self.service.on_status(StreamStatus(spec, "incomplete", (record.seq, record.end)))
        if record.seq > 0:
            cursor.degraded = f"lost seq {record.seq}..{record.end - 1}"

    def _live(self, spec: StreamSpec, cursor: StreamCursor, record: RelayRecord) -> None:
        if cursor.degraded is not None and record.seq >= cursor.last_seq:
            cursor.degraded = None
            self.service.on_status(StreamStatus(spec, "live"))

    # ----------------------------------------------------------------- snapshots

    async def _maybe_snapshot(self) -> None:
        opts = self.options
        due = opts.snapshot_batches and self._since_snapshot >= opts.snapshot_batches
        late = (
            opts.snapshot_interval
            and time.monotonic() - self._snapshot_at >= opts.snapshot_interval
        )
        if (due or late) and self._since_snapshot:
            await self.save_snapshot()

    async def save_snapshot(self) -> int | None:
        """Save a snapshot of what is applied now, then trim; its sequence (None: failed)."""
        taken = self._capture()
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        data = snap.encode(taken)
        name = f"{self.js_options.stream}.{self.options.name}"
        from nats.js.api import ObjectMeta

        meta = ObjectMeta(description=json.dumps({"seq": taken.seq, "blocks": taken.blocks}))
        try:
            await self._store.put(name, data, meta=meta)
        except Exception:
            self._counts["snapshot_errors"] += 1
            log.exception("replica %s: snapshot of seq %d not saved", self.options.name, taken.seq)
            return None
        self._counts["snapshots"] += 1
        if self.options.trim and await trim(self._js, self._store, self.js_options):
            self._counts["trims"] += 1
        return taken.seq

    def _capture(self) -> snap.Snapshot:
        service = self.service
        workers = service.workers()
        cursors = [c.state(*key) for key, c in self._cursors.items()]
        return snap.capture(
            service.index,
            stream=self.js_options.stream,
            seq=self._counts["covered_seq"],
            replica=self.options.name,
            workers=workers,
            cursors=cursors,
            hold=lambda: service.lock,
        )

    def snapshot_now(self, timeout: float = 60.0) -> int | None:
        """Save a snapshot now (from any thread); its sequence, None if it was not saved."""
        assert self._aio is not None, "start the replica first"
        return self._aio.run(self.save_snapshot(), timeout)

    # ----------------------------------------------------------------- reads

    def digest(self) -> IndexDigest:
        """The digest of the replica's index (:func:`kvevents.index.digest.index_digest`)."""
        return service_digest(self.service)

    def stats(self) -> ReplicaStats:
        return ReplicaStats(**self._counts)

    @property
    def covered_seq(self) -> int:
        """The last stream sequence applied."""
        return self._counts["covered_seq"]

    def health(self) -> FeedHealth:
        if self._aio is None or self._task is None:
            return FeedHealth("dead", False, 0.0, "the replica is not running")
        if self._task.done():
            return FeedHealth("dead", False, 0.0, "the replica stopped consuming")
        connected = self._nc is not None and self._nc.is_connected
        return FeedHealth("ok" if connected else "stalled", True, 0.0,
                          None if connected else "reconnecting to NATS")  # fmt: skip


_APPLY = {
    "batch": Replica._batch,
    "reset": Replica._reset_record,
    "loss": Replica._loss,
    "live": Replica._live,
}


async def _object_store(js: Any, options: JetStreamOptions) -> Any:
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(options.bucket)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_object_store(options.bucket)

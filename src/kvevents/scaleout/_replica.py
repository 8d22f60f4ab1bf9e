"""A router replica: an :class:`~kvevents.service.IndexService` fed from JetStream.

At start a :class:`Replica` loads the newest snapshot (:mod:`kvevents.scaleout._snapshot`) of
its stream, creates its durable consumer at the sequence after it, and from then on fetches
messages in order, applies them through the service's sink methods, as a subscriber does (the
same index, router and HTTP API as with ZeroMQ), and acknowledges the last of each fetch. Every ``snapshot_batches`` applied
messages or ``snapshot_interval`` seconds it saves a snapshot and trims the stream below what
every live replica has acknowledged and that snapshot covers
(:mod:`kvevents.scaleout._retention`).

The consumer is the replica's bookmark for retention, not for resuming: the index lives in
memory, so a restarted replica starts again from the newest snapshot and recreates its
consumer there. Messages are applied on the replica's event loop thread, one at a time
(:mod:`kvevents.scaleout._apply`); snapshots are taken between fetches, so a snapshot's
sequence is exactly what its index holds, and copied and loaded through the service
(:meth:`IndexService.copy_index`, :meth:`IndexService.load_index`), under its lock.

Nothing stops the consume loop for good: a message it cannot apply is counted and skipped, a
turn that raises is counted and logged and the loop goes on, a loop that ends anyway is
counted, logged and started again (on a consumer recreated where the replica was), and a
consumer the server lost is recreated. ``health()`` says which: ``dead`` while the loop is
not running, ``stalled`` while it cannot fetch, ``degraded`` while some streams are known
incomplete (their matches are not trusted in routing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from kvevents.index import IndexDigest, holders_digest
from kvevents.ratelimit import RateLimitedWarning
from kvevents.scaleout import _snapshot as snap
from kvevents.scaleout._apply import RecordApplier
from kvevents.scaleout._jetstream import JetStreamOptions, LoopThread, connect, ensure_stream
from kvevents.scaleout._replica_records import (
    JetStreamFeed,
    ReplicaCounts,
    ReplicaOptions,
    ReplicaStats,
)
from kvevents.scaleout._retention import newest_snapshots, trim
from kvevents.service import IndexService
from kvevents.subscribe import FeedHealth

__all__ = ["Replica", "ReplicaOptions", "ReplicaStats"]

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.object_store import ObjectStore

    PullSubscription = JetStreamContext.PullSubscription

log = logging.getLogger("kvevents.scaleout.replica")
# A server restarting fails every fetch (5 a second): one line per 10 s, with a count.
_warn = RateLimitedWarning(log, 10.0)
# Seconds between fetches that failed, and after a turn of the loop that raised.
_RETRY_DELAY = 0.2


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
        self._counts = ReplicaCounts()
        self._applier = RecordApplier(self._counts, self.options.window, self.options.name)
        self.service = service or self.new_service()
        self._aio: LoopThread | None = None
        # nats-py's client, JetStream context and object store: set by start() before any use
        # (Any, not Optional: every use would otherwise re-check what start() guarantees).
        self._nc: Any = None
        self._js: Any = None  # the same, for the JetStream context
        self._store: Any = None  # the same, for the object store
        self._task: asyncio.Task[None] | None = None
        self._psub: PullSubscription | None = None  # what the consume loop fetches from
        self._closing = False
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        self._turned_at = time.monotonic()
        #: Why fetches fail now (None: they do not); why the consume loop last ended.
        self._failing: str | None = None
        self._ended: str | None = None
        #: Messages trimmed unread at start, when no stream was known to degrade for them.
        self._hole: str | None = None

    @property
    def service(self) -> IndexService:
        """The index service this replica feeds (set it before :meth:`start`)."""
        return self._applier.service

    @service.setter
    def service(self, service: IndexService) -> None:
        self._applier.service = service

    def new_service(self, **kwargs: Any) -> IndexService:  # IndexService's keywords
        """An index service this replica can feed (``kwargs`` go to IndexService)."""
        return IndexService(
            feed=lambda sink: JetStreamFeed(self.health),
            stream_specs=self._applier.stream_specs,
            **kwargs,
        )

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
        self._spawn(self._consume(psub))

    async def _subscribe(self) -> PullSubscription:
        """Load the newest snapshot and bind a fresh consumer after it; when the stream was
        trimmed past that snapshot meanwhile (another replica saved a newer one), again."""
        for _ in range(5):
            loaded, start = await self._newest_snapshot()
            await self._recreate_consumer(start)
            first = await self._first_seq()
            if first <= start or loaded is None:
                break
        if loaded is not None:
            self._load(loaded)
        self._note_hole(start, first)
        return await self._bind()

    async def _rebind(self) -> PullSubscription:
        """A consumer again where this replica was (the server lost it, or the loop ended)."""
        start = self._counts.covered_seq + 1
        await self._recreate_consumer(start)
        self._note_hole(start, await self._first_seq())
        self._counts.rebinds += 1
        log.warning("replica %s: consumer recreated at seq %d", self.options.name, start)
        return await self._bind()

    async def _bind(self) -> PullSubscription:
        js: JetStreamContext = self._js
        return await js.pull_subscribe_bind(
            durable=self.options.name, stream=self.js_options.stream
        )

    async def _first_seq(self) -> int:
        return int((await self._js.stream_info(self.js_options.stream)).state.first_seq)

    def _note_hole(self, start: int, first: int) -> None:
        """Messages ``start`` .. ``first - 1`` were trimmed before this replica read them:
        count them, say so, and degrade every stream they may have belonged to."""
        if first <= start:
            return
        self._counts.start_gap += first - start
        marked = self._applier.mark_hole(start, first)
        if not marked:
            self._hole = f"messages {start}..{first - 1} of the stream were trimmed unread"
        log.error(
            "replica %s: the stream starts at seq %d, after %d: %d message(s) lost unread, "
            "%d stream(s) degraded; a replica started after a newer snapshot is saved "
            "will not miss them",
            self.options.name,
            first,
            start - 1,
            first - start,
            marked,
        )

    async def _newest_snapshot(self) -> tuple[snap.Snapshot | None, int]:
        """The newest readable snapshot of this stream and the sequence after it (1: none)."""
        stream = self.js_options.stream
        for name, _seq in await newest_snapshots(self._store, stream):
            try:
                result = await self._store.get(name)
                loaded = snap.decode(result.data, name)
            except Exception as exc:  # replaced or unreadable: the next newest will do
                log.warning("replica %s: snapshot %s not loaded: %s", self.options.name, name, exc)
                continue
            if loaded.stream == stream:
                return loaded, loaded.seq + 1
            log.warning(
                "replica %s: snapshot %s is of stream %r, not %r: not loaded",
                self.options.name,
                name,
                loaded.stream,
                stream,
            )
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
        self._applier.load(loaded)
        self.service.load_index(lambda index: snap.restore(index, loaded))
        self._counts.loaded_seq = self._counts.covered_seq = loaded.seq
        log.info(
            "replica %s: loaded snapshot of seq %d (%d blocks)",
            self.options.name,
            loaded.seq,
            loaded.blocks,
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop applying and disconnect (the consumer stays until it is inactive)."""
        self._closing = True
        if self._aio is None:
            return
        task = self._task
        if task is not None:
            self._aio.loop.call_soon_threadsafe(task.cancel)
        try:
            self._aio.run(self._disconnect(), timeout)
        except Exception:
            log.warning("replica: the NATS connection did not close cleanly", exc_info=True)
        self._aio.close()
        self._aio = None
        self.service.close()

    async def _disconnect(self) -> None:
        if self._task is not None:
            self._task.cancel()  # a restart may have replaced the one close() cancelled
            await asyncio.gather(self._task, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- the consume loop

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:  # sent and yielded: unused
        """Run ``coro`` as the consume task (on the loop's thread), watched."""
        self._turned_at = time.monotonic()
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(self._consume_ended)
        self._task = task

    def _consume_ended(self, task: asyncio.Task[None]) -> None:
        """The consume task ended: unless the replica is closing, say so loudly, count it,
        and start it again after ``restart_delay`` on a consumer where the replica was."""
        if self._closing:
            return
        self._counts.consume_restarts += 1
        self._ended = "cancelled" if task.cancelled() else repr(task.exception())
        log.error(
            "replica %s: the consume loop ended (%s); starting it again in %.1f s",
            self.options.name,
            self._ended,
            self.options.restart_delay,
        )
        task.get_loop().call_later(self.options.restart_delay, self._restart)

    def _restart(self) -> None:
        if not self._closing:
            self._spawn(self._resume())

    async def _resume(self) -> None:
        if self._psub is not None:  # the ended loop's: its consumer is about to be replaced
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        await self._consume(await self._rebind())

    async def _consume(self, psub: PullSubscription) -> None:
        while not self._closing:
            self._psub = psub
            try:
                psub = await self._turn(psub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a defect: counted and logged, the loop goes on
                self._counts.consume_errors += 1
                _warn("turn", "replica %s: consume loop: %r; it goes on", self.options.name, exc)
                await asyncio.sleep(_RETRY_DELAY)

    async def _turn(self, psub: PullSubscription) -> PullSubscription:
        """One fetch: apply what came, acknowledge it, snapshot when due. The subscription
        to fetch from next (a new one when the consumer was recreated)."""
        self._turned_at = time.monotonic()
        psub, msgs = await self._fetch(psub)
        for msg in msgs:
            self._apply_message(msg)
        if msgs:  # nats-py returns [] when the server's timeout comes before its own
            self._since_snapshot += len(msgs)
            await self._ack(msgs[-1])
        await self._maybe_snapshot()
        return psub

    def _apply_message(self, msg: Msg) -> None:
        try:
            seq = msg.metadata.sequence.stream
        except Exception as exc:  # no stream sequence: nowhere to place it
            self._counts.malformed += 1
            _warn("metadata", "replica %s: message skipped: %r", self.options.name, exc)
            return
        self._applier.apply(msg.headers, msg.data, seq)
        self._counts.covered_seq = seq

    async def _fetch(self, psub: PullSubscription) -> tuple[PullSubscription, list[Msg]]:
        from nats.errors import TimeoutError as NatsTimeout

        try:
            msgs = await psub.fetch(batch=self.options.fetch, timeout=self.options.fetch_timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            msgs = []
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server restarting (the client reconnects), or lost us
            self._counts.fetch_errors += 1
            self._failing = repr(exc)
            _warn("fetch", "replica %s: fetch failed (%r); again", self.options.name, exc)
            await asyncio.sleep(_RETRY_DELAY)
            return await self._bound(psub), []
        self._failing = None
        return psub, list(msgs)

    async def _bound(self, psub: PullSubscription) -> PullSubscription:
        """``psub``, or a new subscription when the server no longer has the consumer (it
        deleted it after ``inactive_threshold`` without fetches, or someone did)."""
        from nats.js.errors import NotFoundError

        if self._nc is None or not self._nc.is_connected:
            return psub
        try:
            await self._js.consumer_info(self.js_options.stream, self.options.name)
            return psub
        except NotFoundError:
            pass
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
        return await self._rebind()

    async def _ack(self, msg: Msg) -> None:
        try:
            await msg.ack()  # acknowledges every message before it too (AckPolicy.ALL)
        except Exception as exc:  # redelivered later: the cursors drop the copies
            _warn("ack", "replica %s: ack failed (%r)", self.options.name, exc)

    def apply_message(self, headers: dict[str, str] | None, body: bytes, seq: int = 0) -> None:
        """Apply one message (its headers and body, stream sequence ``seq``) as the consume
        loop does, from the loop's thread or before :meth:`start` (tests and tools feed
        records through here)."""
        self._applier.apply(headers, body, seq)

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
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        seq = self._counts.covered_seq
        try:
            data = snap.encode(self._capture())
        except Exception:  # nothing applied should make this fail: say it loudly
            self._counts.snapshot_errors += 1
            log.exception("replica %s: snapshot of seq %d not taken", self.options.name, seq)
            return None
        from nats.js.api import ObjectMeta

        about = {"seq": seq, "stream": self.js_options.stream}
        meta = ObjectMeta(description=json.dumps(about))
        try:
            await self._store.put(f"{self.js_options.stream}.{self.options.name}", data, meta=meta)
        except Exception:
            self._counts.snapshot_errors += 1
            log.exception("replica %s: snapshot of seq %d not saved", self.options.name, seq)
            return None
        self._counts.snapshots += 1
        await self._trim(seq)
        return seq

    async def _trim(self, saved_seq: int) -> None:
        if not self.options.trim:
            return
        try:
            if await trim(self._js, self.js_options, saved_seq):
                self._counts.trims += 1
        except Exception as exc:  # the next snapshot trims again
            self._counts.trim_errors += 1
            _warn("trim", "replica %s: trim failed (%r)", self.options.name, exc)

    def _capture(self) -> snap.Snapshot:
        seq, workers, cursors = (
            self._counts.covered_seq,
            self.service.workers(),
            self._applier.states(),
        )
        return self.service.copy_index(
            lambda index, hold: snap.capture(
                index,
                stream=self.js_options.stream,
                seq=seq,
                replica=self.options.name,
                workers=workers,
                cursors=cursors,
                hold=hold,
            )
        )

    def snapshot_now(self, timeout: float = 60.0) -> int | None:
        """Save a snapshot now (from any thread); its sequence, None if it was not saved."""
        assert self._aio is not None, "start the replica first"
        return self._aio.run(self.save_snapshot(), timeout)

    # ----------------------------------------------------------------- reads

    def digest(self) -> IndexDigest:
        """The digest of the replica's index (:func:`kvevents.index.index_digest`)."""
        return holders_digest(self.service.holders(), self.service.holder_blocks)

    def stats(self) -> ReplicaStats:
        return self._counts.frozen(self._applier.degraded()[0])

    @property
    def covered_seq(self) -> int:
        """The last stream sequence applied."""
        return self._counts.covered_seq

    def health(self) -> FeedHealth:
        """``dead`` while the consume loop is not running, ``stalled`` while it cannot
        fetch or one turn lasts over ``stall_after``, ``degraded`` while streams are known
        incomplete, else ``ok``."""
        task = self._task
        if self._aio is None or task is None:
            return FeedHealth("dead", False, 0.0, "the replica is not running")
        if task.done():
            why = f"the replica stopped consuming ({self._ended}); starting it again"
            return FeedHealth("dead", False, 0.0, why)
        if self._nc is None or not self._nc.is_connected:
            return FeedHealth("stalled", True, 0.0, "reconnecting to NATS")
        turn = time.monotonic() - self._turned_at
        if turn > self.options.stall_after:
            return FeedHealth(
                "stalled", True, turn, f"one turn of the consume loop has lasted {turn:.0f} s"
            )
        if self._failing is not None:
            return FeedHealth("stalled", True, 0.0, f"fetching fails: {self._failing}")
        return self._integrity()

    def _integrity(self) -> FeedHealth:
        count, example = self._applier.degraded()
        if example is not None:
            return FeedHealth("degraded", True, 0.0, f"{count} stream(s) degraded; {example}")
        if self._hole is not None:
            return FeedHealth("degraded", True, 0.0, self._hole)
        return FeedHealth("ok", True, 0.0)


async def _object_store(js: JetStreamContext, options: JetStreamOptions) -> ObjectStore:
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(options.bucket)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_object_store(options.bucket)

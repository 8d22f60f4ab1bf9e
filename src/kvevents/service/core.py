"""The index service: a prefix index and a router fed by a live event feed.

:class:`IndexService` owns the index, the router and the feed (the
:class:`kvevents.subscribe.subscriber.Subscriber` by default, created lazily and applying each batch on
its own I/O thread). Workers are registered with :class:`WorkerRegistration`; a ``Delivery``
is applied, a ``StreamReset`` resets that stream, a stream that lost events for good is
degraded in routing until it is whole again. Queries take the same lock as the feed.

The feed protocol, the records and the default feed are in :mod:`kvevents.service.feed`
(re-exported here); the HTTP API over the service (``kvevents serve``) is
:mod:`kvevents.service.http`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from kvevents.errors import DecodeError, StreamAddError, SubscriberError
from kvevents.events import AllBlocksCleared
from kvevents.index.decision import Target
from kvevents.index.keys import MMSpan
from kvevents.index.prefix import HolderKey, IndexStats, PrefixIndex
from kvevents.index.router import DEFAULT_POLICY, Router
from kvevents.service.decisions import DecisionLog
from kvevents.service.feed import (
    Feed,
    ServiceStats,
    WorkerRegistration,
    default_feed,
    default_stream_specs,
)
from kvevents.service.loadreports import DEFAULT_LOAD_TTL, LoadLedger, LoadReport
from kvevents.service.state import Persisted, StateFile
from kvevents.subscribe.streams import (
    Delivery,
    FeedHealth,
    Item,
    StreamKey,
    StreamSpec,
    StreamStats,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import Applied, DecodedBatch, decode_batch_packed

__all__ = [
    "Feed",
    "IndexService",
    "ServiceStats",
    "WorkerRegistration",
]

log = logging.getLogger("kvevents.service.core")

_T = TypeVar("_T")


class IndexService:
    """The index, a router, and the thread that feeds the index from a feed.

    The service owns its feed (passed in, or made by ``feed_factory`` on first use) and
    closes it in :meth:`close`. With neither, the feed is a Subscriber that applies each item
    on its own I/O thread through :meth:`consume` (no hand-off between threads, the fastest
    path), and the service starts no consumer thread. A feed that calls :meth:`consume` itself
    is passed with ``pushes=True``. ``subscriber_options`` configure that default subscriber
    (e.g. CurveZMQ keys).

    ``load_ttl``: seconds a load report (:meth:`report_loads`) counts for routing
    (``clock``, monotonic by default, measures them). ``state``: where registrations made
    with ``persist=True`` (those over HTTP) are written after every change.
    """

    def __init__(
        self,
        index: PrefixIndex | None = None,
        *,
        router: Router | None = None,
        feed: Feed | None = None,
        feed_factory: Callable[[], Feed] | None = None,
        pushes: bool = False,
        subscriber_options: SubscriberOptions | None = None,
        stream_specs: Callable[[WorkerRegistration], list[StreamSpec]] = default_stream_specs,
        policy: str = DEFAULT_POLICY,
        poll_interval: float = 0.1,
        load_ttl: float = DEFAULT_LOAD_TTL,
        clock: Callable[[], float] | None = None,
        state: StateFile | None = None,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.router = router if router is not None else Router(self.index, policy)
        self.lock = threading.Lock()
        # Serialises register/unregister: a replacement is validated, swapped and, when the
        # feed refuses a stream, rolled back as one step.
        self._changes = threading.Lock()
        self._feed = feed
        self._feed_factory = feed_factory
        self._pushes = pushes
        self._subscriber_options = subscriber_options
        self._stream_specs = stream_specs
        self._poll = poll_interval
        self._workers: dict[str, WorkerRegistration] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = False
        self._consumer_error: str | None = None
        self._counts = {f.name: 0 for f in dataclasses.fields(ServiceStats)}
        #: The last queries' decisions and the hit rate over time (the status page's).
        self.decisions = DecisionLog()
        self._loads = LoadLedger(self.router.loads, load_ttl, clock)
        self._persisted = Persisted(state)

    @property
    def feed(self) -> Feed:
        if self._feed is None:
            if self._feed_factory is None:
                self._pushes = True
                self._feed = default_feed(
                    self.consume,
                    self._subscriber_options,
                    on_status=self.on_status,
                    on_payload=self.apply_payload,
                )
            else:
                self._feed = self._feed_factory()
        return self._feed

    @property
    def pushes(self) -> bool:
        """True when the feed applies items itself (through :meth:`consume`)."""
        return self._pushes

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the feed and, unless it pushes, the consumer thread (idempotent)."""
        if self._started:
            return
        self.feed.start()
        self._started = True
        if self._pushes:
            return
        self._thread = threading.Thread(target=self._run, name="kvevents-index", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop consuming and close the feed (idempotent)."""
        self._stop.set()
        if self._feed is not None:
            self._feed.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> IndexService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        feed = self.feed
        while not self._stop.is_set():
            try:
                item = feed.get(timeout=self._poll)
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("the feed failed; the index stops consuming it")
                self._consumer_error = "the feed failed; the index stopped consuming it"
                return
            if item is not None:
                self.consume(item)

    def consume(self, item: Item) -> None:
        """Apply one feed item: a Delivery, a StreamReset, or a StreamStatus (from feeds
        that queue status items)."""
        if isinstance(item, StreamStatus):
            self.on_status(item)
            return
        stream = item.stream
        try:
            with self.lock:
                reg = self._workers.get(stream.worker_id)
                if reg is None or stream.rank not in reg.ranks:
                    # Queued before the worker was unregistered: applying it would bring
                    # the worker back as a ghost.
                    self._counts["ignored"] += 1
                elif isinstance(item, Delivery):
                    self.index.ingest(stream.worker_id, stream.rank, item.batch)
                    self._counts["deliveries"] += 1
                else:
                    self.index.reset_stream(stream.worker_id, stream.rank)
                    self._counts["resets"] += 1
        except Exception:
            self._counts["apply_errors"] += 1
            log.exception("worker %s rank %s: item not applied", stream.worker_id, stream.rank)

    def apply_payload(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied | None:
        """Apply one batch payload of ``stream`` straight from the wire (the default feed's
        ``on_payload``): no delivery object, no decoded tokens. None for a stream of a worker
        no longer registered (the feed then delivers it, and :meth:`consume` ignores it).

        The payload is decoded before the index lock is taken: queries never wait on a
        decode, however large or hostile the payload.
        """
        return self._apply_decoded(stream, decode_batch_packed(payload, seq=seq))

    def _apply_decoded(self, stream: StreamSpec, decoded: DecodedBatch) -> Applied | None:
        batch = decoded.batch
        with self.lock:
            if not self._follows(stream):
                return None
            self._counted(lambda: self.index.ingest(stream.worker_id, stream.rank, batch))
        cleared = any(type(e) is AllBlocksCleared for e in batch.events)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def _follows(self, stream: StreamSpec) -> bool:
        """Whether ``stream`` is a registered worker's rank (call with the lock held)."""
        reg = self._workers.get(stream.worker_id)
        return reg is not None and stream.rank in reg.ranks

    def _counted(self, apply: Callable[[], _T]) -> _T:
        """``apply()``, counted as a delivery or an apply error."""
        try:
            applied = apply()
        except DecodeError:
            raise
        except Exception:
            self._counts["apply_errors"] += 1  # the subscriber logs it, with the stream
            raise
        self._counts["deliveries"] += 1
        return applied

    def on_status(self, status: StreamStatus) -> None:
        """A stream's state changed: an incomplete stream's matches stop being trusted.

        A loss after events were applied may have hidden removals, so the index can list
        blocks the engine no longer holds; the router keeps the target but ignores its matched
        blocks until the stream is whole again (a cache reset, or a restart rebuilt from
        replay). A loss that starts at sequence 0 (joining after the replay ring moved on) only
        hides stores: the index under-matches that worker but lists nothing false, so it is
        not degraded.
        """
        worker_id, rank = status.stream.worker_id, status.stream.rank
        lost = status.missing
        with self.lock:
            if status.state == "incomplete" and (lost is None or lost[0] > 0):
                why = "events lost" if lost is None else f"lost seq {lost[0]}..{lost[1] - 1}"
                self.router.mark_degraded(worker_id, rank, why)
            elif status.state == "live":
                self.router.mark_healthy(worker_id, rank)

    # ----------------------------------------------------------------- workers

    def stream_specs(self, reg: WorkerRegistration) -> list[StreamSpec]:
        """The streams ``reg`` would add; ``LayoutError`` (a ``ValueError``) if an endpoint
        breaks a rule. Pure: nothing is registered."""
        return self._stream_specs(reg)

    def register(self, reg: WorkerRegistration, *, persist: bool = True) -> list[StreamSpec]:
        """Index a worker's ranks and subscribe to them; re-registering replaces.

        ``persist``: keep it in the state file (if the service has one); False for the
        workers of the service's own configuration, which it registers at every start.

        Everything is checked before anything changes: endpoints that break a rule raise
        ``LayoutError`` and a stream the feed refuses raises
        :class:`~kvevents.errors.StreamAddError`, and in both cases a worker registered before
        keeps its old registration and streams.
        """
        specs = self._stream_specs(reg)
        with self._changes:
            old = self._workers.get(reg.worker_id)
            if old is not None:
                self._drop(old, None)
            try:
                self._add(reg, specs)
            except StreamAddError:
                self._counts["refused_registrations"] += 1
                if old is not None:
                    self._add(old, self._stream_specs(old))
                raise
            self._counts["registrations"] += 1
            if self._persisted.registered(reg.worker_id, persist):
                self._save()
        return specs

    def _add(self, reg: WorkerRegistration, specs: list[StreamSpec]) -> None:
        """Register ``reg`` in the index and the feed, or (StreamAddError) not at all."""
        with self.lock:
            self.index.register_worker(reg.worker_id, block_size=reg.block_size, ranks=reg.ranks)
            self._workers[reg.worker_id] = reg
        added: list[StreamSpec] = []
        for spec in specs:
            try:
                self.feed.add_stream(spec)
            except (SubscriberError, ValueError) as exc:
                refused = exc if isinstance(exc, StreamAddError) else _add_error(spec, exc)
                for done in added:
                    # The feed may have dropped a stream it could not keep: nothing to undo.
                    with contextlib.suppress(KeyError):
                        self.feed.remove_stream(done.worker_id, done.rank)
                self._forget(reg, None)
                raise refused from exc
            added.append(spec)

    def unregister(self, worker_id: str, rank: int | None = None) -> bool:
        """Stop following a worker (or one rank) and drop its blocks. False if unknown."""
        with self._changes:
            reg = self._workers.get(worker_id)
            if reg is None or (rank is not None and rank not in reg.ranks):
                return False
            self._drop(reg, rank)
            if self._persisted.unregistered(worker_id, worker_id not in self._workers):
                self._save()
            return True

    def _drop(self, reg: WorkerRegistration, rank: int | None) -> None:
        self.feed.remove_stream(reg.worker_id, rank)
        self._forget(reg, rank)

    def _forget(self, reg: WorkerRegistration, rank: int | None) -> None:
        """Drop a worker (or one rank) from the index, the router and the registrations."""
        worker_id = reg.worker_id
        with self.lock:
            self.index.remove_worker(worker_id, rank)
            self.router.loads.remove(worker_id, rank)
            self._loads.forget(worker_id, rank)
            self.router.mark_healthy(worker_id, rank)
            if rank is None or reg.ranks == (rank,):
                del self._workers[worker_id]
            else:
                ranks = tuple(r for r in reg.ranks if r != rank)
                self._workers[worker_id] = dataclasses.replace(reg, ranks=ranks)

    def workers(self) -> list[WorkerRegistration]:
        return list(self._workers.values())

    def _save(self) -> None:
        """Write the state file (call with ``_changes`` held). A failed write is counted, not
        raised: the change itself was made, and the next one writes the whole state again."""
        written = self._persisted.write(self._workers)
        self._counts["state_writes" if written else "state_write_errors"] += 1

    # ----------------------------------------------------------------- load

    def report_loads(self, reports: Sequence[LoadReport]) -> list[Target]:
        """Apply load reports for routing; the targets not registered (not applied)."""
        unknown: list[Target] = []
        with self.lock:
            for report in reports:
                reg = self._workers.get(report.worker_id)
                if reg is None or report.rank not in reg.ranks:
                    unknown.append((report.worker_id, report.rank))
                else:
                    self._loads.apply(report)
            self._counts["load_reports"] += len(reports) - len(unknown)
            self._counts["load_unknown"] += len(unknown)
        return unknown

    # ----------------------------------------------------------------- reads

    def query(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        packed: bytes | None = None,
        block_hashes: Sequence[int] | None = None,
        block_size: int | None = None,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMSpan] = (),
        policy: str | None = None,
        prefill_weight: float | None = None,
        load_weight: float | None = None,
    ) -> dict[str, Any]:
        """Matches per holder and a routing decision, JSON-ready.

        The request is ``token_ids``, or the same tokens ``packed`` as uint32 little-endian
        bytes (what ``POST /query`` hands over), or precomputed ``block_hashes``;
        ``cache_salt`` and ``mm`` as in :meth:`PrefixIndex.match`; ``prefill_weight`` and
        ``load_weight`` override the router's cost weights for this decision.
        """
        with self.lock:
            if packed is not None:
                match = self.index.match_packed(packed, lora=lora, cache_salt=cache_salt, mm=mm)
            elif token_ids is not None:
                match = self.index.match(token_ids, lora=lora, cache_salt=cache_salt, mm=mm)
            elif block_hashes is not None:
                match = self.index.match_hashes(block_hashes, block_size=block_size)
            else:
                raise ValueError("query needs token_ids or block_hashes")
            self._counts["loads_expired"] += self._loads.expire()
            decision = self.router.decide(
                match, policy=policy, prefill_weight=prefill_weight, load_weight=load_weight
            )
            self._counts["queries"] += 1
        self.decisions.record(decision)
        scores: dict[str, dict[str, int]] = {}
        for (worker, rank), blocks in match.streams.items():
            scores.setdefault(worker, {})[str(rank)] = blocks
        return {
            "request_tokens": match.request_tokens,
            "request_blocks": {str(k): v for k, v in match.request_blocks.items()},
            "scores": scores,
            "matches": [
                {"worker_id": k.worker_id, "rank": k.rank, "tier": k.tier, "matched_blocks": v}
                for k, v in match.holders.items()
            ],
            "decision": decision.to_dict(),
        }

    def stats(self) -> ServiceStats:
        return ServiceStats(**self._counts)

    def index_stats(self) -> IndexStats:
        with self.lock:
            return self.index.stats()

    def health(self) -> FeedHealth:
        """Whether the feed is serving: the feed's own health, or ``"dead"`` when the
        service's consumer thread stopped on a feed error."""
        if self._consumer_error is not None:
            return FeedHealth("dead", False, 0.0, self._consumer_error)
        return self.feed.health()

    def stream_health(self) -> dict[StreamKey, StreamStats]:
        """The feed's per-stream stats."""
        return self.feed.stream_stats()

    def workers_view(self) -> list[dict[str, Any]]:
        """Workers with their per-rank index state, stream health and reported load
        (``GET /workers``)."""
        with self.lock:
            streams = {(s.worker_id, s.rank): s for s in self.index.streams()}
            degraded = dict(self.router.degraded)
            self._counts["loads_expired"] += self._loads.expire()
            loads = self.router.loads.snapshot()
        health = self.stream_health()
        now = time.time()
        out = []
        for reg in list(self._workers.values()):
            ranks = []
            for rank in reg.ranks:
                info = streams.get((reg.worker_id, rank))
                row: dict[str, Any] = {"rank": rank}
                if info is not None:
                    row.update(_builtins(info))
                    last = info.last_batch_ts
                    row["lag_seconds"] = None if last is None else max(0.0, now - last)
                row["stream"] = _builtins(health.get((reg.worker_id, rank)))
                row["degraded"] = degraded.get((reg.worker_id, rank))
                load = loads.get((reg.worker_id, rank))
                row["load"] = None if load is None else load._asdict()  # None: no report
                ranks.append(row)
            out.append({**_builtins(reg), "ranks": ranks})
        return out

    def holders(self) -> list[tuple[HolderKey, int | None]]:
        """Every holder with its stream's block size, taken under the lock (cheap)."""
        with self.lock:
            return [
                (HolderKey(s.worker_id, s.rank, tier), s.block_size)
                for s in self.index.streams()
                for tier in s.tiers
            ]

    def holder_blocks(self, key: HolderKey) -> list[tuple[int, int]]:
        """One holder's ``(engine_hash, our_hash)`` pairs, copied under the lock.

        The lock is held for one holder's copy (about 0.2 s per million blocks in C), not for
        a walk of the whole index, and nothing is encoded under it.
        """
        with self.lock:
            return _holder_pairs(self.index, key)

    def dump(self) -> dict[str, Any]:
        """Every holder's blocks and the index stats, in memory (``GET /dump`` streams it)."""
        holders = [
            {**_holder_header(key, size), "blocks": [list(p) for p in self.holder_blocks(key)]}
            for key, size in self.holders()
        ]
        return {"holders": holders, "stats": _builtins(self.index_stats())}


def _add_error(spec: StreamSpec, exc: Exception) -> StreamAddError:
    """A feed's own refusal (a duplicate stream: ValueError) as the Subscriber reports one."""
    return StreamAddError(
        worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason=str(exc)
    )


def _holder_header(key: HolderKey, block_size: int | None) -> dict[str, Any]:
    return {
        "worker_id": key.worker_id,
        "rank": key.rank,
        "tier": key.tier,
        "block_size": block_size,
    }


def _holder_pairs(index: PrefixIndex, key: HolderKey) -> list[tuple[int, int]]:
    # The index has no per-holder accessor; its dump() walks every holder in one go, which
    # would hold the service lock for seconds on a large index. Reading one holder's table
    # here keeps each hold short. (To move into PrefixIndex as a public method.)
    stream = index._streams.get((key.worker_id, key.rank))
    holder = None if stream is None else stream.holders.get(key.tier)
    return [] if holder is None else holder.engine.items()


def _builtins(value: Any) -> Any:
    """Dataclasses, structs and named tuples as plain JSON-ready values."""
    return msgspec.to_builtins(value, builtin_types=None, str_keys=True)

"""The index service: a prefix index and a router fed by a live event feed.

:class:`IndexService` owns the index, the router and the feed, and is the feed's
:class:`~kvevents.subscribe.Sink`: the feed (a
:class:`~kvevents.subscribe.Subscriber` by default, made by a
:data:`~kvevents.service._feed.FeedFactory`) hands it each registered stream's batches, resets
and states on its own thread, and the service applies them under the lock that queries take.
A batch's way is one direction: feed -> :meth:`IndexService.apply` ->
:meth:`PrefixIndex.ingest_payload <kvevents.index.PrefixIndex.ingest_payload>` (decoded
before the lock) -> the index. A stream that lost events for good is degraded in routing until
it is whole again (:meth:`IndexService.status`).

Workers are registered with :class:`WorkerRegistration`; a change of registrations is one
step under the ``_changes`` lock: validated, swapped in the index and the feed and, when the
feed refuses a stream, rolled back (the rules are :mod:`.workers`'). The feed protocol and the
records are in :mod:`kvevents.service._feed` (re-exported here); the JSON rows of the read
views are :mod:`.views`'; the HTTP API over the service (``kvevents serve``) is
:mod:`kvevents.http`, the layer above.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

from kvevents._types import Document
from kvevents.errors import (
    DecodeError,
    LayoutError,
    StreamAddError,
    StreamNotRegistered,
    SubscriberError,
)
from kvevents.events import StreamKey
from kvevents.index import (
    DEFAULT_POLICY,
    Decision,
    HolderKey,
    IndexStats,
    MatchResult,
    MMSpan,
    PrefixIndex,
    Router,
    StreamInfo,
)
from kvevents.service import _workers as rules
from kvevents.service._answers import Shape, answer, scoped
from kvevents.service._decisions import DecisionLog
from kvevents.service._feed import (
    Feed,
    FeedFactory,
    ServiceCounts,
    ServiceStats,
    WorkerRegistration,
    default_stream_specs,
    subscriber_feed,
)
from kvevents.service._loadreports import DEFAULT_LOAD_TTL, LoadLedger, LoadReport
from kvevents.service._state import Persisted, StateFile
from kvevents.service._views import builtins, holder_header, worker_rows
from kvevents.subscribe import FeedHealth, ResetReason, StreamSpec, StreamStats, StreamStatus
from kvevents.wire import Applied

__all__ = [
    "Feed",
    "IndexService",
    "ServiceStats",
    "WorkerRegistration",
]

log = logging.getLogger("kvevents.service.core")
#: Why a replaying stream's matches are not trusted (:meth:`IndexService.status`).
REPLAYING = "replaying: the index is behind the stream"

_R = TypeVar("_R")

#: Takes the service's lock (what a snapshot copy holds around each piece it copies).
Hold = Callable[[], AbstractContextManager[object]]


class IndexService:
    """The index, a router, and the feed that fills the index: the feed's sink.

    ``feed`` makes the feed, given the service as its sink (default: a Subscriber,
    :func:`~kvevents.service.subscriber_feed`; pass ``subscriber_feed(options)`` for
    e.g. CurveZMQ keys); the service starts and closes it. ``stream_specs`` turns a
    registration into the streams to read. ``load_ttl``: seconds a load report
    (:meth:`report_loads`) counts for routing (``clock``, monotonic by default, measures them).
    ``state``: where registrations made with ``persist=True`` (those over HTTP) are written
    after every change.
    """

    def __init__(
        self,
        index: PrefixIndex | None = None,
        *,
        router: Router | None = None,
        feed: FeedFactory | None = None,
        stream_specs: Callable[[WorkerRegistration], list[StreamSpec]] = default_stream_specs,
        policy: str = DEFAULT_POLICY,
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
        self._stream_specs = stream_specs
        self._workers: dict[str, WorkerRegistration] = {}
        self._counts = ServiceCounts()
        #: The last queries' decisions and the hit rate over time (the status page's).
        self.decisions = DecisionLog()
        self._loads = LoadLedger(self.router.loads, load_ttl, clock)
        self._persisted = Persisted(state)
        self._started = False
        #: The feed, made last: it may call the sink methods as soon as it is started.
        self.feed: Feed = (feed or subscriber_feed())(self)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the feed (idempotent)."""
        if not self._started:
            self.feed.start()
            self._started = True

    def close(self) -> None:
        """Close the feed (idempotent)."""
        self.feed.close()

    def __enter__(self) -> IndexService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- the sink

    def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
        """Apply batch ``seq`` of ``stream`` (the feed's hot path, once per batch): decoded
        before the lock, so queries never wait on a decode; ``DecodeError`` (nothing changed)
        when it cannot be read. A batch of a worker no longer registered is ignored (applying
        it would bring the worker back as a ghost)."""
        try:
            applied = self.index.ingest_payload(
                stream.worker_id,
                stream.rank,
                payload,
                seq=seq,
                hold=self.lock,
                registered_only=True,
            )
        except StreamNotRegistered as gone:
            self._counts.ignored += 1
            return gone.applied
        except DecodeError:
            raise
        except Exception:
            self._counts.apply_errors += 1  # the feed logs it, with the stream
            raise
        self._counts.deliveries += 1
        return applied

    def reset(self, stream: StreamSpec, reason: ResetReason) -> None:
        """Drop everything the index holds for ``stream`` (a restart, or a removal)."""
        try:
            with self.lock:
                if not self._is_registered(stream.worker_id, stream.rank):
                    self._counts.ignored += 1
                    return
                self.index.reset_stream(stream.worker_id, stream.rank)
        except Exception:
            self._counts.apply_errors += 1  # the feed logs it, with the stream
            raise
        self._counts.resets += 1

    def status(self, status: StreamStatus) -> None:
        """A stream's state changed: an incomplete or replaying stream's matches stop being
        trusted.

        A loss after events were applied may have hidden removals, so the index can list
        blocks the engine no longer holds; the router keeps the target but ignores its matched
        blocks until the stream is whole again (a cache reset, or a restart rebuilt from
        replay). A loss that starts at sequence 0 (joining after the replay ring moved on) only
        hides stores: the index under-matches that worker but lists nothing false, so it is
        not degraded. While a stream replays, the index holds its past, not its present: the
        batches applied so far, the later ones held back. Joining an engine that has run for a
        while replays its ring from the start, whose stores a cache reset further on clears,
        and until the replay reaches that reset the index lists blocks the engine dropped long
        ago. So a replaying stream is degraded until it is live (or incomplete from sequence
        0) again. ``status.reason``, when given, is the mark's reason.
        """
        worker_id, rank = status.stream.worker_id, status.stream.rank
        lost = status.missing
        with self.lock:
            if status.state == "incomplete" and (lost is None or lost[0] > 0):
                why = status.reason or (
                    "events lost" if lost is None else f"lost seq {lost[0]}..{lost[1] - 1}"
                )
                self.router.mark_degraded(worker_id, rank, why)
            elif status.state == "replaying":
                self.router.mark_degraded(worker_id, rank, REPLAYING)
            elif status.state in ("live", "incomplete"):
                self.router.mark_healthy(worker_id, rank)

    def _is_registered(self, worker_id: str, rank: int) -> bool:
        reg = self._workers.get(worker_id)
        return reg is not None and rank in reg.ranks

    # ----------------------------------------------------------------- registrations

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
            self._replace(reg, specs, persist)
        return specs

    def restore(
        self,
        regs: Sequence[WorkerRegistration],
        check: Callable[[StreamSpec], None] | None = None,
    ) -> list[tuple[WorkerRegistration, Exception]]:
        """Register a state file's workers again (persisted, as over HTTP), without writing
        the file for them: it holds them already, and a write half-way would hold only those
        registered so far. A change made meanwhile (over HTTP) is written once, at the end;
        it wins over the file's registration of the same worker. ``health()`` says
        ``starting`` until the end.

        ``check`` raises ``LayoutError`` for a stream to refuse (the endpoint policy of now);
        its worker is then not registered. The workers refused (``LayoutError``,
        ``StreamAddError``) are returned with why; they leave the file at its next write.
        """
        refused: list[tuple[WorkerRegistration, Exception]] = []
        self._persisted.begin_restore(len(regs))
        try:
            for reg in regs:
                try:
                    self._restore_one(reg, check)
                except (LayoutError, StreamAddError) as exc:
                    refused.append((reg, exc))
                self._persisted.restored_one()
        finally:
            with self._changes:
                if self._persisted.end_restore():
                    self._save()
        return refused

    def _restore_one(
        self, reg: WorkerRegistration, check: Callable[[StreamSpec], None] | None
    ) -> None:
        specs = self._stream_specs(reg)
        if check is not None:
            for spec in specs:
                check(spec)
        with self._changes:
            if reg.worker_id not in self._workers:  # else registered over HTTP meanwhile
                self._replace(reg, specs, persist=True, save=False)

    def _replace(
        self, reg: WorkerRegistration, specs: list[StreamSpec], persist: bool, save: bool = True
    ) -> None:
        """:meth:`register` with ``_changes`` held (``save``: write the state file if it
        keeps the worker; a restore's own registrations are in it already)."""
        old = self._workers.get(reg.worker_id)
        if old is not None:
            self._drop(old, None)
        try:
            self._add(reg, specs)
        except StreamAddError:
            self._counts.refused_registrations += 1
            if old is not None:
                self._add(old, self._stream_specs(old))
            raise
        self._registered(reg.worker_id, persist, save)

    def _registered(self, worker_id: str, persist: bool, save: bool = True) -> None:
        """Count a registration made and write the state file if it is kept there."""
        self._counts.registrations += 1
        if self._persisted.registered(worker_id, persist) and save:
            self._save()

    def add_rank(
        self,
        reg: WorkerRegistration,
        *,
        replace: bool = True,
        persist: bool = True,
        one_size_per_model: bool = False,
    ) -> list[StreamSpec]:
        """Register one rank on endpoints of its own (``reg`` has one rank, in its
        ``own_endpoints``) next to the worker's other ranks, which keep their streams.

        A new worker is registered as :meth:`register` does. For a known one, a rank already
        registered is replaced when ``replace`` (its stream alone starts afresh), else
        refused; a model name or block size other than the worker's is refused. Refusals raise
        :class:`~kvevents.errors.RegistrationConflict` and, as in :meth:`register`,
        ``LayoutError`` and ``StreamAddError`` leave everything as it was.
        ``one_size_per_model``: refuse a block size other than that of the model's other
        workers too (Dynamo keeps one per model).
        """
        if len(reg.ranks) != 1 or reg.own(reg.ranks[0]) is None:
            raise ValueError("add_rank takes one rank, with its own endpoints")
        own = reg.own_endpoints[0]
        (spec,) = self._stream_specs(reg)
        with self._changes:
            if one_size_per_model:
                rules.check_model_size(self._workers.values(), reg)
            old = self._workers.get(reg.worker_id)
            if old is None:
                self._replace(reg, [spec], persist)
                return [spec]
            rules.check_fits(old, reg, own.rank, replace)
            if own.rank in old.ranks:
                self._drop(old, own.rank)
            try:
                self._add_one(old.with_rank(own), spec)
            except StreamAddError:
                if own.rank in old.ranks:  # the rank it replaced comes back
                    with contextlib.suppress(StreamAddError):
                        self._add_one(old, self._spec_of(old, own.rank))
                raise
            self._registered(reg.worker_id, persist)
        return [spec]

    def _spec_of(self, reg: WorkerRegistration, rank: int) -> StreamSpec:
        return next(s for s in self._stream_specs(reg) if s.rank == rank)

    def _add_one(self, merged: WorkerRegistration, spec: StreamSpec) -> None:
        """Add one rank's stream as ``merged``, or (StreamAddError) leave the others as
        they were."""
        self._index_worker(merged, (spec.rank,))
        try:
            self.feed.add_stream(spec)
        except (SubscriberError, ValueError) as exc:
            self._counts.refused_registrations += 1
            self._forget(merged, spec.rank)
            raise rules.add_error(spec, exc) from exc

    def _add(self, reg: WorkerRegistration, specs: list[StreamSpec]) -> None:
        """Register ``reg`` in the index and the feed, or (StreamAddError) not at all."""
        self._index_worker(reg, reg.ranks)
        added: list[StreamSpec] = []
        for spec in specs:
            try:
                self.feed.add_stream(spec)
            except (SubscriberError, ValueError) as exc:
                for done in added:
                    # The feed may have dropped a stream it could not keep: nothing to undo.
                    with contextlib.suppress(KeyError):
                        self.feed.remove_stream(done.worker_id, done.rank)
                self._forget(reg, None)
                raise rules.add_error(spec, exc) from exc
            added.append(spec)

    def _index_worker(self, reg: WorkerRegistration, ranks: tuple[int, ...]) -> None:
        """Register ``ranks`` of ``reg`` in the index and keep ``reg`` (before the feed
        reads them: a batch of a stream not registered is ignored)."""
        with self.lock:
            self.index.register_worker(
                reg.worker_id, block_size=reg.block_size, ranks=ranks, report_mode=reg.report_mode
            )
            self._workers[reg.worker_id] = reg

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
                self._workers[worker_id] = reg.without(rank)

    def _save(self) -> None:
        """Write the state file (call with ``_changes`` held). A failed write is counted, not
        raised: the change itself was made, and the next one writes the whole state again.
        During a restore the write waits for its end (:meth:`restore`)."""
        if self._persisted.defer():
            return
        if self._persisted.write(self._workers):
            self._counts.state_writes += 1
        else:
            self._counts.state_write_errors += 1

    def report_loads(self, reports: Sequence[LoadReport]) -> list[StreamKey]:
        """Apply load reports for routing; the targets not registered (not applied)."""
        unknown: list[StreamKey] = []
        with self.lock:
            for report in reports:
                if self._is_registered(report.worker_id, report.rank):
                    self._loads.apply(report)
                else:
                    unknown.append((report.worker_id, report.rank))
            self._counts.load_reports += len(reports) - len(unknown)
            self._counts.load_unknown += len(unknown)
        return unknown

    # ----------------------------------------------------------------- queries

    def query(
        self,
        token_ids: Sequence[int | str] | None = None,
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
        model_name: str | None = None,
        shape: Shape[_R] = answer,  # type: ignore[assignment]  # _R is our answer's type then
    ) -> _R:
        """Matches per holder and a routing decision, JSON-ready (by ``shape``: ours, or
        another API's, e.g. :mod:`.dynamo`).

        The request is ``token_ids``, or the same tokens ``packed`` as uint32 little-endian
        bytes (what ``POST /query`` hands over), or precomputed ``block_hashes``;
        ``cache_salt`` and ``mm`` as in :meth:`PrefixIndex.match` (a str token is a digest);
        ``prefill_weight`` and ``load_weight`` override the router's cost weights for this
        decision. With ``model_name``, only the workers registered for that model (or for
        none) match and are routed to.
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
            targets = None
            if model_name is not None:
                targets = rules.model_targets(self._workers.values(), model_name)
                match = scoped(match, targets)
            self._counts.loads_expired += self._loads.expire()
            decision = self.router.decide(
                match,
                targets=targets,
                policy=policy,
                prefill_weight=prefill_weight,
                load_weight=load_weight,
            )
            self._counts.queries += 1
        self.decisions.record(decision)
        return shape(match, decision)

    def match(
        self,
        token_ids: Sequence[int | str],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMSpan] = (),
    ) -> MatchResult:
        """The index's matches of a request's tokens (:meth:`PrefixIndex.match`, under the
        lock); :meth:`decide` turns one into a decision."""
        with self.lock:
            return self.index.match(token_ids, lora=lora, cache_salt=cache_salt, mm=mm)

    def decide(
        self,
        match: MatchResult,
        *,
        targets: Sequence[StreamKey],
        policy: str | None = None,
        adds: Mapping[StreamKey, int] | None = None,
        recent_matched: Mapping[StreamKey, int] | None = None,
        credit: Mapping[StreamKey, int] | None = None,
    ) -> Decision:
        """A routing decision among ``targets`` from ``match`` (one of :meth:`match`), recorded
        for the status page like every query's; ``adds``, ``recent_matched`` and ``credit``
        (the front door's predicted blocks) as :meth:`Router.decide` takes them."""
        with self.lock:
            self._counts.loads_expired += self._loads.expire()
            decision = self.router.decide(
                match,
                targets=targets,
                policy=policy,
                adds=adds,
                recent_matched=recent_matched,
                credit=credit,
            )
            self._counts.queries += 1
        self.decisions.record(decision)
        return decision

    def set_capacity(self, worker_id: str, rank: int, blocks: int | None) -> None:
        """The blocks a target's cache holds (None: not known), for the router's policies
        (:meth:`Router.set_capacity`)."""
        with self.lock:
            self.router.set_capacity(worker_id, rank, blocks)

    # ----------------------------------------------------------------- reads

    def stream_infos(self) -> list[StreamInfo]:
        """Every stream as the index sees it (blocks per tier, batches applied), under the lock."""
        with self.lock:
            return self.index.streams()

    def removed_blocks(self, worker_id: str, rank: int) -> int:
        """The blocks a stream's engine has announced removed so far, under the lock
        (:meth:`PrefixIndex.removed_blocks`)."""
        with self.lock:
            return self.index.removed_blocks(worker_id, rank)

    def block_size(self, worker_id: str, rank: int) -> int | None:
        """The block size a stream is keyed by (registered or adopted), None if unknown."""
        with self.lock:
            return self.index.stream_block_size(worker_id, rank)

    def stats(self) -> ServiceStats:
        return self._counts.frozen()

    def index_stats(self) -> IndexStats:
        with self.lock:
            return self.index.stats()

    def health(self) -> FeedHealth:
        """Whether the service is serving: the feed's health, ``"starting"`` while it
        registers the workers of its state file again (serving only some of them would look
        healthy), or ``"degraded"`` (serving, naming one stream) while some streams are
        degraded in routing."""
        progress = self._persisted.restore_progress
        if progress is not None:
            why = f"restoring the state file: {progress[0]} of {progress[1]} workers registered"
            return FeedHealth("starting", True, 0.0, why)
        health = self.feed.health()
        if health.state != "ok":
            return health
        marks = self.degraded()
        if not marks:
            return health
        (worker_id, rank), why = next(iter(marks.items()))
        example = f"worker {worker_id[:64]!r} rank {rank}: {why}"
        return FeedHealth("degraded", True, 0.0, f"{len(marks)} stream(s) degraded; {example}")

    def degraded(self) -> dict[StreamKey, str]:
        """The streams whose matches routing does not trust now, and why (a copy)."""
        with self.lock:
            return dict(self.router.degraded)

    def stream_health(self) -> dict[StreamKey, StreamStats]:
        """The feed's per-stream stats."""
        return self.feed.stream_stats()

    def workers(self) -> list[WorkerRegistration]:
        return list(self._workers.values())

    def workers_view(self) -> list[Document]:
        """Workers with their per-rank index state, stream health and reported load
        (``GET /workers``)."""
        with self.lock:
            streams = {(s.worker_id, s.rank): s for s in self.index.streams()}
            degraded = dict(self.router.degraded)
            self._counts.loads_expired += self._loads.expire()
            loads = self.router.loads.snapshot()
        health = self.stream_health()
        return worker_rows(self.workers(), streams, health, degraded, loads, time.time())

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
            return self.index.holder_blocks(key)

    def dump(self) -> Document:
        """Every holder's blocks and the index stats, in memory (``GET /dump`` streams it)."""
        holders = [
            {**holder_header(key, size), "blocks": [list(p) for p in self.holder_blocks(key)]}
            for key, size in self.holders()
        ]
        return {"holders": holders, "stats": builtins(self.index_stats())}

    # ----------------------------------------------------------------- snapshots

    def copy_index(self, copy: Callable[[PrefixIndex, Hold], _R]) -> _R:
        """``copy(index, hold)``: read the index for a snapshot, from its only writer (the
        feed's thread, so nothing changes meanwhile); ``hold()`` takes the lock, for the
        copy to hold around each piece it reads, so queries wait for one piece at a time."""
        return copy(self.index, lambda: self.lock)

    def load_index(self, load: Callable[[PrefixIndex], object]) -> None:
        """``load(index)`` under the lock: a snapshot restored into the index whole, before
        (or between) queries."""
        with self.lock:
            load(self.index)

"""The index service: a prefix index and a router fed by a live event feed.

:class:`IndexService` owns the index, the router and the feed (the
:class:`kvevents.subscribe.subscriber.Subscriber` by default, created lazily and applying each batch on
its own I/O thread). Workers are registered with :class:`WorkerRegistration`; a ``Delivery``
is applied, a ``StreamReset`` resets that stream, a stream that lost events for good is
degraded in routing until it is whole again. Queries take the same lock as the feed.

The feed protocol, the records and the default feed are in :mod:`kvevents.service.feed`
(re-exported here); registrations are kept by :mod:`.workers` and the read views are in
:mod:`.views`, both bases of the service; the HTTP API over the service (``kvevents serve``)
is the layer above, :mod:`kvevents.http`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvevents.errors import DecodeError
from kvevents.index.decision import Decision, Target
from kvevents.index.keys import MMSpan
from kvevents.index.prefix import MatchResult, PrefixIndex, StreamInfo
from kvevents.index.router import DEFAULT_POLICY, Router
from kvevents.service.answers import Shape, answer, scoped
from kvevents.service.decisions import DecisionLog
from kvevents.service.feed import (
    Feed,
    ServiceStats,
    WorkerRegistration,
    default_feed,
    default_stream_specs,
)
from kvevents.service.loadreports import DEFAULT_LOAD_TTL, LoadLedger
from kvevents.service.state import Persisted, StateFile
from kvevents.service.views import ServiceViews
from kvevents.service.workers import ServiceWorkers
from kvevents.subscribe.streams import (
    Delivery,
    Item,
    StreamSpec,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import Applied, decode_batch_packed

__all__ = [
    "Feed",
    "IndexService",
    "ServiceStats",
    "WorkerRegistration",
]

log = logging.getLogger("kvevents.service.core")

_R = TypeVar("_R")


class IndexService(ServiceWorkers, ServiceViews):
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
        # The feed's hot path, once per batch: the checks and counts are inline.
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        worker_id, rank = stream.worker_id, stream.rank
        with self.lock:
            reg = self._workers.get(worker_id)
            if reg is None or rank not in reg.ranks:
                return None
            try:
                cleared = self.index.ingest(worker_id, rank, batch)
            except DecodeError:
                raise
            except Exception:
                self._counts["apply_errors"] += 1  # the subscriber logs it, with the stream
                raise
            self._counts["deliveries"] += 1
        skipped = decoded.skipped_count if decoded.skipped else 0
        return Applied(batch.ts, len(batch.events), skipped, cleared)

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

    # ----------------------------------------------------------------- reads

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
        shape: Shape[_R] = answer,  # type: ignore[assignment]
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
            targets = None if model_name is None else self._model_targets(model_name)
            if targets is not None:
                match = scoped(match, targets)
            self._counts["loads_expired"] += self._loads.expire()
            decision = self.router.decide(
                match,
                targets=targets,
                policy=policy,
                prefill_weight=prefill_weight,
                load_weight=load_weight,
            )
            self._counts["queries"] += 1
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
        self, match: MatchResult, *, targets: Sequence[Target], policy: str | None = None
    ) -> Decision:
        """A routing decision among ``targets`` from ``match`` (one of :meth:`match`, or the
        caller's own view of it: the front door adds its predicted blocks), recorded for the
        status page like every query's."""
        with self.lock:
            self._counts["loads_expired"] += self._loads.expire()
            decision = self.router.decide(match, targets=targets, policy=policy)
            self._counts["queries"] += 1
        self.decisions.record(decision)
        return decision

    def stream_infos(self) -> list[StreamInfo]:
        """Every stream as the index sees it (blocks per tier, batches applied), under the lock."""
        with self.lock:
            return self.index.streams()

    def block_size(self, worker_id: str, rank: int) -> int | None:
        """The block size a stream is keyed by (registered or adopted), None if unknown."""
        with self.lock:
            return self.index.stream_block_size(worker_id, rank)

    def stats(self) -> ServiceStats:
        return ServiceStats(**self._counts)

"""The index service: a prefix index and a router fed by a live event feed.

:class:`IndexService` owns the index, the router and the feed (the
:class:`kvevents.subscribe.subscriber.Subscriber` by default, created lazily and applying each batch on
its own I/O thread). Workers are registered with :class:`WorkerRegistration`; a ``Delivery``
is applied, a ``StreamReset`` resets that stream, a stream that lost events for good is
degraded in routing until it is whole again. Queries take the same lock as the feed.

The HTTP API over it (``kvevents serve``) is :mod:`kvevents.service.http`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from kvevents.errors import DecodeError
from kvevents.index.prefix import IndexStats, PrefixIndex
from kvevents.index.router import Router
from kvevents.subscribe.streams import Delivery
from kvevents.wire import Applied

__all__ = [
    "Feed",
    "IndexService",
    "ServiceStats",
    "WorkerRegistration",
]

log = logging.getLogger("kvevents.service.core")


class Feed(Protocol):
    """What the service needs from an event source (the Subscriber has all of it)."""

    def add_stream(self, spec: Any) -> None: ...
    def remove_stream(self, worker_id: str, rank: int | None = None) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def get(self, timeout: float | None = None) -> Any: ...
    def stats(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class WorkerRegistration:
    """A registered worker: where its ranks publish and how its blocks are sized."""

    worker_id: str
    endpoint: str
    block_size: int
    ranks: tuple[int, ...] = (0,)
    replay_endpoint: str | None = None
    topic: str = ""
    model_name: str | None = None


@dataclasses.dataclass(frozen=True)
class ServiceStats:
    """The feed consumer's counters."""

    deliveries: int  #: batches applied
    resets: int  #: stream resets applied
    ignored: int  #: items of workers (or ranks) no longer registered
    apply_errors: int  #: items that raised while applied (logged; the thread goes on)
    queries: int


def default_stream_specs(reg: WorkerRegistration) -> list[Any]:
    """Stream specs of a worker's ranks, built by ``kvevents.subscribe.subscriber.worker_streams``."""
    subscriber = importlib.import_module("kvevents.subscribe.subscriber")
    specs: list[Any] = subscriber.worker_streams(
        reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=list(reg.ranks), topic=reg.topic
    )
    return specs


def default_feed(
    callback: Callable[[Any], None] | None = None,
    options: Any | None = None,
    on_status: Callable[[Any], None] | None = None,
    on_payload: Callable[[Any, int, bytes], Any] | None = None,
) -> Feed:
    """A ``kvevents.subscribe.subscriber.Subscriber`` with no streams yet.

    ``options`` (a ``SubscriberOptions``) are used as given, except that with ``callback``
    the subscriber calls it with every item on its I/O thread instead of queueing the item,
    ``on_status`` (when given) receives every stream state change, and ``on_payload`` (when
    given) applies batch payloads before they are decoded into deliveries.
    """
    subscriber = importlib.import_module("kvevents.subscribe.subscriber")
    base = options if options is not None else subscriber.SubscriberOptions()
    changes: dict[str, Any] = {"callback": callback}
    if on_status is not None:
        changes["on_status"] = on_status
    if on_payload is not None:
        changes["on_payload"] = on_payload
    feed: Feed = subscriber.Subscriber(options=dataclasses.replace(base, **changes))
    return feed


class IndexService:
    """The index, a router, and the thread that feeds the index from a feed.

    The service owns its feed (passed in, or made by ``feed_factory`` on first use) and
    closes it in :meth:`close`. With neither, the feed is a Subscriber that applies each item
    on its own I/O thread through :meth:`consume` (no hand-off between threads, the fastest
    path), and the service starts no consumer thread. A feed that calls :meth:`consume` itself
    is passed with ``pushes=True``. ``subscriber_options`` (a ``SubscriberOptions``)
    configure that default subscriber (e.g. CurveZMQ keys).
    """

    def __init__(
        self,
        index: PrefixIndex | None = None,
        *,
        router: Router | None = None,
        feed: Feed | None = None,
        feed_factory: Callable[[], Feed] | None = None,
        pushes: bool = False,
        subscriber_options: Any | None = None,
        stream_specs: Callable[[WorkerRegistration], list[Any]] = default_stream_specs,
        policy: str = "prefix_load",
        poll_interval: float = 0.1,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.router = router if router is not None else Router(self.index, policy)
        self.lock = threading.Lock()
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
        self._counts = {
            "deliveries": 0,
            "resets": 0,
            "ignored": 0,
            "apply_errors": 0,
            "queries": 0,
        }

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
                return
            if item is not None:
                self.consume(item)

    def consume(self, item: Any) -> None:
        """Apply one feed item: a Delivery (``.batch``), a StreamReset (``.reason``), or a
        StreamStatus (``.state``, from feeds that queue status items)."""
        stream = item.stream
        delivery = type(item) is Delivery or hasattr(item, "batch")
        if not delivery and hasattr(item, "state"):
            self.on_status(item)
            return
        try:
            with self.lock:
                reg = self._workers.get(stream.worker_id)
                if reg is None or stream.rank not in reg.ranks:
                    # Queued before the worker was unregistered: applying it would bring
                    # the worker back as a ghost.
                    self._counts["ignored"] += 1
                elif delivery:
                    self.index.ingest(stream.worker_id, stream.rank, item.batch)
                    self._counts["deliveries"] += 1
                else:
                    self.index.reset_stream(stream.worker_id, stream.rank)
                    self._counts["resets"] += 1
        except Exception:
            self._counts["apply_errors"] += 1
            log.exception("worker %s rank %s: item not applied", stream.worker_id, stream.rank)

    def apply_payload(self, stream: Any, seq: int, payload: bytes) -> Applied | None:
        """Apply one batch payload of ``stream`` straight from the wire (the default feed's
        ``on_payload``): no delivery object, no decoded tokens. None for a stream of a worker
        no longer registered (the feed then delivers it, and :meth:`consume` ignores it)."""
        with self.lock:
            reg = self._workers.get(stream.worker_id)
            if reg is None or stream.rank not in reg.ranks:
                return None
            try:
                applied = self.index.ingest_payload(stream.worker_id, stream.rank, payload, seq=seq)
            except DecodeError:
                raise
            except Exception:
                self._counts["apply_errors"] += 1  # the subscriber logs it, with the stream
                raise
            self._counts["deliveries"] += 1
            return applied

    def on_status(self, status: Any) -> None:
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

    def register(self, reg: WorkerRegistration) -> list[Any]:
        """Index a worker's ranks and subscribe to them; re-registering replaces."""
        if reg.worker_id in self._workers:
            self.unregister(reg.worker_id)
        specs = self._stream_specs(reg)
        with self.lock:
            self.index.register_worker(reg.worker_id, block_size=reg.block_size, ranks=reg.ranks)
            self._workers[reg.worker_id] = reg
        for spec in specs:
            self.feed.add_stream(spec)
        return specs

    def unregister(self, worker_id: str, rank: int | None = None) -> bool:
        """Stop following a worker (or one rank) and drop its blocks. False if unknown."""
        reg = self._workers.get(worker_id)
        if reg is None or (rank is not None and rank not in reg.ranks):
            return False
        self.feed.remove_stream(worker_id, rank)
        with self.lock:
            self.index.remove_worker(worker_id, rank)
            self.router.loads.remove(worker_id, rank)
            self.router.mark_healthy(worker_id, rank)
            if rank is None or reg.ranks == (rank,):
                del self._workers[worker_id]
            else:
                ranks = tuple(r for r in reg.ranks if r != rank)
                self._workers[worker_id] = dataclasses.replace(reg, ranks=ranks)
        return True

    def workers(self) -> list[WorkerRegistration]:
        return list(self._workers.values())

    # ----------------------------------------------------------------- reads

    def query(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        packed: bytes | None = None,
        block_hashes: Sequence[int] | None = None,
        block_size: int | None = None,
        lora: str | int | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        """Matches per holder and a routing decision, JSON-ready.

        The request is ``token_ids``, or the same tokens ``packed`` as uint32 little-endian
        bytes (what ``POST /query`` hands over), or precomputed ``block_hashes``.
        """
        with self.lock:
            if packed is not None:
                match = self.index.match_packed(packed, lora=lora)
            elif token_ids is not None:
                match = self.index.match(token_ids, lora=lora)
            elif block_hashes is not None:
                match = self.index.match_hashes(block_hashes, block_size=block_size)
            else:
                raise ValueError("query needs token_ids or block_hashes")
            decision = self.router.decide(match, policy=policy)
            self._counts["queries"] += 1
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

    def stream_health(self) -> dict[tuple[str, int], Any]:
        """The feed's per-stream stats, when it has them (the Subscriber does)."""
        stream_stats = getattr(self.feed, "stream_stats", None)
        if stream_stats is None:
            return {}
        try:
            health: dict[tuple[str, int], Any] = stream_stats()
        except Exception:  # health is advisory; never fail /workers on it
            log.exception("the feed's stream_stats() failed")
            return {}
        return health

    def workers_view(self) -> list[dict[str, Any]]:
        """Workers with their per-rank index state and stream health (``GET /workers``)."""
        with self.lock:
            streams = {(s.worker_id, s.rank): s for s in self.index.streams()}
        health = self.stream_health()
        now = time.time()
        out = []
        for reg in self._workers.values():
            ranks = []
            for rank in reg.ranks:
                info = streams.get((reg.worker_id, rank))
                row: dict[str, Any] = {"rank": rank}
                if info is not None:
                    row.update(_builtins(info))
                    last = info.last_batch_ts
                    row["lag_seconds"] = None if last is None else max(0.0, now - last)
                row["stream"] = _builtins(health.get((reg.worker_id, rank)))
                row["degraded"] = self.router.degraded.get((reg.worker_id, rank))
                ranks.append(row)
            out.append({**_builtins(reg), "ranks": ranks})
        return out

    def dump(self) -> dict[str, Any]:
        with self.lock:
            return {"holders": self.index.dump(), "stats": _builtins(self.index.stats())}


def _builtins(value: Any) -> Any:
    """Dataclasses, structs and named tuples as plain JSON-ready values."""
    return msgspec.to_builtins(value, builtin_types=None, str_keys=True)

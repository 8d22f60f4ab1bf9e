"""A simulated cluster: N engines with real publishers, one subscriber, one index service.

Every (worker, rank) is a stream: a :class:`~kvevents.publish.ZmqPublisher` bound on
``tcp://127.0.0.1:0`` with a replay endpoint, read by one
:class:`~kvevents.subscribe.Subscriber`. The subscriber feeds the cluster's
:class:`~kvevents.sim._arrivals.Arrivals` (a sink that holds what arrives), and the cluster
hands each batch, on the caller's thread, to an
:class:`~kvevents.service.IndexService`'s sink over the cluster's
:class:`~kvevents.index.PrefixIndex`: the production path, payloads as they came off the
wire. With a drop rate, live messages pass a :class:`~kvevents.sim.LossyRelay` that loses
a seeded fraction of them, so the subscriber's replays are exercised.

:meth:`Cluster.sync` is what makes a run reproducible: it returns once the subscriber has
delivered, for every stream, the last sequence number its publisher allocated (or raises
:class:`~kvevents.errors.SyncTimeout` at the deadline), so the index then reflects every event
published so far. ``transport="direct"`` hands batches to the index in-process with no
sockets (each batch encoded, as a publisher would): the same bookkeeping and the same
service path, for pure tests and quick sizing runs.

:meth:`Cluster.accuracy` compares the index with the engines' exact cached block sets.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvevents._types import Document
from kvevents.deadline import Deadline
from kvevents.errors import SyncTimeout
from kvevents.events import KVEventBatch, StreamKey
from kvevents.index import HolderKey, PrefixIndex
from kvevents.service import IndexService, WorkerRegistration
from kvevents.sim._arrivals import Arrival, Arrivals
from kvevents.sim._cache import CPU, GPU
from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.subscribe import FeedHealth, StreamSpec, StreamStats, SubscriberStats
from kvevents.wire import encode_batch

if TYPE_CHECKING:
    from kvevents.sim._faults import DropRule, LossyRelay
    from kvevents.subscribe import Subscriber

__all__ = ["Accuracy", "Cluster", "ClusterConfig", "FeedCounters", "HolderAccuracy"]

log = logging.getLogger("kvevents.sim.cluster")


# A handshake probe is re-sent this often until the subscriber has seen the stream: a SUB
# that connected after the first probe misses it (the slow-joiner), a later one gets through.
_PROBE_INTERVAL = 0.02


@dataclass(frozen=True)
class ClusterConfig:
    """Shape of a simulated cluster. ``capacity_blocks`` and the budget are per rank.

    ``step_base_s`` and ``step_token_s``: each engine's step time, ``step_base_s +
    step_token_s * tokens`` (virtual seconds). What decides where requests go is their ratio:
    how long a prefill of many tokens takes against a decode step. The defaults are a GPU's
    shape; a real engine's can be measured (a long prompt's time to first token alone, and
    the time between its tokens) and given here."""

    workers: int = 8
    ranks: int = 1
    block_size: int = 64
    capacity_blocks: int = 16384
    cpu_capacity_blocks: int = 0
    max_num_batched_tokens: int = 8192
    transport: Literal["zmq", "direct"] = "zmq"
    drop_rate: float = 0.0
    seed: int = 0
    sync_timeout: float = 30.0
    step_base_s: float = EngineConfig.step_base_s
    step_token_s: float = EngineConfig.step_token_s

    def __post_init__(self) -> None:
        if self.workers <= 0 or self.ranks <= 0:
            raise ValueError(f"need at least one worker and rank, got {self.workers}x{self.ranks}")
        if not 0 < self.step_base_s < math.inf:
            raise ValueError(f"step_base_s must be a finite number > 0, got {self.step_base_s}")
        if not 0 <= self.step_token_s < math.inf:
            raise ValueError(f"step_token_s must be a finite number >= 0, got {self.step_token_s}")
        if self.transport not in ("zmq", "direct"):
            raise ValueError(f"transport must be 'zmq' or 'direct', got {self.transport!r}")
        if self.drop_rate and self.transport != "zmq":
            raise ValueError("drop_rate needs the zmq transport (drops happen on the wire)")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            capacity_blocks=self.capacity_blocks,
            cpu_capacity_blocks=self.cpu_capacity_blocks,
            ranks=self.ranks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            step_base_s=self.step_base_s,
            step_token_s=self.step_token_s,
        )


@dataclass(frozen=True)
class HolderAccuracy:
    """One (worker, rank, tier): the engine's true block set against the index's."""

    worker_id: str
    rank: int
    tier: str
    true_blocks: int
    index_blocks: int
    common: int

    @property
    def exact(self) -> bool:
        return self.true_blocks == self.index_blocks == self.common


@dataclass(frozen=True)
class Accuracy:
    """The index against ground truth, over every holder of the cluster."""

    holders: tuple[HolderAccuracy, ...]

    @property
    def true_blocks(self) -> int:
        return sum(h.true_blocks for h in self.holders)

    @property
    def index_blocks(self) -> int:
        return sum(h.index_blocks for h in self.holders)

    @property
    def common(self) -> int:
        return sum(h.common for h in self.holders)

    @property
    def exact_holders(self) -> int:
        return sum(h.exact for h in self.holders)

    @property
    def exact(self) -> bool:
        return all(h.exact for h in self.holders)

    @property
    def precision(self) -> float:
        """Share of the index's blocks that the engines really hold (1.0 when empty)."""
        return self.common / self.index_blocks if self.index_blocks else 1.0

    @property
    def recall(self) -> float:
        """Share of the engines' blocks that the index knows (1.0 when empty)."""
        return self.common / self.true_blocks if self.true_blocks else 1.0

    def to_dict(self) -> Document:
        return {
            "exact": self.exact,
            "exact_holders": self.exact_holders,
            "holders": len(self.holders),
            "true_blocks": self.true_blocks,
            "index_blocks": self.index_blocks,
            "precision": self.precision,
            "recall": self.recall,
        }


@dataclass(frozen=True)
class FeedCounters:
    """Losses and recoveries seen between the publishers and the index."""

    published: int  #: batches the publishers allocated a sequence number to
    delivered: int  #: batches the subscriber delivered
    # The counters below start after the connection handshake, whose probes a SUB that
    # joined late misses and replays (an expected gap per stream, not a fault).
    gaps: int
    replays: int
    replayed: int  #: batches delivered from a replay
    unrecoverable: int
    restarts: int
    relay_dropped: int  #: live messages the lossy relay dropped (injected faults)
    heartbeats: int  #: empty batches sent so that a dropped last batch is noticed

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Stream:
    """One (worker, rank): its publisher, last published and delivered sequence numbers."""

    key: StreamKey
    publisher: Any  # a direct or a ZeroMQ publisher: each has the few methods used
    published: int = -1
    delivered: int = -1
    last_ts: float = 0.0
    held: deque[Arrival] = field(default_factory=deque)

    def publish(self, batch: KVEventBatch) -> int:
        seq: int = self.publisher.publish(batch)
        self.published = seq
        self.last_ts = batch.ts
        return seq


#: Where the direct transport's streams "are": nothing connects there.
_DIRECT = "inproc://kvevents-sim-direct"


class _DirectPublisher:
    """The in-process transport: ``publish`` encodes the batch and hands it to the cluster's
    arrivals, as a subscriber would once it came off the wire."""

    def __init__(self, key: StreamKey, arrivals: Arrivals) -> None:
        self._spec = StreamSpec(key[0], key[1], _DIRECT)
        self._arrivals = arrivals
        self._next = 0

    def publish(self, batch: KVEventBatch) -> int:
        seq = self._next
        self._next += 1
        self._arrivals.apply(self._spec, seq, encode_batch(batch))
        return seq


class _OwnStreams:
    """The index service's feed in a cluster: the cluster reads its streams itself (its
    subscriber's specs are known when it starts), so there is nothing to add or start here."""

    def add_stream(self, spec: StreamSpec) -> None:
        pass

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> SubscriberStats:
        return SubscriberStats()

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        return {}

    def health(self) -> FeedHealth:
        return FeedHealth("ok", True)


class Cluster:
    """Engines ``w0``..``w{N-1}`` with publishers, a subscriber and an index (see module doc).

    Not thread-safe: the caller's thread steps engines, syncs and reads the index.
    ``staleness`` (seconds of batch time) holds deliveries back in :meth:`release` so the
    index can lag the engines on purpose.
    """

    def __init__(
        self, config: ClusterConfig | None = None, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.config = cfg = config or ClusterConfig()
        self.worker_ids = [f"w{i}" for i in range(cfg.workers)]
        self.index = PrefixIndex(block_size=cfg.block_size)
        #: The index's service: every batch reaches the index through its sink.
        self.service = IndexService(
            self.index, feed=lambda sink: _OwnStreams(), stream_specs=lambda reg: []
        )
        self.engines: dict[str, SimulatedEngine] = {}
        self.streams: dict[StreamKey, _Stream] = {}
        self.staleness = 0.0
        self.heartbeats = 0
        self._clock = clock
        self._arrivals = Arrivals()
        self._subscriber: Subscriber | None = None
        self._relay: LossyRelay | None = None
        self._rule: DropRule | None = None
        self._baseline: SubscriberStats | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        """Bind publishers, build engines, connect the subscriber and handshake every stream."""
        cfg = self.config
        try:
            for worker in self.worker_ids:
                sinks = [self._open_stream((worker, r)) for r in range(cfg.ranks)]
                self.engines[worker] = SimulatedEngine(
                    cfg.engine_config(), publishers=sinks, clock=self._clock
                )
                reg = WorkerRegistration(worker, _DIRECT, cfg.block_size, tuple(range(cfg.ranks)))
                self.service.register(reg, persist=False)
            if cfg.transport == "zmq":
                self._connect()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close the subscriber, the relay and every publisher (idempotent)."""
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        for stream in self.streams.values():
            shutdown = getattr(stream.publisher, "shutdown", None)
            if shutdown is not None:
                shutdown(timeout=0.5)
        self.streams.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_stream(self, key: StreamKey) -> _Stream:
        if self.config.transport == "direct":
            # A direct or a ZeroMQ publisher: each has the few methods used.
            publisher: Any = _DirectPublisher(key, self._arrivals)
        else:
            from kvevents.config import KVEventsConfig
            from kvevents.publish import create_publisher

            # Ephemeral loopback ports: every stream of every simulated cluster binds its own.
            config = KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint="tcp://127.0.0.1:0",
                replay_endpoint="tcp://127.0.0.1:0",
            )
            publisher = create_publisher(config, key[1], world_size=self.config.ranks)
            publisher.start()
        stream = self.streams[key] = _Stream(key, publisher)
        return stream

    def _connect(self) -> None:
        from kvevents.sim._faults import DropRule, LossyRelay
        from kvevents.subscribe import Subscriber, SubscriberOptions

        live = {k: s.publisher.endpoint for k, s in self.streams.items()}
        self._rule = DropRule(self.config.drop_rate, self.config.seed)
        if self.config.drop_rate:
            self._relay = LossyRelay(live, self._rule)
            self._relay.start()
            live = dict(self._relay.endpoints)
        specs = [
            StreamSpec(k[0], k[1], live[k], s.publisher.replay_endpoint)
            for k, s in self.streams.items()
        ]
        options = SubscriberOptions(gap_log_interval=60.0)
        self._subscriber = Subscriber(specs, sink=self._arrivals, options=options)
        self._subscriber.start()
        with _quiet(logging.getLogger("kvevents.subscribe.subscriber")):
            self._handshake()
        self._rule.arm({k: s.published + 1 for k, s in self.streams.items()})
        self._baseline = self._subscriber.stats()

    def _handshake(self) -> None:
        deadline = Deadline(self.config.sync_timeout)
        while not deadline.expired:
            unseen = [s for s in self.streams.values() if s.delivered < 0]
            if not unseen:
                return
            for stream in unseen:
                stream.publish(KVEventBatch(stream.last_ts, [], stream.key[1]))
            probe = Deadline(_PROBE_INTERVAL)
            while not probe.expired and any(s.delivered < 0 for s in unseen):
                self._take(probe.remaining())
        raise SyncTimeout(self.config.sync_timeout, self._lagging())

    # ------------------------------------------------------------------ views

    def targets(self) -> list[StreamKey]:
        """Every (worker, rank), in a stable order."""
        return list(self.streams)

    def engine_ranks(self) -> Iterator[tuple[str, int, SimulatedEngine]]:
        for worker, engine in self.engines.items():
            for rank in range(self.config.ranks):
                yield worker, rank, engine

    def caught_up(self) -> bool:
        return all(s.delivered >= s.published for s in self.streams.values())

    def _lagging(self) -> dict[StreamKey, tuple[int, int]]:
        return {
            k: (s.delivered, s.published)
            for k, s in self.streams.items()
            if s.delivered < s.published
        }

    # ------------------------------------------------------------------ feeding the index

    def sync(self, cutoff: float | None = None, timeout: float | None = None) -> None:
        """Wait until everything published is delivered, then apply what ``cutoff`` allows.

        ``cutoff`` (batch time): with a staleness, only batches with ``ts <= cutoff`` reach
        the index now; None applies everything delivered.
        """
        self._reveal_tail_drops()
        timeout = self.config.sync_timeout if timeout is None else timeout
        deadline = Deadline(timeout)
        while not self.caught_up():
            if deadline.expired:
                raise SyncTimeout(timeout, self._lagging())
            self._take(deadline.remaining())
        self.release(cutoff)

    def pump(self, cutoff: float | None = None) -> int:
        """Apply whatever has arrived, without waiting (for real-time runs). Returns items."""
        taken = 0
        while self._take(0.0):
            taken += 1
        self.release(cutoff)
        return taken

    def release(self, cutoff: float | None = None) -> None:
        """Apply held batches with ``ts <= cutoff`` (every one when None), per stream in order."""
        for stream in self.streams.values():
            held = stream.held
            while held and (cutoff is None or held[0].ts <= cutoff):
                self._apply(held.popleft())

    def _reveal_tail_drops(self) -> None:
        # A subscriber sees a lost message only when a later one arrives. When the rule drops
        # a stream's newest batch, send empty batches (heartbeats) until one gets through.
        if self._rule is None:
            return
        for stream in self.streams.values():
            while stream.published >= 0 and self._rule.drops(stream.key, stream.published):
                stream.publish(KVEventBatch(stream.last_ts, [], stream.key[1]))
                self.heartbeats += 1

    def _take(self, timeout: float) -> bool:
        """Take one arrival and account for it; False when none came within ``timeout``."""
        arrival = self._arrivals.take(timeout)
        if arrival is None:
            return False
        stream = self.streams[arrival.stream.key]
        if arrival.payload is None:
            # A restart: drop the stream; replayed deliveries from 0 rebuild it.
            stream.held.clear()
            stream.delivered = -1
            self.service.reset(arrival.stream, "restart")
            return True
        stream.delivered = arrival.seq
        if self.staleness > 0 or stream.held:
            stream.held.append(arrival)
        else:
            self._apply(arrival)
        return True

    def _apply(self, arrival: Arrival) -> None:
        assert arrival.payload is not None
        self.service.apply(arrival.stream, arrival.seq, arrival.payload)

    # ------------------------------------------------------------------ checks and counters

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        """The subscriber's per-stream stats (empty for the direct transport)."""
        return {} if self._subscriber is None else dict(self._subscriber.stream_stats())

    def accuracy(self) -> Accuracy:
        """The index's blocks per (worker, rank, tier) against the engines' exact sets."""
        snapshot = self.index.snapshot()
        tiers = (GPU, CPU) if self.config.cpu_capacity_blocks else (GPU,)
        rows = []
        for worker, rank, engine in self.engine_ranks():
            for tier in tiers:
                truth = engine.cached_blocks(rank, tier)
                seen = snapshot.pop(HolderKey(worker, rank, tier), frozenset())
                rows.append(
                    HolderAccuracy(worker, rank, tier, len(truth), len(seen), len(truth & seen))
                )
        for key, seen in snapshot.items():  # holders no engine has: all wrong
            rows.append(HolderAccuracy(key.worker_id, key.rank, key.tier, 0, len(seen), 0))
        return Accuracy(tuple(rows))

    def feed_counters(self) -> FeedCounters:
        published = sum(s.published + 1 for s in self.streams.values())
        relay = self._relay.stats().dropped if self._relay is not None else 0
        if self._subscriber is None:
            delivered = sum(s.delivered + 1 for s in self.streams.values())
            return FeedCounters(published, delivered, 0, 0, 0, 0, 0, relay, self.heartbeats)
        now, base = self._subscriber.stats(), self._baseline

        def since(name: str) -> int:
            return int(getattr(now, name) - getattr(base, name))

        return FeedCounters(
            published,
            now.delivered,
            since("gaps"),
            since("replays"),
            since("replayed"),
            since("unrecoverable"),
            since("restarts"),
            relay,
            self.heartbeats,
        )


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Silence ``logger``: the handshake's slow-joiner gaps are expected, not news."""
    drop = _DropAll()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)

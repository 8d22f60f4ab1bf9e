"""An in-process feed for an :class:`~kvevents.service.IndexService`, driven by a test.

:class:`FakeFeed` has the Subscriber's face as the service drives it (streams added and
removed, start and close, stats and health) and feeds the service's sink when the test says
so, on the test's thread: :meth:`FakeFeed.deliver` encodes a batch and hands it to the sink
as a subscriber would, so the service's own path (decode, registration check, index) runs::

    feed = FakeFeed()
    service = fake_service(feed)
    service.register(WorkerRegistration("a", "tcp://127.0.0.1:6000", block_size=4))
    feed.deliver("a", 0, batch(store_event(list(range(8)), 4)))

It is its own factory: ``IndexService(feed=feed)`` hands it the sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvevents.events import KVEventBatch, StreamKey
from kvevents.index import PrefixIndex
from kvevents.service import IndexService, WorkerRegistration
from kvevents.subscribe import (
    FeedHealth,
    ResetReason,
    Sink,
    StreamSpec,
    StreamState,
    StreamStats,
    StreamStatus,
    SubscriberStats,
    worker_streams,
)
from kvevents.wire import Applied, encode_batch

__all__ = ["FakeFeed", "fake_service", "fake_specs"]


@dataclass
class FakeFeed:
    """A feed a test drives (see the module docstring). ``specs``: the streams added and not
    removed; ``removed``: every ``remove_stream`` call; ``state``: what :meth:`health`
    says; ``refuse``: why :meth:`add_stream` refuses every stream (None: it accepts)."""

    specs: list[StreamSpec] = field(default_factory=list)
    removed: list[tuple[str, int | None]] = field(default_factory=list)
    started: bool = False
    closed: bool = False
    state: FeedHealth = field(default_factory=lambda: FeedHealth("ok", True))
    refuse: str | None = None
    sink: Sink | None = None

    def __call__(self, sink: Sink) -> FakeFeed:
        """The feed factory: the service hands over its sink."""
        self.sink = sink
        return self

    # ----------------------------------------------------------------- what the service drives

    def add_stream(self, spec: StreamSpec) -> None:
        if self.refuse is not None:
            raise ValueError(self.refuse)
        self.specs.append(spec)

    def remove_stream(self, worker_id: str, rank: int | None = None) -> None:
        self.removed.append((worker_id, rank))
        self.specs = [
            s for s in self.specs if not (s.worker_id == worker_id and rank in (None, s.rank))
        ]

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True

    def stats(self) -> SubscriberStats:
        return SubscriberStats(streams=len(self.specs))

    def stream_stats(self) -> dict[StreamKey, StreamStats]:
        return {
            s.key: StreamStats(
                worker_id=s.worker_id, rank=s.rank, state="live", last_seq=None, lag_seconds=None
            )
            for s in self.specs
        }

    def health(self) -> FeedHealth:
        return self.state

    # ----------------------------------------------------------------- what a test does

    def spec(self, worker_id: str, rank: int = 0) -> StreamSpec:
        """The stream added for ``(worker_id, rank)`` (StopIteration when there is none)."""
        return next(s for s in self.specs if (s.worker_id, s.rank) == (worker_id, rank))

    def deliver(self, worker_id: str, rank: int, batch: KVEventBatch, seq: int = 0) -> Applied:
        """Hand ``batch`` (encoded) to the sink as batch ``seq`` of that stream."""
        return self.deliver_payload(worker_id, rank, encode_batch(batch), seq)

    def deliver_payload(self, worker_id: str, rank: int, payload: bytes, seq: int = 0) -> Applied:
        """Hand a payload as it came off the wire to the sink."""
        return self._sink().apply(self.spec(worker_id, rank), seq, payload)

    def reset(self, worker_id: str, rank: int = 0, reason: ResetReason = "restart") -> None:
        """Tell the sink the stream restarted (or was removed)."""
        self._sink().reset(self.spec(worker_id, rank), reason)

    def report(
        self, worker_id: str, rank: int, state: StreamState, missing: tuple[int, int] | None = None
    ) -> None:
        """Tell the sink of a change of the stream's state (``"incomplete"``, ``"live"``...)."""
        self._sink().status(StreamStatus(self.spec(worker_id, rank), state, missing))

    def _sink(self) -> Sink:
        assert self.sink is not None, "hand the feed to an IndexService first"
        return self.sink


def fake_specs(reg: WorkerRegistration) -> list[StreamSpec]:
    """The streams of a registration, every rank on base port + rank (no endpoint policy)."""
    return worker_streams(reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=reg.ranks)


def fake_service(feed: FakeFeed, index: PrefixIndex | None = None) -> IndexService:
    """An index service fed by ``feed``, its streams made by :func:`fake_specs`."""
    return IndexService(
        index if index is not None else PrefixIndex(), feed=feed, stream_specs=fake_specs
    )

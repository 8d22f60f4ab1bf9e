"""What the index service is fed by and keeps: the feed protocol, the registration and stats
records, and the default feed (a Subscriber feeding the service, its sink, on its I/O thread).

Records only, plus one factory: the subscriber (and zmq) load when the default feed is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeAlias

from kvevents.events import StreamKey
from kvevents.index import ReportMode
from kvevents.subscribe import (
    FeedHealth,
    Sink,
    StreamSpec,
    StreamStats,
    SubscriberOptions,
    SubscriberStats,
    worker_streams,
)
from kvevents.wire import rank_endpoint

__all__ = [
    "Feed",
    "FeedFactory",
    "OwnEndpoints",
    "ServiceCounts",
    "ServiceStats",
    "WorkerRegistration",
    "default_stream_specs",
    "subscriber_feed",
]


class Feed(Protocol):
    """What the service drives of the source that feeds it (a Subscriber has all of it): the
    streams it reads, its life, and what it tells of itself. What it reads it hands to the
    service's :class:`~kvevents.subscribe.Sink` methods."""

    def add_stream(self, spec: StreamSpec) -> None: ...
    def remove_stream(self, worker_id: str, rank: int | None = None) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> SubscriberStats: ...
    def stream_stats(self) -> dict[StreamKey, StreamStats]: ...
    def health(self) -> FeedHealth: ...


#: Makes a service's feed, given the sink to feed (the service): called once, by the service.
FeedFactory: TypeAlias = Callable[[Sink], Feed]


class OwnEndpoints(NamedTuple):
    """A rank registered on its own: it publishes on ``endpoint`` itself, not a base + rank."""

    rank: int
    endpoint: str
    replay_endpoint: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkerRegistration:
    """A registered worker: where its ranks publish and how its blocks are sized.

    Rank r publishes on ``endpoint``'s port + r (and replays on ``replay_endpoint``'s), except
    the ranks in ``own_endpoints``: those were registered one at a time (``dp_rank``, as
    Dynamo's API does), each with endpoints of its own.
    """

    worker_id: str
    endpoint: str
    block_size: int
    ranks: tuple[int, ...] = (0,)
    replay_endpoint: str | None = None
    topic: str = ""
    model_name: str | None = None
    own_endpoints: tuple[OwnEndpoints, ...] = ()
    #: What a second store of a held block means (vLLM's ``kv_cache_report_mode``).
    report_mode: ReportMode = "incremental"

    def own(self, rank: int) -> OwnEndpoints | None:
        """The endpoints ``rank`` was registered with on its own, if it was."""
        return next((e for e in self.own_endpoints if e.rank == rank), None)

    def without(self, rank: int) -> WorkerRegistration:
        """This registration less ``rank`` (which must not be its only one)."""
        return dataclasses.replace(
            self,
            ranks=tuple(r for r in self.ranks if r != rank),
            own_endpoints=tuple(e for e in self.own_endpoints if e.rank != rank),
        )

    def with_rank(self, own: OwnEndpoints) -> WorkerRegistration:
        """This registration plus (or with a new endpoint for) one rank of its own."""
        rest = self.without(own.rank) if own.rank in self.ranks else self
        return dataclasses.replace(
            rest,
            ranks=tuple(sorted((*rest.ranks, own.rank))),
            own_endpoints=(*rest.own_endpoints, own),
        )


@dataclasses.dataclass(frozen=True)
class ServiceStats:
    """What the service applied, answered and registered (the frozen twin of
    :class:`ServiceCounts`)."""

    deliveries: int = 0  #: batches applied to the index
    resets: int = 0  #: stream resets applied (a publisher restarted or a stream was removed)
    ignored: int = 0  #: batches and resets of workers (or ranks) no longer registered
    apply_errors: int = 0  #: batches and resets that raised while applied (the feed goes on)
    queries: int = 0  #: queries answered
    registrations: int = 0  #: workers registered (a re-registration counts again)
    refused_registrations: int = 0  #: registrations refused whole (a stream could not be added)
    load_reports: int = 0  #: (worker, rank) loads applied from POST /load
    load_unknown: int = 0  #: load reports for a worker or rank not registered, not applied
    loads_expired: int = 0  #: loads dropped for want of a newer report within the load TTL
    state_writes: int = 0  #: state file rewrites after a registration changed
    state_write_errors: int = 0  #: state file rewrites that failed (logged; the change stands)


@dataclasses.dataclass(slots=True)
class ServiceCounts:
    """The service's running counters (each documented on :class:`ServiceStats`): mutable,
    so that a counter's name is checked by mypy, and frozen by :meth:`frozen`."""

    deliveries: int = 0
    resets: int = 0
    ignored: int = 0
    apply_errors: int = 0
    queries: int = 0
    registrations: int = 0
    refused_registrations: int = 0
    load_reports: int = 0
    load_unknown: int = 0
    loads_expired: int = 0
    state_writes: int = 0
    state_write_errors: int = 0

    def frozen(self) -> ServiceStats:
        return ServiceStats(**dataclasses.asdict(self))


def default_stream_specs(reg: WorkerRegistration) -> list[StreamSpec]:
    """Stream specs of a worker's ranks: from its base endpoints (rank r: base port + r), or
    the rank's own endpoints for a rank registered on its own."""
    if not reg.own_endpoints:
        return worker_streams(
            reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=list(reg.ranks), topic=reg.topic
        )
    return [_rank_spec(reg, rank) for rank in reg.ranks]


def _rank_spec(reg: WorkerRegistration, rank: int) -> StreamSpec:
    own = reg.own(rank)
    if own is not None:
        return StreamSpec(reg.worker_id, rank, own.endpoint, own.replay_endpoint, reg.topic)
    replay = reg.replay_endpoint
    return StreamSpec(
        reg.worker_id,
        rank,
        rank_endpoint(reg.endpoint, rank),
        None if replay is None else rank_endpoint(replay, rank),
        reg.topic,
    )


def subscriber_feed(options: SubscriberOptions | None = None) -> FeedFactory:
    """The default feed: a ``kvevents.subscribe.Subscriber`` with ``options`` and no
    streams yet, feeding the service on its own I/O thread (no hand-off between threads)."""

    def make(sink: Sink) -> Feed:
        # Here, not at the top: the subscriber loads zmq, which a service with its own feed
        # (tests, simulations) never needs.
        from kvevents.subscribe import Subscriber

        return Subscriber(sink=sink, options=options)

    return make

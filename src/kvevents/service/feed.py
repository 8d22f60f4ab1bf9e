"""What the index service is fed by and keeps: the feed protocol, the registration and stats
records, and the default feed (a Subscriber applying batches on its own I/O thread).

Records only, plus one factory: the subscriber (and zmq) load when the default feed is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from kvevents.subscribe.streams import (
    FeedHealth,
    Item,
    StreamKey,
    StreamSpec,
    StreamStats,
    StreamStatus,
    SubscriberOptions,
    SubscriberStats,
    worker_streams,
)
from kvevents.wire import Applied

__all__ = ["Feed", "ServiceStats", "WorkerRegistration", "default_feed", "default_stream_specs"]


class Feed(Protocol):
    """What the service needs from an event source (the Subscriber has all of it)."""

    def add_stream(self, spec: StreamSpec) -> None: ...
    def remove_stream(self, worker_id: str, rank: int | None = None) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def get(self, timeout: float | None = None) -> Item | None: ...
    def stats(self) -> SubscriberStats: ...
    def stream_stats(self) -> dict[StreamKey, StreamStats]: ...
    def health(self) -> FeedHealth: ...


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
    """The feed consumer's and the registrations' counters."""

    deliveries: int = 0  #: batches applied to the index
    resets: int = 0  #: stream resets applied (a publisher restarted or a stream was removed)
    ignored: int = 0  #: feed items of workers (or ranks) no longer registered, not applied
    apply_errors: int = 0  #: feed items that raised while applied (logged; the feed goes on)
    queries: int = 0  #: queries answered
    registrations: int = 0  #: workers registered (a re-registration counts again)
    refused_registrations: int = 0  #: registrations refused whole (a stream could not be added)
    load_reports: int = 0  #: (worker, rank) loads applied from POST /load
    load_unknown: int = 0  #: load reports for a worker or rank not registered, not applied
    loads_expired: int = 0  #: loads dropped for want of a newer report within the load TTL
    state_writes: int = 0  #: state file rewrites after a registration changed
    state_write_errors: int = 0  #: state file rewrites that failed (logged; the change stands)


def default_stream_specs(reg: WorkerRegistration) -> list[StreamSpec]:
    """Stream specs of a worker's ranks from its base endpoints (rank r: base port + r)."""
    return worker_streams(
        reg.worker_id, reg.endpoint, reg.replay_endpoint, ranks=list(reg.ranks), topic=reg.topic
    )


def default_feed(
    callback: Callable[[Item], None] | None = None,
    options: SubscriberOptions | None = None,
    on_status: Callable[[StreamStatus], None] | None = None,
    on_payload: Callable[[StreamSpec, int, bytes], Applied | None] | None = None,
) -> Feed:
    """A ``kvevents.subscribe.subscriber.Subscriber`` with no streams yet.

    ``options`` are used as given, except that with ``callback`` the subscriber calls it with
    every item on its I/O thread instead of queueing the item, ``on_status`` (when given)
    receives every stream state change, and ``on_payload`` (when given) applies batch
    payloads before they are decoded into deliveries.
    """
    # Here, not at the top: the subscriber loads zmq, which a service with its own feed
    # (tests, simulations) never needs.
    from kvevents.subscribe.subscriber import Subscriber

    base = options if options is not None else SubscriberOptions()
    changes: dict[str, Any] = {"callback": callback}
    if on_status is not None:
        changes["on_status"] = on_status
    if on_payload is not None:
        changes["on_payload"] = on_payload
    return Subscriber(options=dataclasses.replace(base, **changes))

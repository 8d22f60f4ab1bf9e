"""The records a publisher is configured with and reports: options, counters, shutdown report.

Frozen dataclasses, no sockets: ``PublisherOptions`` holds what ``KVEventsConfig`` does not
(so every config TensorRT-LLM accepts keeps its meaning), ``PublisherStats`` every counter
(``metrics`` exports them by name), ``ShutdownReport`` what ``shutdown()`` achieved.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from kvevents.publish._replay import ReplayLimits
from kvevents.security import CurveServer

__all__ = ["PublisherOptions", "PublisherStats", "ShutdownReport"]


@dataclass(frozen=True)
class PublisherOptions:
    """Publisher settings that are not part of ``KVEventsConfig``.

    Kept outside the config so that every config TensorRT-LLM accepts keeps its meaning.
    """

    heartbeat_interval: float | None = None
    """Seconds without a publish after which an empty batch is sent; None: no heartbeats."""
    replay_buffer_bytes: int = 256 * 2**20
    """Payload byte budget of the replay ring (with ``buffer_steps``, whichever binds first).
    256 MiB holds about 6,500 prefills of 8,192 tokens, or 10,000 typical 16-block batches
    many times over."""
    linger: float = 2.0
    """Seconds ``shutdown()`` may spend publishing what is queued and flushing the socket."""
    max_concurrent_replays: int = 8
    """Replies sent at the same time; later requests wait in a queue."""
    max_waiting_replays: int = 64
    """Requests that may wait; beyond it a request gets only the end marker (counted). One peer
    may have at most an eighth of them waiting."""
    max_replays_per_peer: int = 2
    """Reply slots one peer (remote address: an IP for tcp, a process for ipc) may hold at
    once; its further requests wait while other peers' requests take the free slots."""
    replay_send_timeout: float = 5.0
    """Seconds a reply may make no progress (its client reads nothing) before it is abandoned
    and its slot given back (``replay_timed_out``)."""
    replay_rate: float = 10.0
    """Replay requests per second one peer may make on average (a token bucket); beyond it a
    request gets only the end marker at once (``replay_rate_limited``)."""
    replay_burst: int = 20
    """Replay requests one peer may make at once before ``replay_rate`` applies."""
    start_timeout: float = 10.0
    """Seconds ``start()`` waits for the socket threads to bind."""
    curve: CurveServer | None = None
    """Encrypt and authenticate the PUB and replay sockets with CurveZMQ (``docs/security.md``);
    None: the plain wire every engine speaks."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval is not None and self.heartbeat_interval <= 0:
            raise ValueError(
                f"heartbeat_interval must be > 0 or None, got {self.heartbeat_interval}"
            )
        for name in (
            "replay_buffer_bytes",
            "max_concurrent_replays",
            "max_waiting_replays",
            "max_replays_per_peer",
            "replay_burst",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("start_timeout", "replay_send_timeout", "replay_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.linger < 0:
            raise ValueError(f"linger must be >= 0, got {self.linger}")

    def replay_limits(self) -> ReplayLimits:
        """The bounds of the replay server these options ask for."""
        return ReplayLimits(
            max_active=self.max_concurrent_replays,
            max_waiting=self.max_waiting_replays,
            per_peer=self.max_replays_per_peer,
            send_timeout=self.replay_send_timeout,
            rate=self.replay_rate,
            burst=self.replay_burst,
        )


@dataclass(frozen=True)
class PublisherStats:
    """What a publisher did since it started. Every loss has a counter."""

    #: Fields that are levels (Prometheus gauges); every other number only grows.
    GAUGES: ClassVar[frozenset[str]] = frozenset(
        {
            "next_seq",
            "pending_carry",
            "queue_depth",
            "replay_active",
            "replay_waiting",
            "replay_peers",
            "ring_batches",
            "ring_bytes",
        }
    )

    enqueued: int = 0
    """Batches accepted into the queue (heartbeats included)."""
    published: int = 0
    """Batches handed to the PUB socket."""
    dropped_queue_full: int = 0
    """Batches dropped because ``max_queue_size`` batches were waiting (each is a seq gap)."""
    dropped_encode_error: int = 0
    """Batches that could not be encoded (each is a seq gap)."""
    dropped_send_error: int = 0
    """Batches the queue refused with an error other than 'full' (each is a seq gap)."""
    carried_events: int = 0
    """Removals and clears of dropped batches delivered in a later batch instead."""
    pending_carry: int = 0
    """Removals and clears waiting for the next accepted batch."""
    replay_requests: int = 0
    """Replay requests received, malformed ones included."""
    replay_batches_served: int = 0
    """Batches sent in replay replies (end markers excluded)."""
    replay_malformed: int = 0
    """Requests that could not be read; each got the end marker."""
    replay_rejected: int = 0
    """Requests beyond the wait queue (or the peer's part of it); each got only the end marker."""
    replay_rate_limited: int = 0
    """Requests over their peer's rate; each got only the end marker."""
    replay_timed_out: int = 0
    """Replies abandoned because the client read nothing for ``replay_send_timeout``."""
    replay_clients_lost: int = 0
    """Replies cut short because the client disconnected, and end markers a client had no room
    for."""
    replay_active: int = 0
    """Replies in progress."""
    replay_waiting: int = 0
    """Requests waiting for a reply slot."""
    replay_peers: int = 0
    """Peers the replay rate limiter keeps a bucket for (bounded)."""
    queue_depth: int = 0
    """Batches accepted but not yet seen leaving the queue (the count lags slightly)."""
    bytes_sent: int = 0
    """Bytes of all frames handed to the PUB socket."""
    heartbeats: int = 0
    """Empty batches sent because the engine was idle."""
    ring_batches: int = 0
    """Batches held for replay."""
    ring_bytes: int = 0
    """Payload bytes held for replay."""
    next_seq: int = 0
    """The sequence number the next batch will get."""
    auth_rejected: int = 0
    """CURVE handshakes refused because the client key is not on the allow-list."""
    handshake_failed: int = 0
    """CURVE handshakes that failed (a peer without keys or with the wrong server key)."""

    @property
    def dropped(self) -> int:
        """Batches lost inside the publisher, all causes."""
        return self.dropped_queue_full + self.dropped_encode_error + self.dropped_send_error

    def as_dict(self) -> dict[str, int]:
        """The counters by name (for metrics)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ShutdownReport:
    """What ``shutdown()`` achieved."""

    published: int
    """Batches handed to the PUB socket over the publisher's life."""
    undelivered: int
    """Accepted batches that had not reached the PUB socket when the linger ran out."""
    flush_complete: bool
    """False when the socket linger ran out with data possibly still queued for a subscriber
    (inferred from the time the final flush took)."""
    duration: float
    """Seconds ``shutdown()`` took."""
    stats: PublisherStats
    """The final counters."""

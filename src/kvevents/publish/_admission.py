"""Per-peer token buckets for replay requests (pure code, no sockets, injected clock).

A peer is what the replay server can tell apart: the remote address ZeroMQ reports for a
connection (an IP for tcp, a process for ipc). A routing identity would not do: a client makes a
new one with every connection, so a flood from fresh DEALERs would get a fresh bucket each time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PeerBuckets"]


@dataclass
class _Bucket:
    tokens: float
    updated: float


class PeerBuckets:
    """``rate`` requests per second per peer, bursts of up to ``burst``; at most ``max_peers``
    buckets are kept.

    A full bucket is the same as no bucket, so full ones are forgotten first when the table is
    over its bound; beyond that the least recently refilled goes (that peer starts afresh with a
    full bucket: lenient, but memory stays bounded whatever the number of peers).
    """

    def __init__(self, rate: float, burst: int, max_peers: int = 1024) -> None:
        if rate <= 0 or burst < 1 or max_peers < 1:
            raise ValueError("a token bucket needs rate > 0, burst >= 1 and max_peers >= 1")
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, peer: str, now: float) -> bool:
        """Take a token from ``peer``'s bucket at time ``now``; False when it is empty."""
        bucket = self._buckets.pop(peer, None) or _Bucket(float(self.burst), now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        allowed = bucket.tokens >= 1.0
        if allowed:
            bucket.tokens -= 1.0
        self._buckets[peer] = bucket  # re-inserted: the dict's order is least recent first
        if len(self._buckets) > self.max_peers:
            self._forget(now)
        return allowed

    def _forget(self, now: float) -> None:
        full = [
            peer
            for peer, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.updated) * self.rate >= self.burst
        ]
        for peer in full:
            del self._buckets[peer]
        # Down to three quarters, so a steady stream of new peers pays for a scan only now
        # and then.
        while len(self._buckets) > self.max_peers - self.max_peers // 4:
            del self._buckets[next(iter(self._buckets))]

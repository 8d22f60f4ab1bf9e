"""Predicted blocks: what a request sent to a target will cache there, credited at once.

An engine announces a prompt's blocks only once it has computed them, and the events reach
the index a moment later. Until then a burst of requests sharing a new prefix would find it
nowhere and be spread over every engine, each computing it again. So when the front door
sends a request, the keys of its prompt's full blocks are credited to that target here at
once; a later request matching them is routed (and predicted) as if they were cached.

A credit lasts while its request is in flight (at most ``ttl`` seconds) and ``grace``
seconds after it ends, by when the engine's own events have long reached the index, which
then speaks for those blocks (and for their eviction). A request that failed takes its credit
back at once. The keys held are bounded (``max_keys``): past it, the credits that expire
first go first. Pure: no sockets; ``clock`` is monotonic seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic

from kvevents.events import StreamKey
from kvevents.route._keycounts import KeyCounts

__all__ = ["Credit", "PredictionStats", "Predictions"]

#: Seconds a credit outlives its request: events arrive within milliseconds of the engine
#: step that stored the blocks; two seconds covers a stalled subscriber without letting a
#: prediction outlast an eviction for long.
DEFAULT_GRACE = 2.0
#: Seconds a credit lasts while its request is still in flight.
DEFAULT_TTL = 300.0
#: Keys held over every target: 1 Mi keys is 512 in-flight prompts of 32k tokens (blocks of 16).
DEFAULT_MAX_KEYS = 1 << 20


@dataclass(eq=False)
class Credit:
    """One request's predicted blocks on one target."""

    target: StreamKey
    keys: Sequence[int]
    expires: float
    live: bool = field(default=True, repr=False)


@dataclass(frozen=True)
class PredictionStats:
    """Credits given, taken back (failed requests), expired; keys held now."""

    credits: int = 0
    withdrawn: int = 0
    expired: int = 0
    keys_held: int = 0


class Predictions:
    """Per target, the keys of blocks its in-flight (or just ended) requests will cache."""

    def __init__(
        self,
        *,
        grace: float = DEFAULT_GRACE,
        ttl: float = DEFAULT_TTL,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if grace < 0 or ttl <= 0 or max_keys < 1:
            raise ValueError("grace must be >= 0, ttl > 0 and max_keys >= 1")
        self.grace, self.ttl, self.max_keys = grace, ttl, max_keys
        self._clock = clock
        self._held = KeyCounts()  # per target, the keys its live credits hold
        self._expiry: list[tuple[float, int, Credit]] = []  # a heap; stale entries skipped
        self._order = itertools.count()
        self._credits = self._withdrawn = self._expired = 0

    def credit(self, target: StreamKey, keys: Sequence[int]) -> Credit:
        """Credit ``keys`` to ``target`` until the request ends (:meth:`settle`)."""
        self.expire()
        credit = Credit(target, keys, self._clock() + self.ttl)
        self._held.add(target, keys)
        self._schedule(credit)
        self._credits += 1
        while self._held.references > self.max_keys and self._expiry:
            self._drop_next()
        return credit

    def settle(self, credit: Credit, *, stored: bool) -> None:
        """The request ended: its credit lasts ``grace`` more seconds if the engine stored
        its blocks (it answered), or ends now if it failed."""
        if not credit.live:
            return
        if not stored:
            self._release(credit)
            self._withdrawn += 1
            return
        credit.expires = min(credit.expires, self._clock() + self.grace)
        self._schedule(credit)

    def prefix(self, target: StreamKey, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are credited to ``target``."""
        return self._held.prefix(target, keys)

    def forget(self, worker_id: str, rank: int | None = None) -> None:
        """Take back every credit of a worker (or one rank): its engine went away or its
        cache was cleared."""
        self._held.forget(worker_id, rank)
        for _, _, credit in self._expiry:
            if credit.target[0] == worker_id and rank in (None, credit.target[1]):
                credit.live = False

    def expire(self) -> int:
        """Drop the credits whose time is up; how many."""
        now = self._clock()
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            dropped += self._drop_next()
        return dropped

    def stats(self) -> PredictionStats:
        return PredictionStats(self._credits, self._withdrawn, self._expired, self._held.references)

    def _schedule(self, credit: Credit) -> None:
        heapq.heappush(self._expiry, (credit.expires, next(self._order), credit))

    def _drop_next(self) -> int:
        expires, _, credit = heapq.heappop(self._expiry)
        if not credit.live or expires != credit.expires:
            return 0  # released already, or rescheduled: a later entry stands for it
        self._release(credit)
        self._expired += 1
        return 1

    def _release(self, credit: Credit) -> None:
        credit.live = False
        self._held.remove(credit.target, credit.keys)

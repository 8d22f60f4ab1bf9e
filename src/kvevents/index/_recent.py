"""What each target was lately asked to hold: the distinct blocks of the requests sent to it.

An engine's cache is always full once it has warmed up, so the blocks the index lists for it
say nothing about how crowded it is. What does is how much *different* prefix it has lately
been asked to keep: an engine that serves the conversations of three apps needs their three
system prompts and every history, one that serves a single app needs one. The front door
sends every request, so it knows this at the moment it sends (before the engine has stored
anything): :class:`RecentBlocks` keeps, per target, the keys of the blocks of the requests
sent there within the last ``window`` seconds, each once. Its size is the target's
``recent_blocks`` in its :class:`~kvevents.index.Load`: ``bounded_prefix`` places a prefix no
target holds on the target with the smallest footprint, so that the apps sharing a cluster
spread over it by how much they take up, instead of by the requests in flight at the instant
the first request of each came (which can pile three apps onto one engine and thrash it).

Pure and single-threaded; the clock is injected (monotonic seconds, or a simulation's time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import takewhile
from time import monotonic

from kvevents.events import StreamKey

__all__ = ["DEFAULT_RECENT_WINDOW", "RecentBlocks"]

#: Seconds a block sent to a target counts in its footprint (``--recent-window``).
DEFAULT_RECENT_WINDOW = 60.0


class RecentBlocks:
    """Per target, the distinct block keys sent to it within the last ``window`` seconds."""

    def __init__(
        self, window: float = DEFAULT_RECENT_WINDOW, clock: Callable[[], float] = monotonic
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        self.window = window
        self._clock = clock
        # Per target, key -> when it was last sent there, oldest first.
        self._seen: dict[StreamKey, OrderedDict[int, float]] = {}

    def touch(self, target: StreamKey, keys: Iterable[int]) -> int:
        """Count ``keys`` as sent to ``target`` now; its footprint after."""
        now = self._clock()
        seen = self._seen.get(target)
        if seen is None:
            seen = self._seen[target] = OrderedDict()
        move = seen.move_to_end
        for key in keys:
            seen[key] = now
            move(key)
        self.expire(now)
        return len(seen)

    def expire(self, now: float | None = None) -> bool:
        """Drop what is older than the window (now: the clock's); whether anything went."""
        horizon = (self._clock() if now is None else now) - self.window
        dropped = False
        for seen in self._seen.values():
            while seen and next(iter(seen.values())) < horizon:
                seen.popitem(last=False)
                dropped = True
        return dropped

    def prefix(self, target: StreamKey, keys: Sequence[int]) -> int:
        """How many leading ``keys`` were sent to ``target`` within the window."""
        seen = self._seen.get(target)
        return sum(1 for _ in takewhile(seen.__contains__, keys)) if seen else 0

    def size(self, target: StreamKey) -> int:
        """The target's footprint: distinct blocks sent to it within the window."""
        seen = self._seen.get(target)
        return 0 if seen is None else len(seen)

    def sizes(self) -> dict[StreamKey, int]:
        """Every target's footprint."""
        return {target: len(seen) for target, seen in self._seen.items()}

    def forget(self, worker_id: str, rank: int | None = None) -> list[StreamKey]:
        """Drop a worker's (or one rank's) footprint (its engine is gone: its cache too);
        the targets dropped."""
        gone = [t for t in self._seen if t[0] == worker_id and rank in (None, t[1])]
        for target in gone:
            del self._seen[target]
        return gone

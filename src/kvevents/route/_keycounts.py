"""Block keys per target, each counted by the requests holding it: a key stays while any of
them holds it. What the front door's predicted blocks (:mod:`._predict`) and its pinned blocks
(:mod:`._inflight`) both keep. Pure: no clock, no sockets."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvevents.events import StreamKey

__all__ = ["KeyCounts"]

_NONE: frozenset[int] = frozenset()


class KeyCounts:
    """Per target, block keys and how many holders hold each; ``references``: the keys held
    over every target, each as many times as it is held."""

    def __init__(self) -> None:
        self._counts: dict[StreamKey, dict[int, int]] = {}
        self.references = 0

    def add(self, target: StreamKey, keys: Sequence[int]) -> int:
        """One more holder of each of ``keys`` on ``target``; the target's distinct keys."""
        counts = self._counts.setdefault(target, {})
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        self.references += len(keys)
        return len(counts)

    def remove(self, target: StreamKey, keys: Sequence[int]) -> int:
        """One holder fewer of each of ``keys`` on ``target`` (a key held by none goes); the
        target's distinct keys left."""
        counts = self._counts.get(target)
        if counts is None:
            return 0  # forgotten with its target
        for key in keys:
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
        self.references -= len(keys)
        if not counts:
            del self._counts[target]
        return len(counts)

    def prefix(self, target: StreamKey, keys: Sequence[int]) -> int:
        """How many leading ``keys`` ``target`` holds."""
        counts = self._counts.get(target)
        if not counts:
            return 0
        depth = 0
        for key in keys:
            if key not in counts:
                break
            depth += 1
        return depth

    def held(self, target: StreamKey) -> Container[int]:
        """The keys ``target`` holds now (a live view: do not keep it)."""
        return self._counts.get(target, _NONE)

    def missing(self, target: StreamKey, keys: Sequence[int]) -> int:
        """How many of ``keys`` ``target`` does not hold."""
        counts = self._counts.get(target)
        if not counts:
            return len(keys)
        return sum(1 for key in keys if key not in counts)

    def forget(self, worker_id: str, rank: int | None = None) -> list[StreamKey]:
        """Drop every key of a worker (or one rank); the targets dropped."""
        gone = [t for t in self._counts if t[0] == worker_id and rank in (None, t[1])]
        for target in gone:
            self.references -= sum(self._counts.pop(target).values())
        return gone

"""Each target's free block queue as the front door sees it: which cached blocks outlive the
prefill of the requests queued ahead of a new one. Pure: no clock, no sockets.

vLLM keeps the blocks no running request holds in one queue, least recently freed first; a
block it allocates comes off the front of that queue, evicting the block cached there. A
finished request frees its blocks last first (its answer's blocks, then its prompt's from the
last to the first), onto the back; a request whose prefix hits takes those blocks out of the
queue until it ends. So when a request reaches its prefill, the cached blocks it finds are
the ones held by requests still running and the newest ones of the queue that the
allocations before it left.

The front door sends every request, so it knows that order for the blocks of its own
requests: :class:`FreeQueue` keeps, per target, the keys of the blocks its requests freed
(newest last; a key leaves while a request in flight holds it), and for the blocks past a
prompt's last full block, whose keys it cannot know (the answer's tokens are the engine's),
their place: the ``j``-th block after the key ``p`` is ``(p, j)``. A later prompt that goes on
from ``p`` (a conversation's next turn, its history holding the answer) matches those blocks
under keys of its own, and finds them by that place. When everything now in flight there has
been computed, the engine holds what those requests hold and keeps, of the queue, the newest
``capacity - held`` blocks: :meth:`FreeQueue.surviving` says how many of a request's matched
blocks are among them or held. A block the front door never saw freed (cached before it
started, or by another front door's request) is older than every one it did, so it outlives
the allocations only when the queue it knows is short of that room. Requests that end before
the prefill, an answer's growth while it decodes, and the engine's own preemptions are not
foreseen: this is the expected hit at the prefill as of now.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from itertools import islice

from kvevents.events import StreamKey

__all__ = ["FreeQueue"]


class FreeQueue:
    """Per target, the blocks its requests freed, oldest first (see the module docstring).

    ``limit``: the most entries kept per target (the oldest go first): a queue never holds
    more blocks than the engine's cache, and the forecast reads at most that many.
    """

    def __init__(self, limit: int = 1 << 20) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._queues: dict[StreamKey, OrderedDict[object, None]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def held(self, target: StreamKey, keys: Sequence[int]) -> None:
        """A request in flight holds ``keys`` (its prompt's): they leave the queue, and so do
        the unkeyed blocks of an earlier answer that its prompt goes on through."""
        queue = self._queues.get(target)
        if queue:
            for entry in _places(queue, keys):
                queue.pop(entry, None)

    def freed(
        self,
        target: StreamKey,
        keys: Sequence[int],
        unkeyed: int = 0,
        capacity: int | None = None,
        last: int | None = None,
    ) -> None:
        """A request ended: its ``unkeyed`` blocks (past its prompt's last full block,
        ``last``), then ``keys`` (its prompt's blocks no other request in flight holds, in
        prompt order) join the back, last first. Past the engine's ``capacity`` (where
        known) the oldest go: no engine keeps them cached."""
        queue = self._queues.setdefault(target, OrderedDict())
        if last is not None:
            for j in range(max(0, unkeyed), 0, -1):
                queue[(last, j)] = None
                queue.move_to_end((last, j))
        for key in reversed(keys):
            queue[key] = None
            queue.move_to_end(key)
        bound = self.limit if capacity is None else min(self.limit, max(1, capacity))
        for _ in range(len(queue) - bound):
            queue.popitem(last=False)

    def surviving(
        self, target: StreamKey, keys: Sequence[int], matched: int, room: int, held: Container[int]
    ) -> int:
        """How many of the first ``matched`` of ``keys`` a request sent to ``target`` now
        finds cached at its prefill: held by a request in flight (``held``), or among the
        newest ``room`` blocks of the queue (``room``: the cache's blocks less those the
        requests in flight will hold once computed). Reads the queue from its back until it
        has found every matched block there, and at most twice its shorter end."""
        if matched <= 0:
            return 0
        queue = self._queues.get(target) or OrderedDict()
        known = len(queue)
        room = max(0, room)
        if room > known:
            return matched  # every block it knows outlives them, and older ones too
        keys = keys[:matched]
        places = _places(queue, keys, held)
        wanted = {p for k, p in zip(keys, places, strict=True) if k not in held and p in queue}
        doomed = known - room
        # From the back, until every wanted entry is found among the newest `room` (or, where
        # fewer are doomed than kept, for as many steps as are doomed; then the front says).
        lost = set(wanted)
        steps = min(room, doomed)
        for entry in islice(reversed(queue), steps):
            lost.discard(entry)
            if not lost:
                break
        if lost and steps < room:
            lost = wanted.intersection(islice(queue, doomed))
        depth = 0
        for key, place in zip(keys, places, strict=True):
            if key not in held and (place in lost or place not in queue):
                break
            depth += 1
        return depth

    def forget(self, worker_id: str, rank: int | None = None) -> None:
        """Drop a worker's queues (or one rank's): its engine is gone."""
        for target in [t for t in self._queues if t[0] == worker_id and rank in (None, t[1])]:
            del self._queues[target]


def _places(
    queue: Container[object], keys: Sequence[int], held: Container[int] = ()
) -> list[object]:
    """Where each of ``keys`` is in ``queue``: the key itself, or, for a key it does not
    have, the place ``(p, j)`` of the ``j``-th block after the last key ``p`` it knows (in
    the queue or ``held``) when the queue has that place; else the key (not there)."""
    places: list[object] = []
    parent: int | None = None
    j = 0
    place: object
    for key in keys:
        if key in queue or key in held:
            parent, j, place = key, 0, key
        elif parent is not None and (parent, j + 1) in queue:
            j += 1
            place = (parent, j)
        else:
            parent, j, place = key, 0, key
        places.append(place)
    return places

"""The drop policy for removals and clears (pure code, no sockets).

When the queue is full a batch is dropped, and its sequence number becomes a gap that
subscribers see. Stores lost that way only cost cache hits (a consumer never routes to a block
it was not told about). Removals and clears are different: a consumer that misses them routes
to blocks that are gone. So the removals and clears of a dropped batch are carried, in order,
into the next batch the publisher accepts, prepended before that batch's own events:

- a removal of a hash already carried (same medium and group) is not repeated;
- ``AllBlocksCleared`` supersedes every removal carried before it;
- if the batch that carries them is dropped too, they are carried again.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvevents.events import AllBlocksCleared, BlockRemoved, Event

__all__ = ["RemovalCarry"]

_Key = tuple[int, str | None, object]


class RemovalCarry:
    """Removals and clears waiting for the next accepted batch."""

    def __init__(self) -> None:
        self._events: list[BlockRemoved | AllBlocksCleared] = []
        self._seen: set[_Key] = set()

    def __bool__(self) -> bool:
        return bool(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def absorb(self, events: Iterable[Event]) -> None:
        """Keep the removals and clears of a dropped batch, deduplicated, in order."""
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._events = [event]
                self._seen.clear()
            elif isinstance(event, BlockRemoved):
                self._absorb_removal(event)

    def _absorb_removal(self, event: BlockRemoved) -> None:
        fresh = []
        for block_hash in event.block_hashes:
            key = (block_hash, event.medium, event.group_idx)
            if key not in self._seen:
                self._seen.add(key)
                fresh.append(block_hash)
        if len(fresh) == len(event.block_hashes):
            self._events.append(event)
        elif fresh:
            self._events.append(
                BlockRemoved(block_hashes=fresh, medium=event.medium, group_idx=event.group_idx)
            )

    def take(self) -> list[BlockRemoved | AllBlocksCleared]:
        """The carried events, oldest first; the carry is empty afterwards."""
        events, self._events = self._events, []
        self._seen = set()
        return events

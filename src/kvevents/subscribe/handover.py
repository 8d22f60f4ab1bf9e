"""What one turn of the I/O thread hands the consumer, and what it sheds when behind.

Items of a turn are handed to the :class:`~kvevents.subscribe.outbox.Outbox` together at its
end. The outbox is bounded in payload bytes by shedding, not waiting: a wait would only move
the bytes into ZeroMQ's queues, which are bounded in messages. A stream that sheds is
rewound and replayed from its first shed batch once the outbox is half empty again.
"""

from __future__ import annotations

from kvevents.events import StreamKey
from kvevents.subscribe.cursor import Gap
from kvevents.subscribe.live import LiveStream
from kvevents.subscribe.outbox import Outbox
from kvevents.subscribe.streams import (
    Item,
)

__all__ = ["Handover"]

# Items handed to consumers in one go at most: a turn over many busy streams must not hold
# the first item back for long (256 typical batches take about 2 ms to read and decode).
HAND_OVER_AT = 256


class Handover:
    """The current turn's items and the shedding state; used by the I/O thread only."""

    def __init__(self, outbox: Outbox[Item], budget: int) -> None:
        self.outbox = outbox
        self.budget = budget
        self._items: list[Item] = []
        self._sizes: list[int] = []
        self._bytes = 0
        # Streams that shed this turn, and shed streams waiting for room to replay.
        self.shed_this_turn: list[LiveStream] = []
        self.rebuilds: dict[StreamKey, Gap] = {}
        outbox.low_water = budget // 2

    def add(self, item: Item, size: int = 0) -> None:
        """Queue ``item`` (``size``: its payload bytes) for the end of the turn."""
        self._items.append(item)
        self._sizes.append(size)
        self._bytes += size
        if len(self._items) >= HAND_OVER_AT:
            self.flush()

    def flush(self) -> None:
        """Hand everything queued to the outbox (waiting while it is full in items)."""
        if self._items:
            items, self._items = self._items, []
            sizes, self._sizes = self._sizes, []
            self._bytes = 0
            self.outbox.put_many(items, sizes)

    def over_budget(self, size: int) -> bool:
        """True when ``size`` more payload bytes would pass the budget. A payload larger
        than the whole budget still goes through an empty outbox."""
        used = self.outbox.bytes + self._bytes
        return used > 0 and used + size > self.budget

    def shed(self, stream: LiveStream, seq: int) -> bool:
        """Count batch ``seq`` of ``stream`` as shed; True for the first of the turn."""
        stream.add("shed")
        if stream.shed_from is not None:
            return False
        stream.shed_from = seq
        self.shed_this_turn.append(stream)
        return True

    def room_to_rebuild(self) -> bool:
        """True when shed streams wait and the outbox is half empty."""
        return bool(self.rebuilds) and self.outbox.bytes <= self.outbox.low_water

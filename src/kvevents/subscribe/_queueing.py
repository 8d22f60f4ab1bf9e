"""The subscriber's own sink: batches decoded into items for ``get()`` and iteration.

A :class:`QueueSink` is what a :class:`~kvevents.subscribe.Subscriber` made
without a sink of its own feeds: each batch is decoded into a
:class:`~kvevents.subscribe.Delivery`, each reset is a
:class:`~kvevents.subscribe.StreamReset` and (with ``status_items``) each state
change a :class:`~kvevents.subscribe.StreamStatus`, queued in order.

Items of one turn of the I/O thread are handed to the
:class:`~kvevents.subscribe._outbox.Outbox` together at its end (:meth:`QueueSink.flush`).
The outbox is bounded in payload bytes by shedding, not waiting (a wait would only move the
bytes into ZeroMQ's queues, which are bounded in messages): a batch over the budget is
refused with :class:`QueueFull` before it is decoded, and the I/O thread sheds it and
replays it once the outbox is half empty again (:meth:`QueueSink.has_room`).
"""

from __future__ import annotations

from kvevents.errors import DecodeError
from kvevents.events import AllBlocksCleared
from kvevents.subscribe._outbox import Outbox
from kvevents.subscribe._streams import (
    Delivery,
    Item,
    ResetReason,
    StreamReset,
    StreamSpec,
    StreamStatus,
    SubscriberOptions,
)
from kvevents.wire import Applied, decode_batch

__all__ = ["QueueFull", "QueueSink"]

# Items handed to consumers in one go at most: a turn over many busy streams must not hold
# the first item back for long (256 typical batches take about 2 ms to read and decode).
HAND_OVER_AT = 256


class QueueFull(Exception):
    """Raised by :meth:`QueueSink.apply` when a batch would pass the queue's byte budget:
    nothing was queued; the I/O thread sheds the batch and replays it later."""


class QueueSink:
    """Decodes each batch into a Delivery and queues it, with resets (and states) in order.

    Used by the I/O thread only, except :meth:`has_room`, which reads the outbox.
    """

    def __init__(self, outbox: Outbox[Item], options: SubscriberOptions) -> None:
        self.outbox = outbox
        self.budget = options.queue_bytes
        self._statuses = options.status_items
        self._limits = options.decode_limits
        self._items: list[Item] = []
        self._sizes: list[int] = []
        self._bytes = 0
        outbox.low_water = self.budget // 2

    def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
        """Decode and queue batch ``seq``; :class:`QueueFull` when over the byte budget,
        ``DecodeError`` when it cannot be read (a decoder bug too: it costs this payload)."""
        if self._over_budget(len(payload)):
            raise QueueFull
        try:
            decoded = decode_batch(payload, seq=seq, limits=self._limits)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"decoder failed: {exc!r}", seq=seq) from exc
        batch = decoded.batch
        clears = any(type(e) is AllBlocksCleared for e in batch.events)
        self._add(Delivery(stream, seq, batch), len(payload))
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, clears)

    def reset(self, stream: StreamSpec, reason: ResetReason) -> None:
        """Queue a :class:`StreamReset`."""
        self._add(StreamReset(stream, reason))

    def status(self, status: StreamStatus) -> None:
        """Queue ``status`` when the options ask for status items."""
        if self._statuses:
            self._add(status)

    def flush(self) -> None:
        """Hand everything queued to the outbox (waiting while it is full in items)."""
        if self._items:
            items, self._items = self._items, []
            sizes, self._sizes = self._sizes, []
            self._bytes = 0
            self.outbox.put_many(items, sizes)

    def has_room(self) -> bool:
        """True when the outbox is half empty: shed batches may be replayed."""
        return self.outbox.bytes <= self.outbox.low_water

    def _add(self, item: Item, size: int = 0) -> None:
        self._items.append(item)
        self._sizes.append(size)
        self._bytes += size
        if len(self._items) >= HAND_OVER_AT:
            self.flush()

    def _over_budget(self, size: int) -> bool:
        """True when ``size`` more payload bytes would pass the budget. A payload larger
        than the whole budget still goes through an empty outbox."""
        used = self.outbox.bytes + self._bytes
        return used > 0 and used + size > self.budget

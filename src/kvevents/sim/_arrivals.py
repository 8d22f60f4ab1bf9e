"""What reached a simulated cluster's router side, held until the cluster applies it.

The cluster's subscriber feeds an :class:`Arrivals` (a :class:`~kvevents.subscribe.Sink`)
on its I/O thread; the cluster takes each :class:`Arrival` on the caller's thread and hands it
to the index service's sink, at once or, with a staleness, once its batch time is old enough.
So a simulated index is filled the way ``kvevents serve`` fills its own: payloads as they came
off the wire, through :meth:`IndexService.apply <kvevents.service.IndexService.apply>`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from kvevents.events import AllBlocksCleared
from kvevents.subscribe import ResetReason, StreamSpec, StreamStatus
from kvevents.wire import Applied, decode_batch_packed

__all__ = ["Arrival", "Arrivals"]


class Arrival(NamedTuple):
    """One batch (``payload`` and its ``ts``) or, with ``payload`` None, a restart."""

    stream: StreamSpec
    seq: int
    payload: bytes | None
    ts: float = 0.0


class Arrivals:
    """A sink that keeps batches and restarts in arrival order, for another thread to take.

    A batch is decoded when it arrives (a payload that cannot be read raises ``DecodeError``
    then, as for any sink) and kept encoded, as it came.
    """

    def __init__(self) -> None:
        self._items: deque[Arrival] = deque()
        self._changed = threading.Condition()

    def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        self._put(Arrival(stream, seq, payload, batch.ts))
        clears = any(type(e) is AllBlocksCleared for e in batch.events)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, clears)

    def reset(self, stream: StreamSpec, reason: ResetReason) -> None:
        if reason == "restart":
            self._put(Arrival(stream, -1, None))

    def status(self, status: StreamStatus) -> None:
        pass  # the simulation's routers judge with the engines' truth, not the stream states

    def take(self, timeout: float) -> Arrival | None:
        """The oldest arrival, waiting up to ``timeout`` seconds; None if none came."""
        with self._changed:
            if not self._items and timeout > 0:
                self._changed.wait_for(lambda: bool(self._items), timeout)
            return self._items.popleft() if self._items else None

    def _put(self, arrival: Arrival) -> None:
        with self._changed:
            self._items.append(arrival)
            self._changed.notify()

"""The bounded hand-off from the subscriber's I/O thread to its consumers."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Outbox"]

T = TypeVar("T")


class Outbox(Generic[T]):
    """A bounded hand-off from the I/O thread to consumers; closing wakes everyone.

    ``listener`` (if set) is called after a put that made the outbox non-empty: the asyncio
    side uses it to wake its event loop without polling.

    ``bytes`` is the sum of the sizes given with the items waiting (the subscriber gives
    each delivery its payload's size). The outbox itself only waits on ``maxsize`` items;
    the producer reads ``bytes`` to shed before it puts (a wait would only move the bytes
    into ZeroMQ's queues, which are bounded in messages).
    """

    def __init__(self, maxsize: int) -> None:
        self._items: deque[T] = deque()
        self._sizes: deque[int] = deque()
        self.bytes = 0
        self._maxsize = maxsize
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self.closed = False
        self.listener: Callable[[], None] | None = None
        # Called (outside the lock) by the get that brings ``bytes`` down to ``low_water``:
        # the producer waits for that to replay what it shed.
        self.on_low: Callable[[], None] | None = None
        self.low_water = 0

    def __len__(self) -> int:
        return len(self._items)

    def put_many(self, items: list[T], sizes: list[int] | None = None) -> bool:
        """Add ``items`` in order, waiting for room as needed; one wake-up for the lot.

        The I/O thread hands over everything one poll turn produced at once: consumers wake
        once per burst instead of once per item, so the two threads trade the GIL far less.
        """
        with self._lock:
            was_empty = not self._items
            for index, item in enumerate(items):
                while len(self._items) >= self._maxsize and not self.closed:
                    # Full: whoever consumes must be awake now, not after the whole burst
                    # (an asyncio consumer only wakes through the listener).
                    self._wake_consumers()
                    self._not_full.wait()
                if self.closed:
                    return False
                self._items.append(item)
                size = 0 if sizes is None else sizes[index]
                self._sizes.append(size)
                self.bytes += size
            self._not_empty.notify()
        if was_empty and self.listener is not None:
            self.listener()
        return True

    def _wake_consumers(self) -> None:
        self._not_empty.notify()
        if self.listener is not None:
            self.listener()  # thread-safe and non-blocking (it schedules on the event loop)

    def get(self, timeout: float | None) -> tuple[bool, T | None]:
        """``(True, item)``, or ``(False, None)`` on timeout or when closed and empty."""
        with self._lock:
            if not self._items and not self.closed:
                self._not_empty.wait_for(lambda: self._items or self.closed, timeout)
            if not self._items:
                return False, None
            item = self._items.popleft()
            size = self._sizes.popleft()
            self.bytes -= size
            self._not_full.notify()
            crossed = self.bytes <= self.low_water < self.bytes + size
        if crossed and self.on_low is not None:
            self.on_low()
        return True, item

    def close(self) -> None:
        """No more puts; consumers drain what is left, then see the closed state."""
        with self._lock:
            self.closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
        if self.listener is not None:
            self.listener()

"""A :class:`~kvevents.subscribe.Sink` for tests: it decodes and keeps what it is fed.

Give it to a :class:`~kvevents.subscribe.Subscriber` (or any feed) to see exactly
what reaches the router side, on which thread, and to make the sink fail on chosen batches
(``fault``) the way a consumer's defect would::

    sink = RecordingSink()
    with Subscriber(streams, sink=sink):
        sink.wait(lambda s: len(s.deliveries) >= 10, what="ten batches")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvevents.events import AllBlocksCleared
from kvevents.subscribe import Delivery, ResetReason, StreamReset, StreamSpec, StreamStatus
from kvevents.wire import Applied, decode_batch

__all__ = ["RecordingSink"]

#: What a sink's ``fault`` returns for a batch: an exception to raise instead of applying it.
Fault = Callable[[StreamSpec, int], BaseException | None]


class RecordingSink:
    """Keeps every batch (decoded), reset and status it is fed, in order; thread-safe.

    ``fault(stream, seq)`` (when given) is asked first for every batch: the exception it
    returns is raised, and the batch is not kept. ``threads`` holds the names of the threads
    that called the sink.
    """

    def __init__(self, *, fault: Fault | None = None) -> None:
        self.deliveries: list[Delivery] = []
        self.resets: list[StreamReset] = []
        self.statuses: list[StreamStatus] = []
        self.threads: set[str] = set()
        self._fault = fault
        self._changed = threading.Condition()

    def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
        self.threads.add(threading.current_thread().name)
        exc = None if self._fault is None else self._fault(stream, seq)
        if exc is not None:
            raise exc
        decoded = decode_batch(payload, seq=seq)
        batch = decoded.batch
        with self._changed:
            self.deliveries.append(Delivery(stream, seq, batch))
            self._changed.notify_all()
        clears = any(isinstance(e, AllBlocksCleared) for e in batch.events)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, clears)

    def reset(self, stream: StreamSpec, reason: ResetReason) -> None:
        with self._changed:
            self.resets.append(StreamReset(stream, reason))
            self._changed.notify_all()

    def status(self, status: StreamStatus) -> None:
        with self._changed:
            self.statuses.append(status)
            self._changed.notify_all()

    def seqs(self, stream: StreamSpec | None = None) -> list[int]:
        """The sequences applied (of ``stream`` only, when given), in order."""
        with self._changed:
            return [d.seq for d in self.deliveries if stream is None or d.stream == stream]

    def wait(
        self, predicate: Callable[[RecordingSink], object], timeout: float = 10.0, what: str = ""
    ) -> None:
        """Wait until ``predicate(self)`` holds; TimeoutError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"timed out after {timeout}s waiting for {what or predicate}"
                    )
                self._changed.wait(left)

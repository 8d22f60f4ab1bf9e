"""The one seam between a feed and what it feeds: a :class:`Sink`.

Every batch a router side receives goes the same way: a feed (the
:class:`~kvevents.subscribe.Subscriber`'s I/O thread, a JetStream replica, a
simulated cluster) orders each stream's messages, then hands them to a sink, one stream's in
sequence order and from one thread at a time:

- :meth:`Sink.apply` ``(stream, seq, payload)``: apply batch ``seq`` of ``stream``, still
  encoded; return what the feed's stats need (:class:`~kvevents.wire.Applied`). A payload
  that cannot be read raises :class:`~kvevents.errors.DecodeError` before anything changes
  (the feed counts it as undecodable and goes on).
- :meth:`Sink.reset` ``(stream, reason)``: drop everything held for ``stream``
  (``"restart"``: rebuilt by the batches that follow; ``"removed"``: nothing follows).
- :meth:`Sink.status` ``(status)``: the stream's state changed (a loss, a replay, live
  again).

The subscriber's own queue is one sink among others
(:class:`~kvevents.subscribe._queueing.QueueSink`); the index service is another
(:class:`~kvevents.service.IndexService`). A test double is a few lines
(:class:`kvevents.testing.sinks.RecordingSink`).
"""

from __future__ import annotations

from typing import Protocol

from kvevents.subscribe._streams import ResetReason, StreamSpec, StreamStatus
from kvevents.wire import Applied

__all__ = ["Sink"]


class Sink(Protocol):
    """What a feed hands each stream's batches, resets and states to (module docstring)."""

    def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
        """Apply batch ``seq`` of ``stream``; ``DecodeError`` (nothing changed) when the
        payload cannot be read."""
        ...

    def reset(self, stream: StreamSpec, reason: ResetReason) -> None:
        """Drop everything held for ``stream``."""
        ...

    def status(self, status: StreamStatus) -> None:
        """Take a change of a stream's state."""
        ...

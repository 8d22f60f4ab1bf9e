"""Faults injected into a running subscriber, for tests of what it does when one stream breaks.

The subscriber's own seams cover most faults: a sink (``Subscriber(sink=...)``) can fail on
chosen batches (:class:`~kvevents.testing.sinks.RecordingSink`'s ``fault``), a publisher can
misbehave (:mod:`kvevents.testing.peers`). What neither can reach is the stream's own socket
breaking under the I/O thread; :func:`break_stream` does that, here rather than in each test.
"""

from __future__ import annotations

from typing import NoReturn

from kvevents.events import StreamKey
from kvevents.subscribe import Subscriber

__all__ = ["break_stream"]


def break_stream(subscriber: Subscriber, key: StreamKey, error: Exception) -> None:
    """Make the next receive on stream ``key``'s socket raise ``error`` on the I/O thread (as
    a broken socket would): the stream is then detached, counted and reported ``"failed"``.
    KeyError when the subscriber is not running or does not read ``key``."""
    loop = subscriber._loop
    if loop is None:
        raise KeyError(f"the subscriber is not running: no stream {key}")
    stream = loop.streams[key]

    def broken(max_messages: int, max_bytes: int) -> NoReturn:
        raise error

    stream.receive = broken  # read by the I/O thread at its next turn for this stream

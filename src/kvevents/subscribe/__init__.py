"""The router side's feed: one subscriber for every rank of every worker, with gap detection,
replay and restart detection.

The cursor (integers in, actions out), the replay client, the I/O loop, the courier that
carries a cursor's verdicts to a :class:`Sink`, and the queue sink with its outbox are the
package's parts; :class:`Subscriber` and :class:`AsyncSubscriber` are its face, and
:class:`Sink` the one seam every feed hands its batches through. Names load on
first use, so the stream records (:class:`StreamSpec`, :class:`StreamStats`...) load without
ZeroMQ. Its modules are private (``_subscriber``, ``_cursor``, ``_loop``...): import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.subscribe._recv import native_receive
    from kvevents.subscribe._sink import Sink
    from kvevents.subscribe._streams import (
        Delivery,
        FeedHealth,
        FeedState,
        ReplayOptions,
        ResetReason,
        StreamReset,
        StreamSpec,
        StreamState,
        StreamStats,
        StreamStatus,
        SubscriberOptions,
        SubscriberStats,
        worker_streams,
    )
    from kvevents.subscribe._subscriber import AsyncSubscriber, Subscriber

__all__ = [
    "AsyncSubscriber",
    "Delivery",
    "FeedHealth",
    "FeedState",
    "ReplayOptions",
    "ResetReason",
    "Sink",
    "StreamReset",
    "StreamSpec",
    "StreamState",
    "StreamStats",
    "StreamStatus",
    "Subscriber",
    "SubscriberOptions",
    "SubscriberStats",
    "native_receive",
    "worker_streams",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.subscribe._recv": ("native_receive",),
        "kvevents.subscribe._sink": ("Sink",),
        "kvevents.subscribe._streams": (
            "Delivery",
            "FeedHealth",
            "FeedState",
            "ReplayOptions",
            "ResetReason",
            "StreamReset",
            "StreamSpec",
            "StreamState",
            "StreamStats",
            "StreamStatus",
            "SubscriberOptions",
            "SubscriberStats",
            "worker_streams",
        ),
        "kvevents.subscribe._subscriber": (
            "AsyncSubscriber",
            "Subscriber",
        ),
    },
)

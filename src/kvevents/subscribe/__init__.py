"""The router side's feed: one subscriber for every rank of every worker, with gap detection,
replay and restart detection.

The cursor (integers in, actions out), the replay client, the I/O loop, the courier that
carries a cursor's verdicts to a :class:`Sink`, and the queue sink with its outbox are the
package's parts; :class:`Subscriber` and :class:`AsyncSubscriber` are its face, and
:class:`Sink` the one seam every feed hands its batches through. Names load on
first use, so ``kvevents.subscribe.cursor`` and the stream records work without ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.subscribe.sink import Sink
    from kvevents.subscribe.streams import (
        Delivery,
        FeedHealth,
        ReplayOptions,
        StreamReset,
        StreamSpec,
        StreamStats,
        StreamStatus,
        SubscriberOptions,
        SubscriberStats,
        worker_streams,
    )
    from kvevents.subscribe.subscriber import AsyncSubscriber, Subscriber

__all__ = [
    "AsyncSubscriber",
    "Delivery",
    "FeedHealth",
    "ReplayOptions",
    "Sink",
    "StreamReset",
    "StreamSpec",
    "StreamStats",
    "StreamStatus",
    "Subscriber",
    "SubscriberOptions",
    "SubscriberStats",
    "worker_streams",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.subscribe.streams": [
            "Delivery",
            "FeedHealth",
            "ReplayOptions",
            "StreamReset",
            "StreamSpec",
            "StreamStats",
            "StreamStatus",
            "SubscriberOptions",
            "SubscriberStats",
            "worker_streams",
        ],
        "kvevents.subscribe.sink": ["Sink"],
        "kvevents.subscribe.subscriber": ["AsyncSubscriber", "Subscriber"],
    },
)

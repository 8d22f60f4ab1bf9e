"""The router side's feed: one subscriber for every rank of every worker, with gap detection,
replay and restart detection.

The cursor (integers in, actions out), the replay client, the I/O loop and its outbox are the
package's parts; :class:`Subscriber` and :class:`AsyncSubscriber` are its face. Names load on
first use, so ``kvevents.subscribe.cursor`` and the stream records work without ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
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
        "kvevents.subscribe.subscriber": ["AsyncSubscriber", "Subscriber"],
    },
)

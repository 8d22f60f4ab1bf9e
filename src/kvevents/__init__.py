"""kvevents: streaming KV cache events between LLM inference engines and KV-aware routers.

The package is a layer per folder, imports pointing one way (docs/architecture.md):
``wire`` (frames, decoder, endpoint strings) <- ``publish`` (engine side) and ``subscribe``
(router side) <- ``index`` <- ``service`` <- ``cli``; ``sim`` and ``testing`` sit on top.
This module is the public face: every name loads on first use, so ``import kvevents.events``
loads neither ZeroMQ nor pydantic.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.config import KVEventsConfig, RankEndpoints, check_layout, rank_endpoints
    from kvevents.errors import (
        BindError,
        DecodeError,
        KVEventsError,
        LayoutError,
        PublisherClosed,
        PublisherError,
        SubscriberClosed,
        SubscriberError,
        SyncTimeout,
        TraceError,
    )
    from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
    from kvevents.index import (
        Decision,
        HolderKey,
        IndexStats,
        LoadBook,
        MatchResult,
        PrefixIndex,
        Router,
    )
    from kvevents.publish import (
        EventRecorder,
        NullPublisher,
        Publisher,
        PublisherOptions,
        PublisherStats,
        RecorderStats,
        ShutdownReport,
        ZmqPublisher,
        create_publisher,
    )
    from kvevents.security import CurveClient, CurveServer
    from kvevents.subscribe import (
        AsyncSubscriber,
        Delivery,
        ReplayOptions,
        StreamReset,
        StreamSpec,
        StreamStats,
        StreamStatus,
        Subscriber,
        SubscriberOptions,
        SubscriberStats,
        worker_streams,
    )
    from kvevents.wire import rank_endpoint

# Where each public name lives.
_HOMES = {
    "kvevents.config": ("KVEventsConfig", "RankEndpoints", "check_layout", "rank_endpoints"),
    "kvevents.errors": (
        "BindError",
        "DecodeError",
        "KVEventsError",
        "LayoutError",
        "PublisherClosed",
        "PublisherError",
        "SubscriberClosed",
        "SubscriberError",
        "SyncTimeout",
        "TraceError",
    ),
    "kvevents.events": (
        "AllBlocksCleared",
        "BlockRemoved",
        "BlockStored",
        "Event",
        "KVEventBatch",
    ),
    "kvevents.index": (
        "Decision",
        "HolderKey",
        "IndexStats",
        "LoadBook",
        "MatchResult",
        "PrefixIndex",
        "Router",
    ),
    "kvevents.publish": (
        "EventRecorder",
        "NullPublisher",
        "Publisher",
        "PublisherOptions",
        "PublisherStats",
        "RecorderStats",
        "ShutdownReport",
        "ZmqPublisher",
        "create_publisher",
    ),
    "kvevents.security": ("CurveClient", "CurveServer"),
    "kvevents.subscribe": (
        "AsyncSubscriber",
        "Delivery",
        "ReplayOptions",
        "StreamReset",
        "StreamSpec",
        "StreamStats",
        "StreamStatus",
        "Subscriber",
        "SubscriberOptions",
        "SubscriberStats",
        "worker_streams",
    ),
    "kvevents.wire": ("rank_endpoint",),
}

try:
    __version__ = version("kvevents")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


__all__ = [
    "AllBlocksCleared",
    "AsyncSubscriber",
    "BindError",
    "BlockRemoved",
    "BlockStored",
    "CurveClient",
    "CurveServer",
    "Decision",
    "DecodeError",
    "Delivery",
    "Event",
    "EventRecorder",
    "HolderKey",
    "IndexStats",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "LayoutError",
    "LoadBook",
    "MatchResult",
    "NullPublisher",
    "PrefixIndex",
    "Publisher",
    "PublisherClosed",
    "PublisherError",
    "PublisherOptions",
    "PublisherStats",
    "RankEndpoints",
    "RecorderStats",
    "ReplayOptions",
    "Router",
    "ShutdownReport",
    "StreamReset",
    "StreamSpec",
    "StreamStats",
    "StreamStatus",
    "Subscriber",
    "SubscriberClosed",
    "SubscriberError",
    "SubscriberOptions",
    "SubscriberStats",
    "SyncTimeout",
    "TraceError",
    "ZmqPublisher",
    "__version__",
    "check_layout",
    "create_publisher",
    "rank_endpoint",
    "rank_endpoints",
    "worker_streams",
]

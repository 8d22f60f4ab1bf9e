"""kvevents: streaming KV cache events between LLM inference engines and KV-aware routers."""

import importlib
from typing import TYPE_CHECKING, Any

from .cache import PrefixCache, RankCache
from .config import KVEventsConfig
from .endpoints import RankEndpoints, check_layout, rank_endpoint, rank_endpoints
from .engine import EngineConfig, SimulatedEngine
from .errors import (
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
from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
from .recorder import EventRecorder, RecorderStats
from .streams import (
    Delivery,
    ReplayOptions,
    StreamReset,
    StreamSpec,
    StreamStats,
    StreamStatus,
    SubscriberOptions,
    SubscriberStats,
    worker_streams,
)
from .trace import TraceRow, load_trace

if TYPE_CHECKING:
    from .index import IndexStats, MatchResult, PrefixIndex
    from .publisher import (
        NullPublisher,
        Publisher,
        PublisherOptions,
        PublisherStats,
        ShutdownReport,
        ZmqPublisher,
        create_publisher,
    )
    from .router import Decision, LoadBook, Router
    from .subscriber import AsyncSubscriber, Subscriber

# Socket-owning modules load on first use, so `import kvevents.wire` (or the config, cursor,
# engine side) never loads ZeroMQ; the index needs the optional xxhash (`kvevents[index]`).
_LAZY = {
    "IndexStats": "index",
    "MatchResult": "index",
    "PrefixIndex": "index",
    "Decision": "router",
    "LoadBook": "router",
    "Router": "router",
    "NullPublisher": "publisher",
    "Publisher": "publisher",
    "PublisherOptions": "publisher",
    "PublisherStats": "publisher",
    "ShutdownReport": "publisher",
    "ZmqPublisher": "publisher",
    "create_publisher": "publisher",
    "AsyncSubscriber": "subscriber",
    "Subscriber": "subscriber",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvevents' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "AsyncSubscriber",
    "BindError",
    "BlockRemoved",
    "BlockStored",
    "Decision",
    "DecodeError",
    "Delivery",
    "EngineConfig",
    "Event",
    "EventRecorder",
    "IndexStats",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "LayoutError",
    "LoadBook",
    "MatchResult",
    "NullPublisher",
    "PrefixCache",
    "PrefixIndex",
    "Publisher",
    "PublisherClosed",
    "PublisherError",
    "PublisherOptions",
    "PublisherStats",
    "RankCache",
    "RankEndpoints",
    "RecorderStats",
    "ReplayOptions",
    "Router",
    "ShutdownReport",
    "SimulatedEngine",
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
    "TraceRow",
    "ZmqPublisher",
    "__version__",
    "check_layout",
    "create_publisher",
    "load_trace",
    "rank_endpoint",
    "rank_endpoints",
    "worker_streams",
]

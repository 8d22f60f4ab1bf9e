"""kvevents: streaming KV cache events between LLM inference engines and KV-aware routers."""

import importlib
from typing import TYPE_CHECKING, Any

from .config import KVEventsConfig
from .endpoints import RankEndpoints, check_layout, rank_endpoint, rank_endpoints
from .errors import (
    BindError,
    DecodeError,
    KVEventsError,
    LayoutError,
    PublisherClosed,
    PublisherError,
    SubscriberClosed,
    SubscriberError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
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

if TYPE_CHECKING:
    from .publisher import (
        NullPublisher,
        Publisher,
        PublisherOptions,
        PublisherStats,
        ShutdownReport,
        ZmqPublisher,
        create_publisher,
    )
    from .subscriber import AsyncSubscriber, Subscriber

# Socket-owning modules load on first use, so `import kvevents.wire` (or the config, cursor,
# index) never loads ZeroMQ.
_LAZY = {
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
    "DecodeError",
    "Delivery",
    "Event",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "LayoutError",
    "NullPublisher",
    "Publisher",
    "PublisherClosed",
    "PublisherError",
    "PublisherOptions",
    "PublisherStats",
    "RankEndpoints",
    "ReplayOptions",
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
    "ZmqPublisher",
    "__version__",
    "check_layout",
    "create_publisher",
    "rank_endpoint",
    "rank_endpoints",
    "worker_streams",
]

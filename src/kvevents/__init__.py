"""kvevents: streaming KV cache events between LLM inference engines and KV-aware routers."""

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

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BindError",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Event",
    "KVEventBatch",
    "KVEventsConfig",
    "KVEventsError",
    "LayoutError",
    "PublisherClosed",
    "PublisherError",
    "RankEndpoints",
    "SubscriberClosed",
    "SubscriberError",
    "__version__",
    "check_layout",
    "rank_endpoint",
    "rank_endpoints",
]

"""The wire: frames of live and replay messages, the tolerant decoder, endpoint string rules.

Pure functions over bytes and strings; nothing here opens a socket or loads ZeroMQ. Its modules
are private (``_frames``, ``_decode``, ``_endpoints``...): import from here.
"""

from __future__ import annotations

from kvevents.wire._decode import PackedStored, decode_batch, decode_batch_packed
from kvevents.wire._endpoints import (
    MAX_IPC_PATH,
    MAX_PORT,
    Endpoint,
    layout_error,
    parse_endpoint,
    rank_endpoint,
)
from kvevents.wire._frames import (
    END_SEQ,
    LiveMessage,
    ReplayMessage,
    encode_batch,
    live_frames,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end_frames,
    replay_reply_frames,
    replay_request_frames,
    unpack_seq,
)
from kvevents.wire._records import DEFAULT_LIMITS, Applied, DecodedBatch, DecodeLimits, SkippedEvent

__all__ = [
    "DEFAULT_LIMITS",
    "END_SEQ",
    "MAX_IPC_PATH",
    "MAX_PORT",
    "Applied",
    "DecodeLimits",
    "DecodedBatch",
    "Endpoint",
    "LiveMessage",
    "PackedStored",
    "ReplayMessage",
    "SkippedEvent",
    "decode_batch",
    "decode_batch_packed",
    "encode_batch",
    "layout_error",
    "live_frames",
    "pack_seq",
    "parse_endpoint",
    "parse_live",
    "parse_replay_reply",
    "parse_replay_request",
    "rank_endpoint",
    "replay_end_frames",
    "replay_reply_frames",
    "replay_request_frames",
    "unpack_seq",
]

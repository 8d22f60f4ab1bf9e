"""The wire: frames of live and replay messages, the tolerant decoder, endpoint string rules.

Pure functions over bytes and strings; nothing here opens a socket or loads ZeroMQ.
"""

from kvevents.wire.decode import (
    DEFAULT_LIMITS,
    Applied,
    DecodedBatch,
    DecodeLimits,
    PackedStored,
    SkippedEvent,
    decode_batch,
    decode_batch_packed,
)
from kvevents.wire.endpoints import (
    Endpoint,
    parse_endpoint,
    rank_endpoint,
)
from kvevents.wire.frames import (
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

__all__ = [
    "DEFAULT_LIMITS",
    "END_SEQ",
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

"""The wire layer's face: the names ``kvevents.wire`` exports (frames, the decoder, endpoint strings); its modules are
private."""

from __future__ import annotations

import kvevents.wire

EXPORTED = [
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


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.wire.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.wire.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.wire, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.wire))

"""The subscribe layer's face: the names ``kvevents.subscribe`` exports (the subscriber, its sink seam and stream records); its modules are
private."""

from __future__ import annotations

import kvevents.subscribe

EXPORTED = [
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


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.subscribe.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.subscribe.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.subscribe, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.subscribe))

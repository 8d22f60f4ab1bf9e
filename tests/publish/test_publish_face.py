"""The publish layer's face: the names ``kvevents.publish`` exports (publishers and the recorder); its modules are
private."""

from __future__ import annotations

import kvevents.publish

EXPORTED = [
    "EventRecorder",
    "Forwarder",
    "NullPublisher",
    "Publisher",
    "PublisherOptions",
    "PublisherStats",
    "RecorderStats",
    "ShutdownReport",
    "ZmqPublisher",
    "create_publisher",
]


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.publish.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.publish.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.publish, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.publish))

"""The engine side: publishers (null and ZeroMQ with replay) and the event recorder.

``create_publisher(config, rank)`` builds what a ``KVEventsConfig`` asks for; the
:class:`EventRecorder` turns cache mutations into well-formed batches. The background threads,
the removal carry and the replay server are private to this package. Names load on first use,
so the recorder works without ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.publish.publisher import (
        NullPublisher,
        Publisher,
        PublisherOptions,
        PublisherStats,
        ShutdownReport,
        ZmqPublisher,
        create_publisher,
    )
    from kvevents.publish.recorder import EventRecorder, RecorderStats

_HOMES = {
    "kvevents.publish.publisher": (
        "NullPublisher",
        "Publisher",
        "PublisherOptions",
        "PublisherStats",
        "ShutdownReport",
        "ZmqPublisher",
        "create_publisher",
    ),
    "kvevents.publish.recorder": ("EventRecorder", "RecorderStats"),
}

__all__ = [
    "EventRecorder",
    "NullPublisher",
    "Publisher",
    "PublisherOptions",
    "PublisherStats",
    "RecorderStats",
    "ShutdownReport",
    "ZmqPublisher",
    "create_publisher",
]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

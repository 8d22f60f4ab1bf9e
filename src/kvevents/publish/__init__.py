"""The engine side: publishers (null and ZeroMQ with replay) and the event recorder.

``create_publisher(config, rank)`` builds what a ``KVEventsConfig`` asks for; the
:class:`EventRecorder` turns cache mutations into well-formed batches. The background threads,
the removal carry and the replay server are private to this package, except
:class:`Forwarder` (the thread that moves batches to the socket), exported for publishers
that pause it (``kvevents.testing.publisher``). Its modules are private (``_publisher``,
``_recorder``...): import from here. Names load on first use, so the recorder works without
ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.publish._publisher import NullPublisher, Publisher, ZmqPublisher, create_publisher
    from kvevents.publish._recorder import EventRecorder, RecorderStats
    from kvevents.publish._records import PublisherOptions, PublisherStats, ShutdownReport
    from kvevents.publish._threads import Forwarder

__all__ = [
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.publish._publisher": (
            "NullPublisher",
            "Publisher",
            "ZmqPublisher",
            "create_publisher",
        ),
        "kvevents.publish._recorder": (
            "EventRecorder",
            "RecorderStats",
        ),
        "kvevents.publish._records": (
            "PublisherOptions",
            "PublisherStats",
            "ShutdownReport",
        ),
        "kvevents.publish._threads": ("Forwarder",),
    },
)

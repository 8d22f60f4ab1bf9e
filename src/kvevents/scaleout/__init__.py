"""Scale-out over NATS JetStream: relays write the engines' streams into one JetStream
stream, router replicas consume it, snapshots let a new replica start warm.

- :class:`Relay` (:class:`RelayOptions`, :class:`RelayStats`): ZeroMQ streams in, JetStream
  out;
- :class:`Replica` (:class:`ReplicaOptions`, :class:`ReplicaStats`): JetStream in, an index
  service out, its records applied none fatal, its index saved as snapshots;
- :class:`JetStreamOptions` and :class:`StreamConfigError`: the stream both sides share;
- :func:`check_registration`: a worker record's registration held to the service's bounds.

Its modules are private: ``_records`` (subjects, headers, message ids, each record checked
whole), ``_cursor`` (a replica's per-stream rules for copies, restarts, gaps and forged
sequences), ``_relay``, ``_replica`` and ``_apply``, ``_snapshot`` and ``_retention``. The NATS
client (``nats-py``) is the ``nats`` extra; see docs/scale-out.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.scaleout._jetstream import JetStreamOptions, StreamConfigError
    from kvevents.scaleout._records import check_registration
    from kvevents.scaleout._relay import Relay, RelayOptions, RelayStats
    from kvevents.scaleout._replica import Replica
    from kvevents.scaleout._replica_records import ReplicaOptions, ReplicaStats

__all__ = [
    "JetStreamOptions",
    "Relay",
    "RelayOptions",
    "RelayStats",
    "Replica",
    "ReplicaOptions",
    "ReplicaStats",
    "StreamConfigError",
    "check_registration",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.scaleout._jetstream": (
            "JetStreamOptions",
            "StreamConfigError",
        ),
        "kvevents.scaleout._records": ("check_registration",),
        "kvevents.scaleout._relay": (
            "Relay",
            "RelayOptions",
            "RelayStats",
        ),
        "kvevents.scaleout._replica": ("Replica",),
        "kvevents.scaleout._replica_records": (
            "ReplicaOptions",
            "ReplicaStats",
        ),
    },
)

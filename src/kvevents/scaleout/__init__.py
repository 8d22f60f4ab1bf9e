"""Scale-out over NATS JetStream: relays write the engines' streams into one JetStream
stream, router replicas consume it, snapshots let a new replica start warm.

- :mod:`.records`: subjects, headers and message ids, each record checked whole (pure);
- :mod:`.cursor`: a replica's per-stream rules for copies, restarts, gaps and forged
  sequences (pure);
- :mod:`.relay`: :class:`Relay`, ZeroMQ streams in, JetStream out;
- :mod:`.replica`: :class:`Replica`, JetStream in, an index service out; :mod:`.apply`, its
  records applied to the service, none fatal;
- :mod:`.snapshot` and :mod:`.retention`: a replica's saved index, and trimming the stream.

The NATS client (``nats-py``) is the ``nats`` extra; see docs/scale-out.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents._lazy import lazy_exports

if TYPE_CHECKING:
    from kvevents.scaleout.jetstream import JetStreamOptions
    from kvevents.scaleout.relay import Relay, RelayOptions, RelayStats
    from kvevents.scaleout.replica import Replica
    from kvevents.scaleout.replica_records import ReplicaOptions, ReplicaStats

__all__ = [
    "JetStreamOptions",
    "Relay",
    "RelayOptions",
    "RelayStats",
    "Replica",
    "ReplicaOptions",
    "ReplicaStats",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "kvevents.scaleout.jetstream": ["JetStreamOptions"],
        "kvevents.scaleout.relay": ["Relay", "RelayOptions", "RelayStats"],
        "kvevents.scaleout.replica": ["Replica"],
        "kvevents.scaleout.replica_records": ["ReplicaOptions", "ReplicaStats"],
    },
)

"""The scaleout layer's face: the names ``kvevents.scaleout`` exports (relays and replicas over JetStream); its modules are
private."""

from __future__ import annotations

import kvevents.scaleout

EXPORTED = [
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


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.scaleout.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.scaleout.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.scaleout, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.scaleout))

"""The service layer's face: the names ``kvevents.service`` exports (the index service, registrations and their bounds, the feed, the state file); its modules are
private."""

from __future__ import annotations

import kvevents.service

EXPORTED = [
    "BlockSize",
    "DecisionLog",
    "EndpointText",
    "HitBucket",
    "IdleTrim",
    "IndexService",
    "LoadLedger",
    "LoadReport",
    "Name",
    "OwnEndpoints",
    "Rank",
    "RankCount",
    "RoutedQuery",
    "ServiceStats",
    "StateFile",
    "StateFileError",
    "Text",
    "WorkerRegistration",
    "decode_registrations",
    "default_stream_specs",
    "encode_registrations",
    "release_free_memory",
    "subscriber_feed",
]


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.service.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.service.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.service, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.service))

"""The index layer's face: the names ``kvevents.index`` exports (the prefix index, the router, keys and digests); its modules are
private."""

from __future__ import annotations

import kvevents.index

EXPORTED = [
    "DEFAULT_POLICY",
    "DEFAULT_RECENT_WINDOW",
    "DEFAULT_TIER",
    "POLICIES",
    "ApplyResult",
    "Decision",
    "HolderKey",
    "IndexDigest",
    "IndexStats",
    "Load",
    "LoadBook",
    "MMSpan",
    "MatchResult",
    "Policy",
    "PrefixIndex",
    "RecentBlocks",
    "ReportMode",
    "RouteInputs",
    "Router",
    "StreamDigest",
    "StreamInfo",
    "TargetScore",
    "holders_digest",
    "index_digest",
    "make_policy",
    "pack_tokens",
    "request_keys",
    "table_implementation",
]


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.index.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.index.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.index, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.index))

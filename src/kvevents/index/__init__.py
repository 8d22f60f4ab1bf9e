"""Which worker holds which prefix, and where to send a request.

:class:`PrefixIndex` keys blocks by our own chained token hash (``kvevents.index.keys``) on
tables from ``kvevents.index.table`` (C where built, plain Python otherwise); :class:`Router`
scores workers with a policy over the index's matches and a load book.
"""

from kvevents.index.decision import Decision, LoadBook
from kvevents.index.prefix import (
    DEFAULT_TIER,
    ApplyResult,
    HolderKey,
    IndexStats,
    MatchResult,
    PrefixIndex,
    ReportMode,
    StreamInfo,
)
from kvevents.index.router import POLICIES, Policy, Router, make_policy

__all__ = [
    "DEFAULT_TIER",
    "POLICIES",
    "ApplyResult",
    "Decision",
    "HolderKey",
    "IndexStats",
    "LoadBook",
    "MatchResult",
    "Policy",
    "PrefixIndex",
    "ReportMode",
    "Router",
    "StreamInfo",
    "make_policy",
]

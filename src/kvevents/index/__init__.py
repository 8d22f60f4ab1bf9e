"""Which worker holds which prefix, and where to send a request.

:class:`PrefixIndex` keys blocks by our own chained token hash (:func:`request_keys`,
:func:`pack_tokens`) on tables in C where built, plain Python otherwise
(:func:`table_implementation` says which); :class:`Router` scores workers with a policy over
the index's matches and a :class:`LoadBook`; :func:`holders_digest` and :func:`index_digest`
sum what it holds per stream. Its modules are private (``_prefix``, ``_router``, ``_keys``...):
import from here.
"""

from __future__ import annotations

from kvevents.index._decision import Decision, Load, LoadBook, RouteInputs, TargetScore
from kvevents.index._digest import IndexDigest, StreamDigest, holders_digest, index_digest
from kvevents.index._keys import MMSpan, pack_tokens, request_keys
from kvevents.index._prefix import PrefixIndex, ReportMode
from kvevents.index._recent import DEFAULT_RECENT_WINDOW, RecentBlocks
from kvevents.index._records import (
    DEFAULT_TIER,
    ApplyResult,
    HolderKey,
    IndexStats,
    MatchResult,
    StreamInfo,
)
from kvevents.index._router import DEFAULT_POLICY, POLICIES, Policy, Router, make_policy
from kvevents.index._table import table_implementation

__all__ = [
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

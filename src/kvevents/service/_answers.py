"""What a query answers: our reply's shape, and a match narrowed to some targets.

Pure functions of a :class:`~kvevents.index.MatchResult` and a routing
:class:`~kvevents.index.Decision`; the service calls them after its lock is released.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

from kvevents._types import Document
from kvevents.events import StreamKey
from kvevents.index import Decision, MatchResult

__all__ = ["Shape", "answer", "scoped"]

_R = TypeVar("_R", covariant=True)

#: Turns a query's match and decision into a reply.
Shape = Callable[[MatchResult, Decision], _R]


def answer(match: MatchResult, decision: Decision) -> Document:
    """Our ``POST /query`` reply: matched blocks per (worker, rank) and per holder, and the
    decision explained."""
    scores: dict[str, dict[str, int]] = {}
    for (worker, rank), blocks in match.streams.items():
        scores.setdefault(worker, {})[str(rank)] = blocks
    return {
        "request_tokens": match.request_tokens,
        "request_blocks": {str(k): v for k, v in match.request_blocks.items()},
        "scores": scores,
        "matches": [
            {"worker_id": k.worker_id, "rank": k.rank, "tier": k.tier, "matched_blocks": v}
            for k, v in match.holders.items()
        ],
        "decision": decision.to_dict(),
    }


def scoped(match: MatchResult, targets: Collection[StreamKey]) -> MatchResult:
    """``match`` with only the holders and streams of ``targets`` (e.g. one model's)."""
    wanted = set(targets)
    return MatchResult(
        match.request_tokens,
        match.request_blocks,
        {k: v for k, v in match.holders.items() if (k.worker_id, k.rank) in wanted},
        {k: v for k, v in match.streams.items() if k in wanted},
    )

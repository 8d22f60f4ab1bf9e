"""What a routing decision is made of and what it says: targets, their load, each target's
score and terms, and the decision with its reason. Plain records; the policies that fill
them are in :mod:`kvevents.index._router`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvevents.events import StreamKey

__all__ = ["Decision", "Load", "LoadBook", "RouteInputs", "TargetScore"]


class Load(NamedTuple):
    """Load of one target, in KV blocks."""

    queued_blocks: int = 0  #: prefill blocks waiting or being computed
    active_blocks: int = 0  #: blocks held by running (decoding) requests
    requests: int = 0  #: requests in flight (sent and not yet answered), where known
    #: distinct blocks the requests in flight hold or will hold (a prefix they share counted
    #: once): what the engine cannot evict while they run, where known
    pinned_blocks: int = 0
    #: distinct blocks of the requests sent to it lately (:class:`~._recent.RecentBlocks`):
    #: how much different prefix it has been asked to keep, where known
    recent_blocks: int = 0


class TargetScore(NamedTuple):
    """How one target scored: inputs (matched blocks, load) and the terms of its score."""

    worker_id: str
    rank: int
    matched_blocks: int
    request_blocks: int
    score: float  #: higher wins
    load: Load
    terms: Mapping[str, float]
    degraded: str | None = None  #: why its matched blocks were not trusted, if they were not


@dataclass(frozen=True)
class Decision:
    """A routing decision and everything needed to explain it."""

    winner: StreamKey | None  #: None when there was no target
    policy: str
    scores: tuple[TargetScore, ...]  #: one per target, in target order
    request_tokens: int = 0
    tied: int = 1  #: targets that shared the best score (the winner drawn among them)
    reason: str = ""  #: what decided, in words (e.g. "most matched blocks (6)")

    @property
    def matched(self) -> dict[StreamKey, int]:
        """Matched blocks per target."""
        return {(s.worker_id, s.rank): s.matched_blocks for s in self.scores}

    @property
    def winner_score(self) -> TargetScore | None:
        """The winner's row of :attr:`scores`."""
        for row in self.scores:
            if (row.worker_id, row.rank) == self.winner:
                return row
        return None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the ``decision`` of ``POST /query``)."""
        return {
            "policy": self.policy,
            "winner": None
            if self.winner is None
            else {"worker_id": self.winner[0], "rank": self.winner[1]},
            "request_tokens": self.request_tokens,
            "tied": self.tied,
            "reason": self.reason,
            "scores": [
                {
                    "worker_id": s.worker_id,
                    "rank": s.rank,
                    "matched_blocks": s.matched_blocks,
                    "request_blocks": s.request_blocks,
                    "score": s.score,
                    "queued_blocks": s.load.queued_blocks,
                    "active_blocks": s.load.active_blocks,
                    "terms": dict(s.terms),
                    "degraded": s.degraded,
                }
                for s in self.scores
            ],
        }

    def explain(self) -> str:
        """A small table: one line per target, the winner marked."""
        if self.reason:
            why = f": {self.reason}"
        else:
            why = f" (drawn among {self.tied} tied targets)" if self.tied > 1 else ""
        lines = [f"policy {self.policy}: winner {self._name(self.winner)}{why}"]
        for s in self.scores:
            mark = "  <- winner" if (s.worker_id, s.rank) == self.winner else ""
            if s.degraded:
                mark = f" (degraded: {s.degraded}){mark}"
            terms = " ".join(f"{k}={v:g}" for k, v in s.terms.items())
            lines.append(
                f"  {self._name((s.worker_id, s.rank))}: matched {s.matched_blocks}/"
                f"{s.request_blocks} blocks, queued {s.load.queued_blocks}, active "
                f"{s.load.active_blocks}, score {s.score:g} {terms}{mark}".rstrip()
            )
        return "\n".join(lines)

    @staticmethod
    def _name(target: StreamKey | None) -> str:
        return "none" if target is None else f"{target[0]}/rank{target[1]}"


class LoadBook:
    """Per-target load, kept by whoever knows it (a simulation, engine load reports)."""

    def __init__(self) -> None:
        self._loads: dict[StreamKey, Load] = {}

    def get(self, worker_id: str, rank: int = 0) -> Load:
        return self._loads.get((worker_id, rank), _IDLE)

    def set(
        self,
        worker_id: str,
        rank: int = 0,
        *,
        queued_blocks: int | None = None,
        active_blocks: int | None = None,
        requests: int | None = None,
        pinned_blocks: int | None = None,
        recent_blocks: int | None = None,
    ) -> None:
        """Replace some terms of a target's load (the others are kept)."""
        old = self.get(worker_id, rank)
        self._loads[(worker_id, rank)] = Load(
            old.queued_blocks if queued_blocks is None else queued_blocks,
            old.active_blocks if active_blocks is None else active_blocks,
            old.requests if requests is None else requests,
            old.pinned_blocks if pinned_blocks is None else pinned_blocks,
            old.recent_blocks if recent_blocks is None else recent_blocks,
        )

    def add(
        self,
        worker_id: str,
        rank: int = 0,
        *,
        queued_blocks: int = 0,
        active_blocks: int = 0,
        requests: int = 0,
    ) -> None:
        """Add to (or, with negative numbers, take from) a target's load; never below 0."""
        old = self.get(worker_id, rank)
        self._loads[(worker_id, rank)] = Load(
            max(0, old.queued_blocks + queued_blocks),
            max(0, old.active_blocks + active_blocks),
            max(0, old.requests + requests),
            old.pinned_blocks,
            old.recent_blocks,
        )

    def remove(self, worker_id: str, rank: int | None = None) -> None:
        """Forget a worker's (or one rank's) load."""
        for key in [k for k in self._loads if k[0] == worker_id and rank in (None, k[1])]:
            del self._loads[key]

    def many(self, targets: Sequence[StreamKey]) -> list[Load]:
        """The loads of ``targets``, in order."""
        get = self._loads.get
        return [get(t, _IDLE) for t in targets]

    def snapshot(self) -> dict[StreamKey, Load]:
        return dict(self._loads)


_IDLE = Load()
_row = TargetScore._make


@dataclass(frozen=True)
class RouteInputs:
    """What a policy sees: per target, matched and request blocks, and load."""

    targets: Sequence[StreamKey]
    matched: Sequence[int]
    request_blocks: Sequence[int]
    loads: Sequence[Load]
    request_tokens: int
    degraded: Sequence[str | None] = ()  #: per target, why it is degraded (empty: none is)
    #: per target, the blocks its cache holds at most (None, or empty: not known)
    capacity: Sequence[int | None] = ()
    #: per target, the blocks this request would pin there that no request in flight there
    #: pins already (empty: not known; the request's blocks less those matched stand for it)
    adds: Sequence[int] = ()
    #: per target, the request's leading blocks sent there lately, cached there now or not
    #: (:class:`~._recent.RecentBlocks`; empty: not known)
    recent_matched: Sequence[int] = ()

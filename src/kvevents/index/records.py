"""The prefix index's records: holder keys, per-batch results, stats, matches, totals.

Plain immutable records, shared by :mod:`kvevents.index.prefix` and the modules it is split
into; ``kvevents.index`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

from kvevents.events import StreamKey

__all__ = [
    "DEFAULT_TIER",
    "ApplyResult",
    "HolderKey",
    "IndexStats",
    "MatchResult",
    "ReportMode",
    "StreamInfo",
]

#: How a stream reports blocks. ``"incremental"``: a store announces a new copy of a block,
#: so a second store of a held block is a second reference (vLLM's default: its cache does
#: not de-duplicate blocks, each copy is stored and evicted on its own). ``"full"``: stores
#: also announce blocks reused from the cache (vLLM ``kv_cache_report_mode="full"``), which
#: are evicted once however often they were announced.
ReportMode = Literal["incremental", "full"]

#: Tier of blocks whose event carries no ``medium``.
DEFAULT_TIER = "GPU"


class HolderKey(NamedTuple):
    """Who holds a block: a worker, one of its attention-DP ranks, and a storage tier."""

    worker_id: str
    rank: int
    tier: str


class ApplyResult(NamedTuple):
    """What one :meth:`PrefixIndex.apply` call did, in block events unless noted.

    A named tuple rather than a dataclass: one is built per batch on the hot path.
    """

    stored: int = 0  #: blocks stored (placed now, duplicates included)
    removed: int = 0  #: blocks removed (including removals of held orphans)
    duplicate_stores: int = 0  #: stores of a block the holder already had (ref counted)
    unknown_removals: int = 0  #: removals of blocks the index never saw (harmless)
    orphaned: int = 0  #: blocks held because their parent is unknown
    placed: int = 0  #: held orphan blocks placed because their parent arrived
    dropped: int = 0  #: held orphan blocks dropped (bound exceeded, clear)
    bad_events: int = 0  #: events skipped: token count does not match (events)
    block_size_mismatches: int = 0  #: events skipped: wrong block size (events)
    cleared: int = 0  #: AllBlocksCleared events applied


@dataclass(frozen=True)
class IndexStats:
    """Totals since the index was created, and its current size."""

    #: Fields that are levels (Prometheus gauges); every other number only grows.
    GAUGES: ClassVar[frozenset[str]] = frozenset(
        {"blocks", "memory_bytes", "entries", "holders", "orphans_held", "streams"}
    )

    streams: int  #: (worker, rank) streams known
    holders: int  #: (worker, rank, tier) holders with an id
    blocks: int  #: distinct blocks (our hashes) indexed
    entries: int  #: (holder, block) pairs indexed
    stored_blocks: int  #: block store events applied (duplicates and placed orphans included)
    removed_blocks: int  #: block removal events applied
    duplicate_stores: int  #: stores of a block its holder already had
    unknown_removals: int  #: removals of blocks never seen (or already removed)
    orphans_held: int  #: blocks held now, waiting for their parent
    orphans_placed: int  #: held blocks placed once their parent arrived
    orphans_dropped: int  #: held blocks dropped (bound, clear, reset, worker removal)
    block_size_mismatches: int  #: store events skipped for a wrong block size
    bad_events: int  #: store events skipped for a token count that does not match
    clears: int  #: AllBlocksCleared events applied
    stream_resets: int  #: reset_stream calls
    #: stores with no full block to key, accepted and not indexed: vLLM's partial-block stores
    #: (``cache_partial_block``) and the offloading connector's tokenless placeholders
    partial_stores: int
    memory_bytes: int  #: estimated bytes held by the index structures
    #: stores of a block its holder already had, on a stream in ``"full"`` report mode: the
    #: engine announcing a reused block again (not a second reference)
    refreshed_stores: int = 0
    #: events of a hybrid model's sliding-window or Mamba group, followed apart from the
    #: block tables (a hit needs only the blocks before its end from such a group)
    group_events: int = 0

    @property
    def bytes_per_block(self) -> float:
        """Estimated bytes per (holder, block) entry."""
        return self.memory_bytes / self.entries if self.entries else 0.0


@dataclass(frozen=True)
class StreamInfo:
    """One (worker, rank) stream as the index sees it (for ``/workers``)."""

    worker_id: str
    rank: int
    block_size: int | None
    registered: bool  #: block size given by register_worker (else adopted from events)
    tiers: Mapping[str, int]  #: blocks held per tier
    orphans_held: int
    block_size_mismatches: int
    bad_events: int
    batches: int  #: batches applied
    last_batch_ts: float | None  #: ``ts`` of the last batch applied (engine clock)


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a request, per holder and per (worker, rank).

    ``holders`` and ``streams`` list only non-zero matches, in blocks of the stream's own
    block size. ``streams`` counts a prefix whose blocks sit on any tier of that stream.
    ``request_blocks`` is the number of full blocks of the request per block size.
    """

    request_tokens: int
    request_blocks: Mapping[int, int]
    holders: Mapping[HolderKey, int] = field(default_factory=dict)
    streams: Mapping[StreamKey, int] = field(default_factory=dict)


class Counts:
    """The index's running totals; ``snapshot`` is in :class:`ApplyResult` field order."""

    __slots__ = (
        "bad_events",
        "clears",
        "dropped",
        "duplicates",
        "grouped",
        "mismatches",
        "orphaned",
        "partial",
        "placed",
        "refreshed",
        "removed",
        "resets",
        "stored",
        "unknown",
    )

    def __init__(self) -> None:
        self.stored = self.removed = self.duplicates = self.unknown = 0
        self.orphaned = self.placed = self.dropped = 0
        self.bad_events = self.mismatches = self.clears = self.resets = self.partial = 0
        self.refreshed = self.grouped = 0

    def snapshot(self) -> tuple[int, ...]:
        return (
            self.stored,
            self.removed,
            self.duplicates,
            self.unknown,
            self.orphaned,
            self.placed,
            self.dropped,
            self.bad_events,
            self.mismatches,
            self.clears,
        )

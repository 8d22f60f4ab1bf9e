"""The prefix index's records: holder keys, per-batch results, stats, matches, totals.

Plain immutable records, shared by :mod:`kvevents.index._prefix` and the modules beside it
(``kvevents.index`` re-exports them), and the index's running :class:`Counts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple, TypeAlias

from kvevents.events import BlockStored, PackedStored, StreamKey

__all__ = [
    "DEFAULT_TIER",
    "ApplyResult",
    "Counts",
    "HolderKey",
    "IndexStats",
    "MatchResult",
    "ReportMode",
    "Stored",
    "StreamInfo",
]

#: A store as the index reads it: decoded whole, or with its tokens still packed.
Stored: TypeAlias = BlockStored | PackedStored

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
    """What one :meth:`PrefixIndex.apply` call did, in block events unless noted; each field
    is named as the total it adds to in :class:`IndexStats`.

    A named tuple rather than a dataclass: one is built per batch.
    """

    stored_blocks: int = 0  #: blocks stored (placed now, duplicates included)
    removed_blocks: int = 0  #: blocks removed (including removals of held orphans)
    duplicate_stores: int = 0  #: stores of a block the holder already had (ref counted)
    unknown_removals: int = 0  #: removals of blocks the index never saw (harmless)
    orphaned_blocks: int = 0  #: blocks held because their parent is unknown
    orphans_placed: int = 0  #: held orphan blocks placed because their parent arrived
    orphans_dropped: int = 0  #: held orphan blocks dropped (bound exceeded, clear)
    bad_events: int = 0  #: events skipped: token count does not match (events)
    block_size_mismatches: int = 0  #: events skipped: wrong block size (events)
    clears: int = 0  #: AllBlocksCleared events applied


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
    #: blocks of stores held as orphans when they arrived (their parent not seen yet)
    orphaned_blocks: int = 0

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


@dataclass(slots=True)
class Counts:
    """The index's running totals, each named as in :class:`IndexStats` (and
    :class:`ApplyResult`): a counter's name is checked by mypy, not found at run time."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    unknown_removals: int = 0
    orphaned_blocks: int = 0
    orphans_placed: int = 0
    orphans_dropped: int = 0
    bad_events: int = 0
    block_size_mismatches: int = 0
    clears: int = 0
    stream_resets: int = 0
    partial_stores: int = 0
    refreshed_stores: int = 0
    group_events: int = 0

    def since(self, before: Counts) -> ApplyResult:
        """What was counted after ``before`` (a copy of these counts), as an ApplyResult."""
        return ApplyResult(
            **{name: getattr(self, name) - getattr(before, name) for name in ApplyResult._fields}
        )

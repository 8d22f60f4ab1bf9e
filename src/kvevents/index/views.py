"""What a :class:`~kvevents.index.prefix.PrefixIndex` shows of itself: its stats, its streams,
snapshots and dumps. Read-only, kept apart from the rules that change the index."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from kvevents.events import StreamKey
from kvevents.index import query
from kvevents.index.records import HolderKey, IndexStats, StreamInfo

if TYPE_CHECKING:
    from kvevents.index import table as bt
    from kvevents.index.holders import Holder, Stream
    from kvevents.index.records import Counts

__all__ = ["IndexViews"]


class IndexViews:
    """The inspection half of :class:`~kvevents.index.prefix.PrefixIndex` (a mixin over its
    tables: ``_pages``, ``_streams``, ``_by_id``, ``_c``)."""

    _pages: list[bt.U64Map]
    _streams: dict[StreamKey, Stream]
    _by_id: dict[int, Holder]
    _c: Counts

    def stats(self) -> IndexStats:
        """A frozen record of totals and sizes (``memory_bytes`` is O(holders))."""
        c = self._c
        holders = list(self._by_id.values())
        return IndexStats(
            streams=len(self._streams),
            holders=len(holders),
            blocks=sum(len(page) for page in self._pages),
            entries=sum(len(h.engine) for h in holders),
            stored_blocks=c.stored,
            removed_blocks=c.removed,
            duplicate_stores=c.duplicates,
            unknown_removals=c.unknown,
            orphans_held=sum(s.orphans.held for s in self._streams.values()),
            orphans_placed=c.placed,
            orphans_dropped=c.dropped,
            block_size_mismatches=c.mismatches,
            bad_events=c.bad_events,
            clears=c.clears,
            stream_resets=c.resets,
            partial_stores=c.partial,
            memory_bytes=self._memory_bytes(holders),
            refreshed_stores=c.refreshed,
            group_events=c.grouped,
        )

    def _memory_bytes(self, holders: list[Holder]) -> int:
        size = sum(page.nbytes for page in self._pages)
        for holder in holders:
            size += holder.engine.nbytes + sys.getsizeof(holder.dups)
            size += sys.getsizeof(holder.shared)
        return size + sum(stream.tombs.nbytes for stream in self._streams.values())

    def streams(self) -> list[StreamInfo]:
        """Every known stream with its per-tier block counts and error counters."""
        return [
            StreamInfo(
                worker_id=s.key[0],
                rank=s.key[1],
                block_size=s.block_size,
                registered=s.registered,
                tiers={tier: len(h.engine) for tier, h in s.holders.items()},
                orphans_held=s.orphans.held,
                block_size_mismatches=s.mismatches,
                bad_events=s.bad_events,
                batches=s.batches,
                last_batch_ts=s.last_ts,
            )
            for s in self._streams.values()
        ]

    def snapshot(self) -> dict[HolderKey, frozenset[int]]:
        """Engine hashes held per holder (to compare with an engine's true cache state)."""
        return {
            h.key: frozenset(h.engine)
            for s in self._streams.values()
            for h in s.holders.values()
            if h.engine
        }

    def holder_blocks(self, key: HolderKey) -> list[tuple[int, int]]:
        """One holder's ``(engine_hash, our_hash)`` pairs, a copy (empty for an unknown one)."""
        stream = self._streams.get((key.worker_id, key.rank))
        holder = None if stream is None else stream.holders.get(key.tier)
        return [] if holder is None else holder.engine.items()

    def holders_of(self, block_hash: int) -> list[HolderKey]:
        """Holders of one block, by our hash."""
        out: dict[HolderKey, int] = {}
        for page, table in enumerate(self._pages):
            query.record(self._by_id, page, table.get(block_hash, 0), 0, out)
        return sorted(out)

    def dump(self) -> list[dict[str, object]]:
        """Every holder's blocks as ``[engine_hash, our_hash]`` pairs, JSON-ready."""
        return [
            {
                "worker_id": h.key.worker_id,
                "rank": h.key.rank,
                "tier": h.key.tier,
                "block_size": s.block_size,
                "blocks": [[eh, oh] for eh, oh in h.engine.items()],
            }
            for s in self._streams.values()
            for h in s.holders.values()
        ]

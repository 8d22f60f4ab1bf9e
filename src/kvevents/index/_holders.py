"""The storage half of the prefix index: a holder's tables, tombstones, a stream's state.

Layout (chosen for memory, see docs/index.md for the measured bytes per block):

- Holders (a (worker, rank, tier)) are numbered; each page of 64 holder ids has one block
  table, our hash -> 64-bit mask of the page's holders, so the C table stores a mask inline.
- Per holder: ``engine``, engine hash -> our hash, and two rarely used dicts of reference
  counts (``dups``: the same engine hash stored again; ``shared``: two engine hashes of one
  holder naming the same tokens).
- Per stream: recently removed engine hashes (:class:`Tombstones`), so that a child stored
  just after its parent was evicted still resolves, and its orphans
  (:class:`~kvevents.index._orphans.OrphanPen`).

The bulk work is done by table primitives (:mod:`kvevents.index._table`); the rules of
reference counting are here, once (the index's hot store calls ``store_run`` itself and comes
here for anything but a fresh run).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvevents.events import StreamKey
from kvevents.index import _table as bt
from kvevents.index._groups import TailGroup
from kvevents.index._orphans import OrphanPen
from kvevents.index._records import DEFAULT_TIER, HolderKey

__all__ = ["PAGE_MASK", "PAGE_SHIFT", "Holder", "Stream", "Tombstones", "tier_name"]

PAGE_SHIFT = 6
PAGE_MASK = 63

U64Map = bt.U64Map


def tier_name(medium: str | None) -> str:
    """The tier of an event's ``medium`` (upper case; :data:`DEFAULT_TIER` when absent)."""
    return DEFAULT_TIER if medium is None else medium.upper()


def _unref(counts: dict[int, int], key: int) -> bool:
    """Take one reference of ``key`` from ``counts``; False when it had none."""
    count = counts.get(key)
    if not count:
        return False
    if count == 1:
        del counts[key]
    else:
        counts[key] = count - 1
    return True


class Tombstones:
    """Engine hash -> our hash of recently removed blocks, in two generations of at most
    ``limit`` each, so that forgetting the oldest is O(1)."""

    __slots__ = ("limit", "old", "recent")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.recent = U64Map()
        self.old = U64Map()

    def get(self, engine_hash: int) -> int | None:
        ours = self.recent.get(engine_hash)
        return ours if ours is not None else self.old.get(engine_hash)

    def settle(self) -> None:
        """Start a new generation once the recent one is over the limit (after burials)."""
        if len(self.recent) > self.limit:
            self.old, self.recent = self.recent, U64Map()

    def clear(self) -> None:
        self.recent = U64Map()
        self.old = U64Map()

    @property
    def nbytes(self) -> int:
        return self.recent.nbytes + self.old.nbytes


class Holder:
    """One (worker, rank, tier): its id, its bit in its page's block table, its engine map."""

    __slots__ = ("bit", "dups", "engine", "id", "key", "page", "shared", "table")

    def __init__(self, key: HolderKey, hid: int, table: bt.U64Map) -> None:
        self.key = key
        self.id = hid
        self.page = hid >> PAGE_SHIFT
        self.bit = 1 << (hid & PAGE_MASK)
        self.table = table  # the block table of this holder's page
        self.engine = U64Map()
        self.dups: dict[int, int] = {}
        self.shared: dict[int, int] = {}

    def add(self, hashes: Sequence[int], ours: Sequence[int], *, refresh: bool = False) -> int:
        """Store blocks whose hashes are known; returns how many the holder had already.

        Such a store is a second reference (removed twice), or with ``refresh`` a report of
        the same block again (one removal takes it).
        """
        shared = bt.store_chain(self.table, self.engine, self.bit, hashes, ours)
        if shared is None:
            return self._add_each(hashes, ours, refresh)
        self.share(shared)
        return 0

    def remove(self, hashes: Sequence[int], tombs: Tombstones) -> list[int]:
        """Remove blocks (one reference each); returns the engine hashes it does not hold."""
        if not self.dups and not self.shared:  # no reference counts: one table call
            return bt.remove_blocks(self.table, self.engine, tombs.recent, self.bit, hashes)
        engine, unknown = self.engine, []
        for eh in hashes:
            oh = engine.pop(eh, None)
            if oh is None:
                unknown.append(eh)
            elif self.dups and _unref(self.dups, eh):
                engine[eh] = oh
            else:
                tombs.recent[eh] = oh
                if not (self.shared and _unref(self.shared, oh)):
                    self._clear(oh)
        return unknown

    def drop(self) -> None:
        """Forget every block of this holder."""
        bt.drop_holder(self.table, self.engine, self.bit)
        self.dups = {}
        self.shared = {}

    def _add_each(self, hashes: Sequence[int], ours: Sequence[int], refresh: bool) -> int:
        engine, fresh, dups = self.engine, [], 0
        for eh, oh in zip(hashes, ours, strict=True):
            if engine.get(eh) is None:
                engine[eh] = oh
                fresh.append(oh)
                continue
            if not refresh:
                self.dups[eh] = self.dups.get(eh, 0) + 1
            dups += 1
        blocks, bit, shared = self.table, self.bit, []
        for oh in fresh:
            mask = blocks.get(oh, 0)
            if mask & bit:
                shared.append(oh)
            else:
                blocks[oh] = mask | bit
        self.share(shared)
        return dups

    def share(self, shared: Iterable[int]) -> None:
        """Count blocks the holder already had under another engine hash (from a store)."""
        counts = self.shared
        for oh in shared:
            counts[oh] = counts.get(oh, 0) + 1

    def _clear(self, ours: int) -> None:
        mask = self.table[ours] ^ self.bit
        if mask:
            self.table[ours] = mask
        else:
            del self.table[ours]


class Stream:
    """One (worker, rank) stream: its block size, holders per tier, tombstones, orphans."""

    __slots__ = (
        "bad_events",
        "batches",
        "block_size",
        "by_medium",
        "holders",
        "key",
        "last_ts",
        "lookahead",
        "masks",
        "mismatches",
        "orphans",
        "partials",
        "refreshes",
        "registered",
        "removed",
        "tails",
        "tombs",
    )

    def __init__(
        self, key: StreamKey, block_size: int | None, registered: bool, tombstones: int
    ) -> None:
        self.key = key
        self.block_size = block_size
        self.registered = registered
        # "full" report mode: a store of a held block is the same block announced again
        self.refreshes = False
        self.lookahead = 0  # tokens after a block that its key covers (EAGLE-style engines)
        self.tails: dict[object, TailGroup] = {}  # group_idx -> a windowed or Mamba group
        self.holders: dict[str, Holder] = {}  # by tier
        self.by_medium: dict[str | None, Holder] = {}  # by the event's medium, as written
        self.masks: dict[int, int] = {}  # page -> bits of this stream's holders
        self.orphans = OrphanPen()
        self.tombs = Tombstones(tombstones)
        self.partials: dict[int, int] = {}  # engine hashes of partial/placeholder stores
        self.mismatches = 0
        self.bad_events = 0
        self.batches = 0
        self.removed = 0  # blocks the engine announced removed (evicted), ever
        self.last_ts: float | None = None

    def resolve(self, engine_hash: int) -> int | None:
        """Our hash of an engine hash held (or recently removed) on any tier of the stream."""
        for holder in self.holders.values():
            ours = holder.engine.get(engine_hash)
            if ours is not None:
                return ours
        return self.tombs.get(engine_hash)

    def holder_of(self, medium: str | None) -> Holder | None:
        """The holder an event's ``medium`` names, if the stream has one yet."""
        holder = self.by_medium.get(medium)
        return holder if holder is not None else self.holders.get(tier_name(medium))

    def note_partials(self, hashes: Iterable[int]) -> None:
        """Remember engine hashes stored without full blocks (the oldest forgotten past the
        tombstone limit), so that their removal is not an unknown one."""
        partials = self.partials
        for eh in hashes:
            partials[eh] = 1
        while len(partials) > self.tombs.limit:
            del partials[next(iter(partials))]

    def known_partials(self, unknown: list[int]) -> list[int]:
        """``unknown`` without the hashes of partial stores (which are forgotten now)."""
        partials = self.partials
        return [eh for eh in unknown if not partials.pop(eh, 0)]

    def drop_state(self) -> int:
        """Forget every block, orphan and tombstone; returns the orphan blocks dropped."""
        for holder in self.holders.values():
            holder.drop()
        for tail in self.tails.values():
            tail.clear()
        self.tombs.clear()
        self.partials = {}
        return self.orphans.clear()

"""The prefix index: which worker, rank and tier holds which prefix of tokens.

Blocks are keyed by our own chained hash of their tokens (:mod:`kvevents.index.keys`), so the
blocks of every engine agree whatever hash the engine uses. The engine's hash is kept per
holder only to resolve parents and removals.

Layout (chosen for memory, see docs/index.md for the measured bytes per block):

- ``_blocks``: one dict, our hash -> bitmask of holders (a holder is a (worker, rank, tier));
  a block held by one holder stores that holder's own bit object, so it costs no extra int.
  Bitmasks are Python ints, so the number of holders per block has no cap.
- per holder: ``engine`` dict, engine hash -> our hash (the int objects are shared with the
  block keys), and two rarely used dicts of reference counts (``dups``: the same engine hash
  stored again; ``shared``: two engine hashes of one holder naming the same tokens).

Rules (each has its own test): duplicate stores and removals are reference counted per holder;
a removal of an unknown block is counted and harmless; ``AllBlocksCleared`` drops the stream's
blocks; a store whose parent is unknown is held as an orphan (bounded, counted) and placed
exactly once when its parent arrives, never re-rooted at token 0; a ``block_size`` different
from the stream's is a loud error and a counter, and the event is not applied; a store whose
``token_ids`` length is not ``block_size * len(block_hashes)`` is skipped and counted.

The index is not thread-safe: one writer at a time (the service holds a lock).
"""

from __future__ import annotations

import heapq
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import ClassVar, NamedTuple

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.index import table as bt
from kvevents.index.keys import ROOT_SEED, pack_tokens, root_seed
from kvevents.wire import Applied, PackedStored, decode_batch_packed

U64Map = bt.U64Map
chain_hashes = bt.chain_hashes
_pack_msgpack = bt.pack_msgpack_tokens
_ingest_events = bt.ingest_events

__all__ = [
    "DEFAULT_TIER",
    "ApplyResult",
    "HolderKey",
    "IndexStats",
    "MatchResult",
    "PrefixIndex",
    "StreamInfo",
]

log = logging.getLogger("kvevents.index.prefix")

#: Tier of blocks whose event carries no ``medium``.
DEFAULT_TIER = "GPU"

# Holders are numbered; each page of 64 holder ids has its own block table whose values are
# 64-bit masks, so the C table stores a mask inline whatever the number of holders.
_PAGE_SHIFT = 6
_PAGE_MASK = 63


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
        {"blocks", "bytes_estimate", "entries", "holders", "orphans_held", "streams"}
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
    bytes_estimate: int  #: estimated bytes held by the index structures

    @property
    def bytes_per_block(self) -> float:
        """Estimated bytes per (holder, block) entry."""
        return self.bytes_estimate / self.entries if self.entries else 0.0


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
    streams: Mapping[tuple[str, int], int] = field(default_factory=dict)


class _Holder:
    __slots__ = ("bit", "dups", "engine", "id", "key", "page", "shared", "table")

    def __init__(self, key: HolderKey, hid: int, table: bt.U64Map) -> None:
        self.key = key
        self.id = hid
        self.page = hid >> _PAGE_SHIFT
        self.bit = 1 << (hid & _PAGE_MASK)
        self.table = table  # the block table of this holder's page
        self.engine = U64Map()
        self.dups: dict[int, int] = {}
        self.shared: dict[int, int] = {}


_Stored = BlockStored | PackedStored
_STORED_TYPES = (PackedStored, BlockStored)


class _Orphan:
    __slots__ = ("alive", "event", "packed", "removed")

    def __init__(self, event: _Stored, packed: bytes) -> None:
        self.event = event
        self.packed = packed
        self.removed: set[int] = set()
        self.alive = True


class _Stream:
    __slots__ = (
        "bad_events",
        "batches",
        "block_size",
        "by_medium",
        "holders",
        "key",
        "last_log",
        "last_ts",
        "masks",
        "mismatches",
        "orphan_blocks",
        "orphan_queue",
        "orphans_held",
        "registered",
        "tombs",
        "tombs_old",
        "waiting",
    )

    def __init__(self, key: tuple[str, int], block_size: int | None, registered: bool) -> None:
        self.key = key
        self.block_size = block_size
        self.registered = registered
        self.holders: dict[str, _Holder] = {}
        self.by_medium: dict[str | None, _Holder] = {}
        self.masks: dict[int, int] = {}  # page -> bits of this stream's holders
        self.waiting: dict[int, list[_Orphan]] = {}
        self.orphan_blocks: dict[int, _Orphan] = {}
        self.orphan_queue: deque[_Orphan] = deque()
        self.orphans_held = 0
        # Engine hash -> our hash of recently removed blocks, in two generations so that
        # trimming is O(1): a child stored just after its parent was evicted still resolves.
        self.tombs = U64Map()
        self.tombs_old = U64Map()
        self.mismatches = 0
        self.bad_events = 0
        self.batches = 0
        self.last_ts: float | None = None
        self.last_log: float | None = None

    def resolve(self, engine_hash: int) -> int | None:
        """Our hash of an engine hash held (or recently removed) on any tier of the stream."""
        for holder in self.holders.values():
            ours = holder.engine.get(engine_hash)
            if ours is not None:
                return ours
        ours = self.tombs.get(engine_hash)
        return ours if ours is not None else self.tombs_old.get(engine_hash)


class _Counts:
    __slots__ = (
        "bad_events",
        "clears",
        "dropped",
        "duplicates",
        "mismatches",
        "orphaned",
        "placed",
        "removed",
        "resets",
        "stored",
        "unknown",
    )

    def __init__(self) -> None:
        self.stored = self.removed = self.duplicates = self.unknown = 0
        self.orphaned = self.placed = self.dropped = 0
        self.bad_events = self.mismatches = self.clears = self.resets = 0

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


def _packed_tokens(event: _Stored) -> bytes | None:
    """The event's tokens as packed uint32 LE, None when one is not an int in range."""
    if type(event) is PackedStored:
        return bt.pack_msgpack_tokens(event.token_ids)
    try:
        return pack_tokens(event.token_ids)
    except (OverflowError, TypeError):
        return None


def _tier_name(medium: str | None) -> str:
    return DEFAULT_TIER if medium is None else medium.upper()


def _ranks(ranks: int | Iterable[int]) -> list[int]:
    if isinstance(ranks, int):
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        return list(range(ranks))
    return sorted(set(ranks))


class PrefixIndex:
    """Which (worker, rank, tier) holds which block; longest-prefix queries.

    ``block_size`` is used for workers that neither register one nor have sent an event yet;
    otherwise a stream adopts the block size of its first store. ``max_orphan_blocks`` bounds
    the orphans held per stream (oldest dropped first, counted); ``tombstones`` bounds the
    recently removed blocks remembered per stream to resolve late children. ``clock`` and
    ``log_interval`` rate-limit the block-size mismatch error per stream.
    """

    def __init__(
        self,
        block_size: int | None = None,
        *,
        max_orphan_blocks: int = 65536,
        tombstones: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        log_interval: float = 30.0,
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._max_orphans = max_orphan_blocks
        self._tombstones = tombstones
        self._clock = clock
        self._log_interval = log_interval
        self._pages: list[bt.U64Map] = []
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._by_id: dict[int, _Holder] = {}
        self._free_ids: list[int] = []
        self._next_id = 0
        self._roots: dict[str | int, int] = {}
        self._sizes: dict[int, dict[int, int]] | None = None  # block size -> page -> mask
        self._c = _Counts()
        # ingest_payload's fast lane, unless a subclass changes what ingest does.
        self._lane = type(self).ingest is PrefixIndex.ingest
        self._lane_events = 0  # events the lane applied (for tests)

    # ----------------------------------------------------------------- workers and streams

    def register_worker(
        self, worker_id: str, *, block_size: int, ranks: int | Iterable[int] = 1
    ) -> None:
        """Declare a worker's ranks and block size; stores of another block size are refused.

        Re-registering a stream with a different block size drops what it held.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        for rank in _ranks(ranks):
            stream = self._streams.get((worker_id, rank))
            if stream is None:
                self._streams[(worker_id, rank)] = _Stream((worker_id, rank), block_size, True)
                continue
            if stream.block_size not in (None, block_size):
                self._drop_stream_state(stream)
            stream.block_size = block_size
            stream.registered = True
        self._sizes = None

    def remove_worker(self, worker_id: str, rank: int | None = None) -> None:
        """Forget a worker (or one rank of it) entirely: blocks, orphans, holder ids."""
        keys = [k for k in self._streams if k[0] == worker_id and rank in (None, k[1])]
        for key in keys:
            stream = self._streams.pop(key)
            self._drop_stream_state(stream)
            for holder in stream.holders.values():
                del self._by_id[holder.id]
                heapq.heappush(self._free_ids, holder.id)
        self._sizes = None

    def reset_stream(self, worker_id: str, rank: int) -> None:
        """Drop everything held for one stream (its publisher restarted or lost events)."""
        stream = self._streams.get((worker_id, rank))
        self._c.resets += 1
        if stream is not None:
            self._drop_stream_state(stream)

    def targets(self) -> list[tuple[str, int]]:
        """Every known (worker, rank) stream, in registration order."""
        return list(self._streams)

    def stream_block_size(self, worker_id: str, rank: int) -> int | None:
        """The block size of a stream (registered or adopted), None if unknown."""
        stream = self._streams.get((worker_id, rank))
        return None if stream is None else stream.block_size

    def _stream(self, worker_id: str, rank: int) -> _Stream:
        stream = self._streams.get((worker_id, rank))
        if stream is None:
            stream = _Stream((worker_id, rank), self.block_size, False)
            self._streams[(worker_id, rank)] = stream
        return stream

    def _holder(self, stream: _Stream, medium: str | None) -> _Holder:
        holder = stream.by_medium.get(medium)
        if holder is not None:
            return holder
        tier = _tier_name(medium)
        holder = stream.holders.get(tier)
        if holder is None:
            hid = heapq.heappop(self._free_ids) if self._free_ids else self._next_id
            self._next_id = max(self._next_id, hid + 1)
            page = hid >> _PAGE_SHIFT
            while len(self._pages) <= page:
                self._pages.append(U64Map())
            holder = _Holder(HolderKey(stream.key[0], stream.key[1], tier), hid, self._pages[page])
            self._by_id[hid] = holder
            stream.holders[tier] = holder
            stream.masks[page] = stream.masks.get(page, 0) | holder.bit
            self._sizes = None
        stream.by_medium[medium] = holder
        return holder

    def _drop_stream_state(self, stream: _Stream) -> None:
        for holder in stream.holders.values():
            bt.drop_holder(holder.table, holder.engine, holder.bit)
            holder.dups = {}
            holder.shared = {}
        self._c.dropped += stream.orphans_held
        stream.waiting = {}
        stream.orphan_blocks = {}
        stream.orphan_queue = deque()
        stream.orphans_held = 0
        stream.tombs = U64Map()
        stream.tombs_old = U64Map()

    # ----------------------------------------------------------------- applying events

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> ApplyResult:
        """Apply one batch of a (worker, rank) stream, in event order."""
        before = self._c.snapshot()
        self.ingest(worker_id, rank, batch)
        return ApplyResult._make(map(sub, self._c.snapshot(), before))

    def ingest(self, worker_id: str, rank: int, batch: KVEventBatch) -> None:
        """:meth:`apply` without the per-batch :class:`ApplyResult` (the feed's hot path;
        totals stay in :meth:`stats`). ``BlockStored`` events may be
        :class:`~kvevents.wire.PackedStored` (from :func:`~kvevents.wire.decode_batch_packed`).
        """
        stream = self._streams.get((worker_id, rank)) or self._stream(worker_id, rank)
        self._apply_events(stream, batch.events)
        stream.batches += 1
        stream.last_ts = batch.ts

    def _apply_events(self, stream: _Stream, events: Iterable[object]) -> None:
        for event in events:
            kind = type(event)
            if kind in _STORED_TYPES:
                self._store(stream, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(stream, event)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                self._drop_stream_state(stream)
                self._c.clears += 1

    def ingest_payload(
        self, worker_id: str, rank: int, payload: bytes, *, seq: int | None = None
    ) -> Applied:
        """Apply one batch payload as :meth:`ingest` would apply its decoded batch
        (:func:`~kvevents.wire.decode_batch_packed`); returns what a subscriber's stats need
        (the index service applies payloads this way, through ``SubscriberOptions.on_payload``).
        A payload that cannot be read raises ``DecodeError`` before anything changes.

        The block table's fast lane (:func:`kvevents.index.table.ingest_events`) reads the
        payload itself and applies its leading events while they are ones it is sure of
        (stores and removals of known holders, clears); the decoder and the Python path apply
        the rest, from the first event it left. A subclass that overrides :meth:`ingest`
        gets every batch through it, decoded, and no lane.
        """
        stream = self._streams.get((worker_id, rank)) if self._lane else None
        if stream is not None:
            done, count, ts, stored, removed, clears = _ingest_events(
                payload, stream, ROOT_SEED, self._tombstones
            )
            if done:
                c = self._c
                c.stored += stored
                c.removed += removed
                c.clears += clears
                self._lane_events += done
            if done == count:  # all of it (a heartbeat included): no decoding at all
                stream.batches += 1
                stream.last_ts = ts
                return Applied(ts, count, 0, clears > 0)
            if done:
                return self._ingest_rest(stream, payload, seq, done, clears > 0)
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        before = self._c.clears
        self.ingest(worker_id, rank, batch)
        cleared = self._c.clears != before
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def _ingest_rest(
        self, stream: _Stream, payload: bytes, seq: int | None, done: int, cleared: bool
    ) -> Applied:
        """Apply the events of a payload from index ``done`` on (the lane applied those
        before): decode it whole and skip the decoded events that came before ``done``."""
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        events: Sequence[object] = batch.events
        if decoded.skipped:  # decoded events by their index in the payload
            skipped = {s.index for s in decoded.skipped}
            left = [i for i in range(len(events) + len(skipped)) if i not in skipped]
            events = [e for e, i in zip(events, left, strict=True) if i >= done]
        else:
            events = events[done:]
        before = self._c.clears
        self._apply_events(stream, events)
        stream.batches += 1
        stream.last_ts = batch.ts
        cleared = cleared or self._c.clears != before
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def _store(self, stream: _Stream, event: _Stored) -> None:
        size = stream.block_size
        if event.block_size != size:
            if size is not None:
                self._mismatch(stream, event)
                return
            if event.block_size <= 0:
                self._bad(stream, event, "block_size must be positive")
                return
            stream.block_size = size = event.block_size
            self._sizes = None
        hashes = event.block_hashes
        if not hashes:
            return
        if type(event) is PackedStored:
            packed = _pack_msgpack(event.token_ids)
        else:
            packed = _packed_tokens(event)
        if packed is None:
            self._bad(stream, event, "token_ids is not an array of ints in 0..2**32-1")
            return
        if len(packed) != 4 * size * len(hashes):
            self._bad(stream, event, "token_ids length is not block_size * len(block_hashes)")
            return
        holder = stream.by_medium.get(event.medium) or self._holder(stream, event.medium)
        parent = event.parent_block_hash
        if parent is None:
            seed = self._root(event)
        else:  # the parent is most often on the same tier: look there first
            found = holder.engine.get(parent)
            if found is None:
                found = stream.resolve(parent)
                if found is None:
                    self._hold_orphan(stream, event, packed)
                    return
            seed = found
        self._add(holder, hashes, chain_hashes(packed, size, seed))
        if stream.waiting:
            self._place_waiting(stream, hashes)

    def _root(self, event: _Stored) -> int:
        lora = event.lora_name if event.lora_name is not None else event.lora_id
        if lora is None:
            return ROOT_SEED
        seed = self._roots.get(lora)
        if seed is None:
            seed = self._roots[lora] = root_seed(lora)
        return seed

    def _add(self, holder: _Holder, hashes: Sequence[int], ours: Sequence[int]) -> None:
        self._c.stored += len(hashes)
        # Fast path, one C call: none of these engine hashes is held by this holder yet.
        shared = bt.store_chain(holder.table, holder.engine, holder.bit, hashes, ours)
        if shared is None:
            self._add_each(holder, hashes, ours)
        elif shared:
            self._share(holder, shared)

    @staticmethod
    def _share(holder: _Holder, shared: Iterable[int]) -> None:
        # The holder already has these tokens under another engine hash: count the extra.
        counts = holder.shared
        for oh in shared:
            counts[oh] = counts.get(oh, 0) + 1

    def _mark(self, holder: _Holder, ours: Sequence[int]) -> None:
        blocks = holder.table
        bit = holder.bit
        shared = []
        for oh in ours:
            mask = blocks.get(oh)
            if mask is None:
                blocks[oh] = bit
            elif mask & bit:
                shared.append(oh)
            else:
                blocks[oh] = mask | bit
        self._share(holder, shared)

    def _add_each(self, holder: _Holder, hashes: Sequence[int], ours: Sequence[int]) -> None:
        engine = holder.engine
        fresh: list[int] = []
        for eh, oh in zip(hashes, ours, strict=True):
            prev = engine.get(eh)
            if prev is None:
                engine[eh] = oh
                fresh.append(oh)
            else:
                holder.dups[eh] = holder.dups.get(eh, 0) + 1
                self._c.duplicates += 1
        self._mark(holder, fresh)

    def _remove(self, stream: _Stream, event: BlockRemoved) -> None:
        holder = stream.by_medium.get(event.medium)
        if holder is None:
            holder = stream.holders.get(_tier_name(event.medium))
        hashes = event.block_hashes
        if holder is None:
            unknown_before = self._c.unknown
            for eh in hashes:
                self._remove_unknown(stream, eh)
            self._c.removed += len(hashes) - (self._c.unknown - unknown_before)
            return
        engine = holder.engine
        bit = holder.bit
        tombs = stream.tombs
        unknown_before = self._c.unknown
        if not holder.dups and not holder.shared:  # no reference counts: one C call
            for eh in bt.remove_blocks(holder.table, engine, tombs, bit, hashes):
                self._remove_unknown(stream, eh)
            self._c.removed += len(hashes) - (self._c.unknown - unknown_before)
            if len(tombs) > self._tombstones:
                stream.tombs_old, stream.tombs = tombs, U64Map()
            return
        blocks = holder.table
        for eh in hashes:
            oh = engine.pop(eh, None)
            if oh is None:
                self._remove_unknown(stream, eh)
                continue
            if holder.dups and self._unref(holder.dups, eh):
                engine[eh] = oh
                continue
            tombs[eh] = oh
            if holder.shared and self._unref(holder.shared, oh):
                continue
            mask = blocks[oh] ^ bit
            if mask:
                blocks[oh] = mask
            else:
                del blocks[oh]
        self._c.removed += len(hashes) - (self._c.unknown - unknown_before)
        if len(tombs) > self._tombstones:
            stream.tombs_old, stream.tombs = tombs, U64Map()

    @staticmethod
    def _unref(counts: dict[int, int], key: int) -> bool:
        count = counts.get(key)
        if not count:
            return False
        if count == 1:
            del counts[key]
        else:
            counts[key] = count - 1
        return True

    def _remove_unknown(self, stream: _Stream, engine_hash: int) -> None:
        orphan = stream.orphan_blocks.get(engine_hash)
        if orphan is not None and engine_hash not in orphan.removed:
            orphan.removed.add(engine_hash)
            return
        self._c.unknown += 1

    def _bad(self, stream: _Stream, event: _Stored, reason: str) -> None:
        stream.bad_events += 1
        self._c.bad_events += 1
        log.debug("worker %s rank %d: store skipped: %s", stream.key[0], stream.key[1], reason)

    def _mismatch(self, stream: _Stream, event: _Stored) -> None:
        stream.mismatches += 1
        self._c.mismatches += 1
        now = self._clock()
        if stream.last_log is not None and now - stream.last_log < self._log_interval:
            return
        stream.last_log = now
        log.error(
            "worker %s rank %d: BlockStored with block_size %d but the stream's block_size is "
            "%s; %d store event(s) skipped so far. Register the worker with the engine's "
            "block size.",
            stream.key[0],
            stream.key[1],
            event.block_size,
            stream.block_size,
            stream.mismatches,
        )

    # ----------------------------------------------------------------- orphans

    def _hold_orphan(self, stream: _Stream, event: _Stored, packed: bytes) -> None:
        assert event.parent_block_hash is not None
        orphan = _Orphan(event, packed)
        stream.waiting.setdefault(event.parent_block_hash, []).append(orphan)
        for eh in event.block_hashes:
            stream.orphan_blocks[eh] = orphan
        stream.orphan_queue.append(orphan)
        stream.orphans_held += len(event.block_hashes)
        self._c.orphaned += len(event.block_hashes)
        while stream.orphans_held > self._max_orphans:
            self._drop_oldest_orphan(stream)

    def _drop_oldest_orphan(self, stream: _Stream) -> None:
        orphan = stream.orphan_queue.popleft()
        if not orphan.alive:
            return
        self._forget_orphan(stream, orphan)
        self._c.dropped += len(orphan.event.block_hashes)
        parent = orphan.event.parent_block_hash
        siblings = stream.waiting.get(parent) if parent is not None else None
        if siblings is not None:
            siblings.remove(orphan)
            if not siblings:
                del stream.waiting[parent]  # type: ignore[arg-type]

    def _forget_orphan(self, stream: _Stream, orphan: _Orphan) -> None:
        orphan.alive = False
        stream.orphans_held -= len(orphan.event.block_hashes)
        for eh in orphan.event.block_hashes:
            if stream.orphan_blocks.get(eh) is orphan:
                del stream.orphan_blocks[eh]
        if len(stream.orphan_queue) > 2 * len(stream.orphan_blocks) + 64:
            stream.orphan_queue = deque(o for o in stream.orphan_queue if o.alive)

    def _place_waiting(self, stream: _Stream, hashes: Sequence[int]) -> None:
        # A worklist, not recursion: chains of orphans can be arbitrarily long.
        pending = [hashes]
        while pending and stream.waiting:
            for eh in pending.pop():
                for orphan in stream.waiting.pop(eh, ()):
                    if orphan.alive:
                        self._place(stream, orphan)
                        pending.append(orphan.event.block_hashes)

    def _place(self, stream: _Stream, orphan: _Orphan) -> None:
        self._forget_orphan(stream, orphan)
        event = orphan.event
        assert event.parent_block_hash is not None and stream.block_size is not None
        seed = stream.resolve(event.parent_block_hash)
        assert seed is not None
        ours = chain_hashes(orphan.packed, stream.block_size, seed)
        hashes = event.block_hashes
        if orphan.removed:
            # Blocks removed while held are not placed, but still chain their children: held
            # children resolve them through the tombstones, as if stored and then removed.
            kept = []
            for eh, oh in zip(hashes, ours, strict=True):
                if eh in orphan.removed:
                    stream.tombs[eh] = oh
                else:
                    kept.append((eh, oh))
            hashes, ours = [eh for eh, _ in kept], [oh for _, oh in kept]
            self._c.stored += len(orphan.removed)
            if len(stream.tombs) > self._tombstones:
                stream.tombs_old, stream.tombs = stream.tombs, U64Map()
        self._add(self._holder(stream, event.medium), hashes, ours)
        self._c.placed += len(event.block_hashes)

    # ----------------------------------------------------------------- queries

    def match(self, token_ids: Sequence[int], *, lora: str | int | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` per holder and per (worker, rank)."""
        return self.match_packed(pack_tokens(token_ids), lora=lora)

    def match_packed(self, packed: bytes, *, lora: str | int | None = None) -> MatchResult:
        """:meth:`match` for tokens already packed as uint32 little-endian bytes
        (:func:`kvevents.index.keys.pack_tokens`), e.g. straight from a request body."""
        sizes = self._block_sizes()
        seed = root_seed(lora)
        holders: dict[HolderKey, int] = {}
        streams: dict[tuple[str, int], int] = {}
        request_blocks: dict[int, int] = {}
        for size, masks in sizes.items():
            hashes = chain_hashes(packed, size, seed)
            request_blocks[size] = len(hashes)
            self._walk(hashes, masks, holders, streams)
        return MatchResult(len(packed) // 4, request_blocks, holders, streams)

    def match_hashes(self, hashes: Sequence[int], *, block_size: int | None = None) -> MatchResult:
        """Like :meth:`match` with precomputed block hashes (:func:`tokenhash.block_hashes`).

        ``block_size`` selects the streams the hashes apply to; by default the index's own
        block size, or the only one in use.
        """
        sizes = self._block_sizes()
        size = block_size if block_size is not None else self.block_size
        if size is None:
            if len(sizes) > 1:
                raise ValueError(f"streams use block sizes {sorted(sizes)}: pass block_size")
            size = next(iter(sizes), 0)
        holders: dict[HolderKey, int] = {}
        streams: dict[tuple[str, int], int] = {}
        if size in sizes:
            self._walk(hashes, sizes[size], holders, streams)
        return MatchResult(len(hashes) * size, {size: len(hashes)}, holders, streams)

    def _block_sizes(self) -> dict[int, dict[int, int]]:
        if self._sizes is not None:
            return self._sizes
        sizes: dict[int, dict[int, int]] = {}
        for stream in self._streams.values():
            if stream.block_size is not None:
                pages = sizes.setdefault(stream.block_size, {})
                for page, mask in stream.masks.items():
                    pages[page] = pages.get(page, 0) | mask
        self._sizes = sizes
        return sizes

    def _walk(
        self,
        hashes: Sequence[int],
        masks: dict[int, int],
        holders: dict[HolderKey, int],
        streams: dict[tuple[str, int], int],
    ) -> None:
        for page, allowed in masks.items():
            for bits, depth in bt.walk(self._pages[page], hashes, allowed):
                self._record(page, bits, depth, holders)
        self._stream_prefixes(hashes, holders, streams)

    def _record(self, page: int, bits: int, depth: int, out: dict[HolderKey, int]) -> None:
        by_id = self._by_id
        base = page << _PAGE_SHIFT
        while bits:
            low = bits & -bits
            out[by_id[base + low.bit_length() - 1].key] = depth
            bits ^= low

    def _stream_prefixes(
        self,
        hashes: Sequence[int],
        holders: dict[HolderKey, int],
        streams: dict[tuple[str, int], int],
    ) -> None:
        for key, depth in holders.items():
            skey = (key.worker_id, key.rank)
            if streams.get(skey, 0) < depth:
                streams[skey] = depth
        pages = self._pages
        for skey, depth in list(streams.items()):
            stream = self._streams[skey]
            if len(stream.holders) < 2:
                continue
            # Blocks of one prefix may sit on different tiers (GPU then CPU): walk the union.
            if len(stream.masks) == 1:
                [(page, mask)] = stream.masks.items()
                streams[skey] = bt.extend(pages[page], hashes, depth, mask)
                continue
            while depth < len(hashes) and any(
                pages[page].get(hashes[depth], 0) & mask for page, mask in stream.masks.items()
            ):
                depth += 1
            streams[skey] = depth

    # ----------------------------------------------------------------- inspection

    def stats(self) -> IndexStats:
        """A frozen record of totals and sizes (``bytes_estimate`` is O(holders))."""
        c = self._c
        holders = list(self._by_id.values())
        entries = sum(len(h.engine) for h in holders)
        return IndexStats(
            streams=len(self._streams),
            holders=len(holders),
            blocks=sum(len(page) for page in self._pages),
            entries=entries,
            stored_blocks=c.stored,
            removed_blocks=c.removed,
            duplicate_stores=c.duplicates,
            unknown_removals=c.unknown,
            orphans_held=sum(s.orphans_held for s in self._streams.values()),
            orphans_placed=c.placed,
            orphans_dropped=c.dropped,
            block_size_mismatches=c.mismatches,
            bad_events=c.bad_events,
            clears=c.clears,
            stream_resets=c.resets,
            bytes_estimate=self._bytes_estimate(holders),
        )

    def _bytes_estimate(self, holders: list[_Holder]) -> int:
        size = sum(page.nbytes for page in self._pages)
        for holder in holders:
            size += holder.engine.nbytes + sys.getsizeof(holder.dups)
            size += sys.getsizeof(holder.shared)
        for stream in self._streams.values():
            size += stream.tombs.nbytes + stream.tombs_old.nbytes
        return size

    def streams(self) -> list[StreamInfo]:
        """Every known stream with its per-tier block counts and error counters."""
        return [
            StreamInfo(
                worker_id=s.key[0],
                rank=s.key[1],
                block_size=s.block_size,
                registered=s.registered,
                tiers={tier: len(h.engine) for tier, h in s.holders.items()},
                orphans_held=s.orphans_held,
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

    def holders_of(self, block_hash: int) -> list[HolderKey]:
        """Holders of one block, by our hash."""
        out: dict[HolderKey, int] = {}
        for page, table in enumerate(self._pages):
            self._record(page, table.get(block_hash, 0), 0, out)
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

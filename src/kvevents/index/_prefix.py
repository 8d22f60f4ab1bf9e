"""The prefix index: which worker, rank and tier holds which prefix of tokens.

Blocks are keyed by our own chained hash of their tokens (:mod:`kvevents.index._keys`), so the
blocks of every engine agree whatever hash the engine uses. The engine's hash is kept per
holder only to resolve parents and removals. Storage is in :mod:`kvevents.index._holders`,
held orphans in :mod:`kvevents.index._orphans`, the query walk in :mod:`kvevents.index._query`;
every rule is written once, in Python, over table primitives (:mod:`kvevents.index._table`).

Rules (each has its own test): duplicate stores and removals are reference counted per holder
(on a stream in ``"full"`` report mode a repeated store is the same block announced again);
a removal of an unknown block is counted and harmless; ``AllBlocksCleared`` drops the stream's
blocks; a store whose parent is unknown is held as an orphan (bounded, counted) and placed
exactly once when its parent arrives, never re-rooted at token 0; a ``block_size`` different
from the stream's is a loud error and a counter, and the event is not applied; a store whose
``token_ids`` length is not ``block_size * len(block_hashes)`` is skipped and counted.

A store is applied in two steps: first its blocks' keys are read from the event, once
(:func:`kvevents.index._tokens.key_store`: tokens in every engine's form, salt, LoRA,
multimodal extras, lookahead), then they are placed (:meth:`PrefixIndex._place_store`: the
parent resolved, the holder's tables, orphans, a hybrid model's windowed and Mamba groups,
which are followed apart: :mod:`kvevents.index._groups`). A batch payload is applied by
:meth:`PrefixIndex.ingest_payload`, decoded outside the caller's lock: the index service's
only way in.

The index is not thread-safe: one writer at a time (the service holds a lock).
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

from kvevents.errors import StreamNotRegistered
from kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    PackedStored,
    StreamKey,
)
from kvevents.index import _query as query
from kvevents.index import _table as bt
from kvevents.index._extras import no_tokens
from kvevents.index._groups import WHOLE_PREFIX, TailGroup, tail_need
from kvevents.index._holders import PAGE_SHIFT, Holder, Stream, tier_name
from kvevents.index._keys import (
    Extras,
    MMSpan,
    digest_blocks,
    merge_extras,
    pack_tokens,
    request_extras,
    root_seed,
    split_digests,
)
from kvevents.index._orphans import Orphan
from kvevents.index._records import (
    DEFAULT_TIER,
    ApplyResult,
    Counts,
    HolderKey,
    IndexStats,
    MatchResult,
    ReportMode,
    Stored,
    StreamInfo,
)
from kvevents.index._tokens import StoreKeys, Unkeyable, key_store
from kvevents.ratelimit import RateLimitedWarning
from kvevents.wire import Applied, decode_batch_packed

__all__ = [
    "DEFAULT_TIER",
    "ApplyResult",
    "HolderKey",
    "IndexStats",
    "MatchResult",
    "PrefixIndex",
    "ReportMode",
    "StreamInfo",
]

log = logging.getLogger("kvevents.index.prefix")

# The feed's hot path calls it once per store: a module global, not an attribute lookup.
_store_run = bt.store_run


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
        self._log_mismatch = RateLimitedWarning(log, log_interval, clock, level=logging.ERROR)
        self._pages: list[bt.U64Map] = []
        self._streams: dict[StreamKey, Stream] = {}
        self._by_id: dict[int, Holder] = {}
        self._free_ids: list[int] = []
        self._next_id = 0
        self._roots: dict[str | int, int] = {}
        # (block size, lookahead tokens) -> page -> mask of the streams keyed that way
        self._sizes: dict[tuple[int, int], dict[int, int]] | None = None
        self._c = Counts()

    # ----------------------------------------------------------------- workers and streams

    def register_worker(
        self,
        worker_id: str,
        *,
        block_size: int,
        ranks: int | Iterable[int] = 1,
        report_mode: ReportMode = "incremental",
    ) -> None:
        """Declare a worker's ranks and block size; stores of another block size are refused.

        ``report_mode`` says what a second store of a held block means (:data:`ReportMode`):
        ``"full"`` for a vLLM engine whose requests use ``kv_cache_report_mode="full"``.
        Re-registering a stream with a different block size drops what it held.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if report_mode not in ("incremental", "full"):
            raise ValueError(f"report_mode must be 'incremental' or 'full', got {report_mode!r}")
        for rank in _ranks(ranks):
            stream = self._stream(worker_id, rank, block_size)
            if stream.block_size not in (None, block_size):
                self._drop_stream_state(stream)
            stream.block_size = block_size
            stream.registered = True
            stream.refreshes = report_mode == "full"
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
        self._c.stream_resets += 1
        if stream is not None:
            self._drop_stream_state(stream)

    def targets(self) -> list[StreamKey]:
        """Every known (worker, rank) stream, in registration order."""
        return list(self._streams)

    def stream_block_size(self, worker_id: str, rank: int) -> int | None:
        """The block size of a stream (registered or adopted), None if unknown."""
        stream = self._streams.get((worker_id, rank))
        return None if stream is None else stream.block_size

    def _stream(self, worker_id: str, rank: int, block_size: int | None = None) -> Stream:
        stream = self._streams.get((worker_id, rank))
        if stream is None:
            registered = block_size is not None
            size = block_size if registered else self.block_size
            stream = Stream((worker_id, rank), size, registered, self._tombstones)
            self._streams[(worker_id, rank)] = stream
        return stream

    def _holder(self, stream: Stream, medium: str | None) -> Holder:
        holder = stream.by_medium.get(medium)
        if holder is not None:
            return holder
        tier = tier_name(medium)
        holder = stream.holders.get(tier)
        if holder is None:
            holder = self._new_holder(stream, tier)
        stream.by_medium[medium] = holder
        return holder

    def _new_holder(self, stream: Stream, tier: str) -> Holder:
        hid = heapq.heappop(self._free_ids) if self._free_ids else self._next_id
        self._next_id = max(self._next_id, hid + 1)
        page = hid >> PAGE_SHIFT
        while len(self._pages) <= page:
            self._pages.append(bt.U64Map())
        holder = Holder(HolderKey(stream.key[0], stream.key[1], tier), hid, self._pages[page])
        self._by_id[hid] = holder
        stream.holders[tier] = holder
        stream.masks[page] = stream.masks.get(page, 0) | holder.bit
        self._sizes = None
        return holder

    def _drop_stream_state(self, stream: Stream) -> None:
        self._c.orphans_dropped += stream.drop_state()

    # ----------------------------------------------------------------- applying events

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> ApplyResult:
        """Apply one batch of a (worker, rank) stream, in event order."""
        before = copy.copy(self._c)
        self.ingest(worker_id, rank, batch)
        return self._c.since(before)

    def ingest(self, worker_id: str, rank: int, batch: KVEventBatch) -> bool:
        """:meth:`apply` without the per-batch :class:`ApplyResult` (the feed's hot path;
        totals stay in :meth:`stats`); True when the batch cleared the stream (an
        ``AllBlocksCleared``). ``BlockStored`` events may be
        :class:`~kvevents.wire.PackedStored` (from :func:`~kvevents.wire.decode_batch_packed`).
        """
        stream = self._streams.get((worker_id, rank)) or self._stream(worker_id, rank)
        cleared = False
        for event in batch.events:
            kind: type = type(event)  # PackedStored too, which the batch type does not name
            # Dispatch on the exact type (faster than isinstance on the hot path), which mypy
            # does not narrow by.
            if kind is PackedStored or kind is BlockStored:
                self._store(stream, event)  # type: ignore[arg-type]  # kind: a store
            elif kind is BlockRemoved:
                self._remove(stream, event)  # type: ignore[arg-type]  # kind: a removal
            elif kind is AllBlocksCleared:
                self._drop_stream_state(stream)
                self._c.clears += 1
                cleared = True
        stream.batches += 1
        stream.last_ts = batch.ts
        return cleared

    def ingest_payload(
        self,
        worker_id: str,
        rank: int,
        payload: bytes,
        *,
        seq: int | None = None,
        hold: AbstractContextManager[object] | None = None,
        registered_only: bool = False,
    ) -> Applied:
        """Apply one batch payload: :func:`~kvevents.wire.decode_batch_packed`, then
        :meth:`ingest`; returns what a feed's stats need. The index service's only way to
        apply a batch (as the :class:`~kvevents.subscribe.Sink` of its feed).

        The payload is decoded first, outside ``hold`` (the caller's lock, taken around the
        apply alone), so readers never wait on a decode however large or hostile the payload.
        A payload that cannot be read raises ``DecodeError`` before anything changes. With
        ``registered_only``, a batch of a stream not registered with :meth:`register_worker`
        (or removed since) raises :class:`~kvevents.errors.StreamNotRegistered` and changes
        nothing, checked under ``hold``.
        """
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        cleared: bool | None
        if hold is None and not registered_only:
            cleared = self.ingest(worker_id, rank, batch)
        else:  # the service's path, once per batch: inline
            with hold if hold is not None else contextlib.nullcontext():
                stream = self._streams.get((worker_id, rank))
                if registered_only and (stream is None or not stream.registered):
                    cleared = None  # not applied: it would make the stream up again
                else:
                    cleared = self.ingest(worker_id, rank, batch)
        if cleared is None:
            applied = Applied(batch.ts, len(batch.events), decoded.skipped_count)
            raise StreamNotRegistered(worker_id=worker_id, rank=rank, applied=applied)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def _store(self, stream: Stream, event: Stored) -> None:
        """A store in two steps: its keys read once (:func:`key_store`), then placed."""
        kind = event.kv_cache_spec_kind  # nearly every store: no group, or a whole-prefix one
        tail = (
            self._tail_group(stream, event)
            if (kind and kind not in WHOLE_PREFIX) or stream.tails
            else None
        )
        if tail is not None:
            self._c.group_events += 1
            if event.block_size != stream.block_size:
                return  # a group of another block size is not followed (counted only)
        elif event.block_size != stream.block_size and not self._other_size(stream, event):
            return
        if not event.block_hashes:
            return
        try:
            keys = key_store(event, self._roots)
        except Unkeyable as exc:
            self._bad(stream, str(exc))
            return
        if tail is not None:
            self._place_in_group(stream, tail, event, keys)
        else:
            self._place_store(stream, event, keys)

    def _remove(self, stream: Stream, event: BlockRemoved) -> None:
        hashes = event.block_hashes
        stream.removed += len(hashes)
        if stream.tails and (tail := stream.tails.get(event.group_idx)) is not None:
            missed = tail.remove(hashes)
            self._c.group_events += 1
            self._c.unknown_removals += missed
            self._c.removed_blocks += len(hashes) - missed
            return
        holder = stream.holder_of(event.medium)
        unknown = hashes if holder is None else holder.remove(hashes, stream.tombs)
        if unknown and stream.partials:  # a partial block grown full, a placeholder gone
            unknown = stream.known_partials(list(unknown))
        claimed = sum(1 for eh in unknown if stream.orphans.claim_removal(eh)) if unknown else 0
        self._c.unknown_removals += len(unknown) - claimed
        self._c.removed_blocks += len(hashes) - len(unknown) + claimed
        stream.tombs.settle()

    # ----------------------------------------------------------------- placing a store

    def _place_store(self, stream: Stream, event: Stored, keys: StoreKeys) -> None:
        """The second step: the parent's key resolved, the blocks placed in their holder's
        tables (or held as an orphan), then the orphans waiting for them."""
        after = keys.after  # the hot path reads fields, not properties
        if after is not None:
            self._note_lookahead(stream, len(after) // 4)
        hashes = event.block_hashes
        holder = stream.by_medium.get(event.medium) or self._holder(stream, event.medium)
        parent = event.parent_block_hash
        if parent is None:
            seed = keys.root
        else:  # the parent is most often on the same tier: look there first
            found = holder.engine.get(parent)
            if found is None:
                found = stream.resolve(parent)
                if found is None:
                    self._c.orphaned_blocks += len(hashes)
                    self._c.orphans_dropped += stream.orphans.hold(event, keys, self._max_orphans)
                    return
            seed = found
        self._c.stored_blocks += len(hashes)
        if after is not None or keys.extras is not None:  # not plain: keyed here, then placed
            self._held_again(stream, holder.add(hashes, keys.chain(seed), refresh=stream.refreshes))
        else:  # the hot path: keys chained and placed by one table call
            shared = _store_run(
                holder.table, holder.engine, holder.bit, hashes, keys.packed, keys.block_size, seed
            )
            if shared is None:  # some engine hash is held already: the reference-counted way
                ours = keys.chain(seed)
                self._held_again(stream, holder.add(hashes, ours, refresh=stream.refreshes))
            elif shared:
                holder.share(shared)
        if stream.orphans.waiting:
            self._place_waiting(stream, hashes)

    def _place_waiting(self, stream: Stream, hashes: Sequence[int]) -> None:
        # A worklist, not recursion: chains of orphans can be arbitrarily long.
        pending = [hashes]
        while pending and stream.orphans.waiting:
            for orphan in stream.orphans.release(pending.pop()):
                self._place_orphan(stream, orphan)
                pending.append(orphan.event.block_hashes)

    def _place_orphan(self, stream: Stream, orphan: Orphan) -> None:
        """An orphan whose parent arrived: its keys chained from the parent's (read when it
        was held), its blocks placed but those removed while it was held."""
        event = orphan.event
        assert event.parent_block_hash is not None
        seed = stream.resolve(event.parent_block_hash)
        assert seed is not None
        hashes: Sequence[int] = event.block_hashes
        ours = orphan.keys.chain(seed)
        self._c.orphans_placed += len(hashes)
        self._c.stored_blocks += len(hashes)
        if orphan.removed:
            # Blocks removed while held are not placed, but still chain their children: held
            # children resolve them through the tombstones, as if stored and then removed.
            kept = [i for i, eh in enumerate(hashes) if eh not in orphan.removed]
            for eh, oh in zip(hashes, ours, strict=True):
                if eh in orphan.removed:
                    stream.tombs.recent[eh] = oh
            stream.tombs.settle()
            hashes, ours = [hashes[i] for i in kept], [ours[i] for i in kept]
        holder = self._holder(stream, event.medium)
        self._held_again(stream, holder.add(hashes, ours, refresh=stream.refreshes))

    def _held_again(self, stream: Stream, blocks: int) -> None:
        """Count stores of blocks their holder had: refreshes or second references."""
        if stream.refreshes:
            self._c.refreshed_stores += blocks
        else:
            self._c.duplicate_stores += blocks

    def _tail_group(self, stream: Stream, event: Stored) -> TailGroup | None:
        """The windowed or Mamba group a store is of (followed apart: groups.py), None for a
        store of the block tables."""
        kind = event.kv_cache_spec_kind
        group, size = event.group_idx, stream.block_size
        tail = stream.tails.get(group)
        if tail is None:
            if not isinstance(kind, str) or not isinstance(group, int) or size is None:
                return None
            need = tail_need(kind, event.kv_cache_spec_sliding_window, size)
            if need is None:
                return None
            tail = stream.tails[group] = TailGroup(need)
        return tail

    def _place_in_group(
        self, stream: Stream, tail: TailGroup, event: Stored, keys: StoreKeys
    ) -> None:
        """A group's store: its keys chained from its parent's, in the group or the tables."""
        parent = event.parent_block_hash
        seed = keys.root if parent is None else tail.engine.get(parent)
        seed = stream.resolve(parent) if seed is None and parent is not None else seed
        if seed is not None:  # else its chain is unknown: the group's check fails, an under-match
            tail.add(event.block_hashes, keys.chain(seed), stream.refreshes)

    # ----------------------------------------------------------------- stores refused

    def _note_lookahead(self, stream: Stream, tokens: int) -> None:
        """A store's blocks cover ``tokens`` after them: queries of the stream must too."""
        if stream.lookahead != tokens:
            stream.lookahead = tokens
            self._sizes = None

    def _other_size(self, stream: Stream, event: Stored) -> bool:
        """Whether a store of another block size than the stream's may go on. Partial and
        placeholder stores are legitimate traffic with nothing to key: counted, not logged."""
        size, limit = event.block_size, stream.block_size
        if (size == 0 and no_tokens(event)) or (
            limit is not None and 0 < size < limit and len(event.block_hashes) == 1
        ):
            self._c.partial_stores += 1
            stream.note_partials(event.block_hashes)
            return False
        return self._adopt(stream, event)

    def _adopt(self, stream: Stream, event: Stored) -> bool:
        """Whether a store of another block size than the stream's may go on: only the first
        store of a stream with none sets it; any other is counted (and logged)."""
        if stream.block_size is not None:
            self._mismatch(stream, event)
            return False
        if event.block_size <= 0:
            self._bad(stream, "block_size must be positive")
            return False
        stream.block_size = event.block_size
        self._sizes = None
        return True

    def _bad(self, stream: Stream, reason: str) -> None:
        stream.bad_events += 1
        self._c.bad_events += 1
        log.debug("worker %s rank %d: store skipped: %s", stream.key[0], stream.key[1], reason)

    def _mismatch(self, stream: Stream, event: Stored) -> None:
        stream.mismatches += 1
        self._c.block_size_mismatches += 1
        self._log_mismatch(
            f"{stream.key[0]}\0{stream.key[1]}",
            "worker %s rank %d: BlockStored with block_size %d but the stream's block_size is "
            "%s; %d store event(s) skipped so far. Register the worker with the engine's "
            "block size.",
            stream.key[0],
            stream.key[1],
            event.block_size,
            stream.block_size,
            stream.mismatches,
        )

    # ----------------------------------------------------------------- queries

    def match(
        self,
        token_ids: Sequence[int | str],
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMSpan] = (),
    ) -> MatchResult:
        """Longest cached prefix of ``token_ids`` per holder and per (worker, rank).

        ``cache_salt`` and ``mm`` (the request's multimodal items) enter the keys as the
        engine's own do (:func:`kvevents.index._keys.request_extras`): a request matches only
        blocks stored with the same salt and items, and an unsalted one no salted block. A str
        token is a multimodal digest where the item's tokens are (TensorRT-LLM's form).
        """
        digests: list[tuple[int, str]] = []
        try:
            packed = pack_tokens(token_ids)  # type: ignore[arg-type]  # a str raises TypeError
        except TypeError:  # digest tokens: rare, so the plain case pays nothing for them
            ints, digests = split_digests(token_ids)
            packed = pack_tokens(ints)
        return self.match_packed(packed, lora=lora, cache_salt=cache_salt, mm=mm, digests=digests)

    def match_packed(
        self,
        packed: bytes,
        *,
        lora: str | int | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMSpan] = (),
        digests: Sequence[tuple[int, str]] = (),
    ) -> MatchResult:
        """:meth:`match` for tokens already packed as uint32 little-endian bytes
        (:func:`kvevents.index.pack_tokens`), e.g. straight from a request body;
        ``digests`` are the ``(position, digest)`` of digest tokens (0 in ``packed``)."""

        def extras_of(blocks: int, size: int) -> list[Extras] | None:
            extras = request_extras(blocks, size, cache_salt, mm) if cache_salt or mm else None
            if digests:
                extras = merge_extras(extras, digest_blocks(digests, blocks, size))
            return extras

        tokens = len(packed) // 4
        holders, streams, request_blocks = query.match_all(
            (self._pages, self._by_id, self._streams),
            self._block_sizes(),
            packed,
            root_seed(lora),
            extras_of,
        )
        return MatchResult(tokens, request_blocks, holders, streams)

    def match_hashes(self, hashes: Sequence[int], *, block_size: int | None = None) -> MatchResult:
        """Like :meth:`match` with precomputed block hashes (:func:`tokenhash.block_hashes`).

        ``block_size`` selects the streams the hashes apply to; by default the index's own
        block size, or the only one in use. Streams keyed with lookahead are not matched
        (plain block hashes cannot name their blocks).
        """
        sizes = {size for size, _ in self._block_sizes()}
        size = block_size if block_size is not None else self.block_size
        if size is None:
            if len(sizes) > 1:
                raise ValueError(f"streams use block sizes {sorted(sizes)}: pass block_size")
            size = next(iter(sizes), 0)
        masks = self._block_sizes().get((size, 0))
        if masks is None:
            return MatchResult(len(hashes) * size, {size: len(hashes)})
        found, prefixes = query.walk(self._pages, self._by_id, self._streams, hashes, masks)
        return MatchResult(len(hashes) * size, {size: len(hashes)}, found, prefixes)

    def _block_sizes(self) -> dict[tuple[int, int], dict[int, int]]:
        if self._sizes is not None:
            return self._sizes
        sizes: dict[tuple[int, int], dict[int, int]] = {}
        for stream in self._streams.values():
            if stream.block_size is not None:
                pages = sizes.setdefault((stream.block_size, stream.lookahead), {})
                for page, mask in stream.masks.items():
                    pages[page] = pages.get(page, 0) | mask
        self._sizes = sizes
        return sizes

    # ----------------------------------------------------------------- views

    def stats(self) -> IndexStats:
        """A frozen record of totals and sizes (``memory_bytes`` is O(holders))."""
        c = self._c
        holders = list(self._by_id.values())
        return IndexStats(
            streams=len(self._streams),
            holders=len(holders),
            blocks=sum(len(page) for page in self._pages),
            entries=sum(len(h.engine) for h in holders),
            stored_blocks=c.stored_blocks,
            removed_blocks=c.removed_blocks,
            duplicate_stores=c.duplicate_stores,
            unknown_removals=c.unknown_removals,
            orphans_held=sum(s.orphans.held for s in self._streams.values()),
            orphans_placed=c.orphans_placed,
            orphans_dropped=c.orphans_dropped,
            block_size_mismatches=c.block_size_mismatches,
            bad_events=c.bad_events,
            clears=c.clears,
            stream_resets=c.stream_resets,
            partial_stores=c.partial_stores,
            memory_bytes=self._memory_bytes(holders),
            refreshed_stores=c.refreshed_stores,
            group_events=c.group_events,
            orphaned_blocks=c.orphaned_blocks,
        )

    def _memory_bytes(self, holders: list[Holder]) -> int:
        size = sum(page.nbytes for page in self._pages)
        for holder in holders:
            size += holder.engine.nbytes + sys.getsizeof(holder.dups)
            size += sys.getsizeof(holder.shared)
        return size + sum(stream.tombs.nbytes for stream in self._streams.values())

    def removed_blocks(self, worker_id: str, rank: int) -> int:
        """How many blocks the stream's engine has announced removed (evicted) so far: two
        readings tell whether it evicted anything in between (0 for an unknown stream)."""
        stream = self._streams.get((worker_id, rank))
        return 0 if stream is None else stream.removed

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

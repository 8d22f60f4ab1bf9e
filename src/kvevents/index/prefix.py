"""The prefix index: which worker, rank and tier holds which prefix of tokens.

Blocks are keyed by our own chained hash of their tokens (:mod:`kvevents.index.keys`), so the
blocks of every engine agree whatever hash the engine uses. The engine's hash is kept per
holder only to resolve parents and removals. Storage is in :mod:`kvevents.index.holders`,
held orphans in :mod:`kvevents.index.orphans`, the query walk in :mod:`kvevents.index.query`;
every rule is written once, in Python, over table primitives (:mod:`kvevents.index.table`).

Rules (each has its own test): duplicate stores and removals are reference counted per holder
(on a stream in ``"full"`` report mode a repeated store is the same block announced again);
a removal of an unknown block is counted and harmless; ``AllBlocksCleared`` drops the stream's
blocks; a store whose parent is unknown is held as an orphan (bounded, counted) and placed
exactly once when its parent arrives, never re-rooted at token 0; a ``block_size`` different
from the stream's is a loud error and a counter, and the event is not applied; a store whose
``token_ids`` length is not ``block_size * len(block_hashes)`` is skipped and counted.
Stores in other engines' forms (lookahead, bigrams, digest tokens) are read by
:mod:`kvevents.index.tokens`; a hybrid model's windowed and Mamba groups are followed apart
(:mod:`kvevents.index.groups`).

The index is not thread-safe: one writer at a time (the service holds a lock).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from operator import sub

from kvevents.errors import StreamNotRegistered
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, StreamKey
from kvevents.index import query
from kvevents.index import table as bt
from kvevents.index.checks import StoreChecks, pack_ints
from kvevents.index.extras import has_extras
from kvevents.index.groups import WHOLE_PREFIX
from kvevents.index.holders import PAGE_SHIFT, Holder, Stream, tier_name
from kvevents.index.keys import (
    Extras,
    MMSpan,
    chain_hashes,
    digest_blocks,
    merge_extras,
    pack_tokens,
    request_extras,
    root_seed,
    split_digests,
)
from kvevents.index.orphans import Orphan, Stored
from kvevents.index.records import (
    DEFAULT_TIER,
    ApplyResult,
    Counts,
    HolderKey,
    IndexStats,
    MatchResult,
    ReportMode,
    StreamInfo,
)
from kvevents.index.tokens import Run, read_run, special_run, store_keys
from kvevents.index.views import IndexViews
from kvevents.ratelimit import RateLimitedWarning
from kvevents.wire import Applied, PackedStored, decode_batch_packed

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

# The feed's hot path calls these once per store: module globals, not attribute lookups.
_pack_msgpack = bt.pack_msgpack_tokens
_store_run = bt.store_run


def _ranks(ranks: int | Iterable[int]) -> list[int]:
    if isinstance(ranks, int):
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        return list(range(ranks))
    return sorted(set(ranks))


class PrefixIndex(StoreChecks, IndexViews):
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
        self._c.resets += 1
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
        self._c.dropped += stream.drop_state()

    # ----------------------------------------------------------------- applying events

    def apply(self, worker_id: str, rank: int, batch: KVEventBatch) -> ApplyResult:
        """Apply one batch of a (worker, rank) stream, in event order."""
        before = self._c.snapshot()
        self.ingest(worker_id, rank, batch)
        return ApplyResult._make(map(sub, self._c.snapshot(), before))

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
            if kind is PackedStored or kind is BlockStored:
                self._store(stream, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(stream, event)  # type: ignore[arg-type]
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
        apply a batch (as the :class:`~kvevents.subscribe.sink.Sink` of its feed).

        The payload is decoded first, outside ``hold`` (the caller's lock, taken around the
        apply alone), so readers never wait on a decode however large or hostile the payload.
        A payload that cannot be read raises ``DecodeError`` before anything changes. With
        ``registered_only``, a batch of a stream not registered with :meth:`register_worker`
        (or removed since) raises :class:`~kvevents.errors.StreamNotRegistered` and changes
        nothing, checked under ``hold``.
        """
        decoded = decode_batch_packed(payload, seq=seq)
        batch = decoded.batch
        if hold is None:
            cleared = self._ingest_known(worker_id, rank, batch, registered_only)
        else:
            with hold:
                cleared = self._ingest_known(worker_id, rank, batch, registered_only)
        if cleared is None:
            applied = Applied(batch.ts, len(batch.events), decoded.skipped_count)
            raise StreamNotRegistered(worker_id=worker_id, rank=rank, applied=applied)
        return Applied(batch.ts, len(batch.events), decoded.skipped_count, cleared)

    def _ingest_known(
        self, worker_id: str, rank: int, batch: KVEventBatch, registered_only: bool
    ) -> bool | None:
        """:meth:`ingest`, or None (nothing applied) for a stream not registered when
        ``registered_only``."""
        if registered_only:
            stream = self._streams.get((worker_id, rank))
            if stream is None or not stream.registered:
                return None
        return self.ingest(worker_id, rank, batch)

    def _store(self, stream: Stream, event: Stored) -> None:
        kind = event.kv_cache_spec_kind
        if ((kind and kind not in WHOLE_PREFIX) or stream.tails) and self._grouped(stream, event):
            return
        size = event.block_size
        if size != stream.block_size and not self._other_size(stream, event):
            return
        hashes = event.block_hashes
        if not hashes:
            return
        if type(event) is PackedStored:
            packed = _pack_msgpack(event.token_ids)
        else:
            packed = pack_ints(event.token_ids)
        run: Run | None = None
        if packed is None or event.lookahead_token_ids:  # bigrams, digests, lookahead
            read = read_run(event, size)
            if isinstance(read, str):
                self._bad(stream, read)
                return
            run, packed = read, read.packed
        if len(packed) != 4 * size * len(hashes):
            self._bad(stream, "token_ids length is not block_size * len(block_hashes)")
            return
        salted = run is not None or has_extras(event, len(hashes))
        if salted and not self._extras_ok(stream, event):
            return
        if run is not None:
            self._note_lookahead(stream, len(run.after) // 4)
        holder = stream.by_medium.get(event.medium) or self._holder(stream, event.medium)
        parent = event.parent_block_hash
        if parent is None:
            seed = self._root(event)
        else:  # the parent is most often on the same tier: look there first
            found = holder.engine.get(parent)
            if found is None:
                found = stream.resolve(parent)
                if found is None:
                    self._c.orphaned += len(hashes)
                    self._c.dropped += stream.orphans.hold(event, packed, self._max_orphans)
                    return
            seed = found
        if salted:
            ours = store_keys(event, packed, size, seed, run)
            self._c.stored += len(hashes)
            self._held_again(stream, holder.add(hashes, ours, refresh=stream.refreshes))
            if stream.orphans.waiting:
                self._place_waiting(stream, hashes)
            return
        self._c.stored += len(hashes)
        shared = _store_run(holder.table, holder.engine, holder.bit, hashes, packed, size, seed)
        if shared is None:  # some engine hash is held already: the reference-counted way
            self._held_again(
                stream,
                holder.add(hashes, chain_hashes(packed, size, seed), refresh=stream.refreshes),
            )
        elif shared:
            holder.share(shared)
        if stream.orphans.waiting:
            self._place_waiting(stream, hashes)

    def _remove(self, stream: Stream, event: BlockRemoved) -> None:
        hashes = event.block_hashes
        if stream.tails and (tail := stream.tails.get(event.group_idx)) is not None:
            missed = tail.remove(hashes)
            self._c.grouped += 1
            self._c.unknown += missed
            self._c.removed += len(hashes) - missed
            return
        holder = stream.holder_of(event.medium)
        unknown = hashes if holder is None else holder.remove(hashes, stream.tombs)
        if unknown and stream.partials:  # a partial block grown full, a placeholder gone
            unknown = stream.known_partials(list(unknown))
        claimed = sum(1 for eh in unknown if stream.orphans.claim_removal(eh)) if unknown else 0
        self._c.unknown += len(unknown) - claimed
        self._c.removed += len(hashes) - len(unknown) + claimed
        stream.tombs.settle()

    # ----------------------------------------------------------------- orphans

    def _place_waiting(self, stream: Stream, hashes: Sequence[int]) -> None:
        # A worklist, not recursion: chains of orphans can be arbitrarily long.
        pending = [hashes]
        while pending and stream.orphans.waiting:
            for orphan in stream.orphans.release(pending.pop()):
                self._place(stream, orphan)
                pending.append(orphan.event.block_hashes)

    def _place(self, stream: Stream, orphan: Orphan) -> None:
        event = orphan.event
        assert event.parent_block_hash is not None and stream.block_size is not None
        seed = stream.resolve(event.parent_block_hash)
        assert seed is not None
        hashes: Sequence[int] = event.block_hashes
        run = special_run(event, stream.block_size)
        assert not isinstance(run, str)  # it was read when held
        ours = store_keys(event, orphan.packed, stream.block_size, seed, run)
        self._c.placed += len(hashes)
        self._c.stored += len(hashes)
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
            self._c.refreshed += blocks
        else:
            self._c.duplicates += blocks

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
        engine's own do (:func:`kvevents.index.keys.request_extras`): a request matches only
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
        (:func:`kvevents.index.keys.pack_tokens`), e.g. straight from a request body;
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

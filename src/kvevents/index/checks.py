"""How the prefix index reads one store: its tokens, extras, group and block size.

A mixin of :class:`~kvevents.index.prefix.PrefixIndex` (which applies what these return):
each rule that decides whether and how a store can be keyed, and counts what it refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvevents.index import table as bt
from kvevents.index.extras import no_tokens, store_extras
from kvevents.index.groups import TailGroup, tail_need
from kvevents.index.keys import ROOT_SEED, pack_tokens, root_seed
from kvevents.index.tokens import Run, read_run, store_keys
from kvevents.wire import PackedStored

if TYPE_CHECKING:
    from kvevents.index.holders import Stream
    from kvevents.index.orphans import Stored
    from kvevents.index.records import Counts
    from kvevents.ratelimit import RateLimitedWarning

__all__ = ["StoreChecks", "pack_ints"]

log = logging.getLogger("kvevents.index.prefix")

_pack_msgpack = bt.pack_msgpack_tokens


def pack_ints(token_ids: Sequence[int | str]) -> bytes | None:
    """Int token ids as packed uint32 LE, None when one is not an int in range."""
    try:
        return pack_tokens(token_ids)  # type: ignore[arg-type]  # a str raises TypeError
    except (OverflowError, TypeError):
        return None


class StoreChecks:
    """The store-reading half of :class:`~kvevents.index.prefix.PrefixIndex` (a mixin over
    its counters ``_c``, LoRA seeds ``_roots``, size cache ``_sizes`` and mismatch log)."""

    _c: Counts
    _roots: dict[str | int, int]
    _sizes: object
    _log_mismatch: RateLimitedWarning

    def _extras_ok(self, stream: Stream, event: Stored) -> bool:
        """Whether a store's extras can be read (else it is a bad event, counted)."""
        try:
            store_extras(event)
        except ValueError as exc:
            self._bad(stream, str(exc))
            return False
        return True

    def _grouped(self, stream: Stream, event: Stored) -> bool:
        """Whether a store is of a windowed or Mamba group (then followed apart: groups.py)."""
        group, size = event.group_idx, stream.block_size
        tail = stream.tails.get(group)
        if tail is None:
            kind = event.kv_cache_spec_kind
            if not isinstance(kind, str) or not isinstance(group, int) or size is None:
                return False
            need = tail_need(kind, event.kv_cache_spec_sliding_window, size)
            if need is None:
                return False
            tail = stream.tails[group] = TailGroup(need)
        self._c.grouped += 1
        read = self._read(stream, event) if event.block_size == size else None
        if read is None:
            return True
        packed, run = read
        parent = event.parent_block_hash
        seed = self._root(event) if parent is None else tail.engine.get(parent)
        seed = stream.resolve(parent) if seed is None and parent is not None else seed
        if seed is not None:  # else its chain is unknown: the group's check fails, an under-match
            ours = store_keys(event, packed, event.block_size, seed, run)
            tail.add(event.block_hashes, ours, stream.refreshes)
        return True

    def _read(self, stream: Stream, event: Stored) -> tuple[bytes, Run | None] | None:
        """A store's packed tokens and its :class:`~kvevents.index.tokens.Run` when not plain
        ints, None for a bad event (counted). :meth:`_store` inlines it: the hot path."""
        if type(event) is PackedStored:
            packed = _pack_msgpack(event.token_ids)
        else:
            packed = pack_ints(event.token_ids)
        run: Run | None = None
        if packed is None or event.lookahead_token_ids:
            read = read_run(event, event.block_size)
            if isinstance(read, str):
                self._bad(stream, read)
                return None
            run, packed = read, read.packed
        if len(packed) != 4 * event.block_size * len(event.block_hashes):
            self._bad(stream, "token_ids length is not block_size * len(block_hashes)")
            return None
        if not self._extras_ok(stream, event):
            return None
        return packed, run

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
            self._c.partial += 1
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

    def _root(self, event: Stored) -> int:
        lora = event.lora_name if event.lora_name is not None else event.lora_id
        if lora is None:
            return ROOT_SEED
        seed = self._roots.get(lora)
        if seed is None:
            seed = self._roots[lora] = root_seed(lora)
        return seed

    def _bad(self, stream: Stream, reason: str) -> None:
        stream.bad_events += 1
        self._c.bad_events += 1
        log.debug("worker %s rank %d: store skipped: %s", stream.key[0], stream.key[1], reason)

    def _mismatch(self, stream: Stream, event: Stored) -> None:
        stream.mismatches += 1
        self._c.mismatches += 1
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

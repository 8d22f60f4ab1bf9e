"""A replica's snapshot: its index, its cursors and registrations, and the stream sequence
they cover; encoded, decoded, and loaded into a fresh index.

The body is one msgpack document (:class:`Snapshot`). The registrations are in the state
file's format (:func:`kvevents.service.encode_registrations`: the workers a replica
learned from ``worker`` records are what ``kvevents serve --state-file`` keeps), the
index's holders as packed little-endian ``(engine hash, our hash)`` pairs with their reference
counts, so that a loaded index answers queries, resolves parents and counts removals exactly
as the one saved. Two things are not carried: orphans held for a parent that never came
(counted in ``orphans_not_saved``; their parents come before them in the stream, so a replica
that loads a snapshot rarely misses one) and the index's running counters (they tell how the
index was built, not what it holds).

Reading the index's tables here (not through a public method) keeps this format out of the
index package; it belongs with the replica that writes it.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from array import array
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal

import msgspec

from kvevents.index import PrefixIndex
from kvevents.scaleout._cursor import CursorState
from kvevents.service import WorkerRegistration, decode_registrations, encode_registrations

__all__ = ["HolderState", "Snapshot", "SnapshotError", "StreamState", "decode", "encode", "restore"]


class SnapshotError(ValueError):
    """A snapshot cannot be read; ``name`` is the object it came from."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(f"snapshot {name}: {message}")
        self.name = name


class HolderState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tier: str
    pairs: bytes  # uint64 LE: engine hash, our hash, engine hash, ...
    dups: list[tuple[int, int]] = []
    shared: list[tuple[int, int]] = []


class StreamState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    worker_id: str
    rank: int
    block_size: int | None
    registered: bool
    holders: list[HolderState]
    tombs: bytes = b""
    batches: int = 0
    last_ts: float | None = None


class Snapshot(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a replica saves: the index after applying the stream up to ``seq``."""

    version: Literal[1] = 1
    stream: str
    seq: int
    created: float
    replica: str
    registrations: bytes
    cursors: list[CursorState]
    streams: list[StreamState]
    orphans_not_saved: int = 0

    def workers(self) -> list[WorkerRegistration]:
        return decode_registrations(self.registrations)

    @property
    def blocks(self) -> int:
        return sum(len(h.pairs) // 16 for s in self.streams for h in s.holders)


def _packed(pairs: list[tuple[int, int]]) -> bytes:
    return array("Q", itertools.chain.from_iterable(pairs)).tobytes()


def _pairs(data: bytes, name: str) -> tuple[list[int], list[int]]:
    if len(data) % 16:
        raise SnapshotError(
            "a holder's pairs are not whole (bytes not a multiple of 16)", name=name
        )
    flat = array("Q")
    flat.frombytes(data)
    return flat[0::2].tolist(), flat[1::2].tolist()


def capture(
    index: PrefixIndex,
    *,
    stream: str,
    seq: int,
    replica: str,
    workers: list[WorkerRegistration],
    cursors: list[CursorState],
    hold: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> Snapshot:
    """The snapshot of ``index``; it copies, not encodes.

    Call it from the index's only writer (the replica's own thread), so nothing changes
    meanwhile; ``hold()`` (the service's lock) is taken per holder only, against readers
    that keep caches, so queries wait for one holder's copy at a time, not the whole index.
    """
    streams, orphans = [], 0
    for s in list(index._streams.values()):
        holders = []
        for tier, h in list(s.holders.items()):
            with hold():
                pairs, dups, shared = h.engine.items(), list(h.dups.items()), list(h.shared.items())
            holders.append(HolderState(tier=tier, pairs=_packed(pairs), dups=dups, shared=shared))
        with hold():
            tombs = _packed([*s.tombs.old.items(), *s.tombs.recent.items()])
        orphans += s.orphans.held
        streams.append(
            StreamState(
                worker_id=s.key[0],
                rank=s.key[1],
                block_size=s.block_size,
                registered=s.registered,
                holders=holders,
                tombs=tombs,
                batches=s.batches,
                last_ts=s.last_ts,
            )
        )
    return Snapshot(
        stream=stream,
        seq=seq,
        created=time.time(),
        replica=replica,
        registrations=encode_registrations(workers),
        cursors=cursors,
        streams=streams,
        orphans_not_saved=orphans,
    )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode(snapshot: Snapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode(data: bytes, name: str = "snapshot") -> Snapshot:
    """The snapshot in ``data``; SnapshotError naming ``name`` if it is not one."""
    try:
        snapshot = _decoder.decode(data)
        snapshot.workers()
    except (msgspec.DecodeError, RecursionError) as exc:
        raise SnapshotError(f"not a kvevents snapshot ({exc})", name=name) from None
    return snapshot


def restore(index: PrefixIndex, snapshot: Snapshot, name: str = "snapshot") -> None:
    """Load ``snapshot``'s streams into ``index`` (a fresh one: streams it already holds are
    replaced)."""
    for state in snapshot.streams:
        key = (state.worker_id, state.rank)
        if key in index._streams:
            index.remove_worker(*key)
        stream = index._stream(state.worker_id, state.rank, state.block_size)
        stream.block_size = state.block_size
        stream.registered = state.registered
        stream.batches = state.batches
        stream.last_ts = state.last_ts
        for saved in state.holders:
            holder = index._new_holder(stream, saved.tier)
            hashes, ours = _pairs(saved.pairs, name)
            holder.add(hashes, ours)
            holder.dups = dict(saved.dups)
            holder.shared = dict(saved.shared)
        for eh, oh in zip(*_pairs(state.tombs, name), strict=True):
            stream.tombs.recent[eh] = oh
        stream.tombs.settle()
    index._sizes = None

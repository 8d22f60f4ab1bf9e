"""A digest of a prefix index's contents, per (worker, rank): do two indexes hold the same?

Replicas of the router fed from one stream must hold the same blocks; comparing whole dumps
is costly, so each stream's contents are folded into a 64-bit value: the sum, modulo 2**64,
of a mixed hash of every ``(tier, engine_hash, our_hash)`` the stream holds. A sum does not
depend on the order blocks were stored in (or on which holder id a tier got), so two indexes
built by different paths (events applied live, a snapshot loaded) agree exactly when they
hold the same blocks, up to a 2**-64 chance per differing stream.

The block size is part of a stream's digest; counters (stores, duplicates, orphans) are not:
they describe the path, not the contents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvevents.events import StreamKey
from kvevents.index._prefix import PrefixIndex
from kvevents.index._records import HolderKey

__all__ = ["IndexDigest", "StreamDigest", "holders_digest", "index_digest"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finaliser: every input bit moves every output bit (a plain sum of the
    raw hashes would let two swapped pairs cancel out)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class StreamDigest:
    """One (worker, rank): its blocks (entries over all tiers), block size and digest."""

    worker_id: str
    rank: int
    block_size: int | None
    blocks: int
    digest: str  # 16 hex digits

    def to_dict(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "rank": self.rank,
            "block_size": self.block_size,
            "blocks": self.blocks,
            "digest": self.digest,
        }


@dataclass(frozen=True)
class IndexDigest:
    """Every stream's digest, and one over them all (``total``: equal totals, equal indexes)."""

    streams: tuple[StreamDigest, ...]
    total: str

    def by_stream(self) -> dict[StreamKey, StreamDigest]:
        return {(s.worker_id, s.rank): s for s in self.streams}

    def to_dict(self) -> dict[str, object]:
        return {"total": self.total, "streams": [s.to_dict() for s in self.streams]}


def _holder_sum(tier: str, pairs: list[tuple[int, int]]) -> int:
    salt = _seed(tier)
    total = 0
    for eh, oh in pairs:
        total += _mix(_mix(eh ^ salt) ^ oh)
    return total & _MASK


def index_digest(index: PrefixIndex, *, include_empty: bool = False) -> IndexDigest:
    """The digest of every stream of ``index``. Streams holding no block are left out (a
    stream registered but never fed holds what one never seen holds), unless
    ``include_empty`` lists those that had blocks once."""
    holders = [
        (HolderKey(info.worker_id, info.rank, tier), info.block_size)
        for info in index.streams()
        for tier in info.tiers
    ]
    return holders_digest(holders, index.holder_blocks, include_empty=include_empty)


def holders_digest(
    holders: Iterable[tuple[HolderKey, int | None]],
    blocks_of: Callable[[HolderKey], list[tuple[int, int]]],
    *,
    include_empty: bool = False,
) -> IndexDigest:
    """:func:`index_digest` from ``holders`` (key, block size) and each one's pairs, read
    through ``blocks_of`` (a service copies one holder at a time under its lock, so queries
    never wait for the whole digest)."""
    sums: dict[StreamKey, list[int]] = {}  # stream -> [sum, blocks, block size]
    for key, block_size in holders:
        pairs = blocks_of(key)
        entry = sums.setdefault((key.worker_id, key.rank), [0, 0, block_size or 0])
        entry[0] += _holder_sum(key.tier, pairs)
        entry[1] += len(pairs)
    out = []
    for (worker_id, rank), (total, blocks, size) in sorted(sums.items()):
        if blocks == 0 and not include_empty:
            continue
        total = (total + _mix(size ^ _GOLDEN)) & _MASK
        out.append(StreamDigest(worker_id, rank, size or None, blocks, f"{total:016x}"))
    return IndexDigest(tuple(out), _total(out))


def _total(streams: list[StreamDigest]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for s in streams:
        h.update(f"{s.worker_id}\0{s.rank}\0{s.digest}\0".encode())
    return h.hexdigest()

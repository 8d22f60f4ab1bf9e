"""``GET /dump`` as a stream of JSON chunks, never the whole index in one piece.

The old dump built every ``[engine_hash, our_hash]`` pair as Python lists and one JSON
document under the index lock: on 1.34M entries it held the lock (and so every query and
every event) for seconds and doubled the process's memory. Here each holder's pairs are
copied under the lock one holder at a time, on a worker thread, and encoded in slices off
the lock; the event loop only forwards bytes. The document is the same as before:
``{"holders": [{worker_id, rank, tier, block_size, blocks: [[eh, oh], ...]}, ...],
"stats": {...}}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from starlette.concurrency import run_in_threadpool

from kvevents.index.prefix import HolderKey
from kvevents.service.core import IndexService

__all__ = ["CHUNK_PAIRS", "dump_chunks"]

#: Pairs encoded per chunk: about 4 MB of JSON.
CHUNK_PAIRS = 1 << 16

_encode = msgspec.json.encode


def _holder_head(key: HolderKey, block_size: int | None) -> bytes:
    head = _encode(
        {"worker_id": key.worker_id, "rank": key.rank, "tier": key.tier, "block_size": block_size}
    )
    return head[:-1] + b',"blocks":['


def _members(pairs: list[tuple[int, int]]) -> bytes:
    """The pairs as comma-joined JSON array members (no brackets)."""
    return _encode(pairs)[1:-1]


async def dump_chunks(service: IndexService) -> AsyncIterator[bytes]:
    """The dump document in pieces; the index lock is never held while one is encoded."""
    yield b'{"holders":['
    holders = await run_in_threadpool(service.holders)
    for n, (key, block_size) in enumerate(holders):
        yield (b"," if n else b"") + _holder_head(key, block_size)
        pairs = await run_in_threadpool(service.holder_blocks, key)
        for i in range(0, len(pairs), CHUNK_PAIRS):
            piece = await run_in_threadpool(_members, pairs[i : i + CHUNK_PAIRS])
            yield (b"," if i else b"") + piece
        del pairs
        yield b"]}"
    stats = await run_in_threadpool(service.index_stats)
    yield b'],"stats":' + _encode(stats) + b"}"

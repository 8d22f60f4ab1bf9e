"""Batch builders for testing a prefix index: stores and removals with proper chained hashes.

Engines chain their block hashes (a block's hash covers its parent's), and so must test data,
or parents and removals would not resolve as they do in production. :func:`engine_hashes`
stands in for an engine's own scheme (:mod:`kvevents.sim._hashing`, the simulated engines' hash:
SHA-256 chained over parent and tokens, read as vLLM does or as SGLang and TensorRT-LLM do).
It is deliberately not :mod:`kvevents.index._keys`, so tests prove that the index does not
depend on engine hashes matching its own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, KVEventBatch
from kvevents.sim import engine_chain_hashes

__all__ = [
    "HashStyle",
    "batch",
    "clear_event",
    "engine_hashes",
    "random_worker_batches",
    "remove_event",
    "store_event",
]

HashStyle = Literal["vllm", "sglang"]


def engine_hashes(
    token_ids: Sequence[int], block_size: int, *, style: HashStyle = "vllm", salt: bytes = b""
) -> list[int]:
    """An engine-like chained hash for every full block of ``token_ids`` (from token 0):
    :func:`kvevents.sim.engine_chain_hashes` in vLLM's (unsigned) or SGLang's (signed) style."""
    return engine_chain_hashes(
        token_ids, block_size, salt=salt, style="unsigned" if style == "vllm" else "signed"
    )


def store_event(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int = 0,
    end_block: int | None = None,
    medium: str | None = None,
    style: HashStyle = "vllm",
    salt: bytes = b"",
    lora_name: str | None = None,
) -> BlockStored:
    """The ``BlockStored`` announcing blocks ``start_block:end_block`` of a prefix.

    The parent hash is the engine hash of block ``start_block - 1`` (None at block 0), as an
    engine sends it when the earlier blocks were already cached.
    """
    hashes = engine_hashes(token_ids, block_size, style=style, salt=salt)
    end = len(hashes) if end_block is None else end_block
    return BlockStored(
        block_hashes=hashes[start_block:end],
        parent_block_hash=hashes[start_block - 1] if start_block > 0 else None,
        token_ids=list(token_ids[start_block * block_size : end * block_size]),
        block_size=block_size,
        medium=medium,
        lora_name=lora_name,
    )


def remove_event(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int = 0,
    end_block: int | None = None,
    medium: str | None = None,
    style: HashStyle = "vllm",
    salt: bytes = b"",
) -> BlockRemoved:
    """The ``BlockRemoved`` for blocks ``start_block:end_block`` of a prefix."""
    hashes = engine_hashes(token_ids, block_size, style=style, salt=salt)
    end = len(hashes) if end_block is None else end_block
    return BlockRemoved(block_hashes=hashes[start_block:end], medium=medium)


def clear_event() -> AllBlocksCleared:
    """An ``AllBlocksCleared`` event."""
    return AllBlocksCleared()


def batch(*events: Event, ts: float = 0.0, rank: int | None = None) -> KVEventBatch:
    """A batch of the given events."""
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=rank)


def random_worker_batches(
    workers: int,
    batches_per_worker: int,
    *,
    blocks_per_event: int = 16,
    block_size: int = 16,
    vocab: int = 32000,
    token_pool: int = 64,
    seed: int = 0,
) -> dict[str, list[KVEventBatch]]:
    """Store batches for load and memory measurements, fast to build and light to hold.

    Each worker (``worker-0`` ...) stores one long chain: every event's parent is the last
    block of the event before, so every block is distinct although token lists are drawn
    from a small shared pool. Engine hashes are random 64-bit ints.
    """
    rng = random.Random(seed)
    tokens = blocks_per_event * block_size
    pool = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(token_pool)]
    out: dict[str, list[KVEventBatch]] = {}
    for w in range(workers):
        parent: int | None = None
        batches = []
        for i in range(batches_per_worker):
            # The first event of each worker differs, so workers do not share blocks.
            ids = [w, *pool[0][1:]] if i == 0 else pool[rng.randrange(token_pool)]
            hashes = [rng.getrandbits(64) for _ in range(blocks_per_event)]
            event = BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=ids,
                block_size=block_size,
            )
            batches.append(batch(event, ts=float(i)))
            parent = hashes[-1]
        out[f"worker-{w}"] = batches
    return out

"""The index follows what real engines put on the wire (issue 13).

Every event here is built in the engine's own shape, from the engine's source (facts only):
vLLM's map-form ``BlockStored`` (``vllm/distributed/kv_events.py``,
``vllm/v1/core/block_pool.py``), SGLang's radix-cache stores
(``python/sglang/srt/mem_cache/radix_cache.py``) and TensorRT-LLM's. Each goes through
``ingest_payload``, the service's own path (the packed decoder), unless noted.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvevents.index.prefix import PrefixIndex

BS = 4
PROMPT = list(range(100, 100 + 4 * BS))
HASHES = [11, 12, 13, 14]


def vllm_store(
    hashes: list[int], tokens: list[int], parent: int | None = None, **more: Any
) -> dict[str, Any]:
    """A vLLM (0.32+) map-form BlockStored, as ``BlockPool._build_block_stored_event``."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": more.pop("block_size", BS),
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": more.pop("group_idx", 0),
        **more,
    }


def removed(hashes: list[int], **more: Any) -> dict[str, Any]:
    """A vLLM BlockRemoved (one per evicted block hash in the engine)."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **more}


def feed(index: PrefixIndex, *events: dict[str, Any], worker: str = "w") -> None:
    """One batch of engine events, through the service's path."""
    index.ingest_payload(worker, 0, msgspec.msgpack.encode([1.0, list(events), 0]))


def matched(index: PrefixIndex, tokens: list[int], worker: str = "w") -> int:
    return index.match(tokens).streams.get((worker, 0), 0)


# ------------------------------------------------------------------ report mode (item 1)


def _reuse_then_evict(index: PrefixIndex) -> None:
    """vLLM with ``kv_cache_report_mode="full"``: request A computes 2 blocks; request B hits
    them, and ``emit_cached_block_events`` announces them again (parent None, from block 0)
    before B's new block; then the engine evicts each block once."""
    feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS]))
    feed(
        index,
        vllm_store(HASHES[:2], PROMPT[: 2 * BS], session_id="b"),
        vllm_store(HASHES[2:3], PROMPT[2 * BS : 3 * BS], parent=HASHES[1], session_id="b"),
    )
    feed(index, removed(HASHES[2:3]), removed(HASHES[1:2]), removed(HASHES[:1]))


def test_full_report_mode_reuse_then_eviction_leaves_nothing_stale() -> None:
    """A stream in full report mode: blocks announced again on reuse go with one eviction."""
    index = PrefixIndex()
    index.register_worker("w", block_size=BS, report_mode="full")
    _reuse_then_evict(index)
    assert matched(index, PROMPT) == 0
    stats = index.stats()
    assert (stats.entries, stats.blocks) == (0, 0)
    assert (stats.refreshed_stores, stats.duplicate_stores, stats.unknown_removals) == (2, 0, 0)


def test_incremental_mode_still_counts_a_second_store_as_a_second_copy() -> None:
    """The default mode is unchanged: vLLM does not de-duplicate its cache, so a second
    store of a held hash is a second copy, evicted on its own."""
    index = PrefixIndex()
    index.register_worker("w", block_size=BS)
    _reuse_then_evict(index)
    assert matched(index, PROMPT) == 2 * BS // BS
    assert index.stats().duplicate_stores == 2
    feed(index, removed(HASHES[:2]))
    assert matched(index, PROMPT) == 0


def test_full_report_mode_is_per_stream() -> None:
    """One worker in full mode does not change how another stream counts its stores."""
    index = PrefixIndex()
    index.register_worker("full", block_size=BS, report_mode="full")
    index.register_worker("inc", block_size=BS)
    for worker in ("full", "inc"):
        feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS]), worker=worker)
        feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS]), worker=worker)
        feed(index, removed(HASHES[:2]), worker=worker)
    assert (matched(index, PROMPT, "full"), matched(index, PROMPT, "inc")) == (0, 2)


def test_full_report_mode_refresh_on_a_salted_store() -> None:
    """A re-announced block with extras (the keyed-in-Python path) is a refresh too."""
    index = PrefixIndex()
    index.register_worker("w", block_size=BS, report_mode="full")
    salted = vllm_store(HASHES[:1], PROMPT[:BS], extra_keys=[["salt"]])
    feed(index, salted, salted, removed(HASHES[:1]))
    assert index.stats().entries == 0


def test_register_refuses_an_unknown_report_mode() -> None:
    """A misspelt report mode is a clear error naming the field, not a silent default."""
    with pytest.raises(ValueError, match="report_mode"):
        PrefixIndex().register_worker("w", block_size=BS, report_mode="fulll")  # type: ignore[arg-type]

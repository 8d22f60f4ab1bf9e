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
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index._prefix import PrefixIndex
from kvevents.wire import decode_batch, decode_batch_packed

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


# ------------------------------------------------------------------ lookahead (items 2, 3)

NEXT = 999  # a token after PROMPT's blocks


def test_vllm_lookahead_block_needs_the_token_after_it() -> None:
    """vLLM's lookahead-aware hashing (PR 50897: the successor token enters a block's hash,
    sent as ``lookahead_token_ids``): a request without the stored successor, or with another
    one, reuses one block less; with it, all of them."""
    index = PrefixIndex()
    feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS], lookahead_token_ids=[NEXT]))
    assert matched(index, PROMPT[: 2 * BS]) == 1
    assert matched(index, [*PROMPT[: 2 * BS], NEXT]) == 2
    assert matched(index, [*PROMPT[: 2 * BS], NEXT + 1]) == 1
    assert matched(index, PROMPT[: BS + 1]) == 1
    assert matched(index, PROMPT[:BS]) == 0


def test_vllm_lookahead_continuation_and_orphan_chain_on() -> None:
    """A continuation store (and one arriving before its parent) keys on from the parent's
    lookahead key, so the whole prefix matches."""
    index = PrefixIndex()
    third = vllm_store(
        HASHES[2:3], PROMPT[2 * BS : 3 * BS], parent=HASHES[1], lookahead_token_ids=[NEXT]
    )
    feed(index, third)  # its parent is not known yet: held
    first = vllm_store(HASHES[:2], PROMPT[: 2 * BS], lookahead_token_ids=[PROMPT[2 * BS]])
    feed(index, first)
    assert index.stats().orphans_placed == 1
    assert matched(index, [*PROMPT[: 3 * BS], NEXT]) == 3
    assert matched(index, PROMPT[: 3 * BS]) == 2


def test_a_lookahead_stream_leaves_plain_streams_alone() -> None:
    """Queries key each stream its own way: a plain worker beside a lookahead one still
    matches every full block."""
    index = PrefixIndex()
    feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS]), worker="plain")
    feed(index, vllm_store(HASHES[:2], PROMPT[: 2 * BS], lookahead_token_ids=[NEXT]), worker="la")
    result = index.match(PROMPT[: 2 * BS])
    assert result.streams == {("plain", 0): 2, ("la", 0): 1}
    assert result.request_blocks == {BS: 2}


def sglang_bigram_stores(tokens: list[int], hashes: list[int]) -> list[dict[str, Any]]:
    """SGLang with EAGLE (``RadixCache._record_store_event`` over ``convert_to_bigram_key``):
    one store per page of ``(t[i], t[i+1])`` pairs, ``block_size`` the page's length."""
    pairs = [[tokens[i], tokens[i + 1]] for i in range(len(tokens) - 1)]
    out, parent = [], None
    for n, h in enumerate(hashes):
        page = pairs[n * BS : (n + 1) * BS]
        out.append(
            {
                "type": "BlockStored",
                "block_hashes": [h],
                "parent_block_hash": parent,
                "token_ids": page,
                "block_size": len(page),
                "lora_id": None,
                "medium": "GPU",
            }
        )
        parent = h
    return out


def test_sglang_bigram_stores_are_indexed_as_the_engine_matches_them() -> None:
    """SGLang's EAGLE bigram stores were skipped; now a page of pairs is its tokens plus the
    one after, and a query matches ``(len(tokens) - 1) // page`` pages at most, as SGLang's
    own bigram match does."""
    tokens = [*PROMPT[: 2 * BS], NEXT]
    index = PrefixIndex()
    feed(index, *sglang_bigram_stores(tokens, HASHES[:2]))
    assert index.stats().bad_events == 0
    assert matched(index, tokens) == 2
    assert matched(index, tokens[:-1]) == 1
    assert matched(index, [*tokens[:-1], NEXT + 1]) == 1


def test_sglang_bigram_and_vllm_lookahead_share_keys() -> None:
    """The same tokens stored as SGLang bigrams or as vLLM lookahead stores get the same keys,
    by either decoder (packed for the service, typed for ``apply``)."""
    tokens = [*PROMPT[: 2 * BS], NEXT]
    bigram, lookahead, typed = PrefixIndex(), PrefixIndex(), PrefixIndex()
    feed(bigram, *sglang_bigram_stores(tokens, HASHES[:2]))
    feed(lookahead, vllm_store(HASHES[:2], tokens[:-1], lookahead_token_ids=[NEXT]))
    payload = msgspec.msgpack.encode([1.0, sglang_bigram_stores(tokens, HASHES[:2]), 0])
    typed.apply("w", 0, decode_batch(payload).batch)

    def keys(index: PrefixIndex) -> set[int]:
        return {ours for holder in index.dump() for _, ours in holder["blocks"]}  # type: ignore[attr-defined]

    assert keys(bigram) == keys(lookahead) == keys(typed)
    assert len(keys(bigram)) == 2


def test_a_bigram_store_that_does_not_chain_costs_only_itself() -> None:
    """Pairs that do not chain ([a, b] then [c, d] with c != b) are a bad event, counted;
    the good store beside it in the batch is indexed."""
    good = sglang_bigram_stores([*PROMPT[:BS], NEXT], HASHES[:1])[0]
    bad = {**good, "block_hashes": [77], "token_ids": [[1, 2], [3, 4], [4, 5], [5, 6]]}
    index = PrefixIndex()
    feed(index, bad, good)
    assert (index.stats().bad_events, index.stats().entries) == (1, 1)
    decoded = decode_batch(msgspec.msgpack.encode([1.0, [bad, good], 0]))
    assert [s.path for s in decoded.skipped] == ["$[1][0].token_ids"]
    assert len(decoded.batch.events) == 1


# ------------------------------------------------------------------ digest tokens (item 4)

DIGEST = "9f" * 32  # a multimodal item's hex digest (SHA-256), where its tokens are


def trtllm_store(tokens: list[int | str], hashes: list[int]) -> dict[str, Any]:
    """A TensorRT-LLM map-form store of a multimodal request: ints, and the item's digest in
    place of each of its tokens."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


MM_TOKENS: list[int | str] = [*PROMPT[:BS], *[DIGEST] * BS, *PROMPT[2 * BS : 3 * BS]]


def test_trtllm_digest_tokens_are_part_of_the_key() -> None:
    """A store mixing ints and digests is indexed (it was skipped); a query naming the same
    digest at the same positions matches it all, another digest or plain ids only the text
    block before the item."""
    index = PrefixIndex()
    feed(index, trtllm_store(MM_TOKENS, HASHES[:3]))
    assert index.stats().bad_events == 0
    assert matched(index, MM_TOKENS) == 3
    other: list[int | str] = [t if t != DIGEST else "00" * 32 for t in MM_TOKENS]
    assert matched(index, other) == 1
    assert matched(index, PROMPT[: 3 * BS]) == 1


def test_trtllm_digest_tokens_by_the_typed_decoder() -> None:
    """``decode_batch`` keeps digest tokens as strings and ``apply`` keys them as
    ``ingest_payload`` does."""
    payload = msgspec.msgpack.encode([1.0, [trtllm_store(MM_TOKENS, HASHES[:3])], 0])
    decoded = decode_batch(payload)
    assert decoded.skipped == ()
    assert decoded.batch.events[0].token_ids == MM_TOKENS  # type: ignore[union-attr]
    index = PrefixIndex()
    index.apply("w", 0, decoded.batch)
    assert matched(index, MM_TOKENS) == 3


def test_an_overlong_digest_token_costs_only_its_event() -> None:
    """A digest token over 256 characters is refused with the rule named; the rest of the
    batch is kept."""
    bad = trtllm_store([*PROMPT[: BS - 1], "f" * 257], [77])
    good = trtllm_store(MM_TOKENS, HASHES[:3])
    index = PrefixIndex()
    feed(index, bad, good)
    assert (index.stats().bad_events, matched(index, MM_TOKENS)) == (1, 3)
    decoded = decode_batch(msgspec.msgpack.encode([1.0, [bad, good], 0]))
    assert [s.path for s in decoded.skipped] == [f"$[1][0].token_ids[{BS - 1}]"]
    assert "longer than 256" in decoded.skipped[0].reason


# ------------------------------------------------------------------ fields kept (item 5)


def test_vllm_033_placement_fields_reach_the_decoded_events() -> None:
    """vLLM 0.33's ``locality``/``ownership`` on stores and removals and ``session_id`` on
    stores are kept on the decoded events (packed and typed decoders), not dropped."""
    store = vllm_store(HASHES[:1], PROMPT[:BS], locality="REMOTE", ownership="lmcache")
    store["session_id"] = "s-1"
    gone = removed(HASHES[:1], group_idx=0, locality="LOCAL", ownership="lmcache")
    payload = msgspec.msgpack.encode([1.0, [store, gone], 0])
    packed_store, packed_gone = decode_batch_packed(payload).batch.events
    assert (packed_store.locality, packed_store.ownership) == ("REMOTE", "lmcache")  # type: ignore[union-attr]
    assert packed_store.session_id == "s-1"  # type: ignore[union-attr]
    typed_store, typed_gone = decode_batch(payload).batch.events
    assert typed_store.session_id == "s-1"  # type: ignore[union-attr]
    for event in (packed_gone, typed_gone):
        assert (event.locality, event.ownership) == ("LOCAL", "lmcache")  # type: ignore[union-attr]


def test_placement_fields_on_a_generic_path_removal() -> None:
    """A removal read by the tolerant per-event path (a batch with an unknown event) keeps
    its placement fields too."""
    gone = removed(HASHES[:1], locality="REMOTE", ownership="x")
    payload = msgspec.msgpack.encode([1.0, [["Unknown", 1], gone], 0])
    [event] = decode_batch(payload).batch.events
    assert (event.locality, event.ownership) == ("REMOTE", "x")  # type: ignore[union-attr]


# ------------------------------------------------------------------ hybrid models (item 6)

WINDOW = 2 * BS + 1  # a sliding window needing cdiv(WINDOW - 1, BS) = 2 blocks before a hit


def fa(hashes: list[int], first: int, parent: int | None = None) -> dict[str, Any]:
    """vLLM's full-attention group (0) storing blocks ``first..`` of PROMPT."""
    tokens = PROMPT[first * BS : (first + len(hashes)) * BS]
    return vllm_store(hashes, tokens, parent, kv_cache_spec_kind="full_attention")


def swa(hashes: list[int], first: int, parent: int | None = None) -> dict[str, Any]:
    """vLLM's sliding-window group (1): the same block hashes, its own events."""
    tokens = PROMPT[first * BS : (first + len(hashes)) * BS]
    return vllm_store(
        hashes,
        tokens,
        parent,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=WINDOW,
    )


def test_hybrid_hit_needs_the_sliding_window_blocks_before_it() -> None:
    """Full attention + sliding window (vLLM ``SlidingWindowManager``): a hit of n blocks
    needs full attention's blocks 0..n-1 and the window's last blocks before n; once the
    window group evicted blocks 2-3, only a 2-block hit is left."""
    index = PrefixIndex()
    feed(index, fa(HASHES, 0), swa(HASHES, 0))
    assert matched(index, PROMPT) == 4
    feed(index, removed(HASHES[2:], group_idx=1))
    assert matched(index, PROMPT) == 2
    stats = index.stats()
    assert (stats.group_events, stats.entries, stats.unknown_removals) == (2, 4, 0)


def test_hybrid_full_attention_eviction_still_cuts_the_prefix() -> None:
    """The full-attention group's own eviction shortens the hit as before."""
    index = PrefixIndex()
    feed(index, fa(HASHES, 0), swa(HASHES, 0))
    feed(index, removed(HASHES[3:], group_idx=0))
    assert matched(index, PROMPT) == 3


def test_hybrid_sparse_window_stores_allow_only_hits_at_their_end() -> None:
    """vLLM caches only the window blocks a hit can use: with window blocks 2-3 alone, a
    4-block hit is whole, and a 3-block request has no hit (its window blocks are missing)."""
    index = PrefixIndex()
    feed(index, fa(HASHES, 0), swa(HASHES[2:], 2, parent=HASHES[1]))
    assert matched(index, PROMPT) == 4
    assert matched(index, PROMPT[: 3 * BS]) == 0


def test_hybrid_mamba_group_needs_the_state_at_the_hit() -> None:
    """A Mamba group needs only its block at the hit point: with its state at block 1 (of
    2 stored, block 3 evicted), the hit is 2 blocks."""
    index = PrefixIndex()
    mamba = vllm_store(HASHES, PROMPT, group_idx=1, kv_cache_spec_kind="mamba")
    feed(index, fa(HASHES, 0), mamba, removed(HASHES[2:], group_idx=1))
    assert matched(index, PROMPT) == 2
    feed(index, {"type": "AllBlocksCleared"})
    assert matched(index, PROMPT) == 0


def test_single_group_full_attention_stores_are_unchanged() -> None:
    """A non-hybrid vLLM stream (one full-attention group) is indexed as before: no group
    followed apart, every block matched."""
    index = PrefixIndex()
    feed(index, fa(HASHES, 0))
    assert (matched(index, PROMPT), index.stats().group_events) == (4, 0)


def test_vllm_lookahead_as_one_successor_per_block_reads_the_same() -> None:
    """``lookahead_token_ids`` holding each block's successor (the last block's included)
    keys exactly as the single token after the last block does."""
    per_block, after_last = PrefixIndex(), PrefixIndex()
    successors = [PROMPT[BS], NEXT]
    feed(per_block, vllm_store(HASHES[:2], PROMPT[: 2 * BS], lookahead_token_ids=successors))
    feed(after_last, vllm_store(HASHES[:2], PROMPT[: 2 * BS], lookahead_token_ids=[NEXT]))
    assert per_block.dump() == after_last.dump()
    assert matched(per_block, [*PROMPT[: 2 * BS], NEXT]) == 2


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50), min_size=BS + 1, max_size=6 * BS + 3),
    cuts=st.lists(st.integers(1, 3), max_size=6),
    bigram=st.booleans(),
    query_len=st.integers(0, 6 * BS + 3),
)
def test_lookahead_stores_in_any_split_match_what_the_engine_reuses(
    tokens: list[int], cuts: list[int], bigram: bool, query_len: int
) -> None:
    """However a lookahead stream's blocks are split into stores (vLLM lookahead or SGLang
    bigram form), a query of the same tokens matches ``(len - 1) // block_size`` blocks."""
    blocks = (len(tokens) - 1) // BS
    hashes = [1000 + i for i in range(blocks)]
    index, start, parent = PrefixIndex(), 0, None
    for size in [*cuts, blocks]:
        end = min(blocks, start + size)
        if end <= start:
            break
        span = tokens[start * BS : end * BS + 1]
        if bigram:
            pairs = [[span[i], span[i + 1]] for i in range(len(span) - 1)]
            event = {**vllm_store(hashes[start:end], [], parent), "token_ids": pairs}
        else:
            event = vllm_store(hashes[start:end], span[:-1], parent, lookahead_token_ids=span[-1:])
        feed(index, event)
        start, parent = end, hashes[end - 1]
    query = tokens[:query_len]
    assert matched(index, query) == min(blocks, max(0, len(query) - 1) // BS)

"""Cache isolation: a block's extra inputs (cache_salt, multimodal items) are part of its key.

Events are built in the engines' own shapes: vLLM's map stores with one ``extra_keys`` entry
per block (the salt on the first block, ``[mm_hash, offset]`` pairs on the blocks an item
overlaps, the LoRA name first in every entry) and SGLang's map stores with ``cache_salt``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.events import BlockStored
from kvevents.http import QueryReader
from kvevents.index.keys import (
    ROOT_SEED,
    MMSpan,
    block_hashes,
    chain_hashes,
    chain_keys,
    mix_extras,
    pack_tokens,
    request_extras,
)
from kvevents.index.prefix import PrefixIndex
from kvevents.service.core import IndexService
from kvevents.wire import PackedStored, decode_batch, decode_batch_packed

BS = 16
PROMPT = list(range(100, 100 + 3 * BS))


def vllm_store(
    hashes: list[int],
    tokens: list[int],
    extra_keys: list[Any] | None,
    parent: int | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A vLLM map-form BlockStored as the engine sends it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": more.pop("block_size", BS),
        "lora_id": more.pop("lora_id", None),
        "medium": "GPU",
        "lora_name": more.pop("lora_name", None),
        "extra_keys": extra_keys,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **more,
    }


def sglang_store(
    hashes: list[int], tokens: list[int], parent: int | None, salt: str | None
) -> dict[str, Any]:
    """An SGLang map-form BlockStored: no medium or lora_name, the salt as a field."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "cache_salt": salt,
        "session_id": "s1",
    }


def payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def index_with(*events: dict[str, Any], packed: bool = True) -> PrefixIndex:
    """An index fed ``events`` on w0 rank 0 (through the packed feed path by default)."""
    index = PrefixIndex()
    index.register_worker("w0", block_size=BS)
    if packed:
        index.ingest_payload("w0", 0, payload(*events))
    else:
        index.ingest("w0", 0, decode_batch(payload(*events)).batch)
    return index


def matched(index: PrefixIndex, tokens: list[int] = PROMPT, **query: Any) -> int:
    return index.match(tokens, **query).streams.get(("w0", 0), 0)


SALTED = vllm_store([11, 12, 13], PROMPT, [["tenant-a"], None, None])


# ----------------------------------------------------------------- keys


def test_extras_key_scheme_is_pinned() -> None:
    """The documented key of a block with extras, and unsalted keys unchanged by extras=None."""
    packed = pack_tokens(PROMPT)
    plain = chain_hashes(packed, BS, ROOT_SEED)
    assert chain_keys(packed, BS, ROOT_SEED, [None, None, None]) == plain
    salted = chain_keys(packed, BS, ROOT_SEED, [["tenant-a"], None, None])
    [first] = chain_hashes(packed[: 4 * BS], BS, ROOT_SEED)
    assert salted[0] == mix_extras(first, ["tenant-a"])
    assert salted[1:] == chain_hashes(packed[4 * BS :], BS, salted[0])
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert salted == [16354174821035208, 566423087587646485, 949380181527042685]  # golden


def test_request_extras_follow_the_engine_rule() -> None:
    """Salt on block 0 only (after mm pairs); an item on every block it overlaps, offset
    relative to the block; an empty salt is none."""
    mm = [MMSpan("img", 4, 20)]
    assert request_extras(3, BS, "s", mm) == [[["img", 4], "s"], [["img", -12]]]
    assert request_extras(3, BS, "", ()) is None
    assert request_extras(2, BS, None, [MMSpan("a", 16, 1)]) == [None, [["a", 0]]]


# ----------------------------------------------------------------- vLLM stores


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_salted_store_matches_only_its_salt(packed: bool) -> None:
    """A vLLM store salted on its first block matches a query with that salt only."""
    index = index_with(SALTED, packed=packed)
    assert matched(index, cache_salt="tenant-a") == 3
    assert matched(index, cache_salt="tenant-b") == 0
    assert matched(index) == 0


def test_unsalted_store_is_not_matched_by_a_salted_query() -> None:
    """extra_keys of nils is an unsalted store: keys as before, no salted query matches it."""
    index = index_with(vllm_store([11, 12, 13], PROMPT, [None, None, None]))
    assert matched(index) == 3
    assert matched(index, cache_salt="tenant-a") == 0
    assert index.match_hashes(block_hashes(PROMPT, BS)).streams == {("w0", 0): 3}


def test_packed_and_decoded_stores_key_alike() -> None:
    """The feed's packed decode and the full decode give the same keys for salted stores."""
    mm = vllm_store([21, 22], PROMPT[: 2 * BS], [[["img", 4]], [["img", -12]]])
    both = [index_with(SALTED, mm, packed=p).dump() for p in (True, False)]
    assert both[0] == both[1]


def test_salted_chain_continues_from_its_parent() -> None:
    """A later store continuing a salted run (parent given, nil extras) stays salted."""
    first = vllm_store([11], PROMPT[:BS], [["tenant-a"]])
    rest = vllm_store([12, 13], PROMPT[BS:], [None, None], parent=11)
    index = index_with(first, rest)
    assert matched(index, cache_salt="tenant-a") == 3
    assert matched(index) == 0


def test_multimodal_items_enter_the_blocks_they_overlap() -> None:
    """vLLM's [mm_hash, offset] pairs: the same image matches, another image or none not,
    and blocks before the image match whatever the image."""
    extra = [None, [["img-1", 4]], [["img-1", -12]]]
    index = index_with(vllm_store([11, 12, 13], PROMPT, extra))
    assert matched(index, mm=[MMSpan("img-1", BS + 4, 20)]) == 3
    assert matched(index, mm=[MMSpan("img-2", BS + 4, 20)]) == 1
    assert matched(index) == 1


def test_lora_name_in_extra_keys_is_keyed_by_the_root() -> None:
    """vLLM puts the LoRA name first in every entry: the index keys LoRA by its root seed, so
    a query with lora= matches, and the salt after the name still counts."""
    extra = [["ad", "tenant-a"], ["ad"], ["ad"]]
    index = index_with(vllm_store([11, 12, 13], PROMPT, extra, lora_name="ad", lora_id=1))
    assert matched(index, lora="ad", cache_salt="tenant-a") == 3
    assert matched(index, lora="ad") == 0
    assert matched(index, cache_salt="tenant-a") == 0


def test_bad_extra_keys_skip_only_that_store() -> None:
    """extra_keys not one entry per block, or an entry that is not a list: that store is a
    bad event, counted; the rest of the batch is applied."""
    wrong_count = vllm_store([11, 12], PROMPT[: 2 * BS], [["s"]])
    not_a_list = vllm_store([31], PROMPT[:BS], [7])
    good = vllm_store([41], [9] * BS, [None])
    for packed in (True, False):
        index = index_with(wrong_count, not_a_list, good, packed=packed)
        assert index.stats().bad_events == 2
        assert index.stats().entries == 1


# ----------------------------------------------------------------- SGLang stores


def test_sglang_cache_salt_keys_the_first_block() -> None:
    """SGLang's cache_salt field salts a store at token 0; a continuation store's salt is
    already in its parent's key. Same salt, same keys as vLLM's extra_keys."""
    first = sglang_store([-1], PROMPT[:BS], None, "tenant-a")
    rest = sglang_store([-2, -3], PROMPT[BS:], -1, "tenant-a")
    index = index_with(first, rest)
    assert matched(index, cache_salt="tenant-a") == 3
    assert matched(index, cache_salt="tenant-b") == 0
    assert matched(index) == 0
    vllm = index_with(SALTED)
    assert sorted(oh for _, oh in index.dump()[0]["blocks"]) == sorted(  # type: ignore[index]
        oh
        for _, oh in vllm.dump()[0]["blocks"]  # type: ignore[index]
    )


# ----------------------------------------------------------------- property


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([None, "a", "b"])), min_size=1, max_size=8
    ),
    st.integers(0, 3),
    st.sampled_from([None, "a", "b"]),
)
def test_salted_and_unsalted_streams_never_cross_match(
    stores: list[tuple[int, str | None]], prompt: int, salt: str | None
) -> None:
    """Prompts stored under random salts: a query matches exactly the longest prefix stored
    under its own salt (an oracle of (salt, prefix) pairs), never one of another salt."""
    prompts = [[p * 7 + b for b in range(3 * BS)] for p in range(2)] + [
        [1] * (3 * BS),
        [1] * BS + [2] * (2 * BS),
    ]
    index = PrefixIndex()
    index.register_worker("w0", block_size=BS)
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    for n, (which, s) in enumerate(stores):
        tokens = prompts[which]
        hashes = [n * 10 + i for i in range(3)]
        extra = [[s] if s else None, None, None]
        index.ingest_payload("w0", 0, payload(vllm_store(hashes, tokens, extra)))
        seen.update((s, tuple(tokens[: k * BS])) for k in (1, 2, 3))
    tokens = prompts[prompt]
    want = max((k for k in (1, 2, 3) if (salt, tuple(tokens[: k * BS])) in seen), default=0)
    assert matched(index, tokens, cache_salt=salt) == want


# ----------------------------------------------------------------- legitimate odd stores


def test_partial_block_store_is_not_a_mismatch(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's cache_partial_block store (block_size below the stream's, one hash) is counted
    as a partial store, not a block-size mismatch, and logs no ERROR."""
    partial = vllm_store([99], PROMPT[:5], [["tenant-a"]], parent=None, block_size=5)
    with caplog.at_level(logging.DEBUG, logger="kvevents.index.prefix"):
        index = index_with(SALTED, partial)
    stats = index.stats()
    assert (stats.block_size_mismatches, stats.partial_stores, stats.bad_events) == (0, 1, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert matched(index, cache_salt="tenant-a") == 3


@pytest.mark.parametrize("packed", [True, False])
def test_placeholder_store_is_not_a_mismatch(
    packed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The offloading connector's placeholder (no tokens, block_size 0) is a partial store:
    not a mismatch, not a bad event, no ERROR, nothing indexed."""
    placeholder = vllm_store([77], [], None, block_size=0, locality="LOCAL", ownership="x")
    placeholder["medium"] = "CPU"
    with caplog.at_level(logging.DEBUG, logger="kvevents.index.prefix"):
        index = index_with(placeholder, packed=packed)
    stats = index.stats()
    assert (stats.block_size_mismatches, stats.partial_stores, stats.bad_events) == (0, 1, 0)
    assert stats.entries == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_removal_of_a_partial_store_is_not_unknown() -> None:
    """vLLM removes a partial block's hash when the block grows full: that removal is of a
    block the stream sent, so it is not counted as an unknown removal (another one still is)."""
    partial = vllm_store([99], PROMPT[:5], None, block_size=5)
    removed = {"type": "BlockRemoved", "block_hashes": [99, 98], "medium": "GPU"}
    index = index_with(partial, removed)
    assert (index.stats().unknown_removals, index.stats().partial_stores) == (1, 1)


def test_query_fields_are_in_the_openapi_description() -> None:
    """/openapi.json describes cache_salt and mm_items (derived from QueryBody)."""
    from kvevents.http._openapi import openapi_document

    schemas = openapi_document()["components"]["schemas"]
    assert {"cache_salt", "mm_items"} <= set(schemas["QueryBody"]["properties"])
    assert set(schemas["MMItem"]["properties"]) == {"hash", "offset", "length"}


def test_other_block_size_is_still_a_mismatch() -> None:
    """A full-size store of another block size (several hashes) is still a mismatch."""
    index = index_with(vllm_store([1, 2], list(range(16)), None, block_size=8))
    assert (index.stats().block_size_mismatches, index.stats().partial_stores) == (1, 0)


# ----------------------------------------------------------------- wire


NEW_FIELDS = {
    "lookahead_token_ids": [5, 6],
    "session_id": "s1",
    "locality": "LOCAL",
    "ownership": "owner-1",
}


def test_newer_store_fields_are_decoded() -> None:
    """vLLM 0.33's lookahead_token_ids, session_id and SGLang's cache_salt reach the event on
    every decode path (typed, packed, generic); locality and ownership the packed one."""
    event = vllm_store([1], PROMPT[:BS], [["s"]], **NEW_FIELDS, cache_salt="c")
    typed = decode_batch(payload(event)).batch.events[0]
    packed = decode_batch_packed(payload(event)).batch.events[0]
    odd = {**event, "unknown_tag_field": {"nested": [1]}, "group_idx": 0}
    generic = decode_batch(payload(odd, ["Unknown"])).batch.events[0]  # type: ignore[arg-type]
    assert isinstance(typed, BlockStored) and isinstance(packed, PackedStored)
    for got in (typed, packed, generic):
        assert (got.lookahead_token_ids, got.session_id, got.cache_salt) == ([5, 6], "s1", "c")
    assert (packed.locality, packed.ownership) == ("LOCAL", "owner-1")
    assert typed.extra_keys == [["s"]] and packed.extras() == [["s"]]


def test_bad_lookahead_skips_only_that_event() -> None:
    """A lookahead_token_ids that is not a list of ints costs its event only (generic path)."""
    bad = vllm_store([1], PROMPT[:BS], None, lookahead_token_ids="x")
    good = vllm_store([2], PROMPT[:BS], None)
    decoded = decode_batch(payload(bad, good))
    assert [e.block_hashes for e in decoded.batch.events] == [[2]]  # type: ignore[union-attr]
    assert decoded.skipped[0].path == "$[1][0].lookahead_token_ids"


# ----------------------------------------------------------------- service


def service_with(*events: dict[str, Any]) -> IndexService:
    return IndexService(index_with(*events))


def test_query_body_takes_cache_salt_and_mm_items() -> None:
    """POST /query's cache_salt and mm_items reach the index (the lean reader's answer)."""
    mm = vllm_store([21, 22], PROMPT[: 2 * BS], [[["img", 4]], [["img", -12]]])
    reader = QueryReader(service_with(SALTED))
    mm_reader = QueryReader(service_with(mm))

    def scores(r: QueryReader, **body: Any) -> Any:
        return r.answer(msgspec.json.encode({"token_ids": PROMPT, **body}))["scores"]

    assert scores(reader, cache_salt="tenant-a") == {"w0": {"0": 3}}
    assert scores(reader) == {}
    assert scores(reader, cache_salt="tenant-b") == {}
    item = {"hash": "img", "offset": 4, "length": 20}
    assert scores(mm_reader, mm_items=[item]) == {"w0": {"0": 2}}
    assert scores(mm_reader) == {}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"token_ids": [1], "mm_items": [{"hash": "i", "offset": -1, "length": 1}]}, "offset"),
        ({"token_ids": [1], "mm_items": [{"hash": "", "offset": 0, "length": 1}]}, "hash"),
        ({"token_ids": [1], "cache_salt": 5}, "cache_salt"),
        ({"block_hashes": [1], "cache_salt": "s"}, "not block_hashes"),
    ],
)
def test_bad_salt_or_items_are_a_400(body: dict[str, Any], error: str) -> None:
    """A bad cache_salt or mm_items is a BadRequest naming the field."""
    from kvevents.http import BadRequest

    with pytest.raises(BadRequest, match=error):
        QueryReader(service_with()).answer(msgspec.json.encode(body))


def test_random_salted_traffic_keeps_unsalted_matches() -> None:
    """Salted stores of the same tokens beside unsalted ones leave the unsalted match whole."""
    rng = random.Random(3)
    events = [vllm_store([1, 2, 3], PROMPT, [None, None, None])]
    for n in range(5):
        salt = rng.choice(["a", "b", "c"])
        events.append(vllm_store([10 * n + 10 + i for i in range(3)], PROMPT, [[salt], None, None]))
    index = index_with(*events)
    assert matched(index) == 3


def test_packed_decode_bounds_extra_keys() -> None:
    """The feed's packed decode keeps extra_keys encoded and skips a store whose extra_keys
    are over max_extra_bytes, keeping the rest of the batch."""
    from kvevents.wire import DecodeLimits

    big = vllm_store([1], PROMPT[:BS], [["x" * 100]])
    small = vllm_store([2], PROMPT[:BS], [["s"]])
    decoded = decode_batch_packed(payload(big, small), limits=DecodeLimits(max_extra_bytes=64))
    assert [e.block_hashes for e in decoded.batch.events] == [[2]]  # type: ignore[union-attr]
    assert decoded.skipped[0].path == "$[1][0].extra_keys"

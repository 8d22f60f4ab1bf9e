"""Engine-shaped wire fixtures: payloads shaped like vLLM's (every era), SGLang's and
TensorRT-LLM's real output, each with the batch a tolerant decoder must read from it; plus
typical batches and heartbeats for load tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = [
    "WireFixture",
    "heartbeat",
    "sglang_array_fixture",
    "sglang_map_fixture",
    "tensorrt_llm_fixture",
    "typical_batch",
    "vllm_array_fixture",
    "vllm_bytes_hash_fixture",
    "vllm_map_fixture",
    "vllm_v09_fixture",
    "wire_fixtures",
]


def typical_batch(step: int, *, blocks: int = 16, block_size: int = 16) -> KVEventBatch:
    """One prefill step: ``blocks`` stored blocks of ``block_size`` tokens, and a removal."""
    base = step * 1000
    hashes = [base + i + 1 for i in range(blocks)]
    tokens = list(range(base, base + blocks * block_size))
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=block_size,
        medium="GPU",
    )
    removed = BlockRemoved(block_hashes=[base - 1000 + 1], medium="GPU")
    return KVEventBatch(ts=time.time(), events=[stored, removed], data_parallel_rank=0)


def heartbeat() -> KVEventBatch:
    """An empty batch (used as a probe: it changes no state)."""
    return KVEventBatch(ts=time.time(), events=[], data_parallel_rank=None)


@dataclass(frozen=True)
class WireFixture:
    """A payload shaped like ``engine`` emits it, and the batch it must decode to."""

    engine: str
    payload: bytes
    expected: KVEventBatch


_U64 = 2**64 - 1
_TS = 1_750_000_000.25


def _enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def vllm_v09_fixture() -> WireFixture:
    """vLLM 0.9: 2-element batch, array events, 5 stored fields, removal without medium."""
    payload = _enc([_TS, [["BlockStored", [_U64, 7], None, list(range(8)), 4, None]]])
    stored = BlockStored(
        block_hashes=[_U64, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4
    )
    return WireFixture("vllm-0.9", payload, KVEventBatch(_TS, [stored], None))


def vllm_array_fixture() -> WireFixture:
    """vLLM 0.16 array era: tagged arrays with medium and lora_name, unsigned hashes."""
    events = [
        ["BlockStored", [_U64 - 1, _U64], 12, list(range(32)), 16, None, "GPU", None],
        ["BlockRemoved", [12], "GPU"],
        ["AllBlocksCleared"],
    ]
    payload = _enc([_TS, events, 1])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[_U64 - 1, _U64],
                parent_block_hash=12,
                token_ids=list(range(32)),
                block_size=16,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[12], medium="GPU"),
            AllBlocksCleared(),
        ],
        1,
    )
    return WireFixture("vllm-array", payload, expected)


def vllm_map_fixture() -> WireFixture:
    """vLLM map era: map events with every always-present key, optional keys set."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [2**63 + 5],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [2**63 + 5], "medium": "GPU"}
    payload = _enc([_TS, [stored, removed], 0])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[2**63 + 5],
                token_ids=list(range(16)),
                block_size=16,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[2**63 + 5], medium="GPU"),
        ],
        0,
    )
    return WireFixture("vllm-map", payload, expected)


def vllm_bytes_hash_fixture() -> WireFixture:
    """vLLM with integer hashes off: 32-byte digests, read as their last 8 bytes."""
    digest = bytes(range(32))
    as_int = int.from_bytes(digest[-8:], "big")
    events = [["BlockStored", [digest], None, list(range(4)), 4, None, "GPU", None]]
    expected = BlockStored(
        block_hashes=[as_int], token_ids=list(range(4)), block_size=4, medium="GPU"
    )
    return WireFixture("vllm-bytes", _enc([_TS, events, 0]), KVEventBatch(_TS, [expected], 0))


def sglang_map_fixture() -> WireFixture:
    """SGLang map events: signed hashes, no lora_name/medium when nil, salt and session."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [-(2**63), -5],
        "parent_block_hash": -9,
        "token_ids": list(range(2)),
        "block_size": 1,
        "lora_id": None,
        "cache_salt": "tenant-a",
        "session_id": "s1",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [-5]}
    payload = _enc([_TS, [stored, removed], 3])
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[-(2**63), -5],
                parent_block_hash=-9,
                token_ids=[0, 1],
                block_size=1,
                cache_salt="tenant-a",
                session_id="s1",
            ),
            BlockRemoved(block_hashes=[-5]),
        ],
        3,
    )
    return WireFixture("sglang-map", payload, expected)


def sglang_array_fixture() -> WireFixture:
    """SGLang array events: a salted store carries a metadata map where vLLM has lora_name."""
    events = [
        ["BlockStored", [-1, -2], None, list(range(4)), 2, None, "CPU_PINNED", {"salt": "x"}],
        ["BlockRemoved", [-1], "CPU_PINNED"],
        ["NewTagFromTheFuture", 1, 2],
    ]
    expected = KVEventBatch(
        _TS,
        [
            BlockStored(
                block_hashes=[-1, -2], token_ids=list(range(4)), block_size=2, medium="CPU_PINNED"
            ),
            BlockRemoved(block_hashes=[-1], medium="CPU_PINNED"),
        ],
        0,
    )
    return WireFixture("sglang-array", _enc([_TS, events, 0]), expected)


def tensorrt_llm_fixture() -> WireFixture:
    """TensorRT-LLM: map events, signed 64-bit hashes, a cache reset, DP rank set."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [-42, 2**63 - 1],
        "parent_block_hash": 17,
        "token_ids": list(range(64)),
        "block_size": 32,
        "lora_id": 3,
        "medium": "GPU",
        "lora_name": "adapter",
    }
    payload = _enc([_TS, [{"type": "AllBlocksCleared"}, stored], 2])
    expected = KVEventBatch(
        _TS,
        [
            AllBlocksCleared(),
            BlockStored(
                block_hashes=[-42, 2**63 - 1],
                parent_block_hash=17,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=3,
                medium="GPU",
                lora_name="adapter",
            ),
        ],
        2,
    )
    return WireFixture("tensorrt-llm", payload, expected)


def wire_fixtures() -> list[WireFixture]:
    """Every engine-shaped fixture."""
    return [
        vllm_v09_fixture(),
        vllm_array_fixture(),
        vllm_map_fixture(),
        vllm_bytes_hash_fixture(),
        sglang_map_fixture(),
        sglang_array_fixture(),
        tensorrt_llm_fixture(),
    ]

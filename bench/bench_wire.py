"""Codec throughput: kvevents encode/decode vs plain msgspec on the same data."""

from __future__ import annotations

import msgspec

from harness import Row, throughput
from kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvevents.wire import decode_batch, encode_batch

BLOCK = 16


def stored(n_blocks: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, n_blocks + 1)],
        parent_block_hash=parent,
        token_ids=[(i * 7919) % 128_000 for i in range(n_blocks * BLOCK)],
        block_size=BLOCK,
        medium="GPU",
    )


CASES = {
    "1 block": KVEventBatch(ts=1.7e9, events=[stored(1)], data_parallel_rank=0),
    "typical (16 blocks + removal)": KVEventBatch(
        ts=1.7e9,
        events=[stored(16, parent=12345), BlockRemoved(block_hashes=[1, 2, 3], medium="GPU")],
        data_parallel_rank=0,
    ),
    "8k-token prefill (512 blocks)": KVEventBatch(
        ts=1.7e9, events=[stored(512)], data_parallel_rank=0
    ),
}


def run() -> list[Row]:
    rows: list[Row] = []
    for case, batch in CASES.items():
        payload = encode_batch(batch)
        plain = msgspec.to_builtins(batch)  # the same data as plain lists and dicts
        mb = len(payload) / 1e6
        enc = throughput(lambda b=batch: encode_batch(b))
        enc_base = throughput(lambda p=plain: msgspec.msgpack.encode(p))
        dec = throughput(lambda p=payload: decode_batch(p))
        dec_base = throughput(lambda p=payload: msgspec.msgpack.decode(p))
        array_form = msgspec.msgpack.encode(
            [plain[0], [[e.pop("type"), *e.values()] for e in plain[1]], plain[2]]
        )
        dec_array = throughput(lambda p=array_form: decode_batch(p))
        # SGLang's salted array stores put a metadata map where lora_name goes: per-event path.
        irregular = msgspec.msgpack.decode(array_form)
        irregular[1][0] = [*irregular[1][0][:7], {"cache_salt": "s"}]
        irregular_form = msgspec.msgpack.encode(irregular)
        dec_generic = throughput(lambda p=irregular_form: decode_batch(p))
        section = f"wire codec: {case}, {len(payload):,} bytes"
        rows += [
            Row(
                section,
                "encode",
                "throughput",
                enc,
                "batches/s",
                enc_base,
                "msgspec untyped encode",
            ),
            Row(section, "encode", "bandwidth", enc * mb, "MB/s"),
            Row(
                section,
                "decode, map events (typed)",
                "throughput",
                dec,
                "batches/s",
                dec_base,
                "msgspec untyped decode",
            ),
            Row(section, "decode, map events (typed)", "bandwidth", dec * mb, "MB/s"),
            Row(
                section,
                "decode, array-era events (typed)",
                "throughput",
                dec_array,
                "batches/s",
                dec_base,
                "msgspec untyped decode",
            ),
            Row(
                section,
                "decode, SGLang metadata arrays (per event)",
                "throughput",
                dec_generic,
                "batches/s",
                dec_base,
                "msgspec untyped decode",
            ),
        ]
    return rows

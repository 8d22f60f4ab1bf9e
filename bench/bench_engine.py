"""Engine side: what the recorder's bookkeeping costs, and what one simulated engine sustains.

- Recorder per stored block: a step storing a 16-block chain through ``record_stored`` and
  ``flush``, against building the same ``BlockStored`` and batch directly (no dedup, no parent
  check, no merging) in the same run.
- Recorder per step: a typical decode step (one stored block, one removal), and an empty step.
- Engine: the synthetic Mooncake trace in virtual time through one engine (one rank), with a
  null sink and with every batch encoded by ``kvevents.wire.encode_batch``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness import Row, throughput
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publish._recorder import EventRecorder
from kvevents.sim._engine import EngineConfig, SimulatedEngine
from kvevents.sim._hashing import engine_chain_hashes
from kvevents.sim._trace import default_trace_path, load_trace, run_trace
from kvevents.wire import encode_batch

TRACE = Path(default_trace_path())
BS = 16
CHAIN = 16
ROWS = int(os.environ.get("KVEVENTS_BENCH_TRACE_ROWS", "1500"))


def _chain() -> tuple[list[int], list[list[int]]]:
    tokens = list(range(BS * CHAIN))
    return engine_chain_hashes(tokens, BS), [tokens[i * BS : (i + 1) * BS] for i in range(CHAIN)]


def recorder_rows() -> list[Row]:
    hashes, blocks = _chain()
    root = EventRecorder(BS, rank=0)
    root.record_stored(1, None, [0] * BS)  # so every chain has an announced parent
    root.flush(ts=0.0)

    def with_recorder() -> None:
        parent = 1
        for h, toks in zip(hashes, blocks, strict=True):
            root.record_stored(h, parent, toks)
            parent = h
        root.flush(ts=0.0)
        for h in hashes:  # forget them so the next call stores again (not part of the figure)
            root._held["GPU"].discard(h)

    def direct() -> None:
        tokens: list[int] = []
        for toks in blocks:
            tokens.extend(toks)
        event = BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=1,
            token_ids=tokens,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        KVEventBatch(0.0, [event], 0)

    rec_rate, base_rate = throughput(with_recorder), throughput(direct)
    per_block = 1e9 / (rec_rate * CHAIN)
    return [
        Row(
            "recorder",
            f"{CHAIN}-block chain in one step",
            "cost per stored block",
            per_block,
            "ns",
            1e9 / (base_rate * CHAIN),
            "building BlockStored directly",
        ),
        *step_rows(hashes, blocks),
    ]


def step_rows(hashes: list[int], blocks: list[list[int]]) -> list[Row]:
    rec = EventRecorder(BS, rank=0)
    rec.record_stored(hashes[0], None, blocks[0])
    rec.flush(ts=0.0)
    state = {"i": 0}

    def decode_step() -> None:
        h = 10_000 + state["i"]
        state["i"] += 1
        rec.record_stored(h, hashes[0], blocks[1])
        rec.record_removed(h)
        rec.flush(ts=0.0)

    def direct_step() -> None:
        stored = BlockStored(
            block_hashes=[5],
            parent_block_hash=hashes[0],
            token_ids=blocks[1],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        KVEventBatch(0.0, [stored, BlockRemoved(block_hashes=[5], medium="GPU")], 0)

    empty = EventRecorder(BS, rank=0)
    step_rate, base_rate = throughput(decode_step), throughput(direct_step)
    return [
        Row(
            "recorder",
            "decode step: 1 store + 1 removal",
            "cost per step",
            1e6 / step_rate,
            "us",
            1e6 / base_rate,
            "building the two events directly",
        ),
        Row(
            "recorder",
            "empty step",
            "cost per flush",
            1e9 / throughput(lambda: empty.flush()),
            "ns",
        ),
    ]


class _NullSink:
    def publish(self, batch: KVEventBatch) -> None:
        return None


class _EncodingSink:
    def __init__(self) -> None:
        self.bytes = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.bytes += len(encode_batch(batch))


def engine_rows() -> list[Row]:
    if not TRACE.exists():
        return []
    rows = load_trace(TRACE, limit=ROWS)
    cfg = EngineConfig(block_size=BS, capacity_blocks=65536, cpu_capacity_blocks=0, ranks=1)
    out: list[Row] = []
    for name, sink in (("null sink", _NullSink()), ("encode_batch sink", _EncodingSink())):
        engine = SimulatedEngine(cfg, publishers=[sink])
        start = time.perf_counter()
        run_trace(engine, rows)
        wall = time.perf_counter() - start
        stats = engine.recorder_stats(0)
        blocks = stats.blocks_stored + stats.blocks_removed
        events = stats.stored_events + stats.removed_events + stats.clears
        case = f"{ROWS} trace rows, block_size {BS}, {name}"
        out += [
            Row(
                "engine",
                case,
                "events/s",
                events / wall,
                "/s",
            ),
            Row("engine", case, "blocks/s (stored + removed)", blocks / wall, "/s"),
            Row("engine", case, "batches/s", stats.batches / wall, "/s"),
            Row("engine", case, "prompt tokens/s", engine.metrics().input_tokens / wall, "/s"),
        ]
    return out


def run() -> list[Row]:
    return recorder_rows() + engine_rows()

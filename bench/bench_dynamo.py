"""Baseline: NVIDIA Dynamo's standalone KV indexer fed over ZeroMQ by 16 publishers (issue 6).

Sixteen raw pyzmq PUB sockets (one per worker) send pre-encoded batches in our wire format,
one ``BlockStored`` of 16 blocks x 16 tokens per batch, 80k blocks per worker, 1.28M in all.
Every worker holds distinct 8k-token prompts (512 blocks, chained), so each block is its own
node in Dynamo's tree. Measured: ingest rate (first send until every worker's last batch is
indexed), HTTP ``/query`` latency for 8k-token prompts, and resident memory per block.

The pieces are importable (``build_workload``, ``measure_dynamo``) so the index benchmark can
run the same stream through our index side by side. Reference figures (issue 6, a 2-core
machine): 1.28M blocks in < 0.9 s (>= 1.4M blocks/s), query p50 0.8 ms / p99 1.5 ms, ~124 B
per block.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import zmq

from harness import Row, median, percentile
from kvevents.events import BlockStored, KVEventBatch
from kvevents.testing.dynamo import DynamoIndexer, dynamo_unavailable_reason
from kvevents.testing.sockets import Deadline, wait_for
from kvevents.wire import encode_batch, pack_seq

SECTION = "Dynamo standalone indexer (baseline, HTTP + ZMQ)"
WORKERS = 16
BLOCKS_PER_WORKER = 80_000
BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
PROMPT_BLOCKS = 512  # 8,192 tokens
QUERIES = 2_000
INGEST_TIMEOUT = 60.0
MODEL = "bench"
# Every worker ends with this root block: once a query sees it on all workers, each worker's
# earlier batches were applied (a listener applies its stream in order).
SENTINEL_TOKENS = list(range(1, BLOCK_SIZE + 1))


@dataclass(frozen=True)
class Workload:
    """Pre-encoded batches per worker, plus the token ranges of their prompts."""

    block_size: int
    payloads: list[list[bytes]]  # per worker, in publish order
    prompts: list[list[tuple[int, int]]]  # per worker: (first token id, blocks)
    blocks: int

    def prompt_tokens(self, worker: int, index: int) -> list[int]:
        first, blocks = self.prompts[worker][index]
        return list(range(first, first + blocks * self.block_size))


def build_workload(
    workers: int = WORKERS,
    blocks_per_worker: int = BLOCKS_PER_WORKER,
    *,
    block_size: int = BLOCK_SIZE,
    blocks_per_event: int = BLOCKS_PER_EVENT,
    prompt_blocks: int = PROMPT_BLOCKS,
) -> Workload:
    """Distinct chained prompts per worker, cut into one-event batches."""
    payloads: list[list[bytes]] = []
    prompts: list[list[tuple[int, int]]] = []
    next_token = 1_000
    for worker in range(workers):
        mine: list[bytes] = []
        spans: list[tuple[int, int]] = []
        left = blocks_per_worker
        while left:
            blocks = min(prompt_blocks, left)
            spans.append((next_token, blocks))
            mine += _prompt_batches(worker, next_token, blocks, block_size, blocks_per_event)
            next_token += blocks * block_size
            left -= blocks
        payloads.append(mine)
        prompts.append(spans)
    return Workload(block_size, payloads, prompts, workers * blocks_per_worker)


def _prompt_batches(
    worker: int, first_token: int, blocks: int, block_size: int, per_event: int
) -> list[bytes]:
    out: list[bytes] = []
    parent: int | None = None
    for start in range(0, blocks, per_event):
        count = min(per_event, blocks - start)
        tokens = first_token + start * block_size
        # Engine hashes: opaque, unique per worker and block (the token id is unique).
        hashes = [(worker << 40) | (tokens + i * block_size) for i in range(count)]
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(range(tokens, tokens + count * block_size)),
            block_size=block_size,
        )
        out.append(encode_batch(KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0)))
        parent = hashes[-1]
    return out


def _root_payload(worker: int, tokens: list[int], tag: int) -> bytes:
    event = BlockStored(
        block_hashes=[(worker << 40) | tag],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=len(tokens),
    )
    return encode_batch(KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0))


@dataclass(frozen=True)
class DynamoFigures:
    """What one run measured."""

    blocks: int
    send_seconds: float
    ingest_seconds: float
    rss_before: int
    rss_after: int
    query_ms: list[float]

    @property
    def blocks_per_second(self) -> float:
        return self.blocks / self.ingest_seconds

    @property
    def bytes_per_block(self) -> float:
        return (self.rss_after - self.rss_before) / self.blocks


class _Publishers:
    """One PUB socket per worker, each with its own dense sequence numbers."""

    def __init__(self, ctx: zmq.Context[Any], count: int) -> None:
        self.sockets: list[zmq.Socket[Any]] = []
        self.seqs = [0] * count
        for _ in range(count):
            sock = ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # queue rather than drop: the run must be lossless
            sock.bind("tcp://127.0.0.1:0")
            self.sockets.append(sock)

    def endpoint(self, worker: int) -> str:
        return str(self.sockets[worker].getsockopt_string(zmq.LAST_ENDPOINT))

    def send(self, worker: int, payload: bytes) -> None:
        seq = self.seqs[worker]
        self.seqs[worker] = seq + 1
        self.sockets[worker].send_multipart([b"", pack_seq(seq), payload])

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def _workers_holding(indexer: DynamoIndexer, tokens: list[int]) -> set[int]:
    matched = indexer.matched_blocks(tokens, len(tokens))
    return {worker for (worker, _rank), blocks in matched.items() if blocks}


def _connect(indexer: DynamoIndexer, pubs: _Publishers, workers: int) -> None:
    """Register every worker and handshake: each one's probe block is indexed."""
    for worker in range(workers):
        indexer.register(worker, pubs.endpoint(worker), block_size=BLOCK_SIZE)
    probe = list(range(100, 100 + BLOCK_SIZE))

    def all_seen() -> bool:
        for worker in range(workers):
            pubs.send(worker, _root_payload(worker, probe, 1))
        return len(_workers_holding(indexer, probe)) == workers

    wait_for(all_seen, timeout=30.0, interval=0.05, what="every worker's probe to be indexed")


def _send_all(pubs: _Publishers, work: Workload) -> None:
    """Every batch, interleaved across workers as concurrent engines would, then sentinels."""
    workers = len(work.payloads)
    for round_ in range(max(len(p) for p in work.payloads)):
        for worker in range(workers):
            if round_ < len(work.payloads[worker]):
                pubs.send(worker, work.payloads[worker][round_])
    for worker in range(workers):
        pubs.send(worker, _root_payload(worker, SENTINEL_TOKENS, 2))


def _wait_indexed(indexer: DynamoIndexer, workers: int) -> None:
    deadline = Deadline(INGEST_TIMEOUT)
    while len(done := _workers_holding(indexer, SENTINEL_TOKENS)) < workers:
        if deadline.expired:
            raise RuntimeError(f"only workers {sorted(done)} indexed within {INGEST_TIMEOUT}s")
        time.sleep(0.002)


def _ingest(
    indexer: DynamoIndexer, pubs: _Publishers, work: Workload, *, paused: bool
) -> tuple[float, float]:
    """(send seconds, seconds until everything is indexed).

    Live, the clock starts with the first send, so a slow sender bounds the rate. Paused, the
    indexer is stopped (SIGSTOP) while we send, so the stream waits in socket buffers and the
    clock starts at SIGCONT: that is Dynamo's own receive + decode + apply rate.
    """
    if paused:
        os.kill(indexer.pid, signal.SIGSTOP)
    try:
        start = time.perf_counter()
        _send_all(pubs, work)
        sent = time.perf_counter() - start
    finally:
        if paused:
            start = time.perf_counter()
            os.kill(indexer.pid, signal.SIGCONT)
    _wait_indexed(indexer, len(work.payloads))
    return sent, time.perf_counter() - start


def _verify(indexer: DynamoIndexer, work: Workload) -> None:
    """Each worker's first and last prompt are fully indexed, on that worker."""
    for worker, spans in enumerate(work.prompts):
        for index in (0, len(spans) - 1):
            tokens = work.prompt_tokens(worker, index)
            got = indexer.matched_blocks(tokens, work.block_size).get((worker, 0), 0)
            if got != spans[index][1]:
                raise RuntimeError(
                    f"worker {worker} prompt {index}: {got}/{spans[index][1]} blocks"
                )


def _query_latencies(indexer: DynamoIndexer, work: Workload, count: int) -> list[float]:
    if count == 0:
        return []
    rng = random.Random(6)
    full = [
        (w, i)
        for w, spans in enumerate(work.prompts)
        for i, (_, b) in enumerate(spans)
        if b == PROMPT_BLOCKS
    ]
    bodies = [
        json.dumps({"token_ids": work.prompt_tokens(w, i), "model_name": MODEL}).encode()
        for w, i in rng.sample(full, 64)
    ]
    for body in bodies:  # warm-up, and a check that the answers are right
        status, reply = indexer.send("POST", "/query", body)
        assert status == 200 and str(PROMPT_BLOCKS * BLOCK_SIZE) in reply.decode()
    samples = []
    for n in range(count):
        t0 = time.perf_counter()
        status, _ = indexer.send("POST", "/query", bodies[n % len(bodies)])
        samples.append((time.perf_counter() - t0) * 1e3)
        assert status == 200
    return samples


def measure_dynamo(
    work: Workload, *, queries: int = QUERIES, paused: bool = False
) -> DynamoFigures:
    """Start the indexer, stream ``work`` into it, and measure; the indexer is stopped after.

    ``paused``: pre-queue the stream while the indexer is stopped (see ``_ingest``).
    """
    ctx: zmq.Context[Any] = zmq.Context()
    pubs = _Publishers(ctx, len(work.payloads))
    try:
        with DynamoIndexer(model_name=MODEL) as indexer:
            _connect(indexer, pubs, len(work.payloads))
            time.sleep(0.2)  # let the probe round's allocations settle before the baseline RSS
            before = indexer.rss_bytes()
            sent, ingest = _ingest(indexer, pubs, work, paused=paused)
            _verify(indexer, work)
            after = indexer.rss_bytes()
            latencies = _query_latencies(indexer, work, queries)
    finally:
        pubs.close()
        ctx.term()
    return DynamoFigures(work.blocks, sent, ingest, before, after, latencies)


def run() -> list[Row]:
    reason = dynamo_unavailable_reason()
    if reason is not None:
        return [Row(SECTION, f"skipped: {reason}", "available", 0.0, "")]
    work = build_workload()
    live = measure_dynamo(work)
    queued = measure_dynamo(work, queries=0, paused=True)
    case = f"{WORKERS} publishers x {BLOCKS_PER_WORKER:,} blocks"
    query_case = f"8k-token /query, {WORKERS} workers"
    ingest_target = "reference: >= 1.4M blocks/s (1.28M in < 0.9 s)"
    return [
        Row(
            SECTION, case, "ingest, live", live.blocks_per_second, "blocks/s", target=ingest_target
        ),
        Row(SECTION, case, "ingest time, live", live.ingest_seconds, "s"),
        Row(SECTION, case, "of which raw send (Python, 16 PUB)", live.send_seconds, "s"),
        Row(
            SECTION,
            case,
            "ingest, pre-queued (indexer paused while sending)",
            queued.blocks_per_second,
            "blocks/s",
            target=ingest_target,
        ),
        Row(SECTION, query_case, "p50", median(live.query_ms), "ms", target="reference: 0.8 ms"),
        Row(
            SECTION,
            query_case,
            "p99",
            percentile(live.query_ms, 99),
            "ms",
            target="reference: 1.5 ms",
        ),
        Row(
            SECTION,
            case,
            "memory (RSS growth)",
            live.bytes_per_block,
            "B/block",
            target="reference: ~124 B/block",
        ),
    ]

"""Side by side on one stream: our index service against NVIDIA Dynamo's standalone indexer.

Both run in a process of their own and get the very same stream, sent by the same code:
sixteen raw pyzmq PUB sockets (one per worker) send pre-encoded batches in our wire format,
one ``BlockStored`` of 16 blocks x 16 tokens per batch, 80k blocks per worker, 1.28M in all.
Every worker holds distinct 8k-token prompts (512 blocks, chained), so each block is its own
entry in either index. The same handshake (each worker's probe block is indexed), sentinel
check, verification and HTTP client (``http.client``, pre-encoded bodies) are used for both.
Measured per indexer: ingest rate live (first send until every worker's sentinel is indexed),
ingest rate pre-queued (the indexer is SIGSTOPped while we send, the clock starts at SIGCONT),
HTTP ``/query`` latency for 8k-token prompts on one kept-alive connection and with a new
connection per query, the throughput and latency of ``CLIENTS`` concurrent kept-alive clients
(one process each, started together), and resident memory growth per block.

Each indexer and mode runs three times, interleaved; the figures are medians (latencies
pooled). Ours is the value, Dynamo's the same-run baseline. Issue 6 targets: through decoding, keep up
with Dynamo's rate on this stream; HTTP query p99 no slower than Dynamo's; bytes per block no
more than Dynamo's. Reference figures from the issue (a 2-core machine): Dynamo ingested 1.28M
blocks in < 0.9 s (>= 1.4M blocks/s), answered in p50 0.8 ms / p99 1.5 ms, ~124 B per block.
Issue 11 adds: both ingest modes at least Dynamo's rate; ``/query`` no slower kept alive or
with a new connection per query; Dynamo's throughput with ``CLIENTS`` concurrent clients.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from harness import Row, median, percentile
from kvevents.events import BlockStored, KVEventBatch
from kvevents.testing.dynamo import DynamoIndexer, dynamo_unavailable_reason
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.sockets import Deadline, wait_for
from kvevents.wire import encode_batch, pack_seq

SECTION = "Our index service vs Dynamo's standalone indexer, same stream (HTTP + ZMQ)"
BASELINE = "Dynamo 1.6.1"
WORKERS = 16
BLOCKS_PER_WORKER = 80_000
BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
PROMPT_BLOCKS = 512  # 8,192 tokens
QUERIES = 2_000
#: Queries per run with a new connection for each (connect, request, answer, close).
QUERIES_NEW_CONNECTION = 1_000
#: Concurrent kept-alive clients (processes), and the queries each sends.
CLIENTS = 4
QUERIES_PER_CLIENT = 1_500
INGEST_TIMEOUT = 60.0
MODEL = "bench"
# Every worker ends with this root block: once a query sees it on all workers, each worker's
# earlier batches were applied (a listener applies its stream in order).
SENTINEL_TOKENS = list(range(1, BLOCK_SIZE + 1))
# Seconds between sentinel queries while ingesting: the polls cost the indexer CPU on the two
# cores it shares with the stream (a Python HTTP stack much more than a Rust one), so they
# are sparse; the clock's resolution is this interval (about 1% of a run).
SENTINEL_POLL = 0.01
# Seconds between the end of the stream and the resident-memory reading, for both indexers.
SETTLE = 1.0


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


class Peer(Protocol):
    """What the benchmark needs from an indexer in its own process (both test peers have it)."""

    @property
    def pid(self) -> int: ...
    @property
    def port(self) -> int: ...
    def register(self, worker: int, endpoint: str, *, block_size: int) -> None: ...
    def matched_blocks(self, token_ids: Sequence[int], block_size: int) -> dict[Any, int]: ...
    def send(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]: ...
    def rss_bytes(self) -> int: ...


PeerFactory = Callable[[], AbstractContextManager[Peer]]


def dynamo_peer() -> AbstractContextManager[Peer]:
    return DynamoIndexer(model_name=MODEL)


def service_peer() -> AbstractContextManager[Peer]:
    return ServiceIndexer()


@dataclass(frozen=True)
class Figures:
    """What one run against one indexer measured."""

    blocks: int
    send_seconds: float
    ingest_seconds: float
    rss_before: int
    rss_after: int
    query_ms: list[float]
    new_connection_ms: list[float] = dataclasses.field(default_factory=list)
    concurrent_ms: list[float] = dataclasses.field(default_factory=list)
    concurrent_qps: float = float("nan")
    concurrent_cpu_us: float = float("nan")  # the indexer's CPU (all threads) per query

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


def _blocks_of(matched: dict[Any, int], worker: int) -> int:
    """Blocks matched on ``worker`` rank 0; Dynamo names workers by int, we by str."""
    return matched.get((worker, 0), 0) or matched.get((str(worker), 0), 0)


def _workers_holding(peer: Peer, tokens: list[int], workers: int) -> set[int]:
    matched = peer.matched_blocks(tokens, len(tokens))
    return {worker for worker in range(workers) if _blocks_of(matched, worker)}


def _connect(peer: Peer, pubs: _Publishers, workers: int) -> None:
    """Register every worker and handshake: each one's probe block is indexed."""
    for worker in range(workers):
        peer.register(worker, pubs.endpoint(worker), block_size=BLOCK_SIZE)
    probe = list(range(100, 100 + BLOCK_SIZE))

    def all_seen() -> bool:
        for worker in range(workers):
            pubs.send(worker, _root_payload(worker, probe, 1))
        return len(_workers_holding(peer, probe, workers)) == workers

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


def _wait_indexed(peer: Peer, workers: int) -> None:
    deadline = Deadline(INGEST_TIMEOUT)
    while len(done := _workers_holding(peer, SENTINEL_TOKENS, workers)) < workers:
        if deadline.expired:
            raise RuntimeError(f"only workers {sorted(done)} indexed within {INGEST_TIMEOUT}s")
        time.sleep(SENTINEL_POLL)


def _ingest(peer: Peer, pubs: _Publishers, work: Workload, *, paused: bool) -> tuple[float, float]:
    """(send seconds, seconds until everything is indexed).

    Live, the clock starts with the first send, so a slow sender bounds the rate. Paused, the
    indexer is stopped (SIGSTOP) while we send, so the stream waits in socket buffers and the
    clock starts at SIGCONT: that is the indexer's own receive + decode + apply rate.
    """
    if paused:
        os.kill(peer.pid, signal.SIGSTOP)
    try:
        start = time.perf_counter()
        _send_all(pubs, work)
        sent = time.perf_counter() - start
    finally:
        if paused:
            start = time.perf_counter()
            os.kill(peer.pid, signal.SIGCONT)
    _wait_indexed(peer, len(work.payloads))
    return sent, time.perf_counter() - start


def _verify(peer: Peer, work: Workload) -> None:
    """Each worker's first and last prompt are fully indexed, on that worker."""
    for worker, spans in enumerate(work.prompts):
        for index in (0, len(spans) - 1):
            tokens = work.prompt_tokens(worker, index)
            got = _blocks_of(peer.matched_blocks(tokens, work.block_size), worker)
            if got != spans[index][1]:
                raise RuntimeError(
                    f"worker {worker} prompt {index}: {got}/{spans[index][1]} blocks"
                )


def _query_bodies(peer: Peer, work: Workload) -> list[bytes]:
    """64 pre-encoded 8k-token queries of fully indexed prompts; each answered right once."""
    rng = random.Random(6)
    full = [
        (w, i)
        for w, spans in enumerate(work.prompts)
        for i, (_, b) in enumerate(spans)
        if b == PROMPT_BLOCKS
    ]
    picked = rng.sample(full, 64)
    bodies = [
        json.dumps({"token_ids": work.prompt_tokens(w, i), "model_name": MODEL}).encode()
        for w, i in picked
    ]
    for (worker, index), body in zip(
        picked, bodies, strict=True
    ):  # warm-up, and the answers are right
        status, _ = peer.send("POST", "/query", body)
        matched = peer.matched_blocks(work.prompt_tokens(worker, index), work.block_size)
        assert status == 200 and _blocks_of(matched, worker) == PROMPT_BLOCKS
    return bodies


def _query_latencies(peer: Peer, bodies: list[bytes], count: int) -> list[float]:
    samples = []
    for n in range(count):
        t0 = time.perf_counter()
        status, _ = peer.send("POST", "/query", bodies[n % len(bodies)])
        samples.append((time.perf_counter() - t0) * 1e3)
        assert status == 200
    return samples


_HEADERS = {"Content-Type": "application/json"}


def _new_connection_latencies(port: int, bodies: list[bytes], count: int) -> list[float]:
    """Each query on a connection of its own: connect, request, answer, close."""
    samples = []
    for n in range(count):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
        try:
            conn.request("POST", "/query", body=bodies[n % len(bodies)], headers=_HEADERS)
            response = conn.getresponse()
            response.read()
        finally:
            conn.close()
        samples.append((time.perf_counter() - t0) * 1e3)
        assert response.status == 200
    return samples


def _client(port: int, bodies: list[bytes], count: int, start: Any, out: Any) -> None:
    """One concurrent client (its own process): ``count`` queries on one kept-alive
    connection, once every client is connected and warm; puts its latencies on ``out``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    try:
        for body in bodies[:8]:
            conn.request("POST", "/query", body=body, headers=_HEADERS)
            conn.getresponse().read()
        start.wait(30.0)
        samples = []
        for n in range(count):
            t0 = time.perf_counter()
            conn.request("POST", "/query", body=bodies[n % len(bodies)], headers=_HEADERS)
            response = conn.getresponse()
            response.read()
            samples.append((time.perf_counter() - t0) * 1e3)
            if response.status != 200:
                raise RuntimeError(f"/query answered {response.status}")
        out.put(samples)
    except BaseException as exc:
        out.put(repr(exc))
    finally:
        conn.close()


def _concurrent(
    port: int, bodies: list[bytes], clients: int, each: int
) -> tuple[float, list[float]]:
    """(queries per second, latencies) of ``clients`` processes querying at once.

    The clock runs from releasing them (all connected and warm) to the last one's answers.
    """
    mp = multiprocessing.get_context("spawn")
    start, out = mp.Barrier(clients + 1), mp.Queue()
    procs = [
        mp.Process(target=_client, args=(port, bodies, each, start, out)) for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    try:
        start.wait(60.0)
        t0 = time.perf_counter()
        results = [out.get(timeout=120.0) for _ in procs]
        elapsed = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"concurrent client failed: {failed[0]}")
    return clients * each / elapsed, [ms for r in results for ms in r]


def measure(
    peer_factory: PeerFactory, work: Workload, *, queries: int = QUERIES, paused: bool = False
) -> Figures:
    """Start an indexer, stream ``work`` into it, and measure; the indexer is stopped after.

    ``paused``: pre-queue the stream while the indexer is stopped (see ``_ingest``).
    """
    ctx: zmq.Context[Any] = zmq.Context()
    pubs = _Publishers(ctx, len(work.payloads))
    try:
        with peer_factory() as peer:
            _connect(peer, pubs, len(work.payloads))
            time.sleep(0.2)  # let the probe round's allocations settle before the baseline RSS
            before = peer.rss_bytes()
            sent, ingest = _ingest(peer, pubs, work, paused=paused)
            _verify(peer, work)
            time.sleep(SETTLE)  # steady state: what stays resident once the stream is over
            after = peer.rss_bytes()
            queried = _queries(peer, work, queries)
    finally:
        pubs.close()
        ctx.term()
    return Figures(work.blocks, sent, ingest, before, after, **queried)


def _queries(peer: Peer, work: Workload, queries: int) -> dict[str, Any]:
    """The query fields of :class:`Figures`: each mode in turn, none when ``queries`` is 0."""
    if queries == 0:
        return {"query_ms": []}
    bodies = _query_bodies(peer, work)
    kept = _query_latencies(peer, bodies, queries)
    fresh = _new_connection_latencies(peer.port, bodies, QUERIES_NEW_CONNECTION)
    cpu = _cpu_seconds(peer.pid)
    qps, concurrent = _concurrent(peer.port, bodies, CLIENTS, QUERIES_PER_CLIENT)
    cpu = _cpu_seconds(peer.pid) - cpu
    return {
        "query_ms": kept,
        "new_connection_ms": fresh,
        "concurrent_ms": concurrent,
        "concurrent_qps": qps,
        "concurrent_cpu_us": cpu / (CLIENTS * QUERIES_PER_CLIENT) * 1e6,
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_dynamo(work: Workload, *, queries: int = QUERIES, paused: bool = False) -> Figures:
    """``measure`` against Dynamo's standalone indexer."""
    return measure(dynamo_peer, work, queries=queries, paused=paused)


def measure_service(work: Workload, *, queries: int = QUERIES, paused: bool = False) -> Figures:
    """``measure`` against our index service (``kvevents serve``)."""
    return measure(service_peer, work, queries=queries, paused=paused)


def _row(metric: str, ours: float, theirs: float, unit: str, case: str, target: str = "") -> Row:
    return Row(SECTION, case, metric, ours, unit, theirs, BASELINE, target)


def rows(live: dict[str, Figures], queued: dict[str, Figures]) -> list[Row]:
    """Ours as the value, Dynamo's as the baseline, one row per figure."""
    ours, theirs = live["ours"], live["dynamo"]
    case = f"{WORKERS} publishers x {BLOCKS_PER_WORKER:,} blocks"
    query_case = f"8k-token /query, {WORKERS} workers, same client"
    concurrent_case = f"8k-token /query, {CLIENTS} kept-alive clients at once"
    return [
        _row(
            "ingest, live",
            ours.blocks_per_second,
            theirs.blocks_per_second,
            "blocks/s",
            case,
            ">= Dynamo's (issue ref: >= 1.4M/s)",
        ),
        _row("ingest time, live", ours.ingest_seconds, theirs.ingest_seconds, "s", case),
        _row(
            "of which raw send (Python, 16 PUB)", ours.send_seconds, theirs.send_seconds, "s", case
        ),
        _row(
            "ingest, pre-queued (indexer paused while sending)",
            queued["ours"].blocks_per_second,
            queued["dynamo"].blocks_per_second,
            "blocks/s",
            case,
            ">= Dynamo's",
        ),
        _row(
            "p50",
            median(ours.query_ms),
            median(theirs.query_ms),
            "ms",
            query_case,
            "issue ref: 0.8 ms",
        ),
        _row(
            "p99",
            percentile(ours.query_ms, 99),
            percentile(theirs.query_ms, 99),
            "ms",
            query_case,
            "<= Dynamo's (issue ref: 1.5 ms)",
        ),
        _row(
            "p50, new connection per query",
            median(ours.new_connection_ms),
            median(theirs.new_connection_ms),
            "ms",
            query_case,
            "<= Dynamo's",
        ),
        _row(
            "p99, new connection per query",
            percentile(ours.new_connection_ms, 99),
            percentile(theirs.new_connection_ms, 99),
            "ms",
            query_case,
            "<= Dynamo's",
        ),
        _row(
            "throughput",
            ours.concurrent_qps,
            theirs.concurrent_qps,
            "queries/s",
            concurrent_case,
            ">= Dynamo's",
        ),
        _row(
            "indexer CPU per query (all its threads)",
            ours.concurrent_cpu_us,
            theirs.concurrent_cpu_us,
            "us",
            concurrent_case,
        ),
        _row(
            "p50",
            median(ours.concurrent_ms),
            median(theirs.concurrent_ms),
            "ms",
            concurrent_case,
        ),
        _row(
            "p99",
            percentile(ours.concurrent_ms, 99),
            percentile(theirs.concurrent_ms, 99),
            "ms",
            concurrent_case,
            "<= Dynamo's",
        ),
        _row(
            "memory (RSS growth)",
            ours.bytes_per_block,
            theirs.bytes_per_block,
            "B/block",
            case,
            "<= Dynamo's (issue ref: ~124 B)",
        ),
    ]


PEERS: dict[str, PeerFactory] = {"dynamo": dynamo_peer, "ours": service_peer}


def combine(runs: Sequence[Figures]) -> Figures:
    """One figure per quantity over repeated runs: the median ingest and send times and memory
    growth, and every query latency pooled (so p99 rests on all of them)."""
    return Figures(
        blocks=runs[0].blocks,
        send_seconds=median([r.send_seconds for r in runs]),
        ingest_seconds=median([r.ingest_seconds for r in runs]),
        rss_before=0,
        rss_after=round(median([r.rss_after - r.rss_before for r in runs])),
        query_ms=[ms for r in runs for ms in r.query_ms],
        new_connection_ms=[ms for r in runs for ms in r.new_connection_ms],
        concurrent_ms=[ms for r in runs for ms in r.concurrent_ms],
        concurrent_qps=median([r.concurrent_qps for r in runs]),
        concurrent_cpu_us=median([r.concurrent_cpu_us for r in runs]),
    )


#: Rounds per indexer and mode: one run of this VM varies by 10-20%, the median of three less.
ROUNDS = 3


def run() -> list[Row]:
    reason = dynamo_unavailable_reason()
    if reason is not None:
        return [Row(SECTION, f"skipped: {reason}", "available", 0.0, "")]
    work = build_workload()
    live: dict[str, list[Figures]] = {name: [] for name in PEERS}
    queued: dict[str, list[Figures]] = {name: [] for name in PEERS}
    print(f"bench_versus: load average at start {os.getloadavg()}", file=sys.stderr)
    # Interleaved, so that a change in the machine's load hits both alike.
    for _ in range(ROUNDS):
        for name, factory in PEERS.items():
            live[name].append(measure(factory, work, queries=QUERIES))
            queued[name].append(measure(factory, work, queries=0, paused=True))
    _print_spread(live, queued)
    return rows(
        {name: combine(runs) for name, runs in live.items()},
        {name: combine(runs) for name, runs in queued.items()},
    )


def _print_spread(live: dict[str, list[Figures]], queued: dict[str, list[Figures]]) -> None:
    """Each round's figures (stderr): the rows give medians, this the spread behind them."""
    print(f"bench_versus: load average at end {os.getloadavg()}", file=sys.stderr)
    for name in PEERS:
        rounds = zip(live[name], queued[name], strict=True)
        for n, (run, paused) in enumerate(rounds):
            print(
                f"bench_versus: {name} round {n}: ingest live {run.blocks_per_second:,.0f}/s, "
                f"pre-queued {paused.blocks_per_second:,.0f}/s; /query p50 kept-alive "
                f"{median(run.query_ms):.3f} ms, new connection "
                f"{median(run.new_connection_ms):.3f} ms; {CLIENTS} clients "
                f"{run.concurrent_qps:,.0f}/s p99 {percentile(run.concurrent_ms, 99):.2f} ms, "
                f"{run.concurrent_cpu_us:.0f} us CPU/query",
                file=sys.stderr,
            )

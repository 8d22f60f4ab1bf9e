"""Soak: 2,000 streams through one ``kvevents serve`` process, with faults injected.

250 workers x 8 ranks publish from a few helper processes (each stream its own PUB socket on
base port + rank and its own replay ROUTER, as an engine's ranks do) into one ``kvevents
serve`` subprocess that registered them over HTTP with a bearer token. While they publish,
faults are injected: live batches dropped (recovered by replay), a publisher restart (seq back
to 0), an undecodable message, bad registrations and hostile HTTP (slow connections, deep
JSON, no token). Reported: the service's memory, publish-to-queryable lag (probes: a unique
prefix published on a random stream, polled with /query until it is indexed), and the time
each fault took to recover.

``python bench/bench_soak.py`` runs it alone (``KVEVENTS_SOAK_SECONDS``, default 20, sets the
steady phase); ``python bench/run.py soak`` records it with the rest.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import random
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import Row, median, percentile  # noqa: E402
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from kvevents.testing.service import ServiceIndexer  # noqa: E402
from kvevents.wire import (  # noqa: E402
    encode_batch,
    live_frames,
    pack_seq,
    parse_replay_request,
    replay_end_frames,
)

SECTION = "Soak: 2,000 streams (250 workers x 8 ranks) through one kvevents serve, faults injected"
WORKERS = 250
RANKS = 8
HELPERS = 4
BS = 16
BLOCKS = 4  # blocks stored per batch
RATE = 2.0  # batches per second per stream
RING = 256  # batches kept for replay per stream
GARBAGE = 1  # undecodable messages injected (never applied)
KEEP = 32  # batches whose blocks stay cached before they are removed
TICK = 0.05
TOKEN = "soak-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Ports below the ephemeral range, one window per helper; a taken port moves the worker on.
PUB_PORTS, REPLAY_PORTS, WINDOW = 20000, 24000, 900


# ---------------------------------------------------------------------- helper processes


@dataclass
class _Stream:
    pub: zmq.Socket[bytes]
    router: zmq.Socket[bytes]
    rng: random.Random
    seq: int = 0
    ring: collections.deque[tuple[int, bytes]] = field(
        default_factory=lambda: collections.deque(maxlen=RING)
    )
    cached: collections.deque[list[int]] = field(default_factory=collections.deque)
    drop_next: int = 0
    sent: int = 0  # batches published, every incarnation

    def batch(self, tokens: list[int] | None = None) -> KVEventBatch:
        tokens = tokens or [self.rng.randrange(1 << 31) for _ in range(BS * BLOCKS)]
        hashes = [self.rng.randrange(1 << 63) for _ in range(len(tokens) // BS)]
        events: list[Any] = [BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BS)]
        self.cached.append(hashes)
        if len(self.cached) > KEEP:
            events.append(BlockRemoved(block_hashes=self.cached.popleft()))
        return KVEventBatch(ts=time.time(), events=events)

    def publish(self, payload: bytes, *, drop: bool = False) -> None:
        seq, self.seq = self.seq, self.seq + 1
        self.sent += 1
        self.ring.append((seq, payload))
        if not drop:
            self.pub.send_multipart(live_frames(b"", seq, payload))

    def answer(self) -> None:
        identity, *rest = self.router.recv_multipart()
        start = parse_replay_request(rest)
        for seq, payload in list(self.ring):
            if seq >= start:
                self.router.send_multipart([identity, b"", b"", pack_seq(seq), payload])
        self.router.send_multipart([identity, *replay_end_frames()])


def _bind_worker(ctx: zmq.Context[zmq.Socket[bytes]], offset: int) -> tuple[int, list[Any]]:
    """Bind a worker's 8 PUB and 8 ROUTER sockets on consecutive ports from ``offset``."""
    while True:
        sockets: list[Any] = []
        try:
            for base, kind in ((PUB_PORTS, zmq.PUB), (REPLAY_PORTS, zmq.ROUTER)):
                for rank in range(RANKS):
                    sock = ctx.socket(kind)
                    sockets.append(sock)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, 0)
                    sock.bind(f"tcp://127.0.0.1:{base + offset + rank}")
            return offset, sockets
        except zmq.ZMQError:
            for sock in sockets:
                sock.close(0)
            offset += RANKS


def _helper(conn: Connection, index: int, workers: list[str], seed: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 8192)
    streams: dict[tuple[str, int], _Stream] = {}
    bases: dict[str, int] = {}
    offset = index * WINDOW
    for n, worker in enumerate(workers):
        offset, sockets = _bind_worker(ctx, offset)
        bases[worker] = offset
        for rank in range(RANKS):
            rng = random.Random(seed * 1_000_003 + n * RANKS + rank)
            streams[(worker, rank)] = _Stream(sockets[rank], sockets[RANKS + rank], rng)
        offset += RANKS
    conn.send({w: (PUB_PORTS + b, REPLAY_PORTS + b) for w, b in bases.items()})
    try:
        _serve(conn, streams)
    finally:
        for stream in streams.values():
            stream.pub.close(0)
            stream.router.close(0)
        ctx.term()


def _serve(conn: Connection, streams: dict[tuple[str, int], _Stream]) -> None:
    poller = zmq.Poller()
    by_socket = {s.router: s for s in streams.values()}
    for router in by_socket:
        poller.register(router, zmq.POLLIN)
    keys = list(streams)
    tick = 0
    running = False
    while True:
        while conn.poll(0):
            command = conn.recv()
            if command[0] == "stop":
                return
            if command[0] in ("go", "quiet"):
                running = command[0] == "go"
                conn.send(sum(s.sent for s in streams.values()))
                continue
            conn.send(_command(streams, command))
        if running:
            # Each tick a rotating share of the streams publishes: RATE batches/s each.
            share = max(1, round(1 / (RATE * TICK)))
            for key in keys[tick % share :: share]:
                stream = streams[key]
                drop = stream.drop_next > 0
                stream.drop_next -= drop
                stream.publish(encode_batch(stream.batch()), drop=drop)
            tick += 1
        deadline = time.monotonic() + TICK
        while (left := deadline - time.monotonic()) > 0:
            for router, _ in poller.poll(left * 1000):
                by_socket[router].answer()


def _command(streams: dict[tuple[str, int], _Stream], command: tuple[Any, ...]) -> Any:
    kind, *args = command
    if kind == "probe":  # publish a known prefix now (or only into the ring: drop=True)
        worker, rank, tokens, drop = args
        stream = streams[(worker, rank)]
        stream.publish(encode_batch(stream.batch(tokens)), drop=drop)
        return time.monotonic()
    if kind == "drop":  # the next n live batches of a stream are lost on the wire
        worker, rank, n = args
        streams[(worker, rank)].drop_next = n
        return True
    if kind == "restart":  # a fresh process on the same ports: seq 0, empty ring
        for rank in range(RANKS):
            stream = streams[(args[0], rank)]
            stream.seq = 0
            stream.ring.clear()
            stream.cached.clear()
        return True
    if kind == "garbage":  # an undecodable payload with the next sequence number
        stream = streams[(args[0], args[1])]
        stream.publish(b"\xc1 not msgpack")
        return True
    raise ValueError(f"unknown command {kind!r}")


# ---------------------------------------------------------------------- the parent


class Soak:
    """The service, the helpers, and the measurements."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.service = ServiceIndexer(
            env={"KVEVENTS_AUTH_TOKEN": TOKEN}, startup_timeout=60.0, http_timeout=30.0
        )
        self.helpers: list[tuple[Any, Connection]] = []
        self.owner: dict[str, Connection] = {}
        self.http: httpx.Client | None = None
        self.rss: list[int] = []
        self.unhealthy = 0
        self.lags: list[float] = []
        self.rows: list[Row] = []
        self.rng = random.Random(7)
        self.registered = 0

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        self.service.start()
        self.http = httpx.Client(base_url=self.service.url, timeout=30.0)
        ctx = multiprocessing.get_context("spawn")
        names = [f"w{i:03d}" for i in range(WORKERS)]
        for i in range(HELPERS):
            parent, child = ctx.Pipe()
            mine = names[i::HELPERS]
            proc = ctx.Process(target=_helper, args=(child, i, mine, i), daemon=True)
            proc.start()
            self.helpers.append((proc, parent))
            for name in mine:
                self.owner[name] = parent
        for _, conn in self.helpers:
            if not conn.poll(120):
                raise TimeoutError("a helper did not bind its sockets in 120 s")
            for worker, (pub, replay) in conn.recv().items():
                self._register(worker, pub, replay)

    def _register(self, worker: str, pub: int, replay: int) -> None:
        body = {
            "worker_id": worker,
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "block_size": BS,
            "ranks": RANKS,
        }
        reply = self._client().post("/register", json=body, headers=AUTH)
        reply.raise_for_status()
        self.registered += reply.json()["streams"]

    def _client(self) -> httpx.Client:
        assert self.http is not None
        return self.http

    def ask(self, worker: str, *command: Any) -> Any:
        conn = self.owner[worker]
        conn.send(command)
        if not conn.poll(30):
            raise TimeoutError(f"helper of {worker} did not answer {command[0]}")
        return conn.recv()

    # ------------------------------------------------------------------ probes

    def _tokens(self) -> list[int]:
        return [self.rng.randrange(1 << 31) for _ in range(BS * BLOCKS)]

    def _found(self, tokens: list[int], worker: str, rank: int) -> bool:
        reply = self._client().post("/query", json={"token_ids": tokens})
        return reply.json()["scores"].get(worker, {}).get(str(rank)) == BLOCKS

    def wait_indexed(self, tokens: list[int], worker: str, rank: int, since: float) -> float:
        """Seconds from ``since`` until the prefix is queryable (bounded: 60 s)."""
        deadline = since + 60.0
        while not self._found(tokens, worker, rank):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker}/{rank}: probe not indexed in 60 s")
            time.sleep(0.01)
        return time.monotonic() - since

    def probe(self, worker: str, rank: int, *, drop: bool = False) -> tuple[list[int], float]:
        tokens = self._tokens()
        return tokens, self.ask(worker, "probe", worker, rank, tokens, drop)

    def lag_probe(self) -> None:
        worker, rank = f"w{self.rng.randrange(WORKERS):03d}", self.rng.randrange(RANKS)
        tokens, sent = self.probe(worker, rank)
        self.lags.append(self.wait_indexed(tokens, worker, rank, sent))

    def sample(self) -> None:
        self.rss.append(self.service.rss_bytes())
        self.unhealthy += self._client().get("/health").status_code != 200

    # ------------------------------------------------------------------ the run

    def run(self) -> list[Row]:
        start = time.monotonic()
        self.start()
        setup = time.monotonic() - start
        self.sample()
        rss_registered = self.rss[-1]
        self._each("go")
        faults = self._faults()
        steady_until = time.monotonic() + self.seconds
        while time.monotonic() < steady_until:
            self.lag_probe()
            self.sample()
            time.sleep(0.2)
        published = sum(self._each("quiet"))
        drain = self._drain(published - GARBAGE)
        metrics = self._metrics()
        self._stop()
        self._rows(setup, rss_registered, faults, metrics, published, drain)
        return self.rows

    def _each(self, command: str) -> list[Any]:
        for _, conn in self.helpers:
            conn.send((command,))
        return [conn.recv() for _, conn in self.helpers if conn.poll(30)]

    def _drain(self, expected: int) -> float:
        """Seconds until the service applied every batch published (bounded: 60 s)."""
        start = time.monotonic()
        while self._metrics().get("kvevents_service_deliveries_total", 0) < expected:
            if time.monotonic() - start > 60:
                break
            time.sleep(0.05)
        return time.monotonic() - start

    def _faults(self) -> dict[str, float]:
        out: dict[str, float] = {}
        # Drops: a probe only in the ring (lost live), then live batches reveal the gap.
        tokens, sent = self.probe("w010", 3, drop=True)
        self.ask("w010", "drop", "w010", 3, 2)
        out["drop"] = self.wait_indexed(tokens, "w010", 3, sent)
        # A restart: seq back to 0, ring emptied; the new incarnation's first batch is found.
        self.ask("w020", "restart", "w020")
        tokens, sent = self.probe("w020", 0)
        out["restart"] = self.wait_indexed(tokens, "w020", 0, sent)
        # An undecodable message in a stream: counted, skipped, the stream goes on.
        self.ask("w030", "garbage", "w030", 5)
        tokens, sent = self.probe("w030", 5)
        out["garbage"] = self.wait_indexed(tokens, "w030", 5, sent)
        out.update(self._hostile_http())
        return out

    def _hostile_http(self) -> dict[str, float]:
        client = self._client()
        bad = [
            ({"worker_id": "w040", "endpoint": "bogus", "block_size": BS}, 400),
            ({"worker_id": "x", "endpoint": "tcp://10.0.0.1:5557", "block_size": BS}, 403),
            (
                {
                    "worker_id": "x",
                    "endpoint": "tcp://127.0.0.1:1",
                    "block_size": BS,
                    "ranks": 2**62,
                },
                400,
            ),
        ]
        statuses = [client.post("/register", json=b, headers=AUTH).status_code for b, _ in bad]
        statuses.append(client.post("/unregister", json={"worker_id": "w040"}).status_code)
        deep = b'{"token_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        statuses.append(client.post("/query", content=deep).status_code)
        wanted = [s for _, s in bad] + [401, 400]
        slow = [socket.create_connection(("127.0.0.1", self.service.port)) for _ in range(50)]
        for sock in slow:
            sock.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\n")
        health = client.get("/health")
        for sock in slow:
            sock.close()
        still = self._found_worker("w040")
        ok = statuses == wanted and health.status_code == 200 and still
        return {"hostile_http_ok": 1.0 if ok else 0.0}

    def _found_worker(self, worker: str) -> bool:
        workers = self._client().get("/workers").json()["workers"]
        return any(w["worker_id"] == worker and w["endpoint"] != "bogus" for w in workers)

    def _metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self._client().get("/metrics").text.splitlines():
            if line.startswith("kvevents_") and "{" not in line:
                name, _, value = line.partition(" ")
                out[name] = float(value)
        return out

    def _stop(self) -> None:
        for proc, conn in self.helpers:
            conn.send(("stop",))
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if self.http is not None:
            self.http.close()
        self.service.close()

    def _rows(
        self,
        setup: float,
        rss_registered: int,
        faults: dict[str, float],
        metrics: dict[str, float],
        published: int,
        drain: float,
    ) -> None:
        mb = 1 << 20
        applied = metrics.get("kvevents_service_deliveries_total", 0)
        rows = [
            ("setup", "streams registered", float(self.registered), "streams"),
            ("setup", "start, bind and register", setup, "s"),
            ("memory", "service RSS after registering", rss_registered / mb, "MB"),
            ("memory", "service RSS peak", max(self.rss) / mb, "MB"),
            ("memory", "service RSS at the end", self.rss[-1] / mb, "MB"),
            ("load", "batches published (probes, faults included)", float(published), "batches"),
            ("load", "batches applied (all but the undecodable one)", applied, "batches"),
            ("load", "publishing stopped: all applied after", drain, "s"),
            ("health", "/health samples not 200", float(self.unhealthy), "samples"),
            (
                "lag",
                f"probe publish -> queryable p50 ({len(self.lags)} probes)",
                median(self.lags) * 1e3,
                "ms",
            ),
            ("lag", "probe publish -> queryable p99", percentile(self.lags, 99) * 1e3, "ms"),
            ("recovery", "2 live batches dropped: probe queryable after", faults["drop"], "s"),
            ("recovery", "publisher restart: new batch queryable after", faults["restart"], "s"),
            ("recovery", "undecodable message: next batch queryable after", faults["garbage"], "s"),
            (
                "hostile HTTP",
                "bad registrations, no token, deep JSON, 50 slow connections: "
                "expected 4xx, /health 200, worker kept",
                faults["hostile_http_ok"],
                "1 = yes",
            ),
        ]
        for name in ("gaps", "replays", "restarts", "decode_errors", "unrecoverable", "add_errors"):
            rows.append(
                ("subscriber", name, metrics.get(f"kvevents_subscriber_{name}_total", 0), "")
            )
        self.rows = [
            Row(SECTION, f"{group}: {case}", "", value, unit) for group, case, value, unit in rows
        ]


def run() -> list[Row]:
    seconds = float(os.environ.get("KVEVENTS_SOAK_SECONDS", "20"))
    return Soak(seconds).run()


def main() -> int:
    rows = run()
    for row in rows:
        print(f"{row.case:90} {row.value:>12.3f} {row.unit}")
    print(json.dumps({r.case: round(r.value, 4) for r in rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

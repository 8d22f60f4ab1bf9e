"""Scale-out over NATS JetStream: the relay against direct ZeroMQ ingest, engine-to-replica
delay, a new replica's time to serve a 1M-block index from a snapshot against replaying the
stream, and a replica's memory. A real nats-server (the nats extra) on loopback, one run.

Throughput is catch-up: an engine publishes ``BATCHES`` batches of 64 blocks (1M blocks) into
its replay ring first, then the relay (or, as the baseline, a subscriber applying each batch
to an index, as ``kvevents serve`` does) joins late and replays them all. Both read the same
ring in the same run, so the ratio is the relay's cost over direct ingest.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from harness import Row, percentile
from kvevents.index._digest import index_digest
from kvevents.index._prefix import PrefixIndex
from kvevents.publish._publisher import PublisherOptions, ZmqPublisher
from kvevents.service._feed import WorkerRegistration
from kvevents.subscribe import StreamSpec, StreamStatus, Subscriber
from kvevents.testing.fixtures import typical_batch
from kvevents.testing.nats import NatsServer, find_nats_server
from kvevents.testing.publisher import local_config
from kvevents.wire import Applied

SECTION = "Scale-out over NATS JetStream (relay -> JetStream -> replicas)"
BLOCKS = 64  # blocks per batch
BATCHES = 15_625  # 1,000,000 blocks
DELAY_BATCHES = 1_500
DELAY_RATE = 500.0  # batches/s while measuring the delay
BS = 16


def _wait(check: object, what: str, timeout: float = 120.0) -> float:
    start = time.perf_counter()
    while not check():  # type: ignore[operator]
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"not within {timeout} s: {what}")
        time.sleep(0.005)
    return time.perf_counter() - start


def _engine() -> ZmqPublisher:
    # Heartbeats tell a subscriber joining a quiet engine how far the sequence is (it then
    # replays from 0).
    options = PublisherOptions(replay_buffer_bytes=1 << 30, heartbeat_interval=0.2)
    pub = ZmqPublisher(local_config(buffer_steps=BATCHES + 10), 0, options=options)
    pub.start()
    for step in range(BATCHES):
        pub.publish(typical_batch(step, blocks=BLOCKS, block_size=BS))
    return pub


def direct_rate(pub: ZmqPublisher) -> float:
    """Batches/s a subscriber applying to an index catches up from the engine's ring."""
    index = PrefixIndex()
    index.register_worker("w", block_size=BS)

    class IndexSink:
        def apply(self, spec: StreamSpec, seq: int, payload: bytes) -> Applied:
            return index.ingest_payload("w", 0, payload, seq=seq)

        def reset(self, spec: StreamSpec, reason: str) -> None:
            index.reset_stream("w", 0)

        def status(self, status: StreamStatus) -> None:
            pass

    spec = StreamSpec("w", 0, pub.endpoint, pub.replay_endpoint)
    with Subscriber([spec], sink=IndexSink()) as sub:
        start = time.perf_counter()
        _wait(lambda: sub.stats().delivered >= BATCHES, "direct ingest")
        return BATCHES / (time.perf_counter() - start)


def relay_rate(server: NatsServer, pub: ZmqPublisher, js: object) -> tuple[float, object]:
    """Batches/s the relay writes to JetStream (acknowledged), catching up the same ring."""
    from kvevents.scaleout import Relay

    reg = WorkerRegistration("w", pub.endpoint, BS, (0,), pub.replay_endpoint)
    relay = Relay(server.url, [reg], jetstream=js)  # type: ignore[arg-type]
    start = time.perf_counter()
    relay.start()
    _wait(lambda: relay.stats().batches >= BATCHES, "relay")
    return BATCHES / (time.perf_counter() - start), relay


def delay_samples(
    pub: ZmqPublisher, replica: object, step0: int, midway: Callable[[], None] | None = None
) -> list[float]:
    """Seconds from a batch's ``ts`` (set by the engine) to its apply in the replica;
    ``midway`` runs on another thread halfway through (a fault)."""
    service = replica.service  # type: ignore[attr-defined]
    samples: list[float] = []
    apply = service.apply

    def timed(spec: StreamSpec, seq: int, payload: bytes) -> Applied:
        applied = apply(spec, seq, payload)
        if applied.events:
            samples.append(time.time() - applied.ts)
        return applied

    service.apply = timed  # the replica feeds its service's sink: time each batch there
    gap = 1.0 / DELAY_RATE
    next_at = time.perf_counter()
    fault = None if midway is None else threading.Timer(DELAY_BATCHES * gap / 2, midway)
    if fault is not None:
        fault.start()
    for step in range(DELAY_BATCHES):
        pub.publish(typical_batch(step0 + step, blocks=16, block_size=BS))
        next_at += gap
        time.sleep(max(0.0, next_at - time.perf_counter()))
    _wait(lambda: len(samples) >= DELAY_BATCHES, "delay batches applied", 60.0)
    if fault is not None:
        fault.join()
    service.apply = apply
    return samples


def run() -> list[Row]:
    from kvevents.scaleout import JetStreamOptions, Replica, ReplicaOptions
    from kvevents.testing.service import ServiceIndexer

    if find_nats_server() is None:
        print("bench_scaleout: skipped, nats-server not installed (the nats extra)")
        return []
    logging.getLogger("kvevents").setLevel(logging.ERROR)
    rows: list[Row] = []
    js = JetStreamOptions(stream="BENCH", prefix="bench", bucket="bench-snaps")
    with tempfile.TemporaryDirectory(), NatsServer() as server:
        pub = _engine()
        try:
            direct = direct_rate(pub)
            rate, relay = relay_rate(server, pub, js)
            base = "direct ZeroMQ ingest (subscriber + index)"
            rows.append(
                Row(
                    SECTION, "relay, 64-block batches", "batches/s", rate, "batches/s", direct, base
                )
            )
            rows.append(
                Row(
                    SECTION,
                    "relay, 64-block batches",
                    "blocks/s",
                    rate * BLOCKS,
                    "blocks/s",
                    direct * BLOCKS,
                    base,
                )
            )
            last = relay.flush() and server  # everything acknowledged
            assert last
            options = ReplicaOptions(name="a", snapshot_batches=0, snapshot_interval=0, trim=False)
            started = time.perf_counter()
            first = Replica(server.url, jetstream=js, options=options).start()
            _wait(lambda: first.stats().applied >= BATCHES, "replay by a new replica")
            replay_s = time.perf_counter() - started
            t0 = time.perf_counter()
            seq = first.snapshot_now(120.0)
            save_s = time.perf_counter() - t0
            assert seq is not None
            started = time.perf_counter()
            warm = Replica(
                server.url, jetstream=js, options=ReplicaOptions(name="b", trim=False)
            ).start()
            warm_s = time.perf_counter() - started
            assert warm.digest() == first.digest(), "the warm replica differs"
            blocks = index_digest(warm.service.index).streams[0].blocks
            case = f"new replica, {blocks:,}-block index"
            rows.append(
                Row(
                    SECTION,
                    case,
                    "time to serve from a snapshot",
                    warm_s,
                    "s",
                    replay_s,
                    "replaying the stream",
                )
            )
            rows.append(Row(SECTION, case, "snapshot save (capture, encode, upload)", save_s, "s"))
            memory = first.service.index_stats().memory_bytes / 1e6
            rows.append(Row(SECTION, case, "index memory (its own accounting)", memory, "MB"))
            samples = delay_samples(pub, warm, BATCHES)
            case = f"engine -> relay -> JetStream -> replica, {DELAY_RATE:.0f} batches/s"
            for q in (50, 99):
                rows.append(Row(SECTION, case, f"delay p{q}", percentile(samples, q) * 1e3, "ms"))
            retries = relay.stats().retries
            hit = delay_samples(pub, warm, BATCHES + DELAY_BATCHES, server.restart)
            case = "the NATS server restarted mid-stream (file storage, 1M-block stream)"
            rows.append(
                Row(
                    SECTION,
                    case,
                    "longest engine -> replica delay",
                    max(hit),
                    "s",
                    max(samples),
                    "no fault",
                )
            )
            rows.append(
                Row(
                    SECTION,
                    case,
                    "relay windows sent again",
                    relay.stats().retries - retries,
                    "windows",
                )
            )
            warm.close()
            first.close()
            relay.close()
            rows += _rss_rows(server, js, ServiceIndexer, blocks)
        finally:
            pub.shutdown(timeout=1.0)
    return rows


def _rss_rows(server: NatsServer, js: object, indexer: type, blocks: int) -> list[Row]:
    """Resident memory of a ``kvevents serve --nats`` process holding the index, against
    one following an empty stream."""

    def args(name: str, stream: str, bucket: str) -> list[str]:
        return [
            "--nats",
            server.url,
            "--replica-name",
            name,
            "--nats-stream",
            stream,
            "--nats-prefix",
            stream.lower(),
            "--nats-bucket",
            bucket,
        ]

    started = time.perf_counter()
    with indexer(args=args("m1", js.stream, js.bucket), startup_timeout=120.0) as full:  # type: ignore[attr-defined]
        serving = time.perf_counter() - started
        full_rss = full.rss_bytes() / 1e6
    with indexer(args=args("m2", "EMPTY", "empty-snaps")) as empty:
        empty_rss = empty.rss_bytes() / 1e6
    case = f"replica process, {blocks:,}-block index"
    return [
        Row(SECTION, case, "resident memory", full_rss, "MB", empty_rss, "empty replica"),
        Row(
            SECTION, case, "(re)started: serving after (process start, snapshot load)", serving, "s"
        ),
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import render

    print(render(run(), ""))

"""Publisher benchmark: caller cost, sustained throughput, delivery latency, replay under load.

Baselines measured in the same run:
- raw pyzmq: one thread sending the same pre-encoded frames on a PUB socket;
- "vLLM design": a background Python thread doing Queue.get -> encode -> send_multipart with a
  blocking Queue.put in publish(), reimplemented from its documented behaviour, to show what
  the GIL does to delivery when the engine thread is busy.
Subscribers run in another process (``python -m kvevents.testing.publisher``).
"""

from __future__ import annotations

import json
import queue
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, median, percentile
from kvevents._libzmq import sender_for
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publish._publisher import PublisherOptions, ZmqPublisher
from kvevents.testing.publisher import (
    local_config,
    probe_until,
    request_replay,
    spawn_subscriber,
)
from kvevents.wire import encode_batch, pack_seq

SECTION_COST = "publish() cost on the caller's thread"
SECTION_LARGE = "large prefills, 1 publish/ms, full ring: now against the copying path"
SECTION_RATE = "sustained throughput to an out-of-process subscriber"
SECTION_LAT = "end-to-end latency at 1,000 batches/s"
SECTION_REPLAY = "replay of 10,000 batches during live publishing"


def small_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[BlockStored(block_hashes=[2**63 + 7], token_ids=list(range(16)), block_size=16)],
    )


def typical_batch(i: int = 0) -> KVEventBatch:
    hashes = [(i * 16 + k) * 0x9E3779B97F4A7C15 % 2**64 for k in range(16)]
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=hashes[0] ^ 1,
                token_ids=[(i + t) % 150_000 for t in range(256)],
                block_size=16,
                medium="GPU",
            ),
            BlockRemoved(block_hashes=[hashes[0] ^ 3], medium="GPU"),
        ],
    )


def large_batch(tokens: int = 8192) -> KVEventBatch:
    hashes = [k * 0x9E3779B97F4A7C15 % 2**64 for k in range(tokens // 16)]
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=hashes,
                token_ids=[t % 150_000 + 1000 for t in range(tokens)],
                block_size=16,
                medium="GPU",
            )
        ],
    )


def fresh(batch: KVEventBatch) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=batch.events)


class ThreadedQueuePublisher:
    """The vLLM/SGLang design: blocking Queue.put, one Python thread encodes and sends."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", hwm: int = 100_000) -> None:
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=100_000)
        self._ready = threading.Event()
        self._hwm = hwm
        self._endpoint = endpoint
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def publish(self, batch: KVEventBatch) -> None:
        self._queue.put(batch)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        context: zmq.Context[Any] = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.bind(self._endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        seq = 0
        while True:
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            pub.send_multipart([b"", pack_seq(seq), encode_batch(batch)])
            seq += 1
        pub.close(linger=2000)
        context.term()


class RawPublisher:
    """Raw pyzmq: pre-encoded frames sent from the caller's thread."""

    def __init__(self, hwm: int) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0

    def publish(self, batch: KVEventBatch) -> None:  # for the readiness probes only
        self.send([b"", pack_seq(self._seq), encode_batch(batch)])

    def send(self, frames: list[bytes]) -> None:
        self._pub.send_multipart(frames)
        self._seq += 1

    def shutdown(self) -> None:
        self._pub.close(linger=2000)
        self._context.term()


def ours(*, copying: bool = False, **config: Any) -> ZmqPublisher:
    fields: dict[str, Any] = {"replay_endpoint": None, "hwm": 200_000, "max_queue_size": 200_000}
    fields.update(config)
    kind = CopyingPublisher if copying else ZmqPublisher
    pub = kind(local_config(**fields), options=PublisherOptions(linger=5.0))
    pub.start()
    return pub


class CopyingPublisher(ZmqPublisher):
    """The publisher as it was: libzmq copies every payload on the caller's thread."""

    def _open(self) -> None:
        super()._open()
        assert self._push is not None
        self._send3 = sender_for(self._push)


# ---------------------------------------------------------------------------- caller cost


def publish_cost() -> list[Row]:
    rows = []
    pub = ours()
    try:
        for name, make, n in (
            ("small (1 block)", small_batch, 20_000),
            ("typical (16 blocks x 16 tokens + removal)", typical_batch, 20_000),
            ("large (8,192-token prefill)", large_batch, 2_000),
        ):
            batch = make()
            encode = _timed(lambda b=batch: encode_batch(b), n)
            samples, on_cpu = _timed_both(lambda b=batch: pub.publish(b), n)
            target = "<= 10 us median" if name.startswith("typical") else ""
            for metric, value, base in (
                ("median", median(samples), median(encode)),
                ("p99", percentile(samples, 99), percentile(encode, 99)),
            ):
                rows.append(
                    Row(
                        SECTION_COST,
                        name,
                        metric,
                        value,
                        "us",
                        base,
                        "msgspec encode only",
                        target if metric == "median" else "",
                    )
                )
            # The same calls' time on this thread's CPU: what is left of the wall-clock tail
            # once the scheduler's share (another thread or process running instead) is out.
            rows.append(
                Row(
                    SECTION_COST,
                    name,
                    "p99 on-CPU (thread time)",
                    percentile(on_cpu, 99),
                    "us",
                    percentile(samples, 99),
                    "wall-clock p99 of the same calls",
                )
            )
    finally:
        pub.shutdown()
    return rows


def large_against_copying() -> list[Row]:
    return [*_against_copying(8192, 6, 300), *_against_copying(32768, 6, 300)]


def _against_copying(tokens: int, rounds: int, n: int) -> list[Row]:
    """One prefill size, both paths in alternating rounds (the machine's load hits both).

    Steady state, as in an engine that has run a while: the replay ring is full, and the
    caller publishes once per millisecond, releasing the GIL in between as an engine step
    does. A tight loop of publish() calls measures something else: every preemption of the
    thread lands in a call, and the service thread, starved of the GIL, lets hundreds of
    payloads pile up (fresh memory, page faults) in a way no engine does.
    """
    got: dict[bool, list[tuple[float, float, int, int]]] = {False: [], True: []}
    batch = large_batch(tokens)
    for r in range(rounds):
        for copying in (False, True) if r % 2 == 0 else (True, False):
            pub = ours(copying=copying, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=100)
            try:
                for _ in range(150):
                    pub.publish(batch)
                for _ in range(n):
                    time.sleep(0.001)
                    got[copying] += _timed_detail(lambda p=pub: p.publish(batch), 1)
            finally:
                pub.shutdown()
    rows = []
    for metric, pick in (
        ("median", lambda s: median([x[0] for x in s])),
        ("p99", lambda s: percentile([x[0] for x in s], 99)),
        ("p99 on-CPU (thread time)", lambda s: percentile([x[1] for x in s], 99)),
        ("minor page faults per call", lambda s: sum(x[2] for x in s) / len(s)),
        ("calls preempted (involuntary switch)", lambda s: 100 * sum(x[3] > 0 for x in s) / len(s)),
    ):
        unit = "%" if metric.startswith("calls") else ("" if "faults" in metric else "us")
        rows.append(
            Row(
                SECTION_LARGE,
                f"{tokens:,} tokens ({len(encode_batch(batch)) // 1024} KiB)",
                metric,
                pick(got[False]),
                unit,
                pick(got[True]),
                "copying path, same run",
            )
        )
    return rows


def _timed_detail(fn: Any, n: int) -> list[tuple[float, float, int, int]]:
    """Per call: wall us, thread CPU us, minor page faults, involuntary context switches."""
    wall, cpu, usage, who = (
        time.perf_counter_ns,
        time.thread_time_ns,
        resource.getrusage,
        resource.RUSAGE_THREAD,
    )
    out = []
    for _ in range(n):
        before = usage(who)
        start, start_cpu = wall(), cpu()
        fn()
        spent, spent_cpu = wall() - start, cpu() - start_cpu
        after = usage(who)
        faults, preempted = after.ru_minflt - before.ru_minflt, after.ru_nivcsw - before.ru_nivcsw
        out.append((spent / 1000, spent_cpu / 1000, faults, preempted))
    return out


def _timed_both(fn: Any, n: int) -> tuple[list[float], list[float]]:
    """Wall-clock and thread CPU time of each of ``n`` calls, in microseconds."""
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    walls, cpus = [], []
    for _ in range(n):
        start, start_cpu = wall(), cpu()
        fn()
        cpus.append((cpu() - start_cpu) / 1000)
        walls.append((wall() - start) / 1000)
    return walls, cpus


def _timed(fn: Any, n: int) -> list[float]:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        start = clock()
        fn()
        samples.append((clock() - start) / 1000)
    return samples


# ---------------------------------------------------------------------------- throughput


def _through_child(publisher: Any, count: int, send: Any, fast: bool = True) -> dict[str, Any]:
    child = spawn_subscriber(publisher.endpoint, count, fast=fast)
    try:
        assert child.stdout is not None
        probe_until(publisher, child.stdout)
        send()
        return dict(json.loads(child.stdout.readline()))
    finally:
        child.kill()
        child.wait()


def throughput(count: int = 60_000) -> list[Row]:
    batches = [typical_batch(i) for i in range(256)]
    frames = [[b"", pack_seq(i), encode_batch(b)] for i, b in enumerate(batches)]

    raw = RawPublisher(hwm=count * 2)
    try:
        base = _through_child(raw, count, lambda: [raw.send(frames[i % 256]) for i in range(count)])
    finally:
        raw.shutdown()
    pub = ours()
    try:
        got = _through_child(
            pub, count, lambda: [pub.publish(batches[i % 256]) for i in range(count)]
        )
    finally:
        pub.shutdown()
    vllm = ThreadedQueuePublisher(hwm=count * 2)
    vllm.start()
    try:
        theirs = _through_child(
            vllm, count, lambda: [vllm.publish(batches[i % 256]) for i in range(count)]
        )
    finally:
        vllm.shutdown()

    def rate(summary: dict[str, Any]) -> float:
        return float(summary["received"]) / max(summary["elapsed_s"], 1e-9)

    rows = []
    for name, summary in (("kvevents", got), ("vLLM design", theirs)):
        target = ">= 80% of raw" if name == "kvevents" else ""
        complete = (
            "" if summary["received"] == count else f" ({summary['received']}/{count} arrived)"
        )
        rows.append(
            Row(
                SECTION_RATE,
                name + complete,
                "batches/s",
                rate(summary),
                "/s",
                rate(base),
                "raw pyzmq PUB",
                target,
            )
        )
        rows.append(
            Row(
                SECTION_RATE,
                name + complete,
                "events/s",
                2 * rate(summary),
                "/s",
                2 * rate(base),
                "raw pyzmq PUB",
            )
        )
    return rows


# ---------------------------------------------------------------------------- latency


def _burn(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def paced(publisher: Any, count: int, mode: str) -> None:
    """Publish ``count`` typical batches at 1 kHz; ``mode``: idle, busy-engine, burner-thread."""
    stop = threading.Event()
    burner = threading.Thread(target=_burn, args=(stop,), daemon=True)
    if mode == "burner-thread":
        burner.start()
    batch = typical_batch()
    next_at = time.perf_counter()
    for _ in range(count):
        next_at += 0.001
        if mode == "busy-engine":
            while time.perf_counter() < next_at:  # a CPU-bound engine step, in pure Python
                pass
        else:
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        publisher.publish(fresh(batch))
    stop.set()
    if burner.is_alive():
        burner.join()


def latency(count: int = 1_500) -> list[Row]:
    rows = []
    for mode in ("idle", "busy-engine", "burner-thread"):
        results = {}
        for design in ("kvevents", "vLLM design"):
            publisher: Any = ours() if design == "kvevents" else ThreadedQueuePublisher()
            if design != "kvevents":
                publisher.start()
            try:
                results[design] = _through_child(
                    publisher, count, lambda p=publisher, m=mode: paced(p, count, m), fast=False
                )
            finally:
                publisher.shutdown()
        mine, theirs = results["kvevents"], results["vLLM design"]
        target = "p99 <= 1 ms" if mode == "busy-engine" else ""
        case = {
            "idle": "idle engine thread",
            "busy-engine": "CPU-bound engine thread",
            "burner-thread": "another thread burning CPU",
        }[mode]
        rows.append(
            Row(
                SECTION_LAT,
                case,
                "p50",
                mine["latency_p50_us"],
                "us",
                theirs["latency_p50_us"],
                "vLLM design",
            )
        )
        rows.append(
            Row(
                SECTION_LAT,
                case,
                "p99",
                mine["latency_p99_us"],
                "us",
                theirs["latency_p99_us"],
                "vLLM design",
                target,
            )
        )
    return rows


# ---------------------------------------------------------------------------- replay


def replay_under_load(ring: int = 10_000, live: int = 2_000) -> list[Row]:
    pub = ours(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=ring)
    context: zmq.Context[Any] = zmq.Context()
    try:
        for i in range(ring):
            pub.publish(typical_batch(i))
        while pub.stats().ring_batches < ring:
            time.sleep(0.01)
        served: list[float] = []
        stop = threading.Event()

        def replays() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                reply = request_replay(context, pub.replay_endpoint or "", 0, timeout=60)
                served.append(time.perf_counter() - start)
                assert len(reply) >= ring

        client = threading.Thread(target=replays, daemon=True)

        def run_live() -> None:
            client.start()
            paced(pub, live, "idle")
            stop.set()
            client.join()

        got = _through_child(pub, live, run_live, fast=False)
    finally:
        pub.shutdown()
        context.term()
    return [
        Row(
            SECTION_REPLAY,
            f"replay of {ring:,} typical batches",
            "time to serve (median)",
            median(served) * 1000,
            "ms",
            None,
            "",
            f"{len(served)} replays",
        ),
        Row(SECTION_REPLAY, "live 1,000 batches/s meanwhile", "p50", got["latency_p50_us"], "us"),
        Row(SECTION_REPLAY, "live 1,000 batches/s meanwhile", "p99", got["latency_p99_us"], "us"),
    ]


def run() -> list[Row]:
    return [
        *publish_cost(),
        *large_against_copying(),
        *throughput(),
        *latency(),
        *replay_under_load(),
    ]


if __name__ == "__main__":
    for row in run():
        print(row)

"""A real vLLM engine under load: its step time and event delivery, its publisher against ours.

The CPU engine of the interop tests (vLLM 0.32 in ``.venv-vllm``, the tiny random Llama of
``tests/interop/vllm_engine.py``; here 512 blocks of 32 tokens and up to 8 sequences) runs a
seeded load: rounds of 32 prompts of 64-600 random tokens, one output token each, so every
step is a prefill of up to 8 prompts with stores and, once the cache is full, evictions.
vLLM's own ZeroMQ publisher and kvevents' plugin (``VllmPublisher``, from the kvevents this
process imports) take turns, round by round, as the scheduler's publisher: one engine, the
same prompts and the same machine load for both. Measured:

- every engine step's wall time (``EngineCore.step``), in the engine process, per publisher;
- every batch's delivery latency: arrival at a SUB socket in this process minus the batch's
  ``ts``, which vLLM stamps (``time.time()``) just before it calls ``publish()``;
- the engine process's full garbage collections (generation 2): how many, the longest.

Both publishers' threads live in the engine the whole time (the idle one wakes now and then).
Skipped, with the reason, where ``.venv-vllm`` has no working vLLM (``make vllm``).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "interop"))
from vllm_peer import VllmEngine, find_vllm_python, scratch_dir, tokens, vllm_version

import kvevents
from harness import Row, percentile
from kvevents.deadline import Deadline
from kvevents.wire import decode_batch

SECTION = "vLLM 0.32 CPU engine under continuous load: kvevents' plugin against vLLM's publisher"
LOAD_SECONDS = float(os.environ.get("KVEVENTS_BENCH_VLLM_SECONDS", "60"))
BLOCK = 32
NUM_BLOCKS = 512


class Collector(threading.Thread):
    """Receives the live stream; keeps each message's arrival time and payload."""

    def __init__(self, context: zmq.Context[Any], endpoint: str) -> None:
        super().__init__(name="bench-vllm-sub", daemon=True)
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.arrivals: list[tuple[float, bytes]] = []
        self.first_load = 0  # arrivals before this index were the handshake's
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.socket.poll(50):
                    frames = self.socket.recv_multipart()
                    self.arrivals.append((time.time(), frames[-1]))
        finally:
            self.socket.close(0)

    def latencies_ms(self, after: int = 0) -> list[float]:
        """Arrival minus the batch's ts, decoded after the run (no decoding while measured)."""
        got = self.arrivals[after:]
        return [(at - decode_batch(payload).batch.ts) * 1000 for at, payload in got]


def _measure(python: str, model_dir: Path) -> dict[str, dict[str, Any]]:
    """One engine; vLLM's publisher and ours take turns; per publisher: steps and latencies."""
    engine = VllmEngine(
        python,
        scratch_dir("kvb-"),
        model_dir,
        BLOCK,
        NUM_BLOCKS,
        engine_args={"max_num_seqs": 8, "max_model_len": 1024},
    )
    context: zmq.Context[Any] = zmq.Context()
    collectors: list[Collector] = []
    try:
        engine.start()
        assert engine.publisher_class.startswith("vllm.distributed"), engine.publisher_class
        ours = {
            "endpoint": f"ipc://{engine.directory}/ours",
            "replay_endpoint": f"ipc://{engine.directory}/ours-replay",
        }
        collectors = [Collector(context, engine.endpoint), Collector(context, ours["endpoint"])]
        for collector in collectors:
            collector.start()
        _handshake(engine, collectors[0])
        load = {"op": "load", "seconds": LOAD_SECONDS, "seed": 7, "alternate": ours}
        reply = engine.call(load, timeout=LOAD_SECONDS + 120)
        # The plugin must run this checkout's kvevents, not whatever .venv-vllm has installed.
        assert Path(reply["kvevents"]).resolve() == Path(kvevents.__file__).resolve()
        time.sleep(0.2)  # the last batches are in flight; nothing is measured from here on
    finally:
        for collector in collectors:
            collector.stop.set()
            collector.join(5)
        context.term()
        engine.stop()
        shutil.rmtree(engine.directory, ignore_errors=True)
    steps = reply["steps"][1:]  # the first step after start-up warms caches
    return {
        name: {
            "steps_ms": [ms * 1000 for who, ms in steps if who == index],
            "latency_ms": collectors[index].latencies_ms(after=collectors[index].first_load),
            "gc_ms": [ms * 1000 for who, ms in reply["gc"] if who == index],
            "requests": reply["requests"],
        }
        for index, name in enumerate(("vllm", "ours"))
    }


def _handshake(engine: VllmEngine, collector: Collector) -> None:
    """Primer requests until the SUB socket (connected asynchronously) receives one."""
    rng = random.Random("bench")
    deadline = Deadline(30)
    while not collector.arrivals and not deadline.expired:
        engine.generate(tokens(rng, BLOCK + 1))
        time.sleep(0.05)
    if not collector.arrivals:
        raise RuntimeError("the subscriber received no batch from the engine")
    collector.first_load = len(collector.arrivals)


def _rows(vllm: dict[str, Any], ours: dict[str, Any]) -> list[Row]:
    rows = []
    name = "vLLM's publisher, same load"
    for case, key in (("engine step", "steps_ms"), ("batch delivery latency", "latency_ms")):
        for metric, pct in (("p50", 50), ("p99", 99)):
            rows.append(
                Row(
                    SECTION,
                    case,
                    metric,
                    percentile(ours[key], pct),
                    "ms",
                    percentile(vllm[key], pct),
                    name,
                )
            )
    for case, key in (
        ("engine steps", "steps_ms"),
        ("batches delivered", "latency_ms"),
        ("full GC collections (generation 2)", "gc_ms"),
    ):
        rows.append(Row(SECTION, case, "count", len(ours[key]), "", len(vllm[key]), name))
    rows.append(
        Row(
            SECTION,
            "engine step",
            "mean",
            sum(ours["steps_ms"]) / len(ours["steps_ms"]),
            "ms",
            sum(vllm["steps_ms"]) / len(vllm["steps_ms"]),
            name,
        )
    )
    longest = [max(r["gc_ms"], default=0.0) for r in (ours, vllm)]
    rows.append(Row(SECTION, "full GC collection", "longest", longest[0], "ms", longest[1], name))
    return rows


def run() -> list[Row]:
    version, reason = vllm_version()
    python = find_vllm_python()
    if reason is not None or python is None:
        print(f"bench_vllm skipped: {reason}")
        return []
    model_dir = scratch_dir("kvb-model-")
    try:
        results = _measure(python, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    for name, got in results.items():
        print(
            f"  {name}: {len(got['steps_ms'])} steps, {len(got['latency_ms'])} batches, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
    print(f"  vLLM {version}, {LOAD_SECONDS:.0f} s of load, {results['vllm']['requests']} requests")
    return _rows(results["vllm"], results["ours"])


if __name__ == "__main__":
    from run import render

    print(render(run(), ""))

"""End to end over real ZeroMQ: engine -> publishers -> raw SUB sockets -> decoded truth.

Needs ``kvevents.publish._publisher`` (skipped until it is merged). Uses only the API in API.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvevents.config import KVEventsConfig
from kvevents.events import KVEventBatch
from kvevents.sim._engine import EngineConfig, SimulatedEngine, zmq_publisher_factory
from kvevents.sim._trace import default_trace_path, load_trace, run_trace
from kvevents.testing.engine import BlockSets
from kvevents.testing.sockets import Deadline
from kvevents.wire import decode_batch, parse_live

pytest.importorskip("kvevents.publish._publisher")

TRACE = Path(default_trace_path())
RANKS = 2


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket[bytes], deadline: Deadline) -> tuple[int, KVEventBatch]:
    if not sub.poll(int(deadline.remaining() * 1000) + 1):
        raise TimeoutError("no live message before the deadline")
    message = parse_live(sub.recv_multipart())
    return message.seq, decode_batch(message.payload, seq=message.seq).batch


def handshake(engine: SimulatedEngine, subs: list[zmq.Socket[bytes]]) -> list[int]:
    """Publish empty probes on each rank until its SUB sees one; returns the last probe seq."""
    last = []
    deadline = Deadline(10.0)
    for rank, sub in enumerate(subs):
        assert engine.publishers is not None
        while True:
            engine.publishers[rank].publish(KVEventBatch(0.0, [], rank))
            if sub.poll(20):
                seq, _ = receive(sub, deadline)
                break
            assert not deadline.expired, f"rank {rank}: subscriber never joined"
        while sub.poll(50):  # drain probes still in flight
            seq, _ = receive(sub, deadline)
        last.append(seq)
    return last


def test_engine_over_zmq_matches_ground_truth(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Every batch arrives in sequence and the decoded events rebuild both ranks' caches."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0")
    cfg = EngineConfig(block_size=64, capacity_blocks=800, cpu_capacity_blocks=300, ranks=RANKS)
    with SimulatedEngine(cfg, publisher_factory=zmq_publisher_factory(config)) as engine:
        assert engine.publishers is not None
        endpoints = [p.endpoint for p in engine.publishers]  # type: ignore[attr-defined]
        subs = [subscribe(ctx, ep) for ep in endpoints]
        last_probe = handshake(engine, subs)
        run_trace(engine, load_trace(TRACE, limit=40))
        sets = BlockSets()
        deadline = Deadline(20.0)
        for rank, sub in enumerate(subs):
            expected = engine.recorder_stats(rank).batches
            for i in range(expected):
                seq, batch = receive(sub, deadline)
                assert seq == last_probe[rank] + 1 + i
                assert batch.data_parallel_rank == rank
                sets.apply(batch)
            for medium in ("GPU", "CPU"):
                assert sets.blocks(rank, medium) == engine.cached_blocks(rank, medium)
        assert sets.violations == []

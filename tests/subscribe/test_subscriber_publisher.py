"""The subscriber against our own publisher (runs once kvevents.publish._publisher exists)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvevents.config import KVEventsConfig
from kvevents.events import BlockStored, KVEventBatch
from kvevents.subscribe import Delivery, StreamSpec, StreamStatus, Subscriber
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.sockets import Deadline
from kvevents.wire import Applied


class NullSink:
    """A sink that keeps nothing (subclasses apply what they need)."""

    def reset(self, stream: StreamSpec, reason: str) -> None:
        pass

    def status(self, status: StreamStatus) -> None:
        pass


publisher_module = pytest.importorskip("kvevents.publish._publisher")

KEY = ("engine", 0)


@pytest.fixture
def publisher() -> Iterator[Any]:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
    )
    pub = publisher_module.create_publisher(config, rank=0)
    pub.start()
    yield pub
    pub.shutdown()


def collect(sub: Subscriber, pub: Any, until: int, timeout: float = 15.0) -> list[Delivery]:
    """Deliveries up to seq ``until``, probing with heartbeats until the first arrives."""
    got: list[Delivery] = []
    deadline = Deadline(timeout)
    while not got or got[-1].seq < until:
        assert not deadline.expired, f"stalled at {got[-1].seq if got else None}"
        item = sub.get(0.02)
        if isinstance(item, Delivery):
            got.append(item)
        elif item is None and not got:
            pub.publish(heartbeat())
    return got


def test_late_subscriber_gets_every_batch_of_our_publisher(publisher: Any) -> None:
    """Joining after 300 batches: replay from 0 then live, every batch once, in order."""
    batches = [typical_batch(i) for i in range(300)]
    for batch in batches:
        publisher.publish(batch)
    spec = StreamSpec(*KEY, publisher.endpoint, publisher.replay_endpoint)
    with Subscriber([spec]) as sub:
        got = collect(sub, publisher, until=299)
        assert [d.seq for d in got[:300]] == list(range(300))
        assert [d.batch for d in got[:300]] == batches
        last = publisher.publish(typical_batch(300))
        got += collect(sub, publisher, until=last)
        assert [d.seq for d in got] == list(range(len(got)))
        assert sub.stream_stats()[KEY].unrecoverable == 0


def test_restarted_publisher_is_detected_and_rebuilt(publisher: Any) -> None:
    """A new publisher on the same endpoints: StreamReset('restart'), then the new run whole."""
    spec = StreamSpec(*KEY, publisher.endpoint, publisher.replay_endpoint)
    with Subscriber([spec]) as sub:
        for i in range(20):
            publisher.publish(typical_batch(i))
        collect(sub, publisher, until=19)
        publisher.shutdown()
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
        )
        second = publisher_module.create_publisher(config, rank=0)
        second.start()
        try:
            reset = False
            deadline = Deadline(15.0)
            seqs: list[int] = []
            while not (reset and seqs and seqs[-1] >= 10):
                assert not deadline.expired, "restart never detected"
                # Paced: batches sent while the SUB reconnects are lost, and a restart first
                # seen past the old sequence would look like a gap (no epoch on the wire).
                second.publish(typical_batch(len(seqs)))
                item = sub.get(0.02 if reset else 0.05)
                while item is not None:
                    if isinstance(item, Delivery) and reset:
                        seqs.append(item.seq)
                    elif not isinstance(item, Delivery):
                        reset = True
                    item = sub.get_nowait()
            assert seqs == list(range(len(seqs)))
            assert sub.stream_stats()[KEY].restarts == 1
        finally:
            second.shutdown()


@pytest.mark.parametrize("hwm", [100_000, 1_000])
def test_a_stalled_subscriber_loses_only_what_the_publishers_queue_cannot_hold(hwm: int) -> None:
    """The subscriber reads only ``rcvhwm`` messages ahead (1,000): while its I/O thread is
    held, a 120 MB backlog (more than that, kernel buffers and a 1,000-batch publisher queue
    together) waits in the publisher's queue. With the default ``hwm`` every batch arrives, in
    order, without a replay; with ``hwm=1000`` the publisher drops, and the loss is reported."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", hwm=hwm)
    pub = publisher_module.create_publisher(config, rank=0)
    pub.start()
    held = threading.Event()
    release = threading.Event()
    seqs: list[int] = []

    class HoldingSink(NullSink):
        def apply(self, stream: StreamSpec, seq: int, payload: bytes) -> Applied:
            if seqs and not held.is_set():
                held.set()  # the I/O thread stops here until the backlog is queued
                assert release.wait(30.0), "never released"
            seqs.append(seq)
            return Applied(0.0, 1)

    spec = StreamSpec(*KEY, pub.endpoint)  # no replay: a loss cannot be hidden
    big = [100_000 + t for t in range(4096)]  # 5 bytes per token: ~20 KB per batch
    try:
        with Subscriber([spec], sink=HoldingSink()) as sub:
            deadline = Deadline(15.0)
            while not seqs:  # handshake: the first batch that arrives
                assert not deadline.expired, "no batch arrived"
                pub.publish(heartbeat())
                time.sleep(0.02)  # the sink is fed on the I/O thread: nothing to get here
            first = pub.publish(heartbeat())
            assert held.wait(15.0), "the I/O thread was not held"
            before = sub.stream_stats()[KEY]  # the handshake may have missed seq 0
            count = 6_000
            for i in range(count):
                pub.publish(KVEventBatch(ts=float(i), events=[stored(big, i)]))
            deadline = Deadline(30.0)
            while pub.stats().published < first + count + 1:
                assert not deadline.expired, "the publisher did not hand the backlog over"
                time.sleep(0.01)
            release.set()
            deadline = Deadline(30.0)
            last = pub.publish(heartbeat())
            while seqs[-1] != last:
                assert not deadline.expired, f"stalled at {seqs[-1]}"
                seen = len(seqs)
                time.sleep(0.05)
                if len(seqs) == seen:  # the newest was dropped too: the next shows the loss
                    last = pub.publish(heartbeat())
            stats = sub.stream_stats()[KEY]
    finally:
        release.set()
        pub.shutdown()
    after = [s for s in seqs if s >= first]
    if hwm == 100_000:
        assert after == list(range(first, last + 1))
        assert (stats.gaps, stats.unrecoverable) == (before.gaps, before.unrecoverable)
    else:
        assert len(after) < count and stats.unrecoverable > before.unrecoverable


def stored(tokens: list[int], i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i * 256 + b + 1 for b in range(256)],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
    )

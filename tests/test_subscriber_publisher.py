"""The subscriber against our own publisher (runs once kvevents.publish.publisher exists)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvevents.config import KVEventsConfig
from kvevents.subscribe import Delivery, StreamSpec, Subscriber
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.sockets import Deadline

publisher_module = pytest.importorskip("kvevents.publish.publisher")

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

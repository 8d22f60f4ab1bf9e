"""The publisher's send path: large payloads lent to libzmq arrive intact and are released."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import zmq

from kvevents.deadline import Deadline
from kvevents.events import BlockRemoved, BlockStored, KVEventBatch
from kvevents.publish import _send as send
from kvevents.testing.publisher import (
    connect_subscriber,
    local_config,
    paused_forwarding,
    request_replay,
    started_publisher,
    wait_subscribed,
)
from kvevents.wire import decode_batch, encode_batch, parse_live

pytestmark = pytest.mark.skipif(
    send._zerosend() is None,
    reason="no payload lending here (_zerosend not built, no direct libzmq, or KVEVENTS_ZERO_COPY=0)",
)


def _prefill(tokens: int, first: int = 0) -> KVEventBatch:
    blocks = tokens // 16
    return KVEventBatch(
        ts=1.0,
        events=[
            BlockStored(
                block_hashes=list(range(first, first + blocks)),
                token_ids=[(first + t) % 150_000 for t in range(tokens)],
                block_size=16,
            )
        ],
        data_parallel_rank=0,
    )


def test_large_payloads_arrive_intact_live_and_replayed() -> None:
    """A lent payload reaches a subscriber and the replay ring byte for byte, small ones too."""
    batches = [_prefill(8192, k) for k in range(3)] + [_prefill(16, 99)]
    assert len(encode_batch(batches[0])) >= send.MIN_BORROW > len(encode_batch(batches[-1]))
    context: zmq.Context[Any] = zmq.Context()
    try:
        with started_publisher() as pub:
            sub = connect_subscriber(context, pub.endpoint or "")
            try:
                first = wait_subscribed(pub, sub) + 1
                for batch in batches:
                    pub.publish(batch)
                live = [parse_live(sub.recv_multipart()) for _ in batches]
            finally:
                sub.close(0)
            assert [decode_batch(m.payload).batch for m in live] == batches
            replayed = request_replay(context, pub.replay_endpoint or "", first)[:-1]
            assert [m.payload for m in replayed] == [m.payload for m in live]
    finally:
        context.term()


def _settled() -> int:
    """Payloads still lent once every dropped publisher's are back (other tests' included)."""
    gc.collect()
    send.release_payloads()
    return send.lent_payloads()


def test_every_lent_payload_is_released_with_the_publisher() -> None:
    """Nothing lent to libzmq outlives the publisher: every reference is given back."""
    before = _settled()
    with started_publisher() as pub:
        for k in range(20):
            pub.publish(_prefill(8192, k))
    assert pub.stats().ring_batches == 20  # the replay ring held them until here
    del pub
    assert _settled() == before


def test_a_full_queue_releases_the_payload_it_refused() -> None:
    """A lent payload refused by a full queue is counted as dropped and released, not leaked."""
    before = _settled()
    config = local_config(replay_endpoint=None, max_queue_size=2)
    with started_publisher(config, pausable=True) as pub, paused_forwarding(pub):
        for k in range(5):
            pub.publish(_prefill(8192, k))
        assert pub.stats().dropped_queue_full == 3
        assert _settled() == before + 2  # only the two queued batches are still lent
    del pub
    assert _settled() == before


def test_an_encoded_batch_dropped_carries_its_removals_into_the_next() -> None:
    """publish_encoded keeps the drop policy: a dropped payload's removals reach subscribers."""
    removal = KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[7])], data_parallel_rank=0)
    config = local_config(replay_endpoint=None, max_queue_size=2)
    context: zmq.Context[Any] = zmq.Context()
    try:
        with started_publisher(config, pausable=True) as pub:
            sub = connect_subscriber(context, pub.endpoint or "")
            try:
                wait_subscribed(pub, sub)
                with paused_forwarding(pub):
                    for k in range(10):  # fill the queue: the first refusal ends it
                        pub.publish_encoded(encode_batch(_prefill(16, k)))
                        if pub.stats().dropped_queue_full:
                            break
                    pub.publish_encoded(encode_batch(removal))
                    assert pub.stats().pending_carry == 1
                deadline = Deadline(10)  # resumed: wait until the queue has drained
                while pub.stats().queue_depth and not deadline.expired:
                    time.sleep(0.005)
                last = pub.publish_encoded(encode_batch(_prefill(16, 50)))
                got = _receive_until(sub, last)
            finally:
                sub.close(0)
    finally:
        context.term()
    assert got.events == [removal.events[0], *_prefill(16, 50).events]


def _receive_until(sub: zmq.Socket[Any], seq: int) -> KVEventBatch:
    """The batch with sequence number ``seq`` (bounded wait)."""
    deadline = Deadline(10)
    while sub.poll(max(1, int(deadline.remaining() * 1000))):
        message = parse_live(sub.recv_multipart())
        if message.seq == seq:
            return decode_batch(message.payload).batch
    raise TimeoutError(f"batch {seq} did not arrive")

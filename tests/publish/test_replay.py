"""The replay socket of a running publisher: ring contents, bounds, slow and bad clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvevents.events import BlockStored, KVEventBatch
from kvevents.publish._publisher import PublisherOptions, ZmqPublisher
from kvevents.testing.publisher import (
    connect_subscriber,
    local_config,
    read_replay,
    replay_dealer,
    request_replay,
    started_publisher,
    wait_subscribed,
)
from kvevents.testing.sockets import Deadline, wait_for
from kvevents.wire import (
    END_SEQ,
    pack_seq,
    parse_live,
    parse_replay_reply,
    replay_request_frames,
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _batch(i: int, tokens: int = 4) -> KVEventBatch:
    stored = BlockStored(block_hashes=[i], token_ids=[1000 + i] * tokens, block_size=tokens)
    return KVEventBatch(ts=float(i), events=[stored])


def _publish(pub: ZmqPublisher, n: int, tokens: int = 4) -> list[int]:
    seqs = [pub.publish(_batch(i, tokens)) for i in range(n)]
    wait_for(lambda: pub.stats().published == pub.stats().enqueued, what="queue drained")
    return seqs


def _dealer(ctx: zmq.Context[Any], endpoint: str, start: int) -> zmq.Socket[Any]:
    dealer: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(endpoint)
    dealer.send_multipart(replay_request_frames(start))
    return dealer


def test_replay_returns_exact_tail_with_topic(ctx: zmq.Context[Any]) -> None:
    """Replay from k gives every buffered batch >= k: same topic and bytes as live, then the end."""
    with started_publisher(local_config(topic="kv")) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        probe = wait_subscribed(pub, sub)
        seqs = [pub.publish(_batch(i)) for i in range(20)]
        live = [parse_live(sub.recv_multipart()) for _ in seqs]
        # Asked right after the last live message: the reply must already include it.
        reply = request_replay(ctx, pub.replay_endpoint or "", seqs[5])
    assert [(m.topic, m.seq, m.payload) for m in reply[:-1]] == [
        (b"kv", m.seq, m.payload) for m in live[5:]
    ]
    assert reply[-1].is_end and reply[-1].seq == END_SEQ and reply[-1].topic == b""
    assert seqs[0] == probe + 1


def test_ring_keeps_last_buffer_steps_and_old_start_starts_later(ctx: zmq.Context[Any]) -> None:
    """Only the last buffer_steps batches stay; an older start gets a later first seq."""
    with started_publisher(local_config(buffer_steps=10)) as pub:
        seqs = _publish(pub, 25)
        reply = request_replay(ctx, pub.replay_endpoint or "", 0)
        assert pub.stats().ring_batches == 10
    assert [m.seq for m in reply[:-1]] == seqs[-10:]


def test_future_start_gets_only_end_marker(ctx: zmq.Context[Any]) -> None:
    """A start beyond the newest batch gets just the end marker."""
    with started_publisher(local_config()) as pub:
        seqs = _publish(pub, 3)
        reply = request_replay(ctx, pub.replay_endpoint or "", seqs[-1] + 5)
    assert len(reply) == 1 and reply[0].is_end


def test_byte_budget_bounds_ring(ctx: zmq.Context[Any]) -> None:
    """The ring holds no more payload bytes than replay_buffer_bytes, newest kept."""
    options = PublisherOptions(replay_buffer_bytes=20_000)
    with started_publisher(local_config(), options=options) as pub:
        seqs = _publish(pub, 50, tokens=512)  # ~1.5 kB each
        stats = pub.stats()
        reply = request_replay(ctx, pub.replay_endpoint or "", 0)
    assert 0 < stats.ring_bytes <= 20_000 and stats.ring_batches < 20
    assert [m.seq for m in reply[:-1]] == seqs[-stats.ring_batches :]


@pytest.mark.parametrize(
    "request_frames",
    [[b"", b"abc"], [b"", pack_seq(1), b"extra"], [b"x", pack_seq(1)], [b"", b""]],
    ids=["short-seq", "extra-frame", "no-delimiter", "empty-seq"],
)
def test_malformed_request_gets_end_marker(
    ctx: zmq.Context[Any], request_frames: list[bytes]
) -> None:
    """A request the server cannot read is answered with the end marker and counted."""
    with started_publisher(local_config()) as pub:
        _publish(pub, 3)
        reply = request_replay(ctx, pub.replay_endpoint or "", 0, request=request_frames)
        assert pub.stats().replay_malformed == 1
    assert len(reply) == 1 and reply[0].is_end


def _big_ring(tmp_path: Path, **options: Any) -> tuple[Any, PublisherOptions]:
    # ipc keeps kernel buffers small, so a reply of a few MB cannot fit in flight and a client
    # that does not read really blocks the server's sends.
    config = local_config(replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=3000)
    return config, PublisherOptions(**options)


def test_slow_client_gets_every_batch_and_end(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """A client with a tiny receive HWM that sleeps still gets the whole reply, then the end."""
    config, options = _big_ring(tmp_path)
    with started_publisher(config, options=options) as pub:
        seqs = _publish(pub, 2000, tokens=512)
        reply = request_replay(ctx, pub.replay_endpoint or "", 0, rcvhwm=1, pause=0.0001)
        stats = pub.stats()
    assert [m.seq for m in reply[:-1]] == seqs and reply[-1].is_end
    assert stats.replay_batches_served == 2000 and stats.replay_clients_lost == 0


def test_live_flows_while_replay_blocked(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """While a large reply is still being served, live batches keep reaching subscribers."""
    config, options = _big_ring(tmp_path)
    with started_publisher(config, options=options) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        wait_subscribed(pub, sub)
        seqs = _publish(pub, 2000, tokens=512)
        for _ in seqs:
            sub.recv_multipart()
        slow = _dealer(ctx, pub.replay_endpoint or "", 0)
        wait_for(lambda: pub.stats().replay_batches_served > 0, what="replay started")
        live = [pub.publish(_batch(i)) for i in range(100)]
        got = [parse_live(sub.recv_multipart()).seq for _ in live]
        assert pub.stats().replay_active == 1  # the reply is still in progress
        reply = read_replay(slow)
    assert got == live
    assert [m.seq for m in reply[:-1]] == list(range(seqs[-1] + 1))  # probes, then the batches


def test_concurrent_replays_bounded(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """Beyond the active and waiting limits a request gets only the end marker; others finish."""
    config, options = _big_ring(tmp_path, max_concurrent_replays=1, max_waiting_replays=1)
    with started_publisher(config, options=options) as pub:
        seqs = _publish(pub, 2000, tokens=512)
        endpoint = pub.replay_endpoint or ""
        first = _dealer(ctx, endpoint, 0)
        wait_for(lambda: pub.stats().replay_active == 1, what="first reply active")
        second = _dealer(ctx, endpoint, 10)
        wait_for(lambda: pub.stats().replay_requests == 2, what="second request queued")
        rejected = request_replay(ctx, endpoint, 0)
        assert pub.stats().replay_rejected == 1
        replies = [read_replay(first), read_replay(second)]
    assert len(rejected) == 1 and rejected[0].is_end
    assert [m.seq for m in replies[0][:-1]] == seqs
    assert [m.seq for m in replies[1][:-1]] == seqs[10:]


def test_vanished_client_is_counted(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """A client that disconnects mid-reply ends its session and is counted, not retried forever."""
    config, options = _big_ring(tmp_path)
    with started_publisher(config, options=options) as pub:
        _publish(pub, 2000, tokens=512)
        gone = _dealer(ctx, pub.replay_endpoint or "", 0)
        wait_for(lambda: pub.stats().replay_batches_served > 0, what="replay started")
        gone.close(0)
        wait_for(
            lambda: pub.stats().replay_clients_lost == 1 and pub.stats().replay_active == 0,
            what="lost client counted and its session ended",
        )
        again = request_replay(ctx, pub.replay_endpoint or "", 1999)
    assert [m.seq for m in again] == [1999, END_SEQ]


def test_no_replay_endpoint_means_no_ring() -> None:
    """Without replay_endpoint nothing is buffered and no replay socket exists."""
    with started_publisher(local_config(replay_endpoint=None)) as pub:
        _publish(pub, 5)
        assert pub.replay_endpoint is None and pub.stats().ring_batches == 0


def test_replay_sessions_interleave(ctx: zmq.Context[Any], tmp_path: Path) -> None:
    """A small reply completes while a large one to a blocked client is still in progress."""
    config, options = _big_ring(tmp_path)
    with started_publisher(config, options=options) as pub:
        seqs = _publish(pub, 2000, tokens=512)
        blocked = _dealer(ctx, pub.replay_endpoint or "", 0)
        wait_for(lambda: pub.stats().replay_active == 1, what="large reply active")
        # Served one reply at a time, this would time out: `blocked` reads nothing until later.
        small = request_replay(ctx, pub.replay_endpoint or "", seqs[-3])
        assert pub.stats().replay_active >= 1  # the large reply is still in progress
        read_replay(blocked)
    assert [m.seq for m in small[:-1]] == seqs[-3:]


# Hostile clients. Their tcp replies are large (2,000 batches, ~12 MB: more than the pipe's
# 1,000 messages and the kernel's socket buffers hold) and their receive buffer small, so a
# client that does not read really holds the server's sends back; another peer connects from
# 127.0.0.2 (all of 127/8 is loopback on Linux).
_OTHER_PEER = "127.0.0.2"
_HOG_TOKENS = 2048


def _hog(ctx: zmq.Context[Any], endpoint: str, start: int = 0) -> zmq.Socket[Any]:
    dealer = replay_dealer(ctx, endpoint, rcvhwm=1, rcvbuf=4096)
    dealer.send_multipart(replay_request_frames(start))
    return dealer


def _end_markers(dealers: list[zmq.Socket[Any]], each: int, timeout: float = 30.0) -> list[int]:
    """Read every dealer at once (one's reply may wait for another's to finish) until each has
    ``each`` end markers; the counts."""
    counts = dict.fromkeys(dealers, 0)
    poller = zmq.Poller()
    for dealer in dealers:
        poller.register(dealer, zmq.POLLIN)
    deadline = Deadline(timeout)
    while any(n < each for n in counts.values()) and not deadline.expired:
        for dealer, _ in poller.poll(int(deadline.remaining() * 1000) + 1):
            counts[dealer] += parse_replay_reply(dealer.recv_multipart()).is_end
    return [counts[dealer] for dealer in dealers]


def test_never_reading_clients_leave_slots_to_another_peer(ctx: zmq.Context[Any]) -> None:
    """Eight clients of one peer that ask and never read hold only its share of the slots."""
    options = PublisherOptions(replay_send_timeout=60.0)  # the hogs must stay stuck meanwhile
    with started_publisher(local_config(buffer_steps=3000), options=options) as pub:
        seqs = _publish(pub, 2000, tokens=_HOG_TOKENS)
        endpoint = pub.replay_endpoint or ""
        hogs = [_hog(ctx, endpoint) for _ in range(8)]
        wait_for(lambda: pub.stats().replay_requests == 8, what="every hog's request read")
        reply = request_replay(ctx, endpoint, seqs[-5], source=_OTHER_PEER)
        # The hogs were really stuck: two of them still hold their peer's two slots, six wait.
        wait_for(lambda: pub.stats().replay_active == 2, what="the other peer's reply finished")
        assert pub.stats().replay_waiting == 6
        for hog in hogs:
            hog.close(0)
    assert [m.seq for m in reply[:-1]] == seqs[-5:] and reply[-1].is_end


def test_stalled_reply_is_abandoned_and_its_slot_reused(ctx: zmq.Context[Any]) -> None:
    """A reply that makes no progress for replay_send_timeout gives its slot back, counted."""
    options = PublisherOptions(max_concurrent_replays=1, replay_send_timeout=0.2)
    with started_publisher(local_config(buffer_steps=3000), options=options) as pub:
        seqs = _publish(pub, 2000, tokens=_HOG_TOKENS)
        endpoint = pub.replay_endpoint or ""
        hog = _hog(ctx, endpoint)
        wait_for(lambda: pub.stats().replay_active == 1, what="the hog holds the only slot")
        reply = request_replay(ctx, endpoint, seqs[-3], source=_OTHER_PEER)
        wait_for(lambda: pub.stats().replay_active == 0, what="the second reply finished")
        stats = pub.stats()
        hog.close(0)
    assert [m.seq for m in reply[:-1]] == seqs[-3:]
    assert stats.replay_timed_out == 1


def test_slots_go_round_robin_between_peers(ctx: zmq.Context[Any]) -> None:
    """A peer's queued requests do not go before another peer's: the free slot alternates."""
    # The queued hogs never read: whichever gets the slot holds it for replay_send_timeout.
    options = PublisherOptions(max_concurrent_replays=1, replay_send_timeout=60.0)
    with started_publisher(local_config(buffer_steps=3000), options=options) as pub:
        seqs = _publish(pub, 2000, tokens=_HOG_TOKENS)
        endpoint = pub.replay_endpoint or ""
        first = replay_dealer(ctx, endpoint, rcvhwm=1, rcvbuf=4096)
        first.send_multipart(replay_request_frames(0))
        wait_for(lambda: pub.stats().replay_active == 1, what="first reply active")
        queued = [_hog(ctx, endpoint) for _ in range(3)]
        wait_for(lambda: pub.stats().replay_waiting == 3, what="same-peer requests queued")
        other = replay_dealer(ctx, endpoint, source=_OTHER_PEER)
        other.send_multipart(replay_request_frames(seqs[-2]))
        wait_for(lambda: pub.stats().replay_waiting == 4, what="other peer's request queued")
        read_replay(first)  # frees the slot: the other peer's request must get it next
        reply = read_replay(other, timeout=5.0)  # in arrival order it would wait 60 s
        for dealer in (first, *queued, other):
            dealer.close(0)
    assert [m.seq for m in reply[:-1]] == seqs[-2:]


def test_request_flood_is_rate_limited_and_live_loses_nothing(ctx: zmq.Context[Any]) -> None:
    """A one-peer flood gets counted end markers; live loses nothing; another peer is served."""
    # The flooders read only at the end; a small burst keeps what they are owed small to read.
    options = PublisherOptions(replay_send_timeout=60.0, replay_burst=4)
    with started_publisher(local_config(buffer_steps=3000), options=options) as pub:
        seqs = _publish(pub, 2000, tokens=_HOG_TOKENS)
        sub = connect_subscriber(ctx, pub.endpoint or "", rcvhwm=0)
        probe = wait_subscribed(pub, sub)
        endpoint = pub.replay_endpoint or ""
        # More clients than reply slots, reading nothing: their replies stall, the queue fills.
        flooders = [replay_dealer(ctx, endpoint, rcvhwm=1, rcvbuf=4096) for _ in range(16)]
        live: list[int] = []
        for round_ in range(10):
            for dealer in flooders:
                dealer.send_multipart(replay_request_frames(0))
            live.append(pub.publish(_batch(round_)))
        wait_for(lambda: pub.stats().replay_requests == 160, what="the flood read")
        reply = request_replay(ctx, endpoint, seqs[-1], source=_OTHER_PEER)
        got = [parse_live(sub.recv_multipart()).seq for _ in live]
        stats = pub.stats()
        answers = _end_markers(flooders, each=10)
        for dealer in flooders:
            dealer.close(0)
    assert got == live == list(range(probe + 1, probe + 11))
    assert [m.seq for m in reply[:-1]] == [seqs[-1], *range(seqs[-1] + 1, live[-1] + 1)]
    assert stats.replay_rate_limited >= 150 and stats.ring_batches == live[-1] + 1
    assert answers == [10] * 16  # every request answered, in order, end marker last

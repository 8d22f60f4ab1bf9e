"""The replay server under hostile input: a seeded fuzz pass, floods, never-reading clients.

Each test checks three things by counts, never by timing: every request that reached the
server got an answer (at least the end marker, in request order), live publishing lost nothing,
and the server's state stayed within its bounds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvevents.errors import DecodeError
from kvevents.events import BlockStored, KVEventBatch
from kvevents.publish._publisher import PublisherOptions, PublisherStats, ZmqPublisher
from kvevents.testing.publisher import (
    connect_subscriber,
    local_config,
    replay_dealer,
    request_replay,
    started_publisher,
    wait_subscribed,
)
from kvevents.testing.sockets import Deadline, wait_for
from kvevents.wire import (
    ReplayMessage,
    pack_seq,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_request_frames,
)

SEED = 20261201
_RING = 300
_OTHER_PEER = "127.0.0.2"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _batch(i: int) -> KVEventBatch:
    stored = BlockStored(block_hashes=[i], token_ids=[1000 + i] * 4, block_size=4)
    return KVEventBatch(ts=float(i), events=[stored])


def _random_request(rng: random.Random, newest: int) -> list[bytes]:
    """One request, valid or not: the shapes a confused or hostile client sends."""
    kind = rng.randrange(8)
    if kind == 0:
        return replay_request_frames(rng.randrange(newest + 1))
    if kind == 1:
        return replay_request_frames(rng.choice([2**63, 2**64 - 2, 2**64 - 1, newest + 10**9]))
    if kind == 2:
        return [pack_seq(rng.randrange(newest + 1))]  # no delimiter: still readable
    if kind == 3:
        return [b"", rng.randbytes(rng.choice([0, 1, 7, 9, 16]))]  # a seq of the wrong size
    if kind == 4:
        return [rng.randbytes(rng.randrange(0, 12)) for _ in range(rng.randrange(1, 6))]
    if kind == 5:
        return [b"", pack_seq(0), *([b""] * rng.randrange(1, 4))]  # extra frames
    if kind == 6:
        return [rng.randbytes(rng.randrange(100, 2000))]  # big but under the frame limit
    return [b"x", pack_seq(rng.randrange(newest + 1))]  # a delimiter that is not empty


def _readable(frames: list[bytes]) -> int | None:
    try:
        return parse_replay_request(frames)
    except DecodeError:
        return None


def _replies(
    dealers: list[zmq.Socket[Any]], each: int, timeout: float = 30.0
) -> list[list[list[ReplayMessage]]]:
    """Read every dealer at once until each has ``each`` whole replies; the replies per dealer.

    At once, because one client's reply may wait for a slot another client's reply holds.
    """
    done: dict[zmq.Socket[Any], list[list[ReplayMessage]]] = {d: [] for d in dealers}
    partial: dict[zmq.Socket[Any], list[ReplayMessage]] = {d: [] for d in dealers}
    poller = zmq.Poller()
    for dealer in dealers:
        poller.register(dealer, zmq.POLLIN)
    deadline = Deadline(timeout)
    while any(len(r) < each for r in done.values()) and not deadline.expired:
        for dealer, _ in poller.poll(int(deadline.remaining() * 1000) + 1):
            partial[dealer].append(parse_replay_reply(dealer.recv_multipart()))
            if partial[dealer][-1].is_end:
                done[dealer].append(partial[dealer])
                partial[dealer] = []
    return [done[d] for d in dealers]


def _within_bounds(stats: PublisherStats, options: PublisherOptions) -> bool:
    return (
        stats.replay_active <= options.max_concurrent_replays
        and stats.replay_waiting <= options.max_waiting_replays
        and stats.replay_peers <= 1024
        and stats.ring_batches <= _RING
    )


def _live_until(pub: ZmqPublisher, sub: zmq.Socket[Any], count: int) -> list[int]:
    seqs = [pub.publish(_batch(i)) for i in range(count)]
    return [parse_live(sub.recv_multipart()).seq for _ in seqs]


def test_fuzzed_requests_all_get_answers_in_order(ctx: zmq.Context[Any]) -> None:
    """Seeded random requests: one reply each, in order, end last; live whole; state bounded."""
    rng = random.Random(SEED)
    # Replies pile up until all requests are sent: no deadline may cut one meanwhile.
    options = PublisherOptions(replay_send_timeout=60.0)
    with started_publisher(local_config(buffer_steps=_RING), options=options) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "", rcvhwm=0)
        first_live = wait_subscribed(pub, sub) + 1
        live = _live_until(pub, sub, _RING)
        endpoint = pub.replay_endpoint or ""
        sources = [None, None, None, _OTHER_PEER, _OTHER_PEER, "127.0.0.3"]
        dealers = [replay_dealer(ctx, endpoint, source=source) for source in sources]
        sent: list[list[list[bytes]]] = [[] for _ in dealers]
        samples = []
        for _ in range(30):
            for dealer, requests in zip(dealers, sent, strict=True):
                requests.append(_random_request(rng, live[-1]))
                dealer.send_multipart(requests[-1])
            live += _live_until(pub, sub, 3)
            samples.append(pub.stats())
        replies = _replies(dealers, each=30)
        stats = pub.stats()
        for dealer in dealers:
            dealer.close(0)
    assert live == list(range(first_live, first_live + _RING + 90))  # dense: nothing lost
    assert all(_within_bounds(s, options) for s in [*samples, stats])
    total = sum(len(r) for r in sent)
    malformed = sum(_readable(frames) is None for requests in sent for frames in requests)
    assert stats.replay_requests == total and stats.replay_malformed == malformed > 0
    for requests, answers in zip(sent, replies, strict=True):
        assert len(answers) == len(requests)
        for frames, reply in zip(requests, answers, strict=True):
            assert reply[-1].is_end and not any(m.is_end for m in reply[:-1])
            start = _readable(frames)
            seqs = [m.seq for m in reply[:-1]]
            if not seqs:
                continue  # refused (rate, queue), unreadable or past the newest: the end alone
            # Else a dense tail from the start asked, or a whole ring that has moved past it.
            assert start is not None and seqs == list(range(seqs[0], seqs[-1] + 1))
            assert seqs[0] == start or (seqs[0] > start and len(seqs) == _RING)
    assert stats.replay_rate_limited + stats.replay_rejected > 0  # the fuzz was a flood too


def test_flood_with_never_reading_clients_keeps_service_and_live(ctx: zmq.Context[Any]) -> None:
    """Hogs, a flood and a giant frame at once: another peer served, live whole, state bounded."""
    options = PublisherOptions(replay_send_timeout=60.0)
    with started_publisher(local_config(buffer_steps=_RING), options=options) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "", rcvhwm=0)
        wait_subscribed(pub, sub)
        live = _live_until(pub, sub, _RING)
        endpoint = pub.replay_endpoint or ""
        hogs = [replay_dealer(ctx, endpoint, rcvhwm=1, rcvbuf=4096) for _ in range(8)]
        flood = [replay_dealer(ctx, endpoint) for _ in range(4)]
        giant = replay_dealer(ctx, endpoint)
        giant.send_multipart([b"", b"\x00" * 1_000_000])  # over the frame limit: refused
        for round_ in range(50):
            for dealer in (*hogs, *flood):
                dealer.send_multipart(replay_request_frames(round_))
            live += _live_until(pub, sub, 2)
        wait_for(lambda: pub.stats().replay_requests == 600, what="the flood read")
        reply = request_replay(ctx, endpoint, live[-1], source=_OTHER_PEER)
        stats = pub.stats()
        answered = _replies(flood, each=50)
        for dealer in (*hogs, *flood, giant):
            dealer.close(0)
    assert [m.seq for m in reply] == [live[-1], 2**64 - 1]
    assert live == list(range(live[0], live[0] + _RING + 100))
    assert [len(r) for r in answered] == [50] * 4
    assert stats.replay_requests == 601 and _within_bounds(stats, options)  # giant never read
    assert stats.replay_rate_limited > 0 and stats.replay_active <= 2 + 1


def test_rate_limiter_memory_is_bounded_by_peer_count() -> None:
    """However many peers ask, the limiter keeps at most max_peers buckets."""
    from kvevents.publish._admission import PeerBuckets

    buckets = PeerBuckets(rate=1.0, burst=2, max_peers=64)
    for i in range(10_000):
        buckets.allow(f"10.0.{i // 256}.{i % 256}", now=i * 1e-6)
        assert len(buckets) <= 64

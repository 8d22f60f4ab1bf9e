"""Pure parts of the publisher: drop-carry policy, replay ring, warnings, options, factory."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
import zmq

from kvevents import KVEventsConfig
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.publish._carry import RemovalCarry
from kvevents.publish._publisher import (
    NullPublisher,
    PublisherOptions,
    PublisherStats,
    ZmqPublisher,
    create_publisher,
)
from kvevents.publish._replay import ReplayLimits, ReplayRing, ReplayServer
from kvevents.ratelimit import RateLimitedWarning
from kvevents.wire import END_SEQ, pack_seq, replay_request_frames, unpack_seq


def _stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], token_ids=[1, 2], block_size=2)


def test_carry_keeps_removals_and_clears_in_order() -> None:
    """A dropped batch's removals and clears are kept, stores are not, order is preserved."""
    carry = RemovalCarry()
    carry.absorb([_stored(1), BlockRemoved(block_hashes=[1, 2]), BlockRemoved(block_hashes=[3])])
    assert carry.take() == [BlockRemoved(block_hashes=[1, 2]), BlockRemoved(block_hashes=[3])]
    assert not carry


def test_carry_deduplicates_removals_per_medium() -> None:
    """A hash already carried is not removed twice; another medium is a different block."""
    carry = RemovalCarry()
    carry.absorb([BlockRemoved(block_hashes=[1, 2])])
    carry.absorb([BlockRemoved(block_hashes=[2, 3]), BlockRemoved(block_hashes=[1])])
    carry.absorb([BlockRemoved(block_hashes=[1], medium="CPU")])
    assert carry.take() == [
        BlockRemoved(block_hashes=[1, 2]),
        BlockRemoved(block_hashes=[3]),
        BlockRemoved(block_hashes=[1], medium="CPU"),
    ]


def test_carry_clear_supersedes_earlier_removals() -> None:
    """AllBlocksCleared replaces every removal carried before it, later ones follow it."""
    carry = RemovalCarry()
    carry.absorb(
        [BlockRemoved(block_hashes=[1]), AllBlocksCleared(), BlockRemoved(block_hashes=[1])]
    )
    assert carry.take() == [AllBlocksCleared(), BlockRemoved(block_hashes=[1])]
    assert carry.take() == []


def test_ring_keeps_last_steps() -> None:
    """The ring holds at most max_batches, the newest ones."""
    ring = ReplayRing(max_batches=3, max_bytes=10**6)
    for seq in range(5):
        ring.append(seq, pack_seq(seq), b"x")
    assert [e.seq for e in ring.tail(0)] == [2, 3, 4]
    assert ring.oldest_seq == 2 and len(ring) == 3


def test_ring_byte_budget_bounds_memory() -> None:
    """The byte budget evicts the oldest batches; a batch larger than it is not kept."""
    ring = ReplayRing(max_batches=100, max_bytes=250)
    for seq in range(5):
        ring.append(seq, pack_seq(seq), b"x" * 100)
    assert [e.seq for e in ring.tail(0)] == [3, 4] and ring.nbytes == 200
    ring.append(5, pack_seq(5), b"y" * 300)
    assert len(ring) == 0 and ring.nbytes == 0


def test_ring_tail_with_gaps_and_compaction() -> None:
    """tail() finds the first seq >= start across gaps, before and after compaction."""
    ring = ReplayRing(max_batches=2000, max_bytes=10**9)
    for seq in range(0, 10_000, 2):
        ring.append(seq, pack_seq(seq), b"p")
    assert [e.seq for e in ring.tail(9_995)] == [9_996, 9_998]
    assert ring.tail(0)[0].seq == 6_000 and ring.tail(10**6) == []
    with pytest.raises(ValueError, match="does not follow"):
        ring.append(5, pack_seq(5), b"p")


def test_rate_limited_warning_holds_back_repeats(caplog: pytest.LogCaptureFixture) -> None:
    """Repeated warnings within the interval are held back and then counted."""
    now = [0.0]
    warn = RateLimitedWarning(
        logging.getLogger("kvevents.publish.publisher"), 10.0, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="kvevents.publish.publisher"):
        for _ in range(5):
            warn("full", "dropped %d", 7)
        now[0] = 11.0
        warn("full", "dropped %d", 8)
    assert [r.getMessage() for r in caplog.records] == [
        "dropped 7",
        "dropped 8 (4 similar warnings held back)",
    ]


def test_options_reject_nonsense() -> None:
    """Options fail loudly on values that would disable a bound."""
    with pytest.raises(ValueError, match="heartbeat_interval"):
        PublisherOptions(heartbeat_interval=0)
    with pytest.raises(ValueError, match="replay_buffer_bytes"):
        PublisherOptions(replay_buffer_bytes=0)


def test_factory_returns_null_when_events_are_off() -> None:
    """Events off (or publisher "null") gives a NullPublisher that discards and reports zeros."""
    for config in (
        KVEventsConfig(),
        KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    ):
        publisher = create_publisher(config, rank=2, world_size=4)
        assert isinstance(publisher, NullPublisher) and publisher.rank == 2
        with publisher:
            assert publisher.publish(None) is None  # type: ignore[arg-type]
        assert publisher.stats() == PublisherStats()


def test_factory_checks_layout_without_side_effects() -> None:
    """Construction validates the whole rank layout but binds nothing."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:65535")
    with pytest.raises(ValueError, match="exceed 65535"):
        create_publisher(config, rank=0, world_size=2)
    with pytest.raises(ValueError, match="outside world size"):
        create_publisher(KVEventsConfig(enable_kv_cache_events=True), rank=3, world_size=2)
    publisher = create_publisher(KVEventsConfig(enable_kv_cache_events=True), rank=1, world_size=2)
    assert isinstance(publisher, ZmqPublisher)
    assert publisher.endpoint is None and publisher.endpoints.publish == "tcp://*:5558"


def test_rank_without_world_size_gives_a_publisher() -> None:
    """A rank without a world size (vLLM's, SGLang's call) builds; layout checked for 0..rank."""
    config = KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="tcp://*:5600")
    publisher = create_publisher(config, rank=1)
    assert isinstance(publisher, ZmqPublisher)
    assert (publisher.endpoints.publish, publisher.endpoints.replay) == (
        "tcp://*:5558",
        "tcp://*:5601",
    )
    with pytest.raises(ValueError, match="exceed 65535"):
        create_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:65535"), 1)
    with pytest.raises(ValueError, match="rank -1 is negative"):
        create_publisher(config, rank=-1)


def test_stats_fields_documented() -> None:
    """Every stats counter is exposed by name for metrics."""
    stats = PublisherStats(dropped_queue_full=2, dropped_send_error=1)
    assert stats.dropped == 3
    assert set(stats.as_dict()) >= {"enqueued", "published", "queue_depth", "bytes_sent"}


def test_peer_buckets_refill_at_the_rate_and_cap_at_the_burst() -> None:
    """A peer gets `burst` requests at once, then `rate` per second; other peers are apart."""
    from kvevents.publish._admission import PeerBuckets

    buckets = PeerBuckets(rate=2.0, burst=3)
    assert [buckets.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert buckets.allow("b", now=0.0)  # another peer has its own bucket
    assert buckets.allow("a", now=0.5) and not buckets.allow("a", now=0.5)  # one token in 0.5 s
    assert [buckets.allow("a", now=100.0) for _ in range(4)] == [True, True, True, False]


def test_options_reject_replay_limits_that_disable_a_bound() -> None:
    """A zero timeout, rate or per-peer share is refused, naming the option."""
    for name, value in (
        ("replay_send_timeout", 0),
        ("replay_rate", 0),
        ("max_replays_per_peer", 0),
        ("replay_burst", 0),
    ):
        with pytest.raises(ValueError, match=name):
            PublisherOptions(**{name: value})


def test_every_replay_server_counter_reaches_stats() -> None:
    """Each ReplayCounters field has a replay_<name> counter in PublisherStats: none is lost."""
    from dataclasses import fields

    from kvevents.publish._replay import ReplayCounters

    published = set(PublisherStats().as_dict())
    missing = [f.name for f in fields(ReplayCounters) if f"replay_{f.name}" not in published]
    assert missing == []
    assert {"replay_active", "replay_waiting", "replay_peers"} <= PublisherStats.GAUGES


# ---------------------------------------------------------------------- replay server, no sockets


class _Frame:
    def __init__(self, data: bytes, peer: str) -> None:
        self.bytes = data
        self._peer = peer

    def get(self, name: str) -> str:
        return self._peer


class _Router:
    """Stands in for the ROUTER socket: scripted requests in, every sent message recorded."""

    def __init__(self) -> None:
        self.inbox: list[list[_Frame]] = []
        self.sent: list[list[bytes]] = []
        self.blocked: set[bytes] = set()

    def request(self, identity: bytes, peer: str, frames: list[bytes]) -> None:
        self.inbox.append([_Frame(identity, peer), *(_Frame(f, peer) for f in frames)])

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[_Frame]:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.pop(0)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if frames[0] in self.blocked:
            raise zmq.Again()
        self.sent.append(frames)

    def seqs_to(self, identity: bytes) -> list[int]:
        return [unpack_seq(f[3]) for f in self.sent if f[0] == identity]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _server(**limits: Any) -> tuple[ReplayServer, _Router, _Clock]:
    ring = ReplayRing(max_batches=100, max_bytes=10**6)
    for seq in range(5):
        ring.append(seq, pack_seq(seq), b"p")
    router, clock = _Router(), _Clock()
    server = ReplayServer(
        cast("zmq.Socket[bytes]", router), ring, b"", ReplayLimits(**limits), clock=clock
    )
    return server, router, clock


def test_server_answers_a_clients_requests_in_order() -> None:
    """An end marker owed to a client whose reply is still queued comes after that reply."""
    server, router, _ = _server()
    router.request(b"a", "p", replay_request_frames(3))
    router.request(b"a", "p", [b"", b"bad"])
    server.accept_requests()
    while server.busy:
        server.pump()
    assert router.seqs_to(b"a") == [3, 4, END_SEQ, END_SEQ]
    assert server.counters.malformed == 1


def test_server_abandons_a_reply_without_progress_after_the_deadline() -> None:
    """A blocked client's reply gives its slot back once send_timeout passes, counted."""
    server, router, clock = _server(send_timeout=5.0)
    router.blocked.add(b"a")
    router.request(b"a", "p", replay_request_frames(0))
    server.accept_requests()
    clock.now = 4.9
    server.pump()
    assert server.active == 1 and server.counters.timed_out == 0
    clock.now = 5.0
    server.pump()
    assert server.active == 0 and server.counters.timed_out == 1


def test_server_gives_a_free_slot_to_the_peer_served_least_recently() -> None:
    """With one slot, peer q's request goes before peer p's second one (round-robin)."""
    server, router, _ = _server(max_active=1, per_peer=1)
    for identity, peer in ((b"p1", "p"), (b"p2", "p"), (b"q1", "q")):
        router.request(identity, peer, replay_request_frames(4))
    server.accept_requests()
    while server.busy:
        server.pump()
    order = [f[0] for f in router.sent if unpack_seq(f[3]) == END_SEQ]
    assert order == [b"p1", b"q1", b"p2"]


def test_server_rate_limits_per_peer_with_the_end_marker() -> None:
    """Past its burst a peer's requests get the end marker at once; another peer is unaffected."""
    server, router, _ = _server(burst=2, rate=1.0)
    for i in range(4):
        router.request(b"p%d" % i, "p", replay_request_frames(4))
    router.request(b"q", "q", replay_request_frames(4))
    server.accept_requests()
    assert router.seqs_to(b"p2") == router.seqs_to(b"p3") == [END_SEQ]
    while server.busy:
        server.pump()
    assert router.seqs_to(b"q") == [4, END_SEQ] and server.counters.rate_limited == 2


def test_server_reads_a_flood_a_bounded_bite_at_a_time() -> None:
    """A flood is read in bounded bites (the ring drains in between); every request answered."""
    server, router, _ = _server(rate=1.0, burst=1)
    for i in range(1000):
        router.request(b"c%d" % i, "p", [b"", b"bad"] if i % 2 else replay_request_frames(4))
    bites = 0
    while server.accept_requests():
        bites += 1
        assert 0 < len(router.inbox) < 1000
    while server.busy:
        server.pump()
    assert bites >= 3 and server.counters.requests == 1000
    assert sorted({f[0] for f in router.sent if unpack_seq(f[3]) == END_SEQ}) == sorted(
        b"c%d" % i for i in range(1000)
    )

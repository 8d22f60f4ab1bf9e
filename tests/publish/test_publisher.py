"""The ZeroMQ publisher's live path and lifecycle, over real sockets."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvevents import BindError, KVEventsConfig, PublisherClosed, PublisherError
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.publish._publisher import PublisherOptions, ZmqPublisher, create_publisher
from kvevents.testing.publisher import (
    PausablePublisher,
    connect_subscriber,
    local_config,
    paused_forwarding,
    probe_until,
    request_replay,
    spawn_subscriber,
    started_publisher,
    wait_subscribed,
)
from kvevents.testing.sockets import wait_for
from kvevents.wire import decode_batch, parse_live

ON_CI = bool(os.environ.get("CI"))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _batch(*hashes: int, removed: tuple[int, ...] = ()) -> KVEventBatch:
    events: list[Any] = [
        BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[h] * 4, block_size=4)
        for h in hashes
    ]
    if removed:
        events.append(BlockRemoved(block_hashes=list(removed)))
    return KVEventBatch(ts=time.time(), events=events)


def _receive(
    sub: zmq.Socket[Any], n: int, timeout: float = 10.0
) -> list[tuple[bytes, int, KVEventBatch]]:
    out = []
    for _ in range(n):
        assert sub.poll(int(timeout * 1000)), f"only {len(out)} of {n} messages arrived"
        msg = parse_live(sub.recv_multipart())
        out.append((msg.topic, msg.seq, decode_batch(msg.payload).batch))
    return out


def test_first_seq_is_zero_and_dense(ctx: zmq.Context[Any]) -> None:
    """The first batch gets seq 0, later ones +1 each, and subscribers see them in order."""
    with started_publisher(local_config(topic="kv")) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        probe = wait_subscribed(pub, sub)
        seqs = [pub.publish(_batch(i)) for i in range(50)]
        got = _receive(sub, 50)
        replayed = request_replay(ctx, pub.replay_endpoint or "", 0)
    assert seqs == list(range(probe + 1, probe + 51))
    assert [s for _, s, _ in got] == seqs
    assert [m.seq for m in replayed[:-1]] == list(range(probe + 51))  # seq 0 first, no hole
    assert {t for t, _, _ in got} == {b"kv"}
    assert [b.events[0].block_hashes for _, _, b in got] == [[i] for i in range(50)]


def test_rank_tag_and_explicit_rank_kept(ctx: zmq.Context[Any]) -> None:
    """A batch without data_parallel_rank gets the publisher's rank; an explicit one is kept."""
    with started_publisher(local_config(), rank=1, world_size=2) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        wait_subscribed(pub, sub)
        pub.publish(_batch(1))
        pub.publish(KVEventBatch(ts=1.0, events=[], data_parallel_rank=7))
        got = _receive(sub, 2)
    assert [b.data_parallel_rank for _, _, b in got] == [1, 7]


def test_rank_without_world_size_publishes(ctx: zmq.Context[Any]) -> None:
    """create_publisher(config, rank=1), as vLLM's and SGLang's factories call it, publishes."""
    with create_publisher(local_config(), rank=1) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        wait_subscribed(pub, sub)
        pub.publish(_batch(1))
        got = _receive(sub, 1)
    assert [b.data_parallel_rank for _, _, b in got] == [1]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port < 65000:
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    pytest.skip("no two consecutive free ports found")


def test_two_ranks_bind_base_and_base_plus_one(ctx: zmq.Context[Any]) -> None:
    """Rank r binds base port + r and tags its batches with r; one SUB reads both ranks."""
    base = _free_port_pair()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{base}")
    pubs = [ZmqPublisher(config, rank, world_size=2) for rank in range(2)]
    for pub in pubs:
        pub.start()
    try:
        assert [p.endpoint for p in pubs] == [f"tcp://127.0.0.1:{base + r}" for r in range(2)]
        subs = [connect_subscriber(ctx, p.endpoint or "") for p in pubs]
        for pub, sub in zip(pubs, subs, strict=True):
            wait_subscribed(pub, sub)
            pub.publish(_batch(pub.rank + 100))
        ranks = [_receive(sub, 1)[0][2].data_parallel_rank for sub in subs]
    finally:
        for pub in pubs:
            pub.shutdown()
    assert ranks == [0, 1]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "endpoint", ["tcp://*:0", "tcp://0.0.0.0:0", "tcp://127.0.0.1:0", "tcp://[::1]:0"]
)
def test_bind_hosts(ctx: zmq.Context[Any], endpoint: str) -> None:
    """Wildcard, IPv4 and IPv6 hosts all bind (never connect) and deliver."""
    if "[::1]" in endpoint and not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1 cannot be bound)")
    config = local_config(endpoint=endpoint, replay_endpoint=endpoint)
    with started_publisher(config) as pub:
        assert pub.endpoint is not None and not pub.endpoint.endswith(":0")
        sub = connect_subscriber(ctx, pub.endpoint)
        probe = wait_subscribed(pub, sub)
        pub.publish(_batch(5))
        assert _receive(sub, 1)[0][1] == probe + 1
        assert request_replay(ctx, pub.replay_endpoint or "", probe + 1)[0].seq == probe + 1


def test_ipc_rank_one_uses_dp_suffix(ctx: zmq.Context[Any], tmp_path: Any) -> None:
    """ipc:// at rank 1 binds PATH_dp1 (publish and replay) and delivers."""
    config = local_config(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/rep")
    with started_publisher(config, rank=1, world_size=2) as pub:
        assert pub.endpoint == f"ipc://{tmp_path}/pub_dp1"
        assert pub.replay_endpoint == f"ipc://{tmp_path}/rep_dp1"
        sub = connect_subscriber(ctx, pub.endpoint)
        wait_subscribed(pub, sub)
        pub.publish(_batch(9))
        assert _receive(sub, 1)[0][2].data_parallel_rank == 1


def test_topic_frame_and_filtering(ctx: zmq.Context[Any]) -> None:
    """Every message starts with the topic; subscribers filter on it by prefix."""
    with started_publisher(local_config(topic="kv@rank0")) as pub:
        other = connect_subscriber(ctx, pub.endpoint or "", topic=b"kv@rank1")
        prefix = connect_subscriber(ctx, pub.endpoint or "", topic=b"kv@")
        wait_subscribed(pub, prefix)
        for i in range(5):
            pub.publish(_batch(i))
        assert {t for t, _, _ in _receive(prefix, 5)} == {b"kv@rank0"}
        # `other` subscribed before the handshake: ZeroMQ filters it out at the PUB side.
        assert not other.poll(50)


def test_queue_full_drops_are_gaps_and_removals_survive(ctx: zmq.Context[Any]) -> None:
    """Drops consume seqs (gaps); their removals and clears arrive in the next accepted batch."""
    with started_publisher(local_config(max_queue_size=4), pausable=True) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        probe = wait_subscribed(pub, sub)
        with paused_forwarding(pub):
            accepted = 0
            while pub.stats().dropped_queue_full == 0:
                pub.publish(_batch(accepted))
                accepted += 1
            dropped_seq = pub.stats().next_seq - 1
            pub.publish(_batch(100, removed=(7, 8)))  # dropped too: queue still full
            pub.publish(
                KVEventBatch(ts=1.0, events=[AllBlocksCleared(), BlockRemoved(block_hashes=[9])])
            )
            stats = pub.stats()
        wait_for(lambda: pub.stats().queue_depth == 0, what="queue drained")
        # libzmq may take a moment to notice the drained queue: retry until accepted (a
        # store-only batch adds nothing to the carry when it is dropped again).
        before = pub.stats().enqueued
        while pub.stats().enqueued == before:
            last_seq = pub.publish(_batch(200))
        got = pub.stats()
        received = _receive(sub, accepted)
    assert stats.dropped_queue_full == 3 and 1 <= accepted - 1 <= 4
    seqs = [s for _, s, _ in received]
    assert seqs == [*range(probe + 1, dropped_seq), last_seq]  # a gap of three or more
    assert last_seq >= dropped_seq + 3
    last = received[-1][2].events
    assert last[:2] == [AllBlocksCleared(), BlockRemoved(block_hashes=[9])]
    assert isinstance(last[2], BlockStored) and last[2].block_hashes == [200]
    assert got.carried_events == 2 and got.pending_carry == 0


def test_encode_error_is_counted_gap(ctx: zmq.Context[Any]) -> None:
    """A batch that cannot be encoded is dropped and counted; its seq becomes a gap."""
    with started_publisher(local_config()) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        probe = wait_subscribed(pub, sub)
        bad = KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[2**80])])
        assert pub.publish(bad) == probe + 1
        pub.publish(_batch(1))
        assert _receive(sub, 1)[0][1] == probe + 2
        assert pub.stats().dropped_encode_error == 1


def test_heartbeat_after_idle(ctx: zmq.Context[Any]) -> None:
    """With heartbeat_interval set, an idle publisher sends empty batches, counted."""
    with started_publisher(
        local_config(), options=PublisherOptions(heartbeat_interval=0.02)
    ) as pub:
        sub = connect_subscriber(ctx, pub.endpoint or "")
        wait_subscribed(pub, sub)
        wait_for(lambda: pub.stats().heartbeats >= 2, what="two heartbeats")
        batch = _receive(sub, 1)[0][2]
    assert batch.events == [] and batch.data_parallel_rank == 0


def test_lifecycle_idempotent_and_closed() -> None:
    """start/shutdown are idempotent, shutdown without start works, publish after it raises."""
    never = ZmqPublisher(local_config())
    assert never.shutdown().published == 0 and never.shutdown() is never.shutdown()
    with pytest.raises(PublisherClosed):
        never.start()
    pub = ZmqPublisher(local_config())
    with pytest.raises(PublisherError, match="not started"):
        pub.publish(_batch(1))
    pub.start()
    pub.start()
    pub.publish(_batch(1))
    report = pub.shutdown()
    assert report is pub.shutdown()
    assert report.undelivered == 0 and report.published == 1 and report.flush_complete
    with pytest.raises(PublisherClosed, match="rank 0 is shut down"):
        pub.publish(_batch(2))


def test_shutdown_reports_undelivered_when_stuck() -> None:
    """Batches that cannot leave within the linger are reported, never raised."""
    pub = PausablePublisher(local_config(max_queue_size=8))
    pub.start()
    pub.pause_forwarding()
    for i in range(20):
        pub.publish(_batch(i))
    report = pub.shutdown(timeout=0.05)
    assert report.undelivered == report.stats.enqueued > 0
    assert report.stats.dropped_queue_full == 20 - report.stats.enqueued


def test_shutdown_flushes_burst(ctx: zmq.Context[Any]) -> None:
    """shutdown() publishes everything queued before closing; a reading subscriber gets it all."""
    pub = ZmqPublisher(local_config(max_queue_size=50_000, hwm=50_000))
    pub.start()
    sub = connect_subscriber(ctx, pub.endpoint or "", rcvhwm=0)
    probe = wait_subscribed(pub, sub)
    for i in range(5_000):
        pub.publish(_batch(i))
    report = pub.shutdown(timeout=10)
    got = _receive(sub, 5_000)
    assert report.undelivered == 0 and got[-1][1] == probe + 5_000


def test_port_reusable_right_after_shutdown() -> None:
    """The same fixed ports bind again immediately after shutdown()."""
    with started_publisher(local_config()) as first:
        endpoint, replay = first.endpoint, first.replay_endpoint
    config = local_config(endpoint=endpoint, replay_endpoint=replay)
    with started_publisher(config) as second:
        assert (second.endpoint, second.replay_endpoint) == (endpoint, replay)


def test_bind_conflict_names_endpoint_rank_role() -> None:
    """A taken port fails start() with the endpoint, rank and role, and can be retried."""
    with started_publisher(local_config()) as holder:
        port = int((holder.replay_endpoint or "").rsplit(":", 1)[1])
        config = local_config(replay_endpoint=f"tcp://127.0.0.1:{port - 1}")
        pub = ZmqPublisher(config, rank=1, world_size=2)
        with pytest.raises(BindError) as info:
            pub.start()
        assert str(info.value) == (
            f"cannot bind tcp://127.0.0.1:{port} for rank 1 (replay): address already in use"
        )
        assert (info.value.rank, info.value.role) == (1, "replay")
        assert pub.endpoint is None
        taken = local_config(endpoint=holder.endpoint)
        with pytest.raises(BindError, match=r"for rank 0 \(publish\): address already in use"):
            ZmqPublisher(taken).start()
    assert pub.shutdown().published == 0


def test_out_of_process_subscriber_gets_every_batch() -> None:
    """100,000 batches reach a subscriber in another process, all of them, dense."""
    count = 100_000
    config = local_config(hwm=count + 1000, max_queue_size=count + 1000, replay_endpoint=None)
    with started_publisher(config) as pub:
        child = spawn_subscriber(pub.endpoint or "", count)
        try:
            assert child.stdout is not None
            assert probe_until(pub, child.stdout) == "ready"
            batch = _batch(1)
            for _ in range(count):
                pub.publish(batch)
            summary = json.loads(child.stdout.readline())
        finally:
            child.kill()
            child.wait()
        stats = pub.stats()
    assert summary["received"] == count and summary["dense"]
    assert stats.dropped == 0

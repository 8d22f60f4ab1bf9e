"""The subscriber against raw publishers driven to misbehave: every loss recovered or reported."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvevents.deadline import Deadline
from kvevents.errors import DecodeError, LayoutError, SubscriberClosed, SubscriberError
from kvevents.events import AllBlocksCleared, KVEventBatch
from kvevents.subscribe import (
    AsyncSubscriber,
    Delivery,
    StreamSpec,
    Subscriber,
    worker_streams,
)
from kvevents.subscribe._replay import ReplayOptions
from kvevents.testing.fixtures import heartbeat, typical_batch, wire_fixtures
from kvevents.testing.peers import Collector, RawPublisher
from kvevents.testing.sinks import RecordingSink
from kvevents.wire import pack_seq

W = "w1"
KEY = (W, 0)


@pytest.fixture
def pubs() -> Iterator[Callable[..., RawPublisher]]:
    made: list[RawPublisher] = []

    def make(**kwargs: object) -> RawPublisher:
        pub = RawPublisher(**kwargs)  # type: ignore[arg-type]
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


def spec_for(pub: RawPublisher, worker: str = W, rank: int = 0) -> StreamSpec:
    return StreamSpec(worker, rank, pub.endpoint, pub.replay_endpoint)


def connected(pub: RawPublisher, sub: Subscriber, key: tuple[str, int] = KEY) -> Collector:
    got = Collector(sub)
    got.handshake(pub, key)
    return got


def publish(pub: RawPublisher, count: int, drop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    for i in range(count):
        pub.publish(typical_batch(i), drop=i in drop)


def probe_until(
    pub: RawPublisher,
    sink: RecordingSink,
    predicate: Callable[[RecordingSink], object],
    what: str,
) -> None:
    """Publish heartbeats until ``predicate(sink)`` holds (the SUB is connected)."""
    deadline = Deadline(10.0)
    while not predicate(sink):
        if deadline.expired:
            raise TimeoutError(f"timed out waiting for {what}")
        pub.publish(heartbeat())
        with contextlib.suppress(TimeoutError):
            sink.wait(predicate, 0.02)


def settle(got: Collector, pub: RawPublisher, key: tuple[str, int] = KEY) -> None:
    got.wait(lambda c: c.caught_up(pub, key), what=f"{key} to deliver seq {pub.next_seq - 1}")


def test_in_order_stream_is_delivered_exactly(pubs, subs) -> None:
    """A clean stream is delivered batch for batch, nothing counted as lost."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 30)
    settle(got, pub)
    assert got.matches(pub, KEY)
    stats = sub.stream_stats()[KEY]
    assert stats.unrecoverable == 0 and stats.duplicates == 0 and stats.state == "live"
    assert stats.events == sum(len(b.events) for _, b in got.delivered[KEY])


def test_dropped_live_messages_are_replayed_in_order(pubs, subs) -> None:
    """Live messages lost on the way show up as gaps, are replayed, and order is kept."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 60, drop={3, 4, 5, 30, 58})
    settle(got, pub)
    assert got.matches(pub, KEY)
    stats = sub.stream_stats()[KEY]
    # One replay may cover several holes when it is served after the later drops happened.
    assert stats.gaps >= 1 and stats.replayed >= 5
    assert stats.unrecoverable == 0 and stats.state == "live"


def test_subscriber_joining_after_500_batches_replays_from_zero(pubs, subs) -> None:
    """A late joiner first replays everything from seq 0, then follows live."""
    pub = pubs()
    publish(pub, 500)
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    settle(got, pub)
    assert got.matches(pub, KEY)
    assert len(got.delivered[KEY]) >= 501
    assert sub.stream_stats()[KEY].replayed >= 500


def test_publisher_restart_resets_the_stream_and_rebuilds(pubs, subs) -> None:
    """Sequence going back to 0 emits StreamReset('restart') and the new run is delivered whole."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 20)
    settle(got, pub)
    pub.restart()
    publish(pub, 15, drop={0, 1})  # the first batches after a restart are often missed
    got.wait(lambda c: bool(c.resets), what="a restart")
    settle(got, pub)
    assert [r.reason for r in got.resets] == ["restart"]
    assert got.matches(pub, KEY)
    assert sub.stream_stats()[KEY].restarts == 1


def test_end_marker_on_the_live_socket_is_treated_as_a_restart(pubs, subs) -> None:
    """A live end marker resets the stream instead of being delivered."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    pub.send_raw([b"", b"\xff" * 8, b""])
    got.wait(lambda c: bool(c.resets), what="a reset")
    pub.restart()
    publish(pub, 5)
    settle(got, pub)
    assert got.matches(pub, KEY)


def test_without_replay_endpoint_every_loss_is_reported(pubs, subs) -> None:
    """No replay: losses are delivered around, reported as missing ranges, stream incomplete."""
    pub = pubs(replay=False)
    sub = subs([spec_for(pub)], status_items=True)
    got = connected(pub, sub)
    publish(pub, 20, drop={5, 6, 12})
    settle(got, pub)
    missing = [s.missing for s in got.statuses if s.missing is not None]
    reported = {seq for start, end in missing for seq in range(start, end)}
    delivered = set(got.seqs(KEY))
    assert delivered | reported == set(range(pub.next_seq)) and not delivered & reported
    assert {pub.next_seq - 20 + i for i in (5, 6, 12)} <= reported
    stats = sub.stream_stats()[KEY]
    assert stats.state == "incomplete" and stats.missing == len(reported)
    pub.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    settle(got, pub)
    assert sub.stream_stats()[KEY].state == "live"  # a cache reset makes the view whole


def test_three_frame_replay_server_is_understood(pubs, subs) -> None:
    """Replies without the topic frame (vLLM <= 0.25, older SGLang) recover gaps the same way."""
    pub = pubs()
    pub.behaviour.reply_frames = 3
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 20, drop={2, 3, 10})
    settle(got, pub)
    assert got.matches(pub, KEY)


def test_replay_starting_later_than_asked_reports_the_trimmed_range(pubs, subs) -> None:
    """A ring that moved on: what it no longer holds is reported, the rest is delivered."""
    pub = pubs()
    sub = subs([spec_for(pub)], status_items=True)
    got = connected(pub, sub)
    base = pub.next_seq
    # The ring moves on before any later batch can reveal the hole, so no replay can win
    # the race against the trim.
    publish(pub, 6, drop={2, 3, 4, 5})
    pub.forget_before(base + 4)
    publish(pub, 7)
    settle(got, pub)
    assert [s.missing for s in got.statuses if s.missing] == [(base + 2, base + 4)]
    expected = [seq for seq, _ in pub.published if not base + 2 <= seq < base + 4]
    assert got.seqs(KEY) == expected
    assert sub.stream_stats()[KEY].state == "incomplete"


def test_replay_that_never_answers_ends_in_a_reported_loss(pubs, subs) -> None:
    """A silent replay server times out, the buffered live batches are released, loss reported."""
    pub = pubs()
    replay = ReplayOptions(idle_timeout=0.2, max_attempts=2, backoff_initial=0.01)
    sub = subs([spec_for(pub)], replay=replay, status_items=True)
    got = connected(pub, sub)
    pub.behaviour.answer = False
    base = pub.next_seq
    publish(pub, 6, drop={1})
    settle(got, pub)
    assert [s.missing for s in got.statuses if s.missing] == [(base + 1, base + 2)]
    assert pub.requests[-2:] == [base + 1, base + 1]


def test_slow_replay_still_recovers(pubs, subs) -> None:
    """A replay server that answers slowly (but within the idle timeout) fills the gap."""
    pub = pubs()
    pub.behaviour.delay = 0.005
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 15, drop={1, 2, 3})
    settle(got, pub)
    assert got.matches(pub, KEY)


def test_duplicated_messages_are_dropped_not_mistaken_for_restarts(pubs, subs) -> None:
    """Repeated batches are counted as duplicates and delivered once; no reset happens."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    publish(pub, 10)
    pub.duplicate(pub.next_seq - 4)
    pub.duplicate(pub.next_seq - 1)
    publish(pub, 5)
    settle(got, pub)
    assert got.matches(pub, KEY) and got.resets == []
    stats = sub.stream_stats()[KEY]
    assert stats.duplicates == 2 and stats.restarts == 0


def test_two_ranks_of_one_worker_have_separate_cursors(pubs, subs) -> None:
    """Each rank's sequence is tracked on its own: a gap on rank 1 leaves rank 0 untouched."""
    rank0, rank1 = pubs(), pubs()
    sub = subs([spec_for(rank0, rank=0), spec_for(rank1, rank=1)])
    got = Collector(sub)
    got.handshake(rank0, (W, 0))
    got.handshake(rank1, (W, 1))
    publish(rank0, 20)
    publish(rank1, 25, drop={4, 5})
    settle(got, rank0, (W, 0))
    settle(got, rank1, (W, 1))
    assert got.matches(rank0, (W, 0)) and got.matches(rank1, (W, 1))
    stats = sub.stream_stats()
    assert stats[(W, 1)].replayed >= 2
    assert stats[(W, 0)].gaps <= 1  # at most its own late join


def test_fifty_streams_at_once(pubs, subs) -> None:
    """50 publishers, each with a lost message, all end up exactly delivered."""
    ctx = zmq.Context.instance()
    fleet = [pubs(context=ctx) for _ in range(50)]
    sub = subs([spec_for(p, worker=f"w{i}") for i, p in enumerate(fleet)])
    got = Collector(sub)
    for i, pub in enumerate(fleet):
        got.handshake(pub, (f"w{i}", 0))
    for pub in fleet:
        publish(pub, 8, drop={3})
    for i, pub in enumerate(fleet):
        settle(got, pub, (f"w{i}", 0))
        assert got.matches(pub, (f"w{i}", 0))
    assert sub.stats().streams == 50 and sub.stats().unrecoverable == 0


def test_engine_shaped_payloads_are_delivered_decoded(pubs, subs) -> None:
    """vLLM (both eras), SGLang and TensorRT-LLM payloads arrive as the expected batches."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    fixtures = wire_fixtures()
    for fixture in fixtures:
        pub.publish(fixture.payload)
    settle(got, pub)
    tail = [batch for _, batch in got.delivered[KEY][-len(fixtures) :]]
    assert tail == [f.expected for f in fixtures]
    assert sub.stream_stats()[KEY].skipped_events == 1  # SGLang's unknown tag


def test_malformed_messages_are_counted_and_skipped(pubs, subs) -> None:
    """Bad frames and undecodable payloads cost only themselves; the thread keeps going."""
    pub = pubs()
    sub = subs([spec_for(pub)])
    got = connected(pub, sub)
    pub.send_raw([b"", b"short", b"x"])
    pub.send_raw([b"", b"", b"", b""])
    pub.publish(b"\xc1not msgpack")
    publish(pub, 3)
    settle(got, pub)
    assert sub.stream_stats()[KEY].decode_errors == 3
    assert len(got.seqs(KEY)) == pub.next_seq - 1  # all but the undecodable one


def test_streams_can_be_added_and_removed_while_running(pubs, subs) -> None:
    """add_stream starts delivering; remove_stream emits StreamReset('removed') and stops."""
    first, second = pubs(), pubs()
    sub = subs([spec_for(first)])
    got = connected(first, sub)
    sub.add_stream(spec_for(second, worker="w2"))
    with pytest.raises(ValueError, match="already subscribed"):
        sub.add_stream(spec_for(second, worker="w2"))
    got.handshake(second, ("w2", 0))
    sub.remove_stream(W)
    got.wait(lambda c: any(r.reason == "removed" for r in c.resets), what="removal")
    assert set(sub.stream_stats()) == {("w2", 0)}
    with pytest.raises(KeyError):
        sub.remove_stream(W)


def test_a_sink_is_fed_on_the_io_thread_and_its_errors_are_counted(pubs) -> None:
    """A subscriber given a sink feeds it on the I/O thread and queues nothing; an exception
    the sink raises is counted in sink_errors, logged, and the next batch is applied."""
    pub = pubs()
    spec = spec_for(pub)
    failed: list[int] = []

    def fault(stream: StreamSpec, seq: int) -> Exception | None:
        if failed:
            return None
        failed.append(seq)
        return RuntimeError("consumer bug")

    sink = RecordingSink(fault=fault)
    with Subscriber([spec], sink=sink) as sub:
        probe_until(pub, sink, lambda s: bool(s.deliveries), what="a batch after the failed one")
        assert sub.stats().sink_errors == 1
        assert sink.threads == {"kvevents-subscriber"}
        assert sink.seqs()[0] > failed[0]
        assert sub.stats().queued == 0
        with pytest.raises(SubscriberError, match="feeds the sink it was given"):
            sub.get(0)


def test_async_iteration_and_aclose(pubs) -> None:
    """async for yields deliveries; aclose ends the iteration."""
    pub = pubs()

    async def main() -> list[int]:
        seqs: list[int] = []
        async with AsyncSubscriber([spec_for(pub)]) as sub:
            for _ in range(500):
                pub.publish(heartbeat())
                item = await sub.get(0.02)
                if item is not None:
                    break
            publish(pub, 5)
            async for item in sub:
                assert isinstance(item, Delivery)
                seqs.append(item.seq)
                if item.seq == pub.next_seq - 1:
                    await sub.aclose()
        return seqs

    seqs = asyncio.run(main())
    assert seqs[-5:] == list(range(pub.next_seq - 5, pub.next_seq))


def test_close_is_clean_and_final(pubs) -> None:
    """close() joins the thread and closes every socket; get() then says it was closed."""
    pub = pubs()
    sub = Subscriber([spec_for(pub)])
    before = set(threading.enumerate())
    sub.start()
    (thread,) = set(threading.enumerate()) - before  # the I/O thread
    sub.close()
    sub.close()
    assert thread.name == "kvevents-subscriber" and not thread.is_alive()
    with pytest.raises(SubscriberClosed):
        sub.get(0.1)
    with pytest.raises(SubscriberClosed):
        sub.start()
    assert list(sub) == []


def test_stream_specs_are_checked_and_expanded_per_rank() -> None:
    """worker_streams gives port + r per rank; a '*' host or port 0 cannot be connected to."""
    specs = worker_streams("w", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6000", ranks=3, topic="kv")
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in specs] == [
        (0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6000"),
        (1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:6001"),
        (2, "tcp://10.0.0.1:5559", "tcp://10.0.0.1:6002"),
    ]
    assert [s.endpoint for s in worker_streams("w", "ipc:///tmp/kv", ranks=[0, 2])] == [
        "ipc:///tmp/kv",
        "ipc:///tmp/kv_dp2",
    ]
    with pytest.raises(LayoutError, match="not '\\*'"):
        StreamSpec("w", 0, "tcp://*:5557")
    with pytest.raises(LayoutError, match="port 0"):
        StreamSpec("w", 0, "tcp://127.0.0.1:0")


def test_topic_filters_other_publishers_topics(pubs, subs) -> None:
    """A stream with a topic ignores messages published under another topic."""
    pub = pubs(topic="kv")
    sub = subs([StreamSpec(W, 0, pub.endpoint, pub.replay_endpoint, topic="kv")])
    got = connected(pub, sub)
    pub.send_raw([b"other", pack_seq(10_000), b""])
    publish(pub, 3)
    settle(got, pub)
    assert got.matches(pub, KEY)


def test_a_sink_decode_error_counts_as_undecodable_and_costs_that_batch(pubs) -> None:
    """A DecodeError from the sink counts the batch as undecodable (not delivered, no sink
    error); another exception counts a sink error and the batch as delivered with no events;
    the batches around them are applied and counted from the sink's Applied."""
    pub = pubs()
    start = 1 << 62  # set after the handshake, whose heartbeats are applied as usual

    def fault(stream: StreamSpec, seq: int) -> Exception | None:
        if seq >= start and seq % 4 == 2:
            return DecodeError("unreadable on purpose", seq=seq)
        if seq >= start and seq % 4 == 3:
            return RuntimeError("consumer bug")
        return None

    sink = RecordingSink(fault=fault)
    with Subscriber([spec_for(pub)], sink=sink) as sub:
        probe_until(pub, sink, lambda s: bool(s.deliveries), what="the handshake")
        while pub.next_seq % 4:
            pub.publish(heartbeat())
        sink.wait(lambda s: s.seqs()[-1:] == [pub.next_seq - 1], what="the handshake's end")
        start = pub.next_seq
        before = sub.stream_stats()[KEY]
        for i in range(8):
            pub.publish(typical_batch(i))
        seqs = range(start, start + 8)
        # The last one fails in the sink: it is accounted for, so everything before it is.
        sink.wait(lambda s: sub.stream_stats()[KEY].last_seq == start + 7, what="the last")
        after = sub.stream_stats()[KEY]
        assert [s for s in sink.seqs() if s >= start] == [s for s in seqs if s % 4 in (0, 1)]
        assert after.decode_errors - before.decode_errors == 2
        assert sub.stats().sink_errors == 2
        # applied (4) + failed in the sink (2): the undecodable ones are not delivered
        assert after.delivered - before.delivered == 6
        per_batch = len(typical_batch(0).events)
        assert after.events - before.events == 4 * per_batch  # the failed ones report none

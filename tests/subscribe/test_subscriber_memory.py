"""Memory bounded in bytes: a slow consumer costs shed batches, counted and rebuilt by replay."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvevents.subscribe import StreamSpec, Subscriber, SubscriberOptions
from kvevents.subscribe._cursor import Cursor, Gap, Unrecoverable
from kvevents.subscribe._outbox import Outbox
from kvevents.subscribe._replay import ReplayOptions
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.peers import Collector, RawPublisher
from kvevents.testing.sockets import wait_for
from kvevents.wire import encode_batch

W = "w1"
KEY = (W, 0)
PAYLOAD = len(encode_batch(typical_batch(0)))  # about 1 KB


@pytest.fixture
def pub() -> Iterator[RawPublisher]:
    publisher = RawPublisher()
    yield publisher
    publisher.close()


def subscriber(spec: StreamSpec, **options: object) -> Subscriber:
    options.setdefault("replay", ReplayOptions(idle_timeout=15.0, total_timeout=60.0))
    return Subscriber([spec], options=SubscriberOptions(status_items=True, **options))  # type: ignore[arg-type]


def test_outbox_counts_the_bytes_it_holds() -> None:
    """The outbox's bytes follow puts and gets."""
    box: Outbox[str] = Outbox(maxsize=10)
    box.put_many(["a", "b"], [100, 20])
    box.put_many(["c"])
    assert box.bytes == 120
    assert box.get(0) == (True, "a") and box.bytes == 20


def test_slow_consumer_sheds_counts_and_is_rebuilt_by_replay(pub) -> None:
    """Past queue_bytes batches are shed, counted, reported, then replayed: none lost."""
    with subscriber(
        StreamSpec(W, 0, pub.endpoint, pub.replay_endpoint), queue_bytes=8 * PAYLOAD
    ) as sub:
        got = Collector(sub)
        got.handshake(pub, KEY)
        start = pub.next_seq
        for i in range(60):
            pub.publish(typical_batch(i))
        wait_for(lambda: sub.stream_stats()[KEY].shed > 0, what="shedding")
        assert sub.stats().queued_bytes <= 8 * PAYLOAD + PAYLOAD
        got.wait(lambda c: c.caught_up(pub, KEY), what="the rebuild")
        seqs = got.seqs(KEY)
        assert seqs == list(range(seqs[0], pub.next_seq))  # every batch once, in order
        assert start in seqs and not got.resets
        stats = sub.stream_stats()[KEY]
        assert stats.shed > 0 and stats.replays >= 1 and stats.unrecoverable == 0
        assert sub.stats().shed == stats.shed
        states = [s.state for s in got.statuses]
        assert "incomplete" in states and states[-1] == "live"


def test_shed_batches_without_a_replay_source_are_reported_lost(pub) -> None:
    """With no replay endpoint, shed batches are an unrecoverable range, never silent."""
    with subscriber(StreamSpec(W, 0, pub.endpoint), queue_bytes=4 * PAYLOAD) as sub:
        got = Collector(sub)
        got.handshake(pub, KEY)
        before = sub.stream_stats()[KEY]  # a late join without replay is a loss too
        for i in range(40):
            pub.publish(typical_batch(i))
        wait_for(lambda: sub.stream_stats()[KEY].shed > 0, what="shedding")

        def probe() -> bool:  # the last ones may have been shed: more until one arrives
            pub.publish(heartbeat())
            got.pump(0.02)
            return got.caught_up(pub, KEY)

        wait_for(probe, what="the stream to go on")
        stats = sub.stream_stats()[KEY]
        assert stats.missing - before.missing == stats.shed
        assert stats.unrecoverable > before.unrecoverable
        assert stats.state == "incomplete"


def test_a_payload_larger_than_the_budget_still_passes_an_empty_queue(pub) -> None:
    """One batch bigger than queue_bytes is delivered when nothing else waits."""
    with subscriber(StreamSpec(W, 0, pub.endpoint, pub.replay_endpoint), queue_bytes=100) as sub:
        got = Collector(sub)
        got.handshake(pub, KEY)
        pub.publish(typical_batch(1))
        got.wait(lambda c: c.caught_up(pub, KEY), what="the big batch")
        assert sub.stream_stats()[KEY].shed == 0


def test_cursor_rewind_asks_for_the_shed_batches_again() -> None:
    """rewind(start) turns delivered-but-shed batches into a gap, or a loss without replay."""
    cursor = Cursor()
    for seq in range(5):
        cursor.on_live(seq, b"p%d" % seq)
    assert cursor.rewind(3) == [Gap(3, 5)]
    assert cursor.state == "replaying" and cursor.next_seq == 3
    assert cursor.on_live(5, b"p5") == []  # held until the replay catches up
    actions = cursor.on_replay(3, b"p3") + cursor.on_replay(4, b"p4")
    assert [a.seq for a in actions if hasattr(a, "seq")] == [3, 4, 5]
    assert cursor.state == "live"
    lossy = Cursor(can_replay=False)
    lossy.on_live(0, b"a")
    assert lossy.rewind(0) == [Unrecoverable(0, 1)] and lossy.state == "incomplete"
    assert lossy.rewind(5) == []


def test_cursor_abandons_a_replay_past_its_byte_budget() -> None:
    """Live messages held during a replay are bounded in bytes too: past it, reported lost."""
    cursor = Cursor(max_buffered_bytes=3000)
    cursor.on_live(0, b"x")
    assert cursor.on_live(2, b"y" * 1000) == [Gap(1, 2)]
    assert cursor.on_live(3, b"y" * 1000) == []
    actions = cursor.on_live(4, b"y" * 1500)
    assert Unrecoverable(1, 2) in actions and cursor.buffered_bytes == 0

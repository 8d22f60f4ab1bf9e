"""Adding streams to a running subscriber: a stream that cannot be added costs only itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvevents.errors import LayoutError, StreamAddError
from kvevents.subscribe import (
    AsyncSubscriber,
    StreamSpec,
    StreamStatus,
    Subscriber,
)
from kvevents.subscribe._fdlimit import fds_needed, make_room
from kvevents.subscribe._replay import ReplayOptions
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.injectors import break_stream
from kvevents.testing.peers import Collector, RawPublisher
from kvevents.testing.sinks import RecordingSink
from kvevents.testing.sockets import unique_ipc, wait_for
from kvevents.wire import MAX_IPC_PATH, rank_endpoint

W = "w1"
KEY = (W, 0)
# A name libzmq refuses when connecting although it looks like a host name.
REFUSED_BY_ZMQ = "tcp://_:5555"


@pytest.fixture
def pub() -> Iterator[RawPublisher]:
    publisher = RawPublisher()
    yield publisher
    publisher.close()


def spec_for(pub: RawPublisher, worker: str = W) -> StreamSpec:
    return StreamSpec(worker, 0, pub.endpoint, pub.replay_endpoint)


def still_delivers(sub: Subscriber, pub: RawPublisher, got: Collector | None = None) -> None:
    got = got or Collector(sub)
    got.handshake(pub, KEY)
    for i in range(5):
        pub.publish(typical_batch(i))
    got.wait(lambda c: c.caught_up(pub, KEY), what="the good stream to deliver")


def test_connect_refused_raises_stream_add_error_and_the_feed_goes_on(pub, subs) -> None:
    """A stream libzmq refuses raises StreamAddError naming it; the thread and others live."""
    sub = subs([spec_for(pub)])
    bad = StreamSpec("w2", 3, REFUSED_BY_ZMQ)
    with pytest.raises(StreamAddError) as caught:
        sub.add_stream(bad)
    err = caught.value
    assert (err.worker_id, err.rank, err.endpoint) == ("w2", 3, REFUSED_BY_ZMQ)
    assert "cannot connect" in err.reason and "'w2'" in str(err) and "rank 3" in str(err)
    assert sub.health().state == "ok" and sub.health().alive
    assert set(sub.stream_stats()) == {KEY} and ("w2", 3) not in {s.key for s in sub.streams()}
    assert sub.stats().add_errors == 1
    still_delivers(sub, pub)


def test_more_streams_than_libzmq_default_socket_limit(pub, subs, tmp_path) -> None:
    """1,100 streams (past libzmq's default 1,023 sockets) are all added and read."""
    sub = subs([])
    for i in range(1100):
        sub.add_stream(StreamSpec(f"idle{i}", 0, unique_ipc(str(tmp_path))))
    sub.add_stream(spec_for(pub))
    assert sub.stats().streams == 1101
    still_delivers(sub, pub)


def test_stream_past_the_socket_limit_is_refused_cleanly(pub, subs, tmp_path) -> None:
    """Past max_sockets a stream is refused with the limit named; earlier streams go on."""
    options = {"replay": ReplayOptions(max_concurrent=1), "max_sockets": 6}  # 3 streams
    sub = subs([spec_for(pub)], **options)
    sub.add_stream(StreamSpec("idle1", 0, unique_ipc(str(tmp_path))))
    sub.add_stream(StreamSpec("idle2", 0, unique_ipc(str(tmp_path))))
    with pytest.raises(StreamAddError, match="max_sockets=6"):
        sub.add_stream(StreamSpec("idle3", 0, unique_ipc(str(tmp_path))))
    sub.remove_stream("idle1")  # room again
    sub.add_stream(StreamSpec("idle3", 0, unique_ipc(str(tmp_path))))
    still_delivers(sub, pub)


def test_failing_initial_stream_fails_start_with_stream_add_error(pub) -> None:
    """start() with a stream libzmq refuses raises StreamAddError and leaves no thread."""
    sub = Subscriber([spec_for(pub), StreamSpec("w2", 0, REFUSED_BY_ZMQ)])
    with pytest.raises(StreamAddError, match="w2"):
        sub.start()
    assert sub.health().state == "dead"
    sub.close()


def test_ipc_path_too_long_fails_when_the_spec_is_built() -> None:
    """An ipc path past the OS limit is a LayoutError at StreamSpec, naming endpoint and rule."""
    endpoint = "ipc:///tmp/" + "p" * MAX_IPC_PATH
    with pytest.raises(LayoutError, match="at most") as caught:
        StreamSpec(W, 2, endpoint)
    assert (caught.value.endpoint, caught.value.rank, caught.value.rule) == (endpoint, 2, "path")
    StreamSpec(W, 0, "ipc://" + "p" * MAX_IPC_PATH)  # exactly at the limit is fine


def test_listen_stops_with_the_reason_when_the_feed_dies(capsys) -> None:
    """kvevents listen notices a dead subscriber thread and says why instead of waiting."""
    from kvevents.cli.listen import _feed_dead
    from kvevents.subscribe._streams import FeedHealth

    class Dead:
        def health(self) -> FeedHealth:
            return FeedHealth("dead", False, 0.0, "RuntimeError: poller broke")

    class Alive:
        def health(self) -> FeedHealth:
            return FeedHealth("ok", True)

    assert not _feed_dead(Alive())
    assert _feed_dead(Dead())
    assert "the subscriber stopped: RuntimeError: poller broke" in capsys.readouterr().err


def test_rank_suffix_pushing_an_ipc_path_over_the_limit_is_refused() -> None:
    """rank_endpoint refuses a rank whose _dp suffix makes the path too long."""
    base = "ipc://" + "p" * (MAX_IPC_PATH - 2)
    assert rank_endpoint(base, 0) == base
    with pytest.raises(LayoutError, match="rank 12") as caught:
        rank_endpoint(base, 12)
    assert caught.value.rule == "path"


def test_a_failing_stream_is_detached_and_costs_only_itself(pub, subs) -> None:
    """An error on one stream's socket marks it failed and counted; other streams go on."""
    other = RawPublisher()
    try:
        sub = subs([spec_for(pub), spec_for(other, worker="w2")], status_items=True)
        got = Collector(sub)
        got.handshake(other, ("w2", 0))

        break_stream(sub, ("w2", 0), OSError("socket broke"))
        other.publish(typical_batch(0))
        got.wait(lambda c: any(s.state == "failed" for s in c.statuses), what="failed status")
        assert got.statuses[-1] == StreamStatus(spec_for(other, worker="w2"), "failed")
        stats = sub.stream_stats()[("w2", 0)]
        assert (stats.state, stats.failures) == ("failed", 1)
        assert sub.stats().failed == 1 and sub.health().state == "ok"
        still_delivers(sub, pub, got)
        sub.remove_stream("w2")  # a failed stream can be removed and added again
        sub.add_stream(spec_for(other, worker="w2"))
        got.handshake(other, ("w2", 0))
    finally:
        other.close()


def test_health_reports_a_stall_while_the_consumer_does_not_read(pub, subs, tmp_path) -> None:
    """A full outbox stalls the I/O thread: health says so, and an add times out cleanly."""
    sub = subs([spec_for(pub)], queue_size=1, stall_after=0.05, add_timeout=0.2)
    got = Collector(sub)
    got.handshake(pub, KEY)
    for i in range(5):
        pub.publish(typical_batch(i))
    health = wait_for(lambda: sub.health().state == "stalled" and sub.health(), what="stall")
    assert health.alive and health.stalled_for > 0.05 and health.error is None
    with pytest.raises(StreamAddError, match="did not answer"):
        sub.add_stream(StreamSpec("late", 0, unique_ipc(str(tmp_path))))
    got.wait(lambda c: c.caught_up(pub, KEY), what="the backlog")
    wait_for(lambda: sub.health().state == "ok", what="recovery")
    assert ("late", 0) not in sub.stream_stats()  # abandoned: never added behind our back


def test_health_is_dead_with_the_reason_when_the_thread_dies(pub, tmp_path) -> None:
    """A failure outside any stream ends the thread (here one the sink raises past
    ``Exception``): health says dead and why; adds refuse."""

    class ThreadKiller(BaseException):
        pass

    sink = RecordingSink(fault=lambda stream, seq: ThreadKiller("sink broke"))
    with Subscriber([spec_for(pub)], sink=sink) as sub:

        def dead() -> object:
            pub.publish(heartbeat())  # until one is read (the slow joiner)
            return sub.health().state == "dead" and sub.health()

        health = wait_for(dead, interval=0.01, what="death")
        assert not health.alive and health.error == "ThreadKiller: sink broke"
        with pytest.raises(StreamAddError, match="not running"):
            sub.add_stream(StreamSpec("late", 0, unique_ipc(str(tmp_path))))


def test_health_before_start_and_after_close() -> None:
    """A subscriber not started, or closed, is dead and says which."""
    sub = Subscriber()
    assert sub.health().error == "not started" and not sub.health().alive
    sub.start()
    assert sub.health().state == "ok"
    sub.close()
    assert sub.health().state == "dead" and sub.health().error == "closed"


def test_async_add_stream_waits_for_the_thread_and_raises(pub) -> None:
    """AsyncSubscriber.add_stream awaits the setup and raises StreamAddError likewise."""

    async def main() -> None:
        async with AsyncSubscriber() as sub:
            await sub.add_stream(spec_for(pub))
            assert set(sub.stream_stats()) == {KEY}
            with pytest.raises(StreamAddError):
                await sub.add_stream(StreamSpec("w2", 0, REFUSED_BY_ZMQ))
            assert sub.health().state == "ok"

    asyncio.run(main())


def test_fd_limit_is_raised_toward_the_hard_limit() -> None:
    """Too low a soft limit is raised (doubled what is needed, capped at the hard limit)."""
    calls: list[tuple[int, int]] = []
    assert make_room(3000, lambda: (1024, 20000), lambda s, h: calls.append((s, h))) is None
    assert calls == [(6000, 20000)]
    assert make_room(500, lambda: (1024, 20000), lambda s, h: calls.append((s, h))) is None
    assert len(calls) == 1  # enough already: untouched


def test_fd_limit_past_the_hard_limit_refuses_with_a_reason() -> None:
    """Needing more than the hard limit refuses, naming it; a failed raise is reported too."""
    why = make_room(fds_needed(4096), lambda: (1024, 4096), lambda s, h: None)
    assert why is not None and "hard limit (RLIMIT_NOFILE) is 4096" in why

    def refuse(soft: int, hard: int) -> None:
        raise ValueError("not allowed")

    why = make_room(2000, lambda: (1024, 4096), refuse)
    assert why is not None and "not allowed" in why

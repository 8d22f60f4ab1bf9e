"""The replay client against a ROUTER the test drives by hand, with an injected clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from kvevents.subscribe._replay import (
    ReplayBatch,
    ReplayClient,
    ReplayEnd,
    ReplayEvent,
    ReplayOptions,
)
from kvevents.testing.sockets import Deadline, unique_inproc
from kvevents.wire import pack_seq, parse_replay_request, replay_end_frames

KEY = ("w", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Server:
    """A ROUTER the test answers from by hand."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.endpoint = unique_inproc("replay")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)

    def request(self, timeout: float = 5.0) -> tuple[bytes, int]:
        assert self.sock.poll(int(timeout * 1000)), "no replay request arrived"
        identity, *rest = self.sock.recv_multipart()
        return identity, parse_replay_request(rest)

    def no_request(self) -> bool:
        return not self.sock.poll(50)

    def send(self, identity: bytes, seqs: range | list[int], frames: int = 4) -> None:
        for seq in seqs:
            body = [b"", b"topic", pack_seq(seq), f"p{seq}".encode()]
            if frames == 3:
                del body[1]
            self.sock.send_multipart([identity, *body])

    def end(self, identity: bytes) -> None:
        self.sock.send_multipart([identity, *replay_end_frames()])


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def make(
    ctx: zmq.Context[zmq.Socket[bytes]], **opts: float
) -> tuple[ReplayClient, zmq.Poller, Clock]:
    clock = Clock()
    poller = zmq.Poller()
    options = ReplayOptions(**opts)  # type: ignore[arg-type]
    return ReplayClient(ctx, poller, options=options, clock=clock), poller, clock


def pump(
    client: ReplayClient, poller: zmq.Poller, done: Callable[[list[ReplayEvent]], bool]
) -> list[ReplayEvent]:
    events: list[ReplayEvent] = []
    deadline = Deadline(5.0)
    while not done(events):
        assert not deadline.expired, f"replay client stalled; got {events}"
        for sock, _ in poller.poll(20):
            events += client.handle(sock)
    return events


def ended(events: list[ReplayEvent]) -> bool:
    return any(isinstance(e, ReplayEnd) for e in events)


def seqs(events: list[ReplayEvent]) -> list[int]:
    return [e.seq for e in events if isinstance(e, ReplayBatch)]


@pytest.mark.parametrize("frames", [4, 3])
def test_reply_of_either_shape_is_read_to_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]], frames: int
) -> None:
    """4-frame and legacy 3-frame replies both yield every batch, then a clean end."""
    server = Server(ctx)
    client, poller, _ = make(ctx)
    client.request(KEY, server.endpoint, 5)
    identity, start = server.request()
    assert start == 5
    server.send(identity, range(5, 9), frames=frames)
    server.end(identity)
    events = pump(client, poller, ended)
    assert seqs(events) == [5, 6, 7, 8]
    assert next(e.payload for e in events if isinstance(e, ReplayBatch)) == b"p5"
    assert events[-1] == ReplayEnd(KEY, True, ticket=1)
    assert not client.active(KEY)


def test_first_sequence_later_than_asked_is_counted_and_passed_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A trimmed ring (first seq > asked) is counted; its batches still come through."""
    server = Server(ctx)
    client, poller, _ = make(ctx)
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    server.send(identity, [7, 8])
    server.end(identity)
    assert seqs(pump(client, poller, ended)) == [7, 8]
    assert client.counters.trimmed == 1


def test_discontinuity_inside_a_reply_resumes_from_the_missing_sequence(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A reply that skips (ROUTER dropped messages) is asked again from the missing seq."""
    server = Server(ctx)
    client, poller, clock = make(ctx, backoff_initial=0.5)
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    server.send(identity, [0, 1, 4, 5])
    events = pump(client, poller, lambda ev: not client.owns_any())
    assert seqs(events) == [0, 1]
    assert client.tick() == [] and server.no_request()  # backing off
    clock.now += 0.5
    client.tick()
    identity, start = server.request()
    assert start == 2
    server.send(identity, range(2, 6))
    server.end(identity)
    assert seqs(pump(client, poller, ended)) == [2, 3, 4, 5]
    assert client.counters.resumes == 1


def test_idle_timeout_resumes_then_gives_up_after_max_attempts(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A server that stops answering is retried from the next seq, then reported failed."""
    server = Server(ctx)
    client, poller, clock = make(ctx, idle_timeout=1.0, max_attempts=2, backoff_initial=0.1)
    client.request(KEY, server.endpoint, 3)
    identity, _ = server.request()
    server.send(identity, [3])
    assert seqs(pump(client, poller, lambda ev: bool(ev))) == [3]
    clock.now += 1.0
    assert client.tick() == []
    clock.now += 0.1
    client.tick()
    _, start = server.request()
    assert start == 4
    clock.now += 1.0
    assert client.tick() == [ReplayEnd(KEY, False, "idle timeout", ticket=1)]
    assert client.counters.timeouts == 2 and client.counters.failed == 1
    assert not client.active(KEY) and client.timeout() is None


def test_total_timeout_ends_a_replay_that_never_finishes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A slow trickle that never ends is cut at total_timeout."""
    server = Server(ctx)
    client, _, clock = make(ctx, idle_timeout=5.0, total_timeout=8.0)
    client.request(KEY, server.endpoint, 0)
    server.request()
    assert client.timeout() == pytest.approx(5.0)
    clock.now += 4.0
    assert client.tick() == []
    clock.now += 4.0
    assert client.tick() == [ReplayEnd(KEY, False, "total timeout", ticket=1)]


def test_concurrent_replays_are_bounded(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """With max_concurrent=1 the second replay is sent only when the first ends."""
    server = Server(ctx)
    client, poller, _ = make(ctx, max_concurrent=1)
    client.request(("a", 0), server.endpoint, 0)
    client.request(("b", 0), server.endpoint, 10)
    identity, start = server.request()
    assert start == 0 and server.no_request()
    server.end(identity)
    pump(client, poller, ended)
    _, start = server.request()
    assert start == 10


def test_cancel_closes_the_socket_and_drops_late_answers(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """After cancel, nothing of that replay is reported."""
    server = Server(ctx)
    client, poller, _ = make(ctx)
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    client.cancel(KEY)
    server.send(identity, [0, 1])
    assert poller.poll(50) == []
    assert not client.active(KEY) and client.tick() == []


def test_malformed_reply_is_counted_not_fatal(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A reply message with a bad shape is counted and skipped; the replay goes on."""
    server = Server(ctx)
    client, poller, _ = make(ctx)
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    server.sock.send_multipart([identity, b"", b"short"])
    server.send(identity, [0])
    server.end(identity)
    assert seqs(pump(client, poller, ended)) == [0]
    assert client.counters.malformed == 1


def test_invalid_options_are_rejected() -> None:
    """Zero attempts or a non-positive timeout would make every replay fail at once."""
    with pytest.raises(ValueError):
        ReplayOptions(max_attempts=0)
    with pytest.raises(ValueError):
        ReplayOptions(idle_timeout=0)


def test_a_replay_socket_that_cannot_be_opened_costs_that_replay_only(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A refused endpoint is retried after backoff, then the replay ends failed; no raise."""
    client, _, clock = make(ctx, max_attempts=2, backoff_initial=0.5)
    ticket = client.request(KEY, "tcp://_:5555", 3)  # libzmq refuses this name on connect
    assert client.tick() == [] and client.active(KEY)  # first attempt failed: backing off
    clock.now += 0.5
    events = client.tick()
    assert len(events) == 1 and isinstance(events[0], ReplayEnd)
    assert (events[0].ok, events[0].ticket) == (False, ticket)
    assert "cannot open a replay socket" in events[0].reason
    assert client.counters.failed == 1 and client.counters.requests == 0
    assert not client.active(KEY)


def test_replay_counters_reach_the_subscriber_stats() -> None:
    """Every replay client counter is a field of SubscriberStats (so of /metrics)."""
    import dataclasses

    from kvevents.subscribe._replay import ReplayClientCounters
    from kvevents.subscribe._streams import SubscriberStats

    names = {f"replay_{f.name}" for f in dataclasses.fields(ReplayClientCounters)}
    assert names <= {f.name for f in dataclasses.fields(SubscriberStats)}

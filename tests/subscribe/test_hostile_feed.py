"""The standing hostile suite: seeded fuzzing of the decoder, the replay client and the feed.

Every input either decodes or raises DecodeError (never anything else), within memory
ceilings (tracemalloc peak per payload against its size) and work ceilings (events read
against the limits); good batches around bad ones are all delivered. Seeded, so a failure
reproduces; bounded to a few seconds.
"""

from __future__ import annotations

import contextlib
import random
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvevents.errors import DecodeError
from kvevents.subscribe import StreamSpec, StreamStatus, Subscriber, SubscriberOptions
from kvevents.subscribe._replay import ReplayBatch, ReplayClient, ReplayEnd, ReplayOptions
from kvevents.testing.fixtures import heartbeat, typical_batch, wire_fixtures
from kvevents.testing.peers import Collector, RawPublisher
from kvevents.testing.sinks import RecordingSink
from kvevents.testing.sockets import Deadline, unique_inproc
from kvevents.wire import (
    DecodeLimits,
    decode_batch,
    decode_batch_packed,
    encode_batch,
    pack_seq,
    parse_replay_request,
    replay_end_frames,
)

SEED = 20261201
HEAD = b"\x92\xcb" + bytes(8)  # [0.0, ...: a batch array of two with its ts
KEY = ("w1", 0)
LIMITS = DecodeLimits(max_events=2000, max_tokens=100_000, max_extra_bytes=64 * 1024)


# --------------------------------------------------------------------------- inputs


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """One to three random edits: flips, random bytes, inserts, cuts, huge length heads."""
    data = bytearray(payload)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        at = rng.randrange(len(data) or 1)
        if op == 0 and data:
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[at] = rng.randrange(256)
        elif op == 2:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del data[at : at + rng.randint(1, 16)]
        elif op == 4:
            data = data[:at]
        else:
            data[at:at] = rng.choice(
                [b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xdb\xff\xff\xff\xf0"]
            )
    return bytes(data)


def fuzz_inputs() -> Iterator[bytes]:
    rng = random.Random(SEED)
    eras = [f.payload for f in wire_fixtures()] + [encode_batch(typical_batch(3))]
    for payload in eras:
        for _ in range(60):
            yield mutate(rng, payload)
    for _ in range(200):
        yield rng.randbytes(rng.randint(0, 600))


def crafted_inputs() -> list[tuple[str, bytes]]:
    """Large hand-made attacks, one per known amplification or crash."""
    n = 1_000_000
    stored = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
    return [
        ("one-byte events", HEAD + b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n),
        ("empty-map events", HEAD + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n),
        ("deep nesting", HEAD + b"\x91" * 100_000 + b"\xc0"),
        ("deep nesting in a map", b"\x81\xa1k" * 40_000 + b"\xc0"),
        ("declared 4G events", HEAD + b"\xdd\xff\xff\xff\xff" + b"\xc0" * 64),
        ("declared 4G string ts", b"\x92\xdb\xff\xff\xff\xff" + b"x" * 64),
        ("extra_keys bomb", msgspec.msgpack.encode([0.0, [{**stored, "extra_keys": [[]] * n}]])),
        ("token bomb", msgspec.msgpack.encode([0.0, [{**stored, "token_ids": [300] * n}]])),
        ("field bomb", HEAD + b"\x91\xdc\xff\xff" + b"\xc0" * 0xFFFF),
        ("hash bomb", msgspec.msgpack.encode([0.0, [["BlockRemoved", [[]] * n]]])),
    ]


def decode_within_bounds(payload: bytes, decoder: Callable[..., Any]) -> int:
    """Decode ``payload`` (DecodeError allowed, nothing else); its tracemalloc peak."""
    tracemalloc.start()
    try:
        got = decoder(payload, seq=1, limits=LIMITS)
    except DecodeError:
        got = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if got is not None:
        assert len(got.batch.events) <= LIMITS.max_events
        for event in got.batch.events:
            assert len(getattr(event, "token_ids", ())) <= LIMITS.max_tokens
    return peak


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("decoder", [decode_batch, decode_batch_packed])
def test_fuzzed_payloads_decode_or_raise_decode_error_within_memory(decoder) -> None:
    """Mutants of every era and random bytes: a result or DecodeError, small peaks."""
    count = 0
    for payload in fuzz_inputs():
        peak = decode_within_bounds(payload, decoder)
        assert peak <= 64 * len(payload) + 256 * 1024, (payload[:64], peak)
        count += 1
    assert count == 60 * (len(wire_fixtures()) + 1) + 200


@pytest.mark.parametrize(
    ("name", "payload"), crafted_inputs(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_crafted_attacks_cost_a_bounded_multiple_of_their_size(name: str, payload: bytes) -> None:
    """Each known attack: DecodeError or a cut batch, peak within 8x its size + 1 MiB."""
    for decoder in (decode_batch, decode_batch_packed):
        peak = decode_within_bounds(payload, decoder)
        assert peak <= 8 * len(payload) + 1024 * 1024, (name, peak, len(payload))


def test_good_events_around_bad_ones_all_survive_a_fuzzed_batch() -> None:
    """Random garbage events between good ones cost only themselves."""
    rng = random.Random(SEED)
    good = {"type": "BlockRemoved", "block_hashes": [7]}
    for _ in range(50):
        raw = [good]
        for _ in range(rng.randint(1, 5)):
            raw.append(msgspec.Raw(rng.randbytes(rng.randint(1, 4)) + b"\xc0" * 8))
            raw.append(good)
        try:
            payload = msgspec.msgpack.encode([0.0, raw])
            got = decode_batch(payload, limits=LIMITS)
        except (DecodeError, msgspec.EncodeError):
            continue  # the garbage swallowed the rest of the array: a message error
        kept = [e for e in got.batch.events if getattr(e, "block_hashes", None) == [7]]
        assert len(kept) >= 1 and got.skipped_count + len(got.batch.events) <= len(raw) + 8


# --------------------------------------------------------------------------- replay client


class _Server:
    """A ROUTER answering replay requests with whatever the test scripts."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def request(self) -> tuple[bytes, int]:
        assert self.sock.poll(5000), "no replay request arrived"
        identity, *rest = self.sock.recv_multipart()
        return identity, parse_replay_request(rest)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_replay(client: ReplayClient, poller: zmq.Poller) -> list[Any]:
    events: list[Any] = []
    deadline = Deadline(5.0)
    while not any(isinstance(e, ReplayEnd) for e in events):
        assert not deadline.expired, f"replay client stalled; got {events}"
        for sock, _ in poller.poll(20):
            events += client.handle(sock)
        events += client.tick()
    return events


def test_fuzzed_replay_replies_are_counted_and_good_batches_pass(ctx) -> None:
    """Malformed, short, long and garbage replies between good ones: counted, not fatal."""
    rng = random.Random(SEED)
    server = _Server(ctx, unique_inproc("hostile-replay"))
    poller = zmq.Poller()
    client = ReplayClient(ctx, poller, options=ReplayOptions(max_attempts=1))
    client.request(KEY, server.endpoint, 0)
    identity, start = server.request()
    bad_count = 0
    for seq in range(start, start + 40):
        server.sock.send_multipart([identity, b"", b"t", pack_seq(seq), b"good%d" % seq])
        bad = rng.choice(
            [
                [b"", b"t", b"short", b"x"],
                [b"", b"t", pack_seq(seq)],
                [b"", b"t", pack_seq(seq), b"x", b"extra", b"frames"],
                # garbage that cannot parse: no 8-byte frame where a sequence would be
                [rng.choice([b"", b"abc", rng.randbytes(9)]) for _ in range(rng.randint(1, 5))],
            ]
        )
        if bad[0] != b"":
            bad = [b"", *bad]
        server.sock.send_multipart([identity, *bad])
        bad_count += 1
    server.sock.send_multipart([identity, *replay_end_frames()])
    events = run_replay(client, poller)
    batches = [e for e in events if isinstance(e, ReplayBatch)]
    assert [b.seq for b in batches] == list(range(start, start + 40))
    assert all(b.payload == b"good%d" % b.seq for b in batches)
    assert client.counters.malformed >= bad_count // 2
    assert events[-1].ok


def test_trimmed_replay_is_counted_and_passed_on(ctx) -> None:
    """A reply starting later than asked is counted as trimmed; its batches come through."""
    server = _Server(ctx, unique_inproc("hostile-trim"))
    poller = zmq.Poller()
    client = ReplayClient(ctx, poller)
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    for seq in (50, 51):
        server.sock.send_multipart([identity, b"", b"t", pack_seq(seq), b"p"])
    server.sock.send_multipart([identity, *replay_end_frames()])
    events = run_replay(client, poller)
    assert [e.seq for e in events if isinstance(e, ReplayBatch)] == [50, 51]
    assert client.counters.trimmed == 1


def test_oversized_replay_reply_never_reaches_the_client(ctx) -> None:
    """A reply frame over max_message_size drops the connection: nothing of it surfaces."""
    server = _Server(ctx, "tcp://127.0.0.1:0")
    poller = zmq.Poller()
    now = [0.0]
    client = ReplayClient(
        ctx,
        poller,
        options=ReplayOptions(max_attempts=1, idle_timeout=1.0),
        clock=lambda: now[0],
        max_message_size=4096,
    )
    client.request(KEY, server.endpoint, 0)
    identity, _ = server.request()
    server.sock.send_multipart([identity, b"", b"t", pack_seq(0), b"x" * 100_000])
    server.sock.send_multipart([identity, *replay_end_frames()])
    assert not any(poller.poll(200) for _ in range(3))  # dropped, not delivered
    now[0] += 1.0
    events = client.tick()
    assert [type(e) for e in events] == [ReplayEnd] and not events[0].ok
    assert client.counters.timeouts == 1


# --------------------------------------------------------------------------- the feed


def test_subscriber_delivers_every_good_batch_around_hostile_ones() -> None:
    """Bad payloads between good batches: each bad one counted, every good one delivered."""
    rng = random.Random(SEED)
    bad = [mutate(rng, encode_batch(typical_batch(1))) for _ in range(30)]
    bad += [HEAD + b"\x91" * 100_000 + b"\xc0", b"\x91" * 100_000 + b"\xc0", b"\xc1"]
    pub = RawPublisher()
    options = SubscriberOptions(max_events_per_batch=100, replay=ReplayOptions(idle_timeout=15.0))
    try:
        with Subscriber(
            [StreamSpec("w1", 0, pub.endpoint, pub.replay_endpoint)], options=options
        ) as sub:
            got = Collector(sub)
            got.handshake(pub, KEY)
            before = sub.stream_stats()[KEY]
            good: list[int] = []
            for payload in bad:
                good.append(pub.publish(typical_batch(len(good))))
                pub.publish(payload)
            good.append(pub.publish(heartbeat()))
            got.wait(lambda c: c.caught_up(pub, KEY), what="the last good batch")
            stats = sub.stream_stats()[KEY]
            delivered = set(got.seqs(KEY))
            assert set(good) <= delivered
            undecodable = stats.decode_errors - before.decode_errors
            assert undecodable + len(delivered & {g + 1 for g in good[:-1]}) == len(bad)
            assert undecodable >= 3  # the nests and the non-msgpack byte at least
            assert sub.health().state == "ok" and stats.unrecoverable == before.unrecoverable
    finally:
        pub.close()


def test_message_over_max_message_size_is_dropped_not_decoded() -> None:
    """A batch past max_message_size is dropped undecoded, counted, reported; the stream goes on."""
    pub = RawPublisher()
    options = SubscriberOptions(max_message_size=64 * 1024, status_items=True)
    try:
        with Subscriber([StreamSpec("w1", 0, pub.endpoint)], options=options) as sub:
            got = Collector(sub)
            got.handshake(pub, KEY)
            before = sub.stream_stats()[KEY]
            big = pub.publish(msgspec.msgpack.encode([0.0, [], 0]) + b"\x00" * 100_000)
            pub.publish(heartbeat())
            got.wait(lambda c: c.caught_up(pub, KEY), what="the batch after the big one")
            stats = sub.stream_stats()[KEY]
            assert big not in got.seqs(KEY)
            assert stats.oversized == 1 and stats.decode_errors == before.decode_errors
            assert stats.missing == before.missing + 1 and stats.state == "incomplete"
            assert any(s.missing == (big, big + 1) for s in got.statuses)
    finally:
        pub.close()


def test_oversized_batch_never_reaches_a_sink() -> None:
    """The size limit holds for every sink, not only the subscriber's queue (the index)."""
    pub = RawPublisher()
    sink = RecordingSink()
    options = SubscriberOptions(max_message_size=64 * 1024)
    spec = StreamSpec("w1", 0, pub.endpoint)
    try:
        with Subscriber([spec], sink=sink, options=options) as sub:
            while not sink.deliveries:  # handshake: heartbeats until one is applied
                pub.publish(heartbeat())
                with contextlib.suppress(TimeoutError):
                    sink.wait(lambda s: bool(s.deliveries), 0.02)
            big = pub.publish(msgspec.msgpack.encode([0.0, [], 0]) + b"\x00" * 100_000)
            after = pub.publish(heartbeat())
            sink.wait(lambda s: after in s.seqs(), what="the batch after the big one")
            assert big not in sink.seqs() and sub.stream_stats()[KEY].oversized == 1
            assert sink.statuses[-1] == StreamStatus(spec, "incomplete", (big, big + 1))
    finally:
        pub.close()

"""Router replicas against hostile and unlucky streams, on a real NATS server with JetStream.

Records are written straight to the stream (no relay, no engine): the honest ones as a relay
writes them, with a reference index fed the same batches, and hostile ones between them
(malformed headers and bodies, registrations past every bound, undecodable payloads, forged
sequence numbers), plus truncated snapshots, a bucket shared by two streams, a stream name
that clashes, a consumer the server lost and a consume loop that ends. Every replica keeps
serving, its digest equals the reference's for the honest streams, and its health says what
is true. Skipped when ``nats-server`` is not installed, unless KVEVENTS_REQUIRE_NATS=1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvevents.index.digest import StreamDigest, index_digest
from kvevents.index.prefix import PrefixIndex
from kvevents.service.feed import WorkerRegistration
from kvevents.testing.fixtures import typical_batch
from kvevents.testing.nats import NatsServer, find_nats_server
from kvevents.wire import encode_batch

if find_nats_server() is None:
    if os.environ.get("KVEVENTS_REQUIRE_NATS") == "1":
        pytest.fail("nats-server is required (KVEVENTS_REQUIRE_NATS=1) but not installed")
    pytest.skip("nats-server not installed (pip install 'kvevents[nats]')", allow_module_level=True)
try:
    import nats
except ImportError:
    if os.environ.get("KVEVENTS_REQUIRE_NATS") == "1":
        pytest.fail("nats-py is required (KVEVENTS_REQUIRE_NATS=1) but not installed")
    pytest.skip("nats-py not installed (pip install 'kvevents[nats]')", allow_module_level=True)

from kvevents.scaleout import JetStreamOptions, Replica, ReplicaOptions
from kvevents.scaleout.jetstream import StreamConfigError, ensure_stream
from kvevents.scaleout.records import Outgoing, batch_record, loss_record, worker_record
from kvevents.testing.service import ServiceIndexer

BS = 16
_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer() as started:
        yield started


@pytest.fixture
def js() -> JetStreamOptions:
    """A stream, subjects and bucket of the test's own on the shared server."""
    n = next(_names)
    return JetStreamOptions(stream=f"H{n}", prefix=f"h{n}", bucket=f"hsnaps-{n}")


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def replica(server: NatsServer, js: JetStreamOptions, name: str, **options: Any) -> Replica:
    return Replica(server.url, jetstream=js, options=ReplicaOptions(name=name, **options)).start()


def serve_args(server: NatsServer, js: JetStreamOptions, name: str) -> list[str]:
    """``kvevents serve`` as a replica of the test's stream."""
    names = ["--nats-stream", js.stream, "--nats-prefix", js.prefix, "--nats-bucket", js.bucket]
    return ["--nats", server.url, "--replica-name", name, *names]


def run(server: NatsServer, work: Callable[[Any, Any], Any]) -> Any:
    """Run ``work(nc, js)`` on a NATS connection of the test's own (closed after)."""

    async def go() -> Any:
        nc = await nats.connect(server.url)
        try:
            return await work(nc, nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(go(), 30))


def publish(server: NatsServer, js: JetStreamOptions, messages: list[Outgoing]) -> int:
    """Write ``messages`` in order (creating the stream if needed); the last one's sequence."""

    async def work(nc: Any, jsc: Any) -> int:
        await ensure_stream(jsc, js)
        last = 0
        for subject, body, headers in messages:
            ack = await jsc.publish(subject, body, headers=headers or None)
            assert not ack.duplicate, f"{headers.get('Nats-Msg-Id')} was dropped as a copy"
            last = ack.seq
        return last

    return int(run(server, work))


class Honest:
    """Honest streams written as a relay writes them, and the index they make when fed
    directly."""

    def __init__(self, prefix: str, workers: dict[str, int]) -> None:
        self.prefix = prefix
        self.truth = PrefixIndex()
        self.next_seq: dict[tuple[str, int], int] = {}
        self.regs = []
        for n, (worker, ranks) in enumerate(workers.items()):
            reg = WorkerRegistration(
                worker, f"tcp://127.0.0.1:{6000 + 10 * n}", BS, tuple(range(ranks))
            )
            self.regs.append(reg)
            self.truth.register_worker(worker, block_size=BS, ranks=ranks)
            for rank in range(ranks):
                self.next_seq[(worker, rank)] = 0
        self.step = itertools.count(1000)

    def registrations(self) -> list[Outgoing]:
        return [worker_record(self.prefix, reg) for reg in self.regs]

    def batch(self, worker: str, rank: int, *, feed: bool = True) -> Outgoing:
        """The next batch of a stream; ``feed``: the reference index applies it too."""
        batch = typical_batch(next(self.step))
        seq = self.next_seq[(worker, rank)]
        self.next_seq[(worker, rank)] = seq + 1
        if feed:
            self.truth.apply(worker, rank, batch)
        return batch_record(self.prefix, worker, rank, seq, encode_batch(batch))

    def digests(
        self, keys: set[tuple[str, int]] | None = None
    ) -> dict[tuple[str, int], StreamDigest]:
        """The reference's stream digests (of ``keys`` only, when given)."""
        every = index_digest(self.truth).by_stream()
        return {k: d for k, d in every.items() if keys is None or k in keys}


def health_of(http: ServiceIndexer) -> tuple[int, str]:
    """``GET /health``: its status code and the state it says."""
    status, body = http.send("GET", "/health")
    return status, json.loads(body)["status"]


def honest_part(replica: Replica, keys: set[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    return {k: d for k, d in replica.digest().by_stream().items() if k in keys}


# ----------------------------------------------------------------------------- the fuzz


_VICTIM = ("v", 0)  # the stream forged records may change: left out of the comparison


def hostile(rng: random.Random, prefix: str, honest: Honest) -> Outgoing:
    """One hostile message: never a valid record that could change an honest stream. Its
    message id is its own (JetStream would drop copies of one id before any replica)."""
    subject, body, headers = _hostile(rng, prefix, honest)
    if headers:
        headers = {**headers, "Nats-Msg-Id": f"hostile/{rng.getrandbits(64):x}"}
    return subject, body, headers


def _hostile(rng: random.Random, prefix: str, honest: Honest) -> Outgoing:
    worker, rank = rng.choice([("a", 0), ("a", 1), ("b", 0)])
    subject, payload, headers = batch_record(prefix, worker, rank, 3, b"x")
    kind = rng.randrange(13)
    if kind == 0:  # no headers at all, random bytes
        return subject, rng.randbytes(rng.randrange(1, 2000)), {}
    if kind == 12:  # worker ids that are not one: too long, or percent-encoded garbage
        worker_header = rng.choice(["w" * 5000, "%FF%FE%00", "%" * 300, ""])
        return subject, payload, {**headers, "Kv-Worker": worker_header}
    if kind == 1:  # an unknown kind
        return subject, payload, {**headers, "Kv-Kind": rng.choice(["", "Batch", "x" * 500])}
    if kind == 2:  # numbers past their bounds, or not numbers
        field = rng.choice(["Kv-Seq", "Kv-Rank", "Kv-End"])
        value = rng.choice(["-1", str((1 << 64) + 1), "9" * 5000, "1e3", "0x10", " 3", ""])
        return (
            subject,
            payload,
            {**headers, field: value, "Kv-Kind": "loss" if field == "Kv-End" else "batch"},
        )
    if kind == 3:  # digests that are not 16 hex digits
        return subject, payload, {**headers, "Kv-Digest": rng.choice(["", "ZZ" * 8, "a" * 50_000])}
    if kind == 4:  # an undecodable payload with a forged high sequence
        seq = rng.choice([10**9, (1 << 64) - 1, 1 << 40])
        return batch_record(prefix, worker, rank, seq, b"\xc1" + rng.randbytes(64))
    if kind == 5:  # an undecodable payload at the very sequence the next honest batch takes
        return batch_record(
            prefix, worker, rank, honest.next_seq[(worker, rank)], rng.randbytes(300)
        )
    if kind == 6:  # a batch of a worker never registered
        return batch_record(prefix, "stranger", 0, 0, encode_batch(typical_batch(1)))
    return hostile_worker(rng, prefix)


def hostile_worker(rng: random.Random, prefix: str) -> Outgoing:
    """A ``worker`` record for a new worker id whose body no replica may register."""
    worker = rng.choice(["x", "y", "stranger"])
    base = {"worker_id": worker, "endpoint": "tcp://127.0.0.1:7000", "block_size": BS, "ranks": [0]}
    body = rng.choice(
        [
            b'{"worker_id": "'
            + worker.encode()
            + b'", "ranks": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}",
            json.dumps({**base, "endpoint": "bogus"}).encode(),
            json.dumps({**base, "ranks": [10**30]}).encode(),
            json.dumps({**base, "block_size": 1 << 70}).encode(),
            json.dumps({**base, "block_size": 0}).encode(),
            json.dumps({**base, "endpoint": "tcp://127.0.0.1:65535", "ranks": [0, 1]}).encode(),
            json.dumps({**base, "worker_id": "a"}).encode(),  # names an honest worker
            json.dumps({**base, "model_name": "m" * 5000}).encode(),
            json.dumps([base]).encode(),
            b"\xff\xfe not json",
            b" " * 300_000,
        ]
    )
    subject, _, headers = worker_record(
        prefix, WorkerRegistration(worker, "tcp://127.0.0.1:7000", BS)
    )
    return subject, body, headers


def forged(prefix: str, honest: Honest, round_: int) -> Outgoing:
    """A valid record for the victim stream with a forged sequence (a jump far ahead): a
    loss record in round 10, a decodable batch otherwise (its payload differs per round, or
    JetStream would drop the second as a copy of the first)."""
    if round_ == 10:
        return loss_record(prefix, *_VICTIM, honest.next_seq[_VICTIM] + 1, 1 << 50)
    return batch_record(prefix, *_VICTIM, 1 << 40, encode_batch(typical_batch(77 + round_)))


def test_replicas_outlive_a_hostile_stream(server: NatsServer, js: JetStreamOptions) -> None:
    """Seeded fuzz: 40 rounds of honest batches with hostile messages between them, and
    forged sequence numbers on a victim stream. Every replica (one from the start saving
    snapshots, a ``kvevents serve --nats`` process, one started last from a snapshot) keeps
    serving; honest streams equal the directly fed index; health tells the truth."""
    rng = random.Random(22)
    honest = Honest(js.prefix, {"a": 2, "b": 1, "v": 1})
    keys = {("a", 0), ("a", 1), ("b", 0)}
    publish(server, js, honest.registrations())
    r1 = replica(server, js, "f1", snapshot_batches=40, snapshot_interval=0)
    args = serve_args(server, js, "f2")
    try:
        with ServiceIndexer(args=args) as http:
            for round_ in range(40):
                messages = [honest.batch(w, r) for w, r in [*keys, _VICTIM] for _ in range(3)]
                for _ in range(6):
                    messages.insert(
                        rng.randrange(len(messages) + 1), hostile(rng, js.prefix, honest)
                    )
                last = publish(server, js, messages)
                if round_ in (5, 10, 15):  # a jump ahead on the victim, seen before it heals
                    jump = publish(server, js, [forged(js.prefix, honest, round_)])
                    wait_until(lambda jump=jump: r1.covered_seq >= jump, "r1 reads the forgery")
                    health = r1.health()
                    assert health.state == "degraded" and "'v' rank 0" in str(health.error)
                    wait_until(lambda: health_of(http) == (200, "degraded"), "serve says so")
            wait_until(lambda: r1.covered_seq >= last, "r1 reads everything")
            assert honest_part(r1, keys) == honest.digests(keys)
            assert r1.health().state == "ok", r1.health()
            stats = r1.stats()
            assert stats.malformed >= 120 and stats.undecodable >= 20 and stats.rewinds == 3
            assert stats.apply_errors == 0 and stats.consume_errors == 0
            assert stats.snapshots >= 5 and stats.snapshot_errors == 0
            wait_until(lambda: http.call("GET", "/digest")["covered_seq"] >= last, "serve reads")
            streams = {
                (s["worker_id"], s["rank"]): s["digest"]
                for s in http.call("GET", "/digest")["streams"]
            }
            expected = {k: d.digest for k, d in honest.digests(keys).items()}
            assert {k: streams[k] for k in keys} == expected
            assert health_of(http) == (200, "ok")
        r1.snapshot_now()
        late = replica(server, js, "f3")
        try:
            assert late.stats().loaded_seq > 0 and late.stats().start_gap == 0
            assert honest_part(late, keys) == honest.digests(keys)
            assert late.health().state == "ok"
        finally:
            late.close()
    finally:
        r1.close()


# ----------------------------------------------------------------------------- snapshots


def put_object(
    server: NatsServer, bucket: str, name: str, data: bytes, about: dict[str, Any]
) -> None:
    from nats.js.api import ObjectMeta

    async def work(nc: Any, jsc: Any) -> None:
        store = await jsc.object_store(bucket)
        await store.put(name, data, meta=ObjectMeta(description=json.dumps(about)))

    run(server, work)


def get_object(server: NatsServer, bucket: str, name: str) -> bytes:
    async def work(nc: Any, jsc: Any) -> bytes:
        return bytes((await (await jsc.object_store(bucket)).get(name)).data)

    return bytes(run(server, work))


def test_a_truncated_newest_snapshot_is_a_hole_the_replica_tells(
    server: NatsServer, js: JetStreamOptions, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest snapshot is truncated and the stream trimmed past the older one: a new
    replica starts from the older one, counts the messages it cannot read, degrades every
    stream, logs it, says ``degraded`` in its health, and a snapshot it saves carries the
    degraded marks to the next replica."""
    honest = Honest(js.prefix, {"a": 1, "b": 1})
    publish(server, js, [*honest.registrations(), *(honest.batch("a", 0) for _ in range(10))])
    r0 = replica(server, js, "t0", snapshot_batches=0, snapshot_interval=0)
    r1 = None
    try:
        wait_until(lambda: r0.covered_seq >= 12, "r0 reads")
        s0 = r0.snapshot_now()
        last = publish(server, js, [honest.batch(w, 0) for w in ("a", "b") for _ in range(10)])
        r1 = replica(server, js, "t1", snapshot_batches=0, snapshot_interval=0)
        wait_until(lambda: r0.covered_seq >= last and r1.covered_seq >= last, "both read")
        s1 = r1.snapshot_now()
        assert s0 is not None and s1 == last
        whole = get_object(server, js.bucket, f"{js.stream}.t1")
        about = {"seq": s1, "stream": js.stream}
        put_object(server, js.bucket, f"{js.stream}.t1", whole[: len(whole) // 2], about)
        with caplog.at_level(logging.ERROR, logger="kvevents.scaleout.replica"):
            r2 = replica(server, js, "t2", snapshot_batches=0, snapshot_interval=0)
        try:
            assert r2.stats().loaded_seq == s0 and r2.stats().start_gap == s1 - s0
            assert set(r2.service.router.degraded) == {("a", 0), ("b", 0)}
            health = r2.health()
            assert health.state == "degraded" and "trimmed unread" in str(health.error)
            assert any("lost unread" in r.getMessage() for r in caplog.records)
            assert r2.stats().degraded_streams == 2
            publish(server, js, [honest.batch("a", 0)])
            wait_until(lambda: r2.covered_seq > last, "r2 goes on")
            r2.snapshot_now()
            r3 = replica(server, js, "t3")
            try:  # r2's snapshot is the newest now: the marks come with it
                assert r3.stats().loaded_seq == r2.covered_seq
                assert set(r3.service.router.degraded) == {("a", 0), ("b", 0)}
                assert r3.health().state == "degraded"
            finally:
                r3.close()
        finally:
            r2.close()
    finally:
        r0.close()
        if r1 is not None:
            r1.close()


def test_a_replica_of_another_stream_in_the_same_bucket_ignores_its_snapshots(
    server: NatsServer, js: JetStreamOptions
) -> None:
    """Two indexes (streams) share the default snapshot bucket: a replica of the second
    neither loads the first's snapshot nor serves its digest."""
    honest = Honest(js.prefix, {"a": 1})
    publish(server, js, [*honest.registrations(), *(honest.batch("a", 0) for _ in range(5))])
    first = replica(server, js, "s1", snapshot_batches=0, snapshot_interval=0)
    try:
        wait_until(lambda: first.covered_seq >= 6, "the first reads")
        assert first.snapshot_now() == 6
        other = JetStreamOptions(stream=f"{js.stream}X", prefix=f"{js.prefix}x", bucket=js.bucket)
        second = replica(server, other, "s1")
        try:
            assert second.stats().loaded_seq == 0 and second.digest().streams == ()
            assert second.service.workers() == []
        finally:
            second.close()
    finally:
        first.close()


# ----------------------------------------------------------------------------- configuration


def test_a_stream_name_that_clashes_with_the_prefix_is_a_clear_error(
    server: NatsServer, js: JetStreamOptions
) -> None:
    """A replica (or relay) given another stream name under a prefix that a stream already
    holds is refused with the stream it clashes with, its subjects and the fix."""
    from kvevents.cli.common import UsageError
    from kvevents.cli.relay import start_replica
    from kvevents.scaleout import Relay

    publish(server, js, [])  # the stream exists, with subjects <prefix>.>
    clash = JetStreamOptions(stream=f"{js.stream}B", prefix=js.prefix, bucket=js.bucket)
    with pytest.raises(StreamConfigError) as caught:
        replica(server, clash, "c1")
    text = str(caught.value)
    assert (
        repr(js.stream) in text
        and f"'{js.prefix}.>'" in text
        and f"--nats-stream {js.stream}" in text
    )
    with pytest.raises(UsageError, match=f"--nats-stream {clash.stream}: cannot create"):
        start_replica(Replica(server.url, jetstream=clash, options=ReplicaOptions(name="c2")))
    wrong_prefix = JetStreamOptions(stream=js.stream, prefix="elsewhere", bucket=js.bucket)
    relay = Relay(server.url, jetstream=wrong_prefix)
    try:
        with pytest.raises(StreamConfigError, match="--nats-prefix"):
            relay.start()
    finally:
        relay.close()


# ----------------------------------------------------------------------------- the consume loop


def test_a_replica_whose_consumer_the_server_lost_recreates_it(
    server: NatsServer, js: JetStreamOptions
) -> None:
    """The server deletes the replica's consumer (after a partition longer than
    ``inactive_threshold``, or by hand): the replica recreates it where it was and goes on,
    instead of failing every fetch for ever while its health says ok."""
    honest = Honest(js.prefix, {"a": 1})
    publish(server, js, [*honest.registrations(), *(honest.batch("a", 0) for _ in range(5))])
    r1 = replica(server, js, "d1", fetch_timeout=0.1)
    try:
        wait_until(lambda: r1.covered_seq >= 6, "r1 reads")
        run(server, lambda nc, jsc: jsc.delete_consumer(js.stream, "d1"))
        last = publish(server, js, [honest.batch("a", 0) for _ in range(5)])
        wait_until(lambda: r1.covered_seq >= last, "r1 reads after its consumer was deleted")
        assert r1.stats().rebinds == 1 and r1.stats().start_gap == 0
        assert honest_part(r1, {("a", 0)}) == honest.digests()
        wait_until(lambda: r1.health().state == "ok", "health ok again")
    finally:
        r1.close()


def test_a_consume_loop_that_ends_is_told_and_started_again(
    server: NatsServer, js: JetStreamOptions
) -> None:
    """Should the consume task end anyway (here: cancelled by someone else), health says
    ``dead`` with why, the loop is started again after ``restart_delay`` on a consumer where
    the replica was, counted, and nothing is lost."""
    honest = Honest(js.prefix, {"a": 1})
    publish(server, js, [*honest.registrations(), *(honest.batch("a", 0) for _ in range(5))])
    r1 = replica(server, js, "e1", fetch_timeout=0.1, restart_delay=0.5)
    try:
        wait_until(lambda: r1.covered_seq >= 6, "r1 reads")
        assert r1._aio is not None

        async def end_it() -> Any:
            task = r1._task
            assert task is not None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return r1.health()  # its done-callbacks ran: the restart is scheduled, not run

        health = r1._aio.run(end_it(), 10)
        assert health.state == "dead" and "cancelled" in str(health.error)
        last = publish(server, js, [honest.batch("a", 0) for _ in range(5)])
        wait_until(lambda: r1.covered_seq >= last, "r1 reads after the restart")
        assert r1.stats().consume_restarts == 1 and r1.health().state == "ok"
        assert honest_part(r1, {("a", 0)}) == honest.digests()
    finally:
        r1.close()

"""Relays and router replicas against a real NATS server with JetStream, and the faults of
docs/scale-out.md: after each, every replica's digest equals an index built from the engines.

The engines are our publishers on loopback; the reference index applies the very batches
they publish. Skipped when ``nats-server`` is not installed, unless KVEVENTS_REQUIRE_NATS=1.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvevents.config import KVEventsConfig
from kvevents.index.digest import index_digest
from kvevents.index.prefix import PrefixIndex
from kvevents.publish.publisher import ZmqPublisher
from kvevents.service.feed import WorkerRegistration
from kvevents.subscribe import ReplayOptions, SubscriberOptions
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.nats import NatsServer, find_nats_server
from kvevents.testing.publisher import local_config

if find_nats_server() is None:
    if os.environ.get("KVEVENTS_REQUIRE_NATS") == "1":
        pytest.fail("nats-server is required (KVEVENTS_REQUIRE_NATS=1) but not installed")
    pytest.skip("nats-server not installed (pip install 'kvevents[nats]')", allow_module_level=True)
try:
    import nats  # noqa: F401
except ImportError:
    if os.environ.get("KVEVENTS_REQUIRE_NATS") == "1":
        pytest.fail("nats-py is required (KVEVENTS_REQUIRE_NATS=1) but not installed")
    pytest.skip("nats-py not installed (pip install 'kvevents[nats]')", allow_module_level=True)

from kvevents.scaleout import JetStreamOptions, Relay, Replica, ReplicaOptions
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
    return JetStreamOptions(stream=f"T{n}", prefix=f"t{n}", bucket=f"snaps-{n}")


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


class Engine:
    """A publisher standing for one engine rank, and what its cache truly holds."""

    def __init__(self, worker: str, truth: PrefixIndex) -> None:
        self.worker = worker
        self.truth = truth
        self.step = 0
        self.config: KVEventsConfig = local_config()
        self.pub = self._started(self.config)
        # The same ports again after a restart.
        self.config = local_config(
            endpoint=self.pub.endpoint, replay_endpoint=self.pub.replay_endpoint
        )
        truth.register_worker(worker, block_size=BS)

    @staticmethod
    def _started(config: KVEventsConfig) -> ZmqPublisher:
        pub = ZmqPublisher(config, 0)
        pub.start()
        return pub

    @property
    def registration(self) -> WorkerRegistration:
        return WorkerRegistration(
            self.worker, self.pub.endpoint, BS, (0,), self.pub.replay_endpoint
        )

    def publish(self, count: int) -> None:
        for _ in range(count):
            batch = typical_batch(self.step + hash(self.worker) % 1000 * 100)
            self.step += 1
            self.pub.publish(batch)
            self.truth.apply(self.worker, 0, batch)

    def restart(self) -> None:
        """The engine process stops and starts again: sequence from 0, an empty cache."""
        self.pub.shutdown(timeout=1.0)
        self.truth.reset_stream(self.worker, 0)
        self.pub = self._started(self.config)

    def close(self) -> None:
        self.pub.shutdown(timeout=1.0)


@pytest.fixture
def engines() -> Iterator[Callable[[str], Engine]]:
    made: list[Engine] = []
    truth = PrefixIndex()

    def make(worker: str) -> Engine:
        engine = Engine(worker, truth)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def joined(relay: Relay, engine: Engine, restarts: int = 0) -> None:
    """Handshake: heartbeats until the relay has relayed one of this engine's batches (and,
    after an engine restart, has seen ``restarts`` of them)."""

    def relayed() -> bool:
        stats = relay.subscriber.stream_stats().get((engine.worker, 0))
        if stats is not None and stats.delivered and stats.restarts >= restarts:
            return True
        engine.pub.publish(heartbeat())
        return False

    wait_until(relayed, f"relay reads {engine.worker}")


def agrees(replica: Replica, truth: PrefixIndex, timeout: float = 20.0) -> None:
    """The replica's digest reaches the engines' truth (and is asserted equal)."""
    expected = index_digest(truth)
    wait_until(lambda: replica.digest() == expected, f"replica {replica.options.name} agrees",
               timeout)  # fmt: skip
    assert replica.digest().total == expected.total


def relay_for(server: NatsServer, workers: list[WorkerRegistration], js: JetStreamOptions) -> Relay:
    """A relay whose replays wait long enough for a loaded machine (as tests/conftest.py's
    subscribers do): a replay given up would be a loss, and these tests want none."""
    options = SubscriberOptions(replay=ReplayOptions(idle_timeout=15.0, total_timeout=60.0))
    return Relay(server.url, workers, jetstream=js, subscriber_options=options)


def replica(server: NatsServer, js: JetStreamOptions, name: str, **options: Any) -> Replica:
    return Replica(server.url, jetstream=js, options=ReplicaOptions(name=name, **options)).start()


def test_replicas_agree_with_an_index_built_from_the_engines(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """Two engines through one relay: two replicas hold exactly what the engines hold."""
    a, b = engines("a"), engines("b")
    with relay_for(server, [a.registration, b.registration], js) as relay:
        joined(relay, a)
        joined(relay, b)
        r1, r2 = replica(server, js, "r1"), replica(server, js, "r2")
        try:
            a.publish(60)
            b.publish(40)
            agrees(r1, a.truth)
            agrees(r2, a.truth)
            assert r1.stats().applied == r2.stats().applied >= 100
            assert {w.worker_id for w in r1.service.workers()} == {"a", "b"}
        finally:
            r1.close()
            r2.close()


def test_two_relays_for_one_engine_write_each_batch_once(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """Two relays for availability: JetStream keeps one copy of every batch, by message id."""
    a = engines("a")
    with (
        relay_for(server, [a.registration], js) as one,
        relay_for(server, [a.registration], js) as two,
    ):
        joined(one, a)
        joined(two, a)
        r1 = replica(server, js, "r1")
        try:
            a.publish(80)
            agrees(r1, a.truth)
            assert one.flush() and two.flush()
            batches = one.stats().batches + two.stats().batches
            copies = one.stats().duplicates + two.stats().duplicates
            # Each batch was written once (by whichever relay came first), every copy dropped.
            assert copies >= 80 and r1.stats().applied == batches
            assert r1.stats().duplicates == 0  # JetStream dropped them before any replica
        finally:
            r1.close()


def test_a_relay_restart_neither_loses_nor_doubles(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """A relay stopped while the engine goes on is replaced; the new one replays the ring
    from 0: what was written before is dropped as copies, what it missed is written."""
    a = engines("a")
    r1 = replica(server, js, "r1")
    try:
        with relay_for(server, [a.registration], js) as relay:
            joined(relay, a)
            a.publish(40)
            agrees(r1, a.truth)
        a.publish(30)  # nobody relays these: the engine's replay ring keeps them
        with relay_for(server, [a.registration], js) as again:
            joined(again, a)
            a.publish(10)
            agrees(r1, a.truth)
            assert again.flush()
            assert again.stats().duplicates >= 40
        assert r1.stats().duplicates == 0 and r1.stats().losses == 0
    finally:
        r1.close()


def test_an_engine_restart_seen_through_the_relay(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """An engine restarts (sequence from 0, empty cache): replicas drop its old blocks once."""
    a = engines("a")
    with relay_for(server, [a.registration], js) as relay:
        joined(relay, a)
        r1 = replica(server, js, "r1")
        try:
            a.publish(30)
            agrees(r1, a.truth)
            a.restart()
            joined(relay, a, restarts=1)
            a.publish(20)
            agrees(r1, a.truth)
            assert relay.stats().resets == 1 and r1.stats().restarts == 1
        finally:
            r1.close()


def test_a_replica_joining_after_the_stream_was_trimmed_loads_the_snapshot(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """Once a snapshot covers the stream's head it is trimmed; a new replica starts from the
    snapshot, not from messages that are gone, and then follows the stream."""
    a = engines("a")
    with relay_for(server, [a.registration], js) as relay:
        joined(relay, a)
        first = replica(server, js, "r1", snapshot_batches=0, snapshot_interval=0)
        try:
            a.publish(50)
            agrees(first, a.truth)
            covered = first.snapshot_now()
            assert covered is not None and first.stats().trims == 1
            late = replica(server, js, "r2")
            try:
                assert late.stats().loaded_seq == covered and late.stats().start_gap == 0
                assert late.digest() == first.digest()
                a.publish(20)
                agrees(late, a.truth)
                agrees(first, a.truth)
            finally:
                late.close()
        finally:
            first.close()


def test_a_nats_server_restart_mid_stream(
    js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """The NATS server stops and starts again (file storage): the relay sends again what was
    not acknowledged, the replica reconnects, and nothing is lost or applied twice."""
    a = engines("a")
    with NatsServer() as own, relay_for(own, [a.registration], js) as relay:
        joined(relay, a)
        r1 = replica(own, js, "r1")
        try:
            a.publish(40)
            agrees(r1, a.truth)
            own.restart()
            a.publish(40)
            agrees(r1, a.truth, timeout=30.0)
            assert r1.stats().applied >= 80
            # The messages from before the restart are still there (file storage).
            fresh = replica(own, js, "r2")
            try:
                assert fresh.stats().loaded_seq == 0
                agrees(fresh, a.truth)
            finally:
                fresh.close()
        finally:
            r1.close()


def test_a_replica_killed_mid_stream_comes_back_warm(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """``kvevents serve --nats`` killed with SIGKILL while batches flow, started again: it
    loads its last snapshot, reads the rest, and GET /digest matches the engines."""
    a = engines("a")
    args = ["--nats", server.url, "--replica-name", "k1", "--snapshot-batches", "20",
            "--nats-stream", js.stream, "--nats-prefix", js.prefix, "--nats-bucket", js.bucket]  # fmt: skip
    with relay_for(server, [a.registration], js) as relay:
        joined(relay, a)
        with ServiceIndexer(args=args) as first:
            a.publish(60)
            expected = index_digest(a.truth).total
            wait_until(lambda: first.call("GET", "/digest")["total"] == expected, "serve agrees")
            a.publish(15)
            os.kill(first.pid, signal.SIGKILL)
        a.publish(15)
        with ServiceIndexer(args=args) as again:
            expected = index_digest(a.truth).total
            wait_until(lambda: again.call("GET", "/digest")["total"] == expected, "restarted")
            stats = again.call("GET", "/digest")
            assert stats["covered_seq"] > 0 and stats["total"] == expected
            _, metrics = again.send("GET", "/metrics")
            loaded = [line for line in metrics.decode().splitlines()
                      if line.startswith("kvevents_replica_loaded_seq ")]  # fmt: skip
            assert loaded and float(loaded[0].split()[1]) >= 20  # warm: from a snapshot


def test_a_replica_refuses_registrations_over_http(
    server: NatsServer, js: JetStreamOptions
) -> None:
    """POST /register on a replica is a 400 naming the relay, not a worker silently unfed."""
    args = ["--nats", server.url, "--replica-name", "h1", "--nats-stream", js.stream,
            "--nats-prefix", js.prefix, "--nats-bucket", js.bucket]  # fmt: skip
    with ServiceIndexer(args=args) as service:
        body = b'{"worker_id": "x", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16}'
        status, reply = service.send("POST", "/register", body)
        assert status == 400 and b"relay" in reply


def _line(proc: subprocess.Popen[str], prefix: str, timeout: float = 20.0) -> str:
    """The first stdout line of ``proc`` starting with ``prefix`` (bounded wait)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line.strip()
            if not line:
                break
    raise AssertionError(f"no {prefix!r} line from the process")


def test_the_relay_command_feeds_a_replica(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """``kvevents relay`` relays a worker until SIGTERM, then says what it wrote."""
    a = engines("a")
    command = [sys.executable, "-m", "kvevents.cli", "relay", "--nats", server.url,
               "--worker", f"a={a.pub.endpoint},{a.pub.replay_endpoint}", "--block-size", str(BS),
               "--nats-stream", js.stream, "--nats-prefix", js.prefix, "--metrics-port", "0"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "relaying 1 worker(s)" in _line(proc, "relaying")
        metrics_url = _line(proc, "metrics on").split()[-1]
        r1 = replica(server, js, "r1")
        try:

            def fed() -> bool:
                a.pub.publish(heartbeat())  # until the relay's subscriber has joined
                return r1.stats().applied > 0

            wait_until(fed, "the relay's first batch")
            a.publish(30)
            agrees(r1, a.truth)
        finally:
            r1.close()
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            assert b"kvevents_relay_batches_total" in reply.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0 and "batches relayed" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_a_loss_the_relay_cannot_replay_reaches_the_replicas_as_a_record(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """An engine without a replay endpoint, joined late: the batches before the relay came are
    lost for good, and replicas learn it from a loss record (from seq 0: under-matching, not
    degraded), then follow the stream."""
    a = engines("a")
    a.publish(5)  # before any relay: nobody will ever see these
    no_replay = WorkerRegistration("a", a.pub.endpoint, BS, (0,), None)
    with relay_for(server, [no_replay], js) as relay:
        joined(relay, a)
        r1 = replica(server, js, "r1")
        try:
            wait_until(lambda: r1.stats().losses == 1, "the loss record applied")
            assert relay.stats().losses == 1
            assert ("a", 0) not in r1.service.router.degraded
            after = PrefixIndex()  # what the replica can know: the batches after the loss
            after.register_worker("a", block_size=BS)
            for step in range(100, 110):
                batch = typical_batch(step)
                a.pub.publish(batch)
                after.apply("a", 0, batch)
            agrees(r1, after)
        finally:
            r1.close()


def test_replicas_and_relays_outlive_a_quiet_stream(
    server: NatsServer, js: JetStreamOptions, engines: Callable[[str], Engine]
) -> None:
    """No traffic for 6 s (60 fetch timeouts of 0.1 s, where nats-py 2.16 often returns no
    message at all), then traffic again: the replicas (a library one and a ``kvevents serve
    --nats`` process) stayed healthy throughout and applied everything the relay wrote."""
    a = engines("a")
    names = ["--nats-stream", js.stream, "--nats-prefix", js.prefix, "--nats-bucket", js.bucket]
    args = ["--nats", server.url, "--replica-name", "q2", *names]
    with relay_for(server, [a.registration], js) as relay, ServiceIndexer(args=args) as http:
        joined(relay, a)
        r1 = replica(server, js, "q1", fetch_timeout=0.1)
        try:
            a.publish(20)
            agrees(r1, a.truth)
            quiet_until = time.monotonic() + 6.0
            while time.monotonic() < quiet_until:
                assert r1.health().state == "ok", r1.health()
                status, body = http.send("GET", "/health")
                assert status == 200, body
                time.sleep(0.25)
            a.publish(20)
            agrees(r1, a.truth)
            expected = index_digest(a.truth).total
            wait_until(lambda: http.call("GET", "/digest")["total"] == expected, "serve agrees")
            assert relay.flush() and r1.stats().applied == relay.stats().batches
            assert r1.stats().consume_restarts == 0 and r1.health().state == "ok"
            assert http.send("GET", "/health")[0] == 200
        finally:
            r1.close()

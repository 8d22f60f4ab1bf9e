"""CurveZMQ: encrypted, authenticated streams (kvevents.security, docs/security.md)."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvevents.events import BlockStored, KVEventBatch
from kvevents.publish import PublisherOptions, ZmqPublisher
from kvevents.security import (
    CurveClient,
    CurveServer,
    KeyPair,
    apply_client,
    generate_keypair,
    load_keypair,
    load_public_key,
    load_public_keys,
    save_keypair,
)
from kvevents.subscribe import Delivery, StreamSpec, Subscriber, SubscriberOptions
from kvevents.testing.fixtures import heartbeat, typical_batch
from kvevents.testing.publisher import started_publisher, wait_subscribed
from kvevents.testing.sockets import Deadline, wait_for
from kvevents.wire import parse_replay_reply, replay_request_frames

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

QUIET = 0.5  # seconds a refused subscriber must stay silent while a keyed one receives


def new_server(allowed: frozenset[str] | None = None) -> CurveServer:
    pair = generate_keypair()
    return CurveServer(pair.secret_key, pair.public_key, allowed)


@contextmanager
def curve_publisher(server: CurveServer | None) -> Iterator[ZmqPublisher]:
    with started_publisher(options=PublisherOptions(curve=server)) as publisher:
        yield publisher


def spec(publisher: ZmqPublisher, worker: str, curve: CurveClient | None) -> StreamSpec:
    assert publisher.endpoint is not None
    return StreamSpec(worker, 0, publisher.endpoint, publisher.replay_endpoint, curve=curve)


def collect(sub: Subscriber, pub: ZmqPublisher, worker: str, until: int) -> list[Delivery]:
    """Every delivery until ``worker`` has seq ``until``, probing until the first arrives."""
    got: list[Delivery] = []
    deadline = Deadline(20.0)
    while not any(d.stream.worker_id == worker and d.seq >= until for d in got):
        assert not deadline.expired, f"{worker} stalled; got {[d.seq for d in got][-5:]}"
        item = sub.get(0.02)
        if isinstance(item, Delivery):
            got.append(item)
        elif item is None and not any(d.stream.worker_id == worker for d in got):
            until = max(until, pub.publish(heartbeat()))
    return got


def quiet_period(sub: Subscriber, seconds: float = QUIET) -> list[Delivery]:
    """Everything delivered within ``seconds``."""
    got: list[Delivery] = []
    deadline = Deadline(seconds)
    while not deadline.expired:
        item = sub.get(max(0.001, deadline.remaining()))
        if isinstance(item, Delivery):
            got.append(item)
    return got


# ---------------------------------------------------------------------- end to end


def test_encrypted_stream_is_delivered_whole_with_a_replayed_late_join() -> None:
    """A CURVE subscriber joining late gets 0..N by replay then live, in order, once each."""
    server = new_server()
    with curve_publisher(server) as pub:
        batches = [typical_batch(i) for i in range(40)]
        for batch in batches:
            pub.publish(batch)
        client = CurveClient.for_server(server.public_key)
        with Subscriber([spec(pub, "a", client)]) as sub:
            got = collect(sub, pub, "a", until=39)
            assert [d.seq for d in got] == list(range(len(got)))
            assert [d.batch for d in got[:40]] == batches
            stats = sub.stream_stats()[("a", 0)]
            assert stats.replayed >= 1 and stats.unrecoverable == 0


def test_subscriber_options_default_applies_to_every_stream() -> None:
    """SubscriberOptions(curve=...) keys streams whose spec has none."""
    server = new_server()
    with curve_publisher(server) as pub:
        first = typical_batch(0)
        pub.publish(first)
        options = SubscriberOptions(curve=CurveClient.for_server(server.public_key))
        with Subscriber([spec(pub, "a", None)], options=options) as sub:
            got = collect(sub, pub, "a", until=0)
            assert (got[0].seq, got[0].batch) == (0, first)


def test_subscribers_without_the_right_keys_receive_nothing() -> None:
    """No keys or the wrong server key: nothing in 0.5 s while a keyed subscriber receives."""
    server = new_server()
    with curve_publisher(server) as pub:
        good = CurveClient.for_server(server.public_key)
        wrong = CurveClient.for_server(generate_keypair().public_key)
        streams = [spec(pub, "good", good), spec(pub, "plain", None), spec(pub, "wrong", wrong)]
        with Subscriber(streams) as sub:
            got = collect(sub, pub, "good", until=0)
            last = pub.publish(typical_batch(1))
            got += collect(sub, pub, "good", until=last)
            got += quiet_period(sub)
            assert {d.stream.worker_id for d in got} == {"good"}
            stats = sub.stream_stats()
            assert stats[("plain", 0)].received == stats[("wrong", 0)].received == 0
        wait_for(lambda: pub.stats().handshake_failed >= 2, what="failed handshakes counted")
        assert pub.stats().auth_rejected == 0


def test_client_off_the_allow_list_is_rejected_and_counted() -> None:
    """With allowed_clients, a valid client key not on the list is refused and counted."""
    alice, mallory = generate_keypair(), generate_keypair()
    server = new_server(frozenset({alice.public_key}))
    with curve_publisher(server) as pub:
        streams = [
            spec(pub, "alice", CurveClient.for_server(server.public_key, alice)),
            spec(pub, "mallory", CurveClient.for_server(server.public_key, mallory)),
        ]
        with Subscriber(streams) as sub:
            got = collect(sub, pub, "alice", until=0)
            got += quiet_period(sub)
            assert {d.stream.worker_id for d in got} == {"alice"}
            assert sub.stream_stats()[("mallory", 0)].received == 0
        wait_for(lambda: pub.stats().auth_rejected >= 1, what="rejected client counted")


def test_replay_endpoint_answers_only_curve_clients() -> None:
    """The replay ROUTER is a CURVE server too: a plain DEALER gets no answer, a keyed one does."""
    server = new_server()
    with curve_publisher(server) as pub, _context() as ctx:
        assert pub.replay_endpoint is not None
        pub.publish(typical_batch(0))
        keyed, plain = _dealer(ctx, pub.replay_endpoint, server), _dealer(ctx, None, None)
        plain.connect(pub.replay_endpoint)
        plain.send_multipart(replay_request_frames(0), zmq.NOBLOCK)
        assert keyed.poll(10_000), "the keyed DEALER got no reply"
        assert parse_replay_reply(keyed.recv_multipart()).seq == 0
        assert not plain.poll(int(QUIET * 1000))


@contextmanager
def _context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def _dealer(ctx: zmq.Context[Any], endpoint: str | None, server: CurveServer | None) -> Any:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if server is not None and endpoint is not None:
        apply_client(dealer, CurveClient.for_server(server.public_key))
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request_frames(0))
    return dealer


# ---------------------------------------------------------------------- the bytes on the wire


class Tap:
    """A TCP relay between a subscriber and a publisher that records the publisher's bytes."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.captured = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            with down, socket.create_connection(self._upstream) as up:
                self._relay(down, up)

    def _relay(self, down: socket.socket, up: socket.socket) -> None:
        peer = {down: up, up: down}
        while not self._stop.is_set():
            readable, _, _ = select.select([down, up], [], [], 0.05)
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                if sock is up:
                    self.captured += data
                peer[sock].sendall(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


SECRET_TOKENS = [4_000_000_000 - 7 * i for i in range(64)]


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "curve"])
def test_token_ids_are_not_plaintext_on_the_wire(encrypted: bool) -> None:
    """The msgpack bytes of token ids cross the wire in clear only without CURVE."""
    server = new_server() if encrypted else None
    needle = msgspec.msgpack.encode(SECRET_TOKENS)
    with curve_publisher(server) as pub, _context() as ctx:
        assert pub.endpoint is not None
        tap = Tap(pub.endpoint)
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            apply_client(sub, server and CurveClient.for_server(server.public_key))
            sub.connect(tap.endpoint)
            wait_subscribed(pub, sub)
            block = BlockStored(
                block_hashes=[1], parent_block_hash=None, token_ids=SECRET_TOKENS, block_size=64
            )
            pub.publish(KVEventBatch(ts=time.time(), events=[block]))
            assert sub.poll(10_000), "the batch did not arrive through the tap"
            assert needle in sub.recv_multipart()[2]  # delivered and decrypted
        finally:
            tap.close()
    assert (needle in tap.captured) is not encrypted
    assert len(tap.captured) > len(needle)


# ---------------------------------------------------------------------- keys and key files


def test_key_files_round_trip_with_a_private_secret(tmp_path: Path) -> None:
    """save_keypair writes NAME.key and a 0600 NAME.key_secret that load back the same pair."""
    public_file, secret_file = save_keypair(tmp_path / "keys", "engine")
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert (public_file.name, secret_file.name) == ("engine.key", "engine.key_secret")
    pair = load_keypair(secret_file)
    assert load_public_key(public_file) == pair.public_key
    assert load_public_keys(tmp_path / "keys") == frozenset({pair.public_key})
    assert "secret-key" not in public_file.read_text()
    server = CurveServer.from_files(secret_file, tmp_path / "keys")
    assert server.allowed_clients == frozenset({pair.public_key})
    with pytest.raises(FileExistsError, match=r"engine\.key"):
        save_keypair(tmp_path / "keys", "engine")
    with pytest.raises(ValueError, match="holds no secret key"):
        load_keypair(public_file)


@pytest.mark.parametrize("which", ["engine.key", "engine.key_secret"])
def test_save_refuses_a_dangling_symlink(tmp_path: Path, which: str) -> None:
    """A symlink at a key file's name, even dangling, is refused: nothing written, no half pair."""
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / which).symlink_to(target)
    with pytest.raises(FileExistsError, match=rf"{which} already exists \(a symlink\)"):
        save_keypair(tmp_path / "keys", "engine")
    assert not target.exists()
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [which]


def test_secret_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    """The secret file is created 0600 even under a permissive umask; the public one readable."""
    old = os.umask(0)
    try:
        public_file, secret_file = save_keypair(tmp_path, "engine")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public_file).st_mode) == 0o644


@pytest.mark.parametrize(("mode", "who"), [(0o640, "its group"), (0o604, "others")])
def test_exposed_secret_file_loads_with_a_warning_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, who: str
) -> None:
    """A group- or world-readable secret key still loads, with a warning: file and chmod 600."""
    _, secret_file = save_keypair(tmp_path, "engine")
    os.chmod(secret_file, mode)
    with caplog.at_level(logging.WARNING, logger="kvevents.security"):
        pair = load_keypair(secret_file)
    assert pair.public_key == load_public_key(tmp_path / "engine.key")
    assert [r.getMessage() for r in caplog.records] == [
        f"secret key file {secret_file} is readable by {who} (mode {mode:03o}): "
        f"run `chmod 600 {secret_file}`"
    ]
    caplog.clear()
    os.chmod(secret_file, 0o600)
    load_keypair(secret_file)
    assert caplog.records == []


def test_bad_keys_are_refused_with_a_reason(tmp_path: Path) -> None:
    """Malformed keys, mismatched pairs, missing files and empty allow-lists say what is wrong."""
    pair, other = generate_keypair(), generate_keypair()
    with pytest.raises(ValueError, match="40-character Z85"):
        CurveClient("short", pair.public_key, pair.secret_key)
    with pytest.raises(ValueError, match="does not belong"):
        CurveServer(pair.secret_key, other.public_key)
    with pytest.raises(ValueError, match="cannot read key file"):
        load_keypair(tmp_path / "missing.key_secret")
    with pytest.raises(ValueError, match=r"no \*\.key file"):
        load_public_keys(tmp_path)


def test_secret_keys_stay_out_of_reprs() -> None:
    """Logging a config never prints a secret key."""
    pair = generate_keypair()
    shown = repr(
        (
            pair,
            CurveServer(pair.secret_key, pair.public_key),
            CurveClient.for_server(pair.public_key, pair),
        )
    )
    assert pair.secret_key not in shown and pair.public_key in shown
    assert isinstance(pair, KeyPair)


# ---------------------------------------------------------------------- command line


def kvevents(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvevents.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_keys_generate_then_publish_listen_and_replay_encrypted(tmp_path: Path) -> None:
    """keys generate, then publish --curve-secret/--curve-allow feeds listen and replay."""
    made = kvevents("keys", "generate", str(tmp_path / "server"), "--name", "engine")
    assert made.returncode == 0, made.stderr
    assert (
        kvevents("keys", "generate", str(tmp_path / "clients"), "--name", "router").returncode == 0
    )
    assert "engine.key_secret" in made.stdout
    secret = tmp_path / "server" / "engine.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    client = [
        "--curve-server-key",
        str(tmp_path / "server" / "engine.key"),
        "--curve-secret",
        str(tmp_path / "clients" / "router.key_secret"),
    ]
    publish = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvevents.cli",
            "publish",
            "--endpoint",
            "tcp://127.0.0.1:0",
            "--replay-endpoint",
            "tcp://127.0.0.1:0",
            "--rate",
            "200",
            "--json",
            "--curve-secret",
            str(secret),
            "--curve-allow",
            str(tmp_path / "clients"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert publish.stdout is not None
        assert select.select([publish.stdout], [], [], 30)[0], "publish printed no ready line"
        line = publish.stdout.readline()
        assert line, f"publish failed: {publish.communicate(timeout=30)[1]}"
        ready = json.loads(line)["ranks"][0]
        worker = f"sim:0={ready['endpoint']},{ready['replay_endpoint']}"
        listen = kvevents("listen", "--worker", worker, "--json", "--count", "5", *client)
        assert listen.returncode == 0, listen.stderr
        seqs = [
            r["seq"] for r in map(json.loads, listen.stdout.splitlines()) if r["type"] == "batch"
        ]
        assert seqs[:5] == list(range(5))
        replay = kvevents("replay", ready["replay_endpoint"], "--from", "0", "--to", "1", *client)
        assert replay.returncode == 0, replay.stderr
        assert replay.stdout.startswith("seq=0 ") and "end: 2 batches" in replay.stdout
    finally:
        publish.terminate()
        publish.communicate(timeout=30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["publish", "--curve-allow", "x"], "--curve-allow needs --curve-secret"),
        (["listen", "tcp://127.0.0.1:1", "--curve-secret", "x"], "needs --curve-server-key"),
        (["serve", "--port", "0", "--curve-secret", "x"], "needs --curve-server-key"),
        (
            ["replay", "tcp://127.0.0.1:1", "--from", "0", "--curve-server-key", "nope.key"],
            "cannot read key file nope.key",
        ),
    ],
)
def test_cli_curve_option_mistakes_give_one_line(args: list[str], message: str) -> None:
    """A missing partner option or key file is a usage error (status 2) naming the problem."""
    done = kvevents(*args)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

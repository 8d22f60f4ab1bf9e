"""The index service: the sink its feed feeds, and the HTTP API against a real server on
port 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvevents.errors import DecodeError, StreamAddError
from kvevents.events import AllBlocksCleared, KVEventBatch
from kvevents.http import HttpStats, Server, serve
from kvevents.http import _app as service_app
from kvevents.http import _dump as service_dump
from kvevents.http import _query as service_query
from kvevents.http import _scan as scan
from kvevents.http._scan_py import pack_json_member, pack_json_tokens
from kvevents.index import DEFAULT_POLICY, IndexStats, PrefixIndex
from kvevents.index import _prefix as index_prefix
from kvevents.index._keys import block_hashes
from kvevents.metrics import field_docs
from kvevents.service import IndexService, ServiceStats, WorkerRegistration, subscriber_feed
from kvevents.service._core import REPLAYING
from kvevents.subscribe import FeedHealth, StreamSpec, Subscriber, SubscriberOptions
from kvevents.testing.feeds import FakeFeed, fake_service, fake_specs
from kvevents.testing.index import batch, engine_hashes, store_event
from kvevents.testing.sockets import wait_for
from kvevents.wire import Applied, DecodedBatch, encode_batch

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks
LOCAL = "tcp://127.0.0.1:6000"


def make_service(feed: FakeFeed) -> IndexService:
    return fake_service(feed)


@pytest.fixture
def feed() -> FakeFeed:
    return FakeFeed()


@pytest.fixture
def server(feed: FakeFeed) -> Iterator[tuple[Server, IndexService]]:
    service = make_service(feed)
    with serve("127.0.0.1", 0, service=service) as running:
        yield running, service


@pytest.fixture
def client(server: tuple[Server, IndexService]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=10.0) as http:
        yield http


def test_service_applies_batches_and_resets(feed: FakeFeed) -> None:
    """Batches its feed hands the service are applied in order; a reset empties a stream."""
    with make_service(feed) as service:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS, ranks=(0, 1)))
        assert [(s.worker_id, s.rank) for s in feed.specs] == [("a", 0), ("a", 1)]
        feed.deliver("a", 1, batch(store_event(PROMPT, BS, end_block=2)))
        feed.deliver("a", 1, batch(store_event(PROMPT, BS, start_block=2)), seq=1)
        assert service.stats().deliveries == 2
        assert service.query(PROMPT)["scores"] == {"a": {"1": 6}}
        feed.reset("a", 1)
        assert service.stats().resets == 1
        assert service.query(PROMPT)["scores"] == {}
    assert feed.started and feed.closed and feed.sink is service


def test_unregister_stops_the_stream_and_drops_the_blocks(feed: FakeFeed) -> None:
    """Unregistering removes the feed stream and every block of the worker."""
    with make_service(feed) as service:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
        feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
        assert service.unregister("a") is True
        assert feed.removed == [("a", None)] and feed.specs == []
        assert service.index_stats().entries == 0 and service.workers() == []
        assert service.unregister("a") is False


def test_batches_of_unregistered_workers_are_ignored(feed: FakeFeed) -> None:
    """A batch or reset the feed still hands over after unregister does not bring the
    worker back; the batch's Applied is still what it held (the feed's stats stay true)."""
    with make_service(feed) as service:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
        spec = feed.spec("a", 0)
        service.unregister("a")
        payload = encode_batch(batch(store_event(PROMPT, BS), ts=3.0))
        assert service.apply(spec, 0, payload) == Applied(3.0, 1)
        service.reset(spec, "removed")
        assert service.stats().ignored == 2 and service.stats().deliveries == 0
        assert service.index.targets() == [] and service.index_stats().entries == 0


def test_payloads_are_applied_straight_from_the_wire(feed: FakeFeed) -> None:
    """The service's apply (its feed's sink) applies a registered stream's batch and
    reports it; an unreadable one raises DecodeError and changes nothing."""
    service = make_service(feed)
    service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
    spec = feed.spec("a", 0)
    payload = encode_batch(batch(store_event(PROMPT, BS), ts=7.0))
    assert service.apply(spec, 0, payload) == Applied(7.0, 1)
    assert service.query(PROMPT)["scores"] == {"a": {"0": 6}}
    cleared = encode_batch(batch(AllBlocksCleared(), ts=8.0))
    assert service.apply(spec, 1, cleared) == Applied(8.0, 1, clears=True)
    with pytest.raises(DecodeError):
        service.apply(spec, 2, b"\xc1")
    assert service.stats().deliveries == 2 and service.index.targets() == [("a", 0)]
    assert service.index_stats().entries == 0 and service.stats().apply_errors == 0


class BrokenIndex(PrefixIndex):
    """An index with a bug in applying batches."""

    def ingest(self, worker_id: str, rank: int, batch: KVEventBatch) -> bool:
        raise RuntimeError("index bug")


def test_a_failing_payload_apply_is_counted_and_raised(feed: FakeFeed) -> None:
    """An index bug while applying a payload is counted (apply_errors) and raised to the
    feed, which logs it with the stream and goes on."""
    service = fake_service(feed, BrokenIndex())
    service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
    with pytest.raises(RuntimeError, match="index bug"):
        feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
    assert service.stats().apply_errors == 1 and service.stats().deliveries == 0


def test_server_binds_port_zero_and_reports_it(server: tuple[Server, IndexService]) -> None:
    """serve() on port 0 returns a started server whose real port is known."""
    running, _ = server
    assert running.port > 0
    assert httpx.get(f"{running.url}/health", timeout=10.0).json() == {"status": "ok", "workers": 0}


def test_closing_the_server_closes_the_service(feed: FakeFeed) -> None:
    """Stopping the HTTP server runs the app's shutdown, which closes the feed."""
    running = serve("127.0.0.1", 0, service=make_service(feed))
    running.close()
    assert feed.closed
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{running.url}/health", timeout=2.0)


def test_register_query_and_unregister_over_http(
    client: httpx.Client, server: tuple[Server, IndexService], feed: FakeFeed
) -> None:
    """The Dynamo/Mooncake-shaped API: register, query by tokens or hashes, unregister."""
    reply = client.post(
        "/register",
        json={"instance_id": 7, "endpoint": "tcp://127.0.0.1:5557", "block_size": BS, "dp_size": 2},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"worker_id": "7", "ranks": [0, 1], "streams": 2}
    client.post(
        "/register", json={"worker_id": "b", "endpoint": "tcp://127.0.0.1:6000", "block_size": BS}
    )
    feed.deliver("7", 1, batch(store_event(PROMPT, BS)))
    feed.deliver("b", 0, batch(store_event(PROMPT, BS, end_block=2)))
    body = client.post("/query", json={"token_ids": PROMPT, "policy": "longest_prefix"}).json()
    assert body["scores"] == {"7": {"1": 6}, "b": {"0": 2}}
    assert {"worker_id": "7", "rank": 1, "tier": "GPU", "matched_blocks": 6} in body["matches"]
    assert body["decision"]["winner"] == {"worker_id": "7", "rank": 1}
    assert body["decision"]["policy"] == "longest_prefix"
    assert len(body["decision"]["scores"]) == 3
    by_hashes = client.post("/query", json={"block_hashes": block_hashes(PROMPT, BS)}).json()
    assert by_hashes["scores"] == body["scores"]
    assert by_hashes["decision"]["policy"] == DEFAULT_POLICY
    assert client.post("/unregister", json={"instance_id": 7, "dp_rank": 1}).status_code == 200
    assert client.post("/query", json={"token_ids": PROMPT}).json()["scores"] == {"b": {"0": 2}}
    missing = client.post("/unregister", json={"worker_id": "nobody"})
    assert missing.status_code == 404 and "unknown worker 'nobody'" in missing.json()["error"]


def test_bad_requests_say_what_is_wrong(client: httpx.Client) -> None:
    """Malformed bodies get a 400 naming the field or the rule."""
    wrong_type = client.post(
        "/register", json={"worker_id": "a", "endpoint": LOCAL, "block_size": "x"}
    )
    assert wrong_type.status_code == 400
    assert "$.block_size" in wrong_type.json()["error"]
    zero = client.post("/register", json={"worker_id": "a", "endpoint": LOCAL, "block_size": 0})
    assert zero.json() == {"error": "/register: Expected `int` >= 1 - at `$.block_size`"}
    nameless = client.post("/register", json={"endpoint": LOCAL, "block_size": 4})
    assert nameless.json()["error"] == "worker_id (or instance_id) is required"
    policy = client.post("/query", json={"token_ids": [1], "policy": "best"})
    assert policy.status_code == 400 and "unknown routing policy 'best'" in policy.json()["error"]
    empty = client.post("/query", json={})
    assert empty.json()["error"] == "/query: query needs token_ids or block_hashes"
    assert client.post("/query", content=b"{").status_code == 400


@pytest.fixture(params=["list", "json"])
def lean(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, feed: FakeFeed
) -> Iterator[tuple[httpx.Client, IndexService]]:
    """A server whose lean /query decodes token_ids as a list, or packs them from the JSON
    text (what it does when the native JSON scanner is there)."""
    packers = (pack_json_tokens, pack_json_member) if request.param == "json" else (None, None)
    monkeypatch.setattr(service_query, "json_packers", lambda: packers)
    service = make_service(feed)
    with (
        serve("127.0.0.1", 0, service=service) as running,
        httpx.Client(base_url=running.url, timeout=10.0) as http,
    ):
        yield http, service


def test_lean_query_packs_json_only_with_native_primitives(monkeypatch: pytest.MonkeyPatch) -> None:
    """token_ids are packed from the JSON text by the native scanner, never the Python one."""
    monkeypatch.setattr(scan, "IMPLEMENTATION", "c")
    assert service_query.json_packers() == (scan.pack_json_tokens, scan.pack_json_member)
    monkeypatch.setattr(scan, "IMPLEMENTATION", "python")
    assert service_query.json_packers() == (None, None)


def test_lean_query_answers_like_the_service(
    lean: tuple[httpx.Client, IndexService], feed: FakeFeed
) -> None:
    """POST /query answers exactly what IndexService.query answers for the same token list."""
    client, service = lean
    for worker, end in [("a", 6), ("b", 2)]:
        client.post("/register", json={"worker_id": worker, "endpoint": LOCAL, "block_size": BS})
        feed.deliver(worker, 0, batch(store_event(PROMPT, BS, end_block=end)))
    feed.deliver("b", 0, batch(store_event(PROMPT, BS, lora_name="x")))
    service.router.loads.set("a", queued_blocks=3)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"token_ids": PROMPT, "model_name": "m"}, {}),
        ({"token_ids": PROMPT[:10], "policy": "longest_prefix"}, {"policy": "longest_prefix"}),
        ({"token_ids": PROMPT, "lora_name": "x"}, {"lora": "x"}),
        ({"token_ids": PROMPT, "lora_id": 3}, {"lora": 3}),
        ({"token_ids": []}, {}),
    ]
    for body, options in cases:
        reply = client.post("/query", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/json"
        assert reply.json() == service.query(body["token_ids"], **options), body
    # Raw bodies the one-pass member scan must not misread: the last token_ids wins (as in a
    # full decode), a nested or quoted "token_ids" is not the member, the member comes last.
    short = json.dumps(PROMPT[:5])
    raw_cases = [
        (f'{{"token_ids": {short}, "token_ids": {json.dumps(PROMPT)}}}', PROMPT),
        (
            f'{{"x": {{"token_ids": [1]}}, "s": "\\"token_ids\\"", "token_ids": {short}}}',
            PROMPT[:5],
        ),
        (f'{{"model_name": "m", "policy": null, "token_ids": {short}}}', PROMPT[:5]),
    ]
    for text, tokens in raw_cases:
        reply = client.post("/query", content=text.encode())
        assert reply.status_code == 200, (text, reply.text)
        assert reply.json() == service.query(tokens), text
    hashes = block_hashes(PROMPT, BS)
    reply = client.post("/query", json={"token_ids": None, "block_hashes": hashes})
    assert reply.json() == service.query(block_hashes=hashes)
    assert reply.json()["scores"] == {"a": {"0": 6}, "b": {"0": 2}}
    assert client.get("/query").status_code == 405


def test_lean_query_rejects_bad_token_ids(lean: tuple[httpx.Client, IndexService]) -> None:
    """Bad JSON, wrong types and token ids outside uint32 get a 400 naming the problem."""
    client, _ = lean
    expected = {
        b"{": "/query: Input data was truncated",
        b'{"token_ids": [1,]}': "/query: JSON is malformed",
        b"[]": "/query: Expected `object`, got `array`",
        b'{"token_ids": "abc"}': "Expected `array | null`, got `str` - at `$.token_ids`",
        # A str token is a multimodal digest (TensorRT-LLM's form), of at most 256 characters.
        b'{"token_ids": [1, "%s"]}' % (b"a" * 257): "length <= 256 - at `$.token_ids[1]`",
        b'{"token_ids": [1, 2.5]}': "got `float` - at `$.token_ids[1]`",
        b'{"token_ids": [1], "block_size": "x"}': "at `$.block_size`",
        b'{"token_ids": [7, -1]}': "/query: token id -1 at `$.token_ids[1]` is outside "
        "0..4294967295",
        b'{"token_ids": [4294967296]}': "/query: token id 4294967296 at `$.token_ids[0]` is "
        "outside 0..4294967295",
    }
    for body, error in expected.items():
        reply = client.post("/query", content=body)
        assert reply.status_code == 400, body
        assert reply.headers["content-type"] == "application/json"
        assert error in reply.json()["error"], (body, reply.json())
    assert client.post("/query", content=b'{"token_ids": [4294967295]}').status_code == 200


def test_workers_dump_and_metrics(
    client: httpx.Client, server: tuple[Server, IndexService], feed: FakeFeed
) -> None:
    """/workers shows per-rank index state and stream health; /dump and /metrics the index."""
    client.post(
        "/register", json={"worker_id": "a", "endpoint": "tcp://127.0.0.1:1", "block_size": BS}
    )
    feed.deliver("a", 0, batch(store_event(PROMPT, BS, medium="CPU"), ts=1.0))
    (worker,) = client.get("/workers").json()["workers"]
    assert worker["worker_id"] == "a" and worker["block_size"] == BS
    (rank,) = worker["ranks"]
    assert rank["tiers"] == {"CPU": 6}
    assert rank["stream"]["state"] == "live" and rank["stream"]["gaps"] == 0
    assert rank["batches"] == 1 and rank["lag_seconds"] > 0
    dump = client.get("/dump").json()
    (holder,) = dump["holders"]
    assert sorted(pair[0] for pair in holder["blocks"]) == sorted(engine_hashes(PROMPT, BS))  # u64
    assert dump["stats"]["entries"] == 6
    text = client.get("/metrics").text
    assert "kvevents_index_blocks 6.0" in text
    assert "kvevents_index_stored_blocks_total 6.0" in text
    assert 'kvevents_index_worker_blocks{rank="0",tier="CPU",worker_id="a"} 6.0' in text
    assert "kvevents_service_deliveries_total 1.0" in text


def test_startup_failure_is_reported_and_frees_the_port() -> None:
    """A feed that cannot start makes serve() raise its own error in the caller."""

    class Broken(FakeFeed):
        def start(self) -> None:
            raise RuntimeError("no feed")

    service = IndexService(feed=Broken(), stream_specs=fake_specs)
    with pytest.raises(RuntimeError, match="no feed"):
        serve("127.0.0.1", 0, service=service)


def test_default_feed_applies_batches_on_the_subscriber_thread() -> None:
    """With no feed given, a Subscriber feeds the service each batch on its I/O thread: no
    hand-off, nothing queued."""
    from kvevents.testing.peers import RawPublisher

    stored = batch(store_event(PROMPT, BS))
    with RawPublisher() as publisher, IndexService(PrefixIndex()) as service:
        assert isinstance(service.feed, Subscriber)
        assert publisher.replay_endpoint is not None
        service.register(
            WorkerRegistration("w", publisher.endpoint, BS, (0,), publisher.replay_endpoint)
        )
        publisher.publish(stored, drop=True)  # comes back by replay once a live batch arrives

        def indexed() -> bool:
            publisher.publish(batch())  # an empty batch: a live probe
            return service.query(PROMPT)["scores"] == {"w": {"0": 6}}

        wait_for(indexed, 10.0, interval=0.01, what="the replayed store to be applied")
        assert service.stats().deliveries >= 2 and service.stats().apply_errors == 0
        assert service.feed.stats().queued == 0  # nothing went through the queue


def test_incomplete_stream_is_degraded_until_whole_again(feed: FakeFeed) -> None:
    """After an unrecoverable loss a worker's matches are not trusted, and routing moves."""
    with make_service(feed) as service:
        for worker in ("a", "b"):
            service.register(
                WorkerRegistration(worker, f"tcp://127.0.0.1:{5557 + 10 * ord(worker)}", BS)
            )
        feed.deliver("a", 0, batch(store_event(PROMPT, BS)), seq=0)
        assert service.query(PROMPT)["decision"]["winner"]["worker_id"] == "a"
        feed.report("a", 0, "incomplete", (3, 5))
        assert service.degraded() == {("a", 0): "lost seq 3..4"}
        decision = service.query(PROMPT)["decision"]
        rows = {row["worker_id"]: row for row in decision["scores"]}
        assert rows["a"]["degraded"] == "lost seq 3..4"
        assert rows["a"]["matched_blocks"] == 0
        ranks = {w["worker_id"]: w["ranks"][0] for w in service.workers_view()}
        assert ranks["a"]["degraded"] == "lost seq 3..4" and ranks["b"]["degraded"] is None
        feed.report("a", 0, "live")
        assert service.degraded() == {}
        assert service.query(PROMPT)["decision"]["winner"]["worker_id"] == "a"


def test_joining_after_the_ring_moved_on_is_not_degraded(feed: FakeFeed) -> None:
    """A hole from seq 0 hides only old stores (no phantom blocks): routing keeps trusting it."""
    with make_service(feed) as service:
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:5557", BS))
        feed.report("a", 0, "incomplete", (0, 40))
        assert service.degraded() == {} and service.health().state == "ok"
        feed.report("a", 0, "incomplete", (50, 51))
        assert service.degraded() == {("a", 0): "lost seq 50..50"}


def test_a_replaying_stream_is_degraded_until_it_is_live(feed: FakeFeed) -> None:
    """While a stream replays, the index holds its past (a late join replays stores that a
    cache reset further on clears): its matches are not trusted until it is live again, or
    incomplete from seq 0 (a join after the ring moved on: nothing false)."""
    with make_service(feed) as service:
        for worker in ("a", "b"):
            service.register(
                WorkerRegistration(worker, f"tcp://127.0.0.1:{5557 + 10 * ord(worker)}", BS)
            )
        feed.report("a", 0, "replaying")
        feed.deliver("a", 0, batch(store_event(PROMPT, BS)), seq=0)  # its ring's past
        assert service.degraded() == {("a", 0): REPLAYING}
        rows = {row["worker_id"]: row for row in service.query(PROMPT)["decision"]["scores"]}
        assert rows["a"]["matched_blocks"] == 0 and rows["a"]["degraded"] == REPLAYING
        feed.deliver("a", 0, batch(AllBlocksCleared()), seq=1)  # the reset further on
        feed.report("a", 0, "live")
        assert service.degraded() == {}
        feed.report("a", 0, "replaying")
        feed.report("a", 0, "incomplete", (0, 40))
        assert service.degraded() == {}


def test_health_says_degraded_naming_a_degraded_stream(
    client: httpx.Client, server: tuple[Server, IndexService], feed: FakeFeed
) -> None:
    """While a stream is degraded (a loss after events were applied), /health is a 200
    saying "degraded" and naming the stream and why, as a replica's does; it is "ok" again
    once the stream is whole, and a stalled feed is still a 503."""
    assert _register(client, "a", LOCAL).status_code == 200
    feed.report("a", 0, "incomplete", (3, 5))
    reply = client.get("/health")
    assert reply.status_code == 200
    assert reply.json() == {
        "status": "degraded",
        "workers": 1,
        "error": "1 stream(s) degraded; worker 'a' rank 0: lost seq 3..4",
    }
    feed.state = FeedHealth("stalled", True, 12.5)
    assert client.get("/health").status_code == 503
    feed.state = FeedHealth("ok", True)
    feed.report("a", 0, "live")
    assert client.get("/health").json() == {"status": "ok", "workers": 1}


# ----------------------------------------------------------------- hostile registrations


@dataclass
class RefusingFeed(FakeFeed):
    """A FakeFeed whose add_stream refuses endpoints on ``refused_port``, as the Subscriber
    does when a socket cannot be set up (StreamAddError)."""

    refused_port: int = 7000

    def add_stream(self, spec: StreamSpec) -> None:
        if spec.endpoint.endswith(f":{self.refused_port}"):
            raise StreamAddError(
                worker_id=spec.worker_id, rank=spec.rank, endpoint=spec.endpoint, reason="no room"
            )
        super().add_stream(spec)


def _register(client: httpx.Client, worker: str, endpoint: str, **more: Any) -> httpx.Response:
    return client.post(
        "/register", json={"worker_id": worker, "endpoint": endpoint, "block_size": BS, **more}
    )


def test_a_stream_the_feed_refuses_is_a_422_and_the_others_run_on() -> None:
    """A registration whose stream cannot be added answers 422 naming the endpoint and rank;
    nothing of it stays registered and the workers registered before keep being fed."""
    feed = RefusingFeed()
    with (
        serve("127.0.0.1", 0, service=make_service(feed)) as running,
        httpx.Client(base_url=running.url, timeout=10.0) as client,
    ):
        assert _register(client, "a", LOCAL).status_code == 200
        refused = _register(client, "b", "tcp://127.0.0.1:6999", ranks=2)  # rank 1 on 7000
        assert refused.status_code == 422
        body = refused.json()
        assert body["field"] == "endpoint" and body["endpoint"] == "tcp://127.0.0.1:7000"
        assert body["rank"] == 1 and "no room" in body["error"]
        assert [s.key for s in feed.specs] == [("a", 0)]  # b's rank 0 was rolled back
        assert [w["worker_id"] for w in client.get("/workers").json()["workers"]] == ["a"]
        feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
        assert client.post("/query", json={"token_ids": PROMPT}).json()["scores"]
        assert client.get("/health").status_code == 200
        assert "kvevents_service_refused_registrations_total 1.0" in client.get("/metrics").text


def test_a_real_subscriber_out_of_sockets_refuses_one_worker_only() -> None:
    """With the default feed, a stream past the subscriber's socket limit is a 422 and the
    subscriber's I/O thread, the other worker and /health all stay fine."""
    options = SubscriberOptions(max_sockets=7)  # room for one stream (and replays)
    service = IndexService(PrefixIndex(), feed=subscriber_feed(options))
    with (
        serve("127.0.0.1", 0, service=service) as running,
        httpx.Client(base_url=running.url, timeout=20.0) as client,
    ):
        assert _register(client, "a", "tcp://127.0.0.1:6100").status_code == 200
        refused = _register(client, "b", "tcp://127.0.0.1:6200")
        assert refused.status_code == 422, refused.text
        assert refused.json()["endpoint"] == "tcp://127.0.0.1:6200"
        assert client.get("/health").json() == {"status": "ok", "workers": 1}
        assert service.feed.health().alive
        assert _register(client, "c", "tcp://127.0.0.1:6300").status_code == 422  # still answers


@pytest.mark.parametrize(
    ("feed_health", "status"),
    [
        (FeedHealth("dead", False, 0.0, "the I/O thread died: boom"), "dead"),
        (FeedHealth("stalled", True, 12.5), "stalled"),
    ],
)
def test_health_reports_a_dead_or_stalled_feed(
    feed: FakeFeed, client: httpx.Client, feed_health: FeedHealth, status: str
) -> None:
    """/health is a 503 naming the feed's state and reason when it is not serving, and
    /metrics says the same in numbers an alert can test."""
    assert client.get("/health").status_code == 200
    feed.state = feed_health
    reply = client.get("/health")
    assert reply.status_code == 503
    assert reply.json() == {
        "status": status,
        "workers": 0,
        "stalled_for": feed_health.stalled_for,
        "error": feed_health.error,
    }
    text = client.get("/metrics").text
    assert "\nkvevents_service_feed_healthy 0.0" in text
    assert f"\nkvevents_service_feed_stalled_seconds {float(feed_health.stalled_for)}" in text


def test_reregistering_with_a_bad_endpoint_keeps_the_old_registration(
    client: httpx.Client, server: tuple[Server, IndexService], feed: FakeFeed
) -> None:
    """A re-registration that is refused (bad endpoint, port range, feed refusal) answers
    4xx and leaves the worker as it was: same streams, same blocks."""
    _, service = server
    assert _register(client, "a", LOCAL).status_code == 200
    feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
    bad = [
        ({"endpoint": "bogus"}, 400, "scheme must be one of"),
        ({"endpoint": "tcp://127.0.0.1:65535", "ranks": 2}, 400, "exceeds 65535"),
        ({"endpoint": "tcp://127.0.0.1:0"}, 400, "port 0 cannot be connected to"),
        ({"endpoint": LOCAL, "replay_endpoint": "tcp://*:5600"}, 400, "not '*'"),
    ]
    for body, status, error in bad:
        reply = client.post("/register", json={"worker_id": "a", "block_size": 8, **body})
        assert reply.status_code == status, (body, reply.text)
        assert error in reply.json()["error"] and "field" in reply.json(), reply.json()
        (worker,) = client.get("/workers").json()["workers"]
        assert (worker["endpoint"], worker["block_size"]) == (LOCAL, BS)
        assert [s.key for s in feed.specs] == [("a", 0)]
        assert service.query(PROMPT)["scores"] == {"a": {"0": 6}}


def test_a_replacement_the_feed_refuses_restores_the_old_registration() -> None:
    """When the feed refuses the new streams of a re-registration, the old ones come back."""
    feed = RefusingFeed()
    service = make_service(feed)
    service.register(WorkerRegistration("a", LOCAL, BS))
    with pytest.raises(StreamAddError, match="no room"):
        service.register(WorkerRegistration("a", "tcp://127.0.0.1:7000", 8))
    assert service.workers() == [WorkerRegistration("a", LOCAL, BS)]
    assert [(s.key, s.endpoint) for s in feed.specs] == [(("a", 0), LOCAL)]
    assert service.stats().refused_registrations == 1 and service.stats().registrations == 1


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("/register", {"ranks": 2**62}, "Expected `int` <= 1024 - at `$.ranks`"),
        ("/register", {"dp_size": 2**62}, "Expected `int` <= 1024 - at `$.dp_size`"),
        ("/register", {"ranks": 0}, "at `$.ranks`"),
        ("/register", {"ranks": []}, "ranks must be a count >= 1 or a non-empty list"),
        ("/register", {"ranks": [2**63]}, "Expected `int` <= 65535 - at `$.ranks[0]`"),
        ("/register", {"ranks": [-1]}, "Expected `int` >= 0 - at `$.ranks[0]`"),
        ("/register", {"block_size": 2**70}, "Expected `int` <= 1048576 - at `$.block_size`"),
        ("/register", {"block_size": -1}, "Expected `int` >= 1 - at `$.block_size`"),
        ("/register", {"worker_id": "w" * 300}, "length <= 256 - at `$.worker_id`"),
        ("/register", {"worker_id": ""}, "length >= 1 - at `$.worker_id`"),
        ("/register", {"instance_id": 2**64}, "at `$.instance_id`"),
        ("/register", {"endpoint": "tcp://127.0.0.1:1" + "0" * 2000}, "at `$.endpoint`"),
        ("/unregister", {"rank": -1}, "Expected `int` >= 0 - at `$.rank`"),
        ("/unregister", {"dp_rank": 2**70}, "at `$.dp_rank`"),
        ("/query", {"token_ids": [1, 2, 3], "block_size": -1}, "at `$.block_size`"),
        ("/query", {"block_hashes": [1], "block_size": 0}, "at `$.block_size`"),
        ("/query", {"block_hashes": [2**64]}, "block hash at `$.block_hashes[0]` is over"),
        ("/query", {"block_hashes": [-1]}, "Expected `int` >= 0 - at `$.block_hashes[0]`"),
        ("/query", {"token_ids": [1], "lora_id": -5}, "at `$.lora_id`"),
    ],
)
def test_numbers_out_of_range_are_400_naming_field_and_rule(
    client: httpx.Client, path: str, body: dict[str, Any], error: str
) -> None:
    """Every numeric field has bounds: out of them is a 400 naming the field and the rule,
    never a 500 (ranks 2**62 was a MemoryError, a huge rank an unhandled LayoutError)."""
    base = {"worker_id": "a", "endpoint": LOCAL, "block_size": BS} if path == "/register" else {}
    if path == "/unregister":
        base = {"worker_id": "a"}
    reply = client.post(path, json={**base, **body})
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"] == "application/json"
    assert error in reply.json()["error"], reply.json()
    assert client.get("/health").status_code == 200


def test_deep_nesting_and_unknown_routes_get_json_errors(client: httpx.Client) -> None:
    """Deeply nested JSON is a 400 (not a RecursionError 500); unknown routes and methods
    answer JSON too."""
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/register", "/unregister", "/query"):
        reply = client.post(
            path, content=b'{"token_ids": ' + deep + b', "worker_id": ' + deep + b"}"
        )
        assert reply.status_code == 400, (path, reply.text)
        assert "error" in reply.json()
    huge = b'{"worker_id": "a", "endpoint": "%s", "block_size": 1e400}' % LOCAL.encode()
    reply = client.post("/register", content=huge)
    assert reply.json() == {"error": "/register: Number out of range - at `$.block_size`"}
    missing = client.get("/nope")
    assert missing.status_code == 404
    assert missing.json() == {"error": "no such endpoint: GET /nope"}
    wrong = client.get("/register")
    assert wrong.status_code == 405 and "Method Not Allowed" in wrong.json()["error"]


def test_metrics_cover_every_service_counter_with_its_documentation(
    client: httpx.Client,
) -> None:
    """Every ServiceStats, IndexStats and HttpStats field reaches /metrics, its HELP text the field's
    own documentation rather than its name."""
    text = client.get("/metrics").text
    records = [
        (ServiceStats, "kvevents_service"),
        (IndexStats, "kvevents_index"),
        (HttpStats, "kvevents_http"),
    ]
    for record, prefix in records:
        docs = field_docs(record)
        for f in dataclasses.fields(record):
            suffix = "" if f.name in getattr(record, "GAUGES", ()) else "_total"
            assert f"# HELP {prefix}_{f.name}{suffix} {docs[f.name]}\n" in text, f.name
    assert (
        "# HELP kvevents_service_ignored_total batches and resets of workers (or ranks) no "
        "longer registered" in text
    )


def test_metrics_have_a_query_latency_histogram_and_process_metrics(
    client: httpx.Client,
) -> None:
    """/metrics carries a /query latency histogram in seconds that counts each answered query,
    and the process's CPU, memory and file descriptors."""

    def count() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("kvevents_query_duration_seconds_count "):
                return float(line.split()[1])
        raise AssertionError("no kvevents_query_duration_seconds_count sample")

    before = count()
    for _ in range(3):
        assert client.post("/query", json={"token_ids": list(range(64))}).status_code == 200
    assert client.post("/query", content=b"{").status_code == 400  # refused: not observed
    assert count() == before + 3
    text = client.get("/metrics").text
    assert "# TYPE kvevents_query_duration_seconds histogram" in text
    assert 'kvevents_query_duration_seconds_bucket{le="0.001"}' in text
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "python_gc_collections_total",
    ):
        assert f"\n{name}" in text, name
    assert "\nkvevents_service_feed_healthy 1.0" in text
    assert "\nkvevents_service_feed_stalled_seconds 0.0" in text


def test_query_takes_cost_weights_for_one_request(client: httpx.Client) -> None:
    """POST /query accepts prefill_weight and load_weight (bounded, 400 naming the field when
    out of range) and the decision uses them."""
    body = {"token_ids": list(range(64)), "policy": "prefix_load", "load_weight": 0.5}
    reply = client.post("/query", json=body)
    assert reply.status_code == 200 and reply.json()["decision"]["policy"] == "prefix_load"
    bad = client.post("/query", json={"token_ids": [1], "prefill_weight": -1})
    assert bad.status_code == 400 and "$.prefill_weight" in bad.json()["error"]


def test_dump_streams_every_holder_and_encodes_off_the_lock(
    client: httpx.Client,
    server: tuple[Server, IndexService],
    feed: FakeFeed,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GET /dump is the index's dump (same document), and no piece of it is encoded while
    the index lock is held (a query may run between any two pieces)."""
    _, service = server
    for worker in ("a", "b"):
        assert _register(client, worker, f"tcp://127.0.0.1:{6000 + ord(worker)}").status_code == 200
    feed.deliver("a", 0, batch(store_event(PROMPT, BS)))
    feed.deliver("b", 0, batch(store_event(PROMPT, BS, end_block=2, medium="CPU")))
    encoded: list[bool] = []

    def members(pairs: list[tuple[int, int]]) -> bytes:
        free = service.lock.acquire(blocking=False)
        if free:
            service.lock.release()
        encoded.append(free)
        return real(pairs)

    real = service_dump._members
    monkeypatch.setattr(service_dump, "_members", members)
    monkeypatch.setattr(service_dump, "CHUNK_PAIRS", 4)  # several pieces per holder
    dump = client.get("/dump").json()
    want = [{**h, "blocks": sorted(h["blocks"])} for h in service.index.dump()]
    got = [{**h, "blocks": sorted(h["blocks"])} for h in dump["holders"]]
    assert got == want and len(got) == 2
    assert dump["stats"]["entries"] == 8
    assert len(encoded) == 3 and all(encoded)  # 6 pairs in 2 pieces, then 2 in 1


def test_one_dump_at_a_time(client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second GET /dump while one is being sent is a 429, not a second copy of the index."""
    entered, release = threading.Event(), threading.Event()

    async def slow_dump(service: IndexService) -> AsyncIterator[bytes]:
        yield b'{"holders":['
        entered.set()
        for _ in range(1000):  # bounded: 10 s
            if release.is_set():
                break
            await asyncio.sleep(0.01)
        yield b'],"stats":{}}'

    monkeypatch.setattr(service_app, "dump_chunks", slow_dump)
    first: list[httpx.Response] = []
    reader = threading.Thread(target=lambda: first.append(client.get("/dump")))
    reader.start()
    try:
        assert entered.wait(10.0)
        with httpx.Client(base_url=str(client.base_url), timeout=10.0) as other:
            second = other.get("/dump")
        assert second.status_code == 429 and "already being sent" in second.json()["error"]
    finally:
        release.set()
        reader.join(10.0)
    assert first[0].json() == {"holders": [], "stats": {}}


@pytest.mark.parametrize("prompts_count", [1, 16])
def test_payloads_are_decoded_before_the_lock_is_taken(
    feed: FakeFeed, monkeypatch: pytest.MonkeyPatch, prompts_count: int
) -> None:
    """A payload, small or large, is decoded with the index lock free and applied as the index
    applies it itself: same blocks, same Applied record."""
    prompts = [list(range(i * 4096, (i + 1) * 4096)) for i in range(prompts_count)]
    big = batch(*(store_event(p, BS) for p in prompts), AllBlocksCleared(), ts=5.0)
    big = batch(*big.events[-1:], *big.events[:-1], ts=5.0)  # the clear first
    payload = encode_batch(big)
    lane, outside = make_service(FakeFeed()), make_service(feed)
    for service in (lane, outside):
        service.register(WorkerRegistration("a", LOCAL, BS))
    decoded_free: list[bool] = []
    real = index_prefix.decode_batch_packed

    def decode(data: bytes, *, seq: int | None = None) -> DecodedBatch:
        free = outside.lock.acquire(blocking=False)
        if free:
            outside.lock.release()
        decoded_free.append(free)
        return real(data, seq=seq)

    want = lane.index.ingest_payload("a", 0, payload, seq=0)
    monkeypatch.setattr(index_prefix, "decode_batch_packed", decode)
    got = feed.deliver_payload("a", 0, payload)
    assert decoded_free[-1] is True
    assert got == want == Applied(5.0, prompts_count + 1, 0, True)
    assert outside.index.snapshot() == lane.index.snapshot()
    assert outside.query(prompts[-1])["scores"] == {"a": {"0": 1024}}
    assert outside.stats().deliveries == 1
    small = encode_batch(batch(store_event(PROMPT, BS)))
    assert feed.deliver_payload("a", 0, small, seq=1) == Applied(0.0, 1)
    assert decoded_free == [True, True]  # the small one too: never decoded under the lock

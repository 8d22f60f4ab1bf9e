"""One Dynamo client, two indexers: NVIDIA Dynamo's standalone indexer and ``kvevents serve
--api dynamo``, fed the same engine streams, answer the same requests alike, field by field.

Both run as subprocesses (``kvevents.testing.dynamo`` and ``kvevents.testing.service``) and
subscribe to the same publishers (a PUB socket serves both). Every request goes through one
function, :func:`call`, to both; replies are compared whole: status and JSON body, and for
409/404 the error text too. Where the two differ by design (docs/service.md) only the status
is compared: Dynamo's 400 and 422 bodies are plain text, ours JSON ``{"error": ...}``.

Each test owns its instance ids, model names and tokens, so the two indexers serve the whole
module. Waits are handshakes (publish a marker block until both indexers match it) bounded by
deadlines.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import pytest

from kvevents.config import KVEventsConfig
from kvevents.events import BlockStored, Event, KVEventBatch
from kvevents.publish import create_publisher
from kvevents.testing._process import IndexerProcess
from kvevents.testing.dynamo import DynamoIndexer, dynamo_unavailable_reason
from kvevents.testing.service import ServiceIndexer
from kvevents.testing.sockets import wait_for

pytestmark = pytest.mark.interop

BS = 4
WAIT = 20.0
_tokens = itertools.count(50_000, 1_000)


class Reply(NamedTuple):
    status: int
    body: Any  # the decoded JSON, or the text when the body is not JSON


Peers = dict[str, IndexerProcess]


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    reason = dynamo_unavailable_reason()
    if reason is not None and os.environ.get("KVEVENTS_REQUIRE_DYNAMO"):
        pytest.fail(f"KVEVENTS_REQUIRE_DYNAMO is set but {reason}")
    if reason is not None:
        pytest.skip(reason)
    with (
        DynamoIndexer(threads=1) as dynamo,
        ServiceIndexer(args=["--api", "dynamo"]) as ours,
    ):
        yield {"dynamo": dynamo, "kvevents": ours}


# --------------------------------------------------------------------------- the client


def call(peer: IndexerProcess, method: str, path: str, body: Any = None) -> Reply:
    """The Dynamo client: one request, JSON in (or raw bytes), JSON (or text) out."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    status, raw = peer.send(method, path, data)
    try:
        return Reply(status, json.loads(raw) if raw else None)
    except ValueError:
        return Reply(status, raw.decode(errors="replace"))


def same(peers: Peers, method: str, path: str, body: Any = None) -> Reply:
    """The request sent to both indexers; their replies must be equal, field by field."""
    theirs, ours = (call(peers[name], method, path, body) for name in ("dynamo", "kvevents"))
    assert ours == theirs, f"{method} {path} {body!r}: Dynamo {theirs}, kvevents {ours}"
    return ours


def same_status(peers: Peers, method: str, path: str, body: Any) -> Reply:
    """Both refuse the request with the same status; ours says why in JSON."""
    theirs, ours = (call(peers[name], method, path, body) for name in ("dynamo", "kvevents"))
    assert ours.status == theirs.status >= 400, f"{path} {body!r}: {theirs} vs {ours}"
    assert isinstance(ours.body, dict) and ours.body["error"], ours
    return theirs


# --------------------------------------------------------------------------- engines


class Engine:
    """One engine rank: our publisher on ephemeral ports, both indexers subscribed to it."""

    def __init__(self, rank: int = 0) -> None:
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint="tcp://127.0.0.1:0",
        )
        self.rank = rank
        self._publisher = create_publisher(config)
        self._publisher.start()
        self.endpoint: str = self._publisher.endpoint
        self.replay_endpoint: str = self._publisher.replay_endpoint

    def publish(self, *events: Event) -> None:
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.rank)
        self._publisher.publish(batch)

    def close(self) -> None:
        self._publisher.shutdown()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


class Chain:
    """Token ids cut into blocks, with engine hashes derived from the tokens: every engine
    storing the same tokens names them alike, as engines with one hash seed do."""

    def __init__(self, blocks: int) -> None:
        first = next(_tokens)
        self.tokens = list(range(first, first + blocks * BS))
        self.hashes = [first * 7 + i for i in range(blocks)]

    def store(self, start: int, stop: int) -> BlockStored:
        return BlockStored(
            block_hashes=self.hashes[start:stop],
            parent_block_hash=self.hashes[start - 1] if start else None,
            token_ids=self.tokens[start * BS : stop * BS],
            block_size=BS,
        )


def register(instance: int, model: str, engine: Engine, **more: Any) -> dict[str, Any]:
    """Dynamo's registration body of one engine rank."""
    return {
        "instance_id": instance,
        "endpoint": engine.endpoint,
        "replay_endpoint": engine.replay_endpoint,
        "model_name": model,
        "block_size": BS,
        "dp_rank": engine.rank,
        **more,
    }


def settled(peers: Peers, instance: int, model: str, engine: Engine) -> None:
    """Publish a fresh one-block marker until both indexers match it on this rank: every
    batch published before is then applied by both (streams apply in sequence order)."""
    marker = Chain(1)
    query = {"token_ids": marker.tokens, "model_name": model}

    def seen() -> bool:
        engine.publish(marker.store(0, 1))
        replies = [call(peer, "POST", "/query", query) for peer in peers.values()]
        return all(
            r.status == 200 and r.body["scores"].get(str(instance), {}).get(str(engine.rank))
            for r in replies
        )

    wait_for(seen, timeout=WAIT, interval=0.05, what=f"instance {instance} rank {engine.rank}")


def workers(peers: Peers, instances: Sequence[int]) -> list[dict[str, Any]]:
    """``GET /workers`` of both, equal once ordered; only ``instances`` (tests share peers)."""
    lists = [call(peer, "GET", "/workers") for peer in peers.values()]
    assert all(reply.status == 200 for reply in lists), lists
    theirs, ours = (
        sorted((w for w in reply.body if w["instance_id"] in instances), key=_key)
        for reply in lists
    )
    assert ours == theirs
    return ours


def _key(worker: dict[str, Any]) -> int:
    return int(worker["instance_id"])


# --------------------------------------------------------------------------- behaviour


def test_two_ranks_and_two_models_register_and_query_alike(
    peers: Peers, engines: list[Engine]
) -> None:
    """Two ranks of one instance registered one at a time, a second model's instance on the
    same tokens: registrations, /workers and queries (tokens per rank, instances, a prefix,
    another model, an unknown model) are the same from both."""
    e0, e1, e2 = Engine(0), Engine(1), Engine(0)
    engines += [e0, e1, e2]
    for body in (register(11, "api-a", e0), register(11, "api-a", e1), register(12, "api-b", e2)):
        assert same(peers, "POST", "/register", body) == Reply(201, {"status": "ok"})
    chain = Chain(5)
    e0.publish(chain.store(0, 2))
    e1.publish(chain.store(0, 2))
    e1.publish(chain.store(2, 3))
    e2.publish(chain.store(0, 5))
    for instance, model, engine in [(11, "api-a", e0), (11, "api-a", e1), (12, "api-b", e2)]:
        settled(peers, instance, model, engine)
    listed = workers(peers, [11, 12])
    assert listed[0]["endpoints"] == {"0": e0.endpoint, "1": e1.endpoint}
    a = same(peers, "POST", "/query", {"token_ids": chain.tokens, "model_name": "api-a"})
    assert a.body["scores"] == {"11": {"0": 2 * BS, "1": 3 * BS}}
    b = same(peers, "POST", "/query", {"token_ids": chain.tokens, "model_name": "api-b"})
    assert b.body["scores"] == {"12": {"0": 5 * BS}}
    for tokens in (chain.tokens[: BS + 2], chain.tokens[:3], []):
        same(peers, "POST", "/query", {"token_ids": tokens, "model_name": "api-a"})
    same(peers, "POST", "/query", {"token_ids": chain.tokens, "model_name": "api-a", "x": 1})
    same(
        peers,
        "POST",
        "/query",
        {"token_ids": chain.tokens, "model_name": "api-a", "lora_name": "adapter"},
    )
    unknown = same(peers, "POST", "/query", {"token_ids": chain.tokens, "model_name": "api-z"})
    assert unknown == Reply(404, {"error": "no indexer for model=api-z routing_group=default"})


def test_registration_conflicts_are_refused_alike(peers: Peers, engines: list[Engine]) -> None:
    """A rank registered twice, another block size for the model, the instance under another
    model: the same 409 and words from both; nothing changes."""
    e0, e1 = Engine(0), Engine(1)
    engines += [e0, e1]
    same(peers, "POST", "/register", register(21, "api-c", e0))
    conflicts = [
        register(21, "api-c", e0),
        register(22, "api-c", e1, block_size=2 * BS),
        register(21, "api-d", e1),
    ]
    for body in conflicts:
        assert same(peers, "POST", "/register", body).status == 409
    assert [w["endpoints"] for w in workers(peers, [21, 22])] == [{"0": e0.endpoint}]


def test_unregister_a_rank_and_an_instance_alike(peers: Peers, engines: list[Engine]) -> None:
    """A rank dropped (with routing_group), then the instance (dp_rank alone drops it whole,
    as Dynamo does); unknown instances and ranks are the same 404s; once the model has no
    worker, its queries are the same 404."""
    e0, e1 = Engine(0), Engine(1)
    engines += [e0, e1]
    for engine in (e0, e1):
        same(peers, "POST", "/register", register(31, "api-e", engine))
    chain = Chain(3)
    e0.publish(chain.store(0, 3))
    e1.publish(chain.store(0, 2))
    settled(peers, 31, "api-e", e0)
    settled(peers, 31, "api-e", e1)
    query = {"token_ids": chain.tokens, "model_name": "api-e"}
    rank1 = {"instance_id": 31, "model_name": "api-e", "dp_rank": 1, "routing_group": "default"}
    assert same(peers, "POST", "/unregister", rank1) == Reply(200, {"status": "ok"})
    assert same(peers, "POST", "/query", query).body["scores"] == {"31": {"0": 3 * BS}}
    assert same(peers, "POST", "/unregister", rank1).status == 404
    other_model = {"instance_id": 31, "model_name": "api-f"}
    assert same(peers, "POST", "/unregister", other_model).status == 404
    whole = {"instance_id": 31, "model_name": "api-e", "dp_rank": 7}
    assert same(peers, "POST", "/unregister", whole).status == 200
    assert workers(peers, [31]) == []
    assert same(peers, "POST", "/query", query).status == 404
    assert same(peers, "POST", "/unregister", whole).status == 404


def _registration(**fields: Any) -> dict[str, Any]:
    body = {"instance_id": 41, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": BS}
    return {k: v for k, v in {**body, **fields}.items() if v is not None}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/register", _registration(model_name=None)),
        ("/register", _registration(instance_id="x")),
        ("/register", _registration(dp_rank=-1)),
        ("/register", _registration(endpoint="nonsense")),
        ("/register", [1]),
        ("/register", b"{not json"),
        ("/unregister", {"model_name": "m"}),
        ("/unregister", {"instance_id": 41}),
        ("/query", {"token_ids": [1, 2, 3, 4]}),
        ("/query", {"token_ids": [-1], "model_name": "m"}),
        ("/query", {"token_ids": "abc", "model_name": "m"}),
        ("/query", b"{bad"),
    ],
)
def test_bad_requests_get_the_same_status(peers: Peers, path: str, body: Any) -> None:
    """Missing or mistyped fields (422), bodies that are not JSON (400), a bad endpoint
    (400): the same status from both, and ours a JSON error naming the field."""
    same_status(peers, "POST", path, body)

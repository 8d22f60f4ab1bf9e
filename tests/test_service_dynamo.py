"""``kvevents serve --api dynamo``: NVIDIA Dynamo's standalone indexer API over the service,
in process (tests/interop/test_dynamo_api.py compares it with the real one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvevents.http import AppOptions, serve
from kvevents.http._dynamo import DynamoQueryReader, dynamo_scores
from kvevents.http._scan_py import pack_json_member
from kvevents.index.prefix import PrefixIndex
from kvevents.index.records import HolderKey, MatchResult
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.testing.index import batch, store_event
from test_service import BS, PROMPT, FakeFeed, applied

E0, E1, E2 = "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7301", "tcp://127.0.0.1:7502"


@pytest.fixture
def feed() -> FakeFeed:
    return FakeFeed()


@pytest.fixture
def served(feed: FakeFeed) -> Iterator[tuple[httpx.Client, IndexService]]:
    service = IndexService(PrefixIndex(), feed=feed, poll_interval=0.01)
    options = AppOptions(api="dynamo")
    with (
        serve("127.0.0.1", 0, service=service, options=options) as server,
        httpx.Client(base_url=server.url, timeout=10.0) as client,
    ):
        yield client, service


def register(client: httpx.Client, instance: int, endpoint: str, **more: Any) -> httpx.Response:
    body = {"instance_id": instance, "endpoint": endpoint, "model_name": "A", "block_size": BS}
    return client.post("/register", json={**body, **more})


def test_two_ranks_and_two_models_answer_in_dynamo_shape(
    served: tuple[httpx.Client, IndexService], feed: FakeFeed
) -> None:
    """Two ranks registered one at a time both count, in tokens, for their model only;
    /workers lists each rank's own endpoint."""
    client, service = served
    assert register(client, 1, E0).status_code == 201
    assert register(client, 1, E1, dp_rank=1).json() == {"status": "ok"}
    assert register(client, 2, E2, model_name="B").status_code == 201
    feed.deliver("1", 0, batch(store_event(PROMPT, BS, end_block=2)))
    feed.deliver("1", 1, batch(store_event(PROMPT, BS, end_block=3)))
    feed.deliver("2", 0, batch(store_event(PROMPT, BS)))
    applied(service, 3)
    reply = client.post("/query", json={"token_ids": PROMPT, "model_name": "A"})
    assert reply.json() == {
        "scores": {"1": {"0": 8, "1": 12}},
        "frequencies": [],
        "instances": {
            "1": {"longest_matched": 12, "gpu": 12, "dp": {"0": 8, "1": 12}, "cpu": 12, "disk": 12}
        },
    }
    other = client.post("/query", json={"token_ids": PROMPT, "model_name": "B"}).json()
    assert other["scores"] == {"2": {"0": 24}}
    (first, _) = sorted(client.get("/workers").json(), key=lambda w: w["instance_id"])
    assert first["instance_id"] == 1
    assert first["endpoints"] == {"0": E0, "1": E1}
    assert first["listeners"]["1"] == {"endpoint": E1, "status": "active"}


def test_conflicts_and_unknowns_get_dynamo_statuses_and_messages(
    served: tuple[httpx.Client, IndexService],
) -> None:
    """A rank registered twice, another block size or model for the instance: 409 with
    Dynamo's words; an unknown model's query 404; a missing field 422; bad JSON 400."""
    client, _ = served
    register(client, 1, E0)
    cases = [
        (register(client, 1, E1), 409, "instance 1 dp_rank 0 already registered"),
        (
            register(client, 2, E1, block_size=BS * 2),
            409,
            f"block_size mismatch for model=A routing_group=default: existing={BS}, "
            f"requested={BS * 2}",
        ),
        (
            register(client, 1, E1, model_name="B", dp_rank=1),
            409,
            "instance 1 is already registered for model=A routing_group=default",
        ),
        (
            client.post("/query", json={"token_ids": PROMPT, "model_name": "Z"}),
            404,
            "no indexer for model=Z routing_group=default",
        ),
    ]
    for reply, status, message in cases:
        assert (reply.status_code, reply.json()) == (status, {"error": message})
    missing = client.post("/query", json={"token_ids": PROMPT})
    assert missing.status_code == 422 and "model_name" in missing.json()["error"]
    assert client.post("/query", content=b"{bad").status_code == 400
    assert client.post("/query_by_hash", json={"block_hashes": [1]}).status_code == 501


def test_unregister_takes_a_rank_only_with_a_routing_group(
    served: tuple[httpx.Client, IndexService],
) -> None:
    """As Dynamo: dp_rank with routing_group drops that rank; dp_rank alone drops the whole
    instance; an unknown instance or rank is a 404 naming it."""
    client, service = served
    register(client, 1, E0)
    register(client, 1, E1, dp_rank=1)
    body = {"instance_id": 1, "model_name": "A"}
    gone = client.post("/unregister", json={**body, "dp_rank": 1, "routing_group": "default"})
    assert (gone.status_code, gone.json()) == (200, {"status": "ok"})
    assert [r.ranks for r in service.workers()] == [(0,)]
    again = client.post("/unregister", json={**body, "dp_rank": 1, "routing_group": "default"})
    assert again.json() == {"error": "instance 1 dp_rank 1 not found"}
    register(client, 1, E1, dp_rank=1)
    assert client.post("/unregister", json={**body, "dp_rank": 1}).status_code == 200
    assert service.workers() == []
    wrong = client.post("/unregister", json=body)
    assert (wrong.status_code, wrong.json()) == (404, {"error": "instance 1 not found"})


def test_lower_tiers_count_cumulatively_in_instances() -> None:
    """A rank's host-tier prefix beyond its device prefix raises ``cpu``; ``disk`` is the
    prefix on any tier; ``scores`` stay the device tier's."""
    match = MatchResult(
        24,
        {BS: 6},
        {HolderKey("1", 0, "GPU"): 2, HolderKey("1", 0, "CPU"): 4, HolderKey("1", 1, "DISK"): 5},
        {("1", 0): 5, ("1", 1): 5},
    )
    reply = dynamo_scores(match, {"1": BS})
    assert reply["scores"] == {"1": {"0": 8}}
    assert reply["instances"]["1"] == {
        "longest_matched": 20,
        "gpu": 8,
        "dp": {"0": 8, "1": 0},
        "cpu": 16,
        "disk": 20,
    }


def test_unregister_under_another_model_names_the_instance_s_model(
    served: tuple[httpx.Client, IndexService],
) -> None:
    """An instance unregistered under a model it is not registered for: Dynamo's 404 saying
    which model it is registered for, and it stays registered."""
    client, service = served
    register(client, 1, E0)
    reply = client.post("/unregister", json={"instance_id": 1, "model_name": "B"})
    assert (reply.status_code, reply.json()) == (
        404,
        {"error": "instance 1 is registered for model=A routing_group=default"},
    )
    assert len(service.workers()) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/register", b"[" * 100_000),
        ("/register", b'{"instance_id": 18446744073709551616, "endpoint": "tcp://127.0.0.1:1"}'),
        ("/register", b'{"instance_id": 1, "endpoint": null, "model_name": "A", "block_size": 4}'),
        ("/unregister", b'{"instance_id": 1e400, "model_name": "A"}'),
        ("/unregister", b'{"instance_id": 1, "model_name": "A", "dp_rank": 70000}'),
        ("/query", b'{"token_ids": [4294967296], "model_name": "A"}'),
        ("/query", b'{"token_ids": [1], "model_name": "' + b"x" * 300 + b'"}'),
        ("/query", b'{"token_ids": {"a": 1}, "model_name": "A"}'),
        ("/query", b"\xff\xfe"),
    ],
)
def test_hostile_bodies_are_4xx_json_errors(
    served: tuple[httpx.Client, IndexService], path: str, body: bytes
) -> None:
    """Whatever a Dynamo client sends is a 4xx with a JSON error, never a 500."""
    client, _ = served
    register(client, 1, E0)
    reply = client.post(path, content=body)
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]


def test_workers_shows_ids_that_are_not_u64s_as_they_are(
    served: tuple[httpx.Client, IndexService],
) -> None:
    """/workers shows an id registered under our own name (a --worker or a state file) as a
    number only when it is a u64 written the usual way; "²", an Arabic-Indic one, "007" and
    2**64 stay as they are, never a 500 or another instance's number."""
    client, service = served
    ids = ["42", "\u00b2", "\u0661", "007", str(2**64)]
    for n, worker in enumerate(ids):
        endpoint = f"tcp://127.0.0.1:{7600 + n}"
        service.register(WorkerRegistration(worker, endpoint, BS, model_name="A"))
    reply = client.get("/workers")
    assert reply.status_code == 200, reply.text
    assert sorted(map(str, (w["instance_id"] for w in reply.json()))) == sorted(ids)
    assert {w["instance_id"] for w in reply.json()} >= {42, "\u00b2", "\u0661", "007"}


def test_the_one_pass_packer_answers_as_the_full_decode(
    served: tuple[httpx.Client, IndexService], feed: FakeFeed
) -> None:
    """token_ids packed from the JSON text give the same reply as a full decode, a repeated
    member included (the last one wins, as in a full decode)."""
    client, service = served
    register(client, 1, E0)
    feed.deliver("1", 0, batch(store_event(PROMPT, BS)))
    applied(service, 1)
    fast, full = DynamoQueryReader(service), DynamoQueryReader(service)
    fast.pack_member, full.pack_member = pack_json_member, None
    short = json.dumps(PROMPT[:8])
    bodies = [
        json.dumps({"token_ids": PROMPT, "model_name": "A"}),
        f'{{"token_ids": {short}, "model_name": "A", "token_ids": {json.dumps(PROMPT)}}}',
        f'{{"model_name": "A", "lora_name": null, "token_ids": {short}}}',
    ]
    for text in bodies:
        assert fast.answer(text.encode()) == full.answer(text.encode()), text
    assert fast.answer(bodies[1].encode())["scores"] == {"1": {"0": 24}}

"""GET /openapi.json: every route described, every $ref resolving, real answers as described."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from starlette.routing import Route

from kvevents.http import Status, create_app, serve
from kvevents.http import _openapi as openapi
from kvevents.service.bounds import MAX_BLOCK_SIZE, MAX_RANKS
from kvevents.service.core import IndexService
from kvevents.testing.index import batch, store_event
from test_service import BS, PROMPT, FakeFeed, applied, make_service

METHODS = {"GET", "POST"}


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref}: not a local reference"
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref}: {part!r} does not resolve"
        node = node[part]
    return node


@pytest.fixture
def served() -> Iterator[tuple[httpx.Client, IndexService, FakeFeed]]:
    feed = FakeFeed()
    service = make_service(feed)
    with (
        serve("127.0.0.1", 0, service=service) as running,
        httpx.Client(base_url=running.url, timeout=10.0) as client,
    ):
        yield client, service, feed


def test_every_route_of_the_app_is_described_and_nothing_else() -> None:
    """Each (path, method) the app routes has an operation, and each operation a route."""
    app = create_app(make_service(FakeFeed()))
    routed = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in (route.methods or ()) & METHODS
    }
    paths = openapi.openapi_document()["paths"]
    described = {(path, method) for path, ops in paths.items() for method in ops}
    assert routed == described
    assert {"/register", "/unregister", "/query", "/dump", "/workers"} < {p for p, _ in routed}
    assert {"/metrics", "/health", "/status", "/", "/openapi.json"} < {p for p, _ in routed}


def test_the_document_is_structurally_valid_openapi_3_1() -> None:
    """Required top-level keys, every operation answers something, every $ref resolves."""
    document = msgspec.json.decode(msgspec.json.encode(openapi.openapi_document()))
    assert document["openapi"].startswith("3.1.")
    assert {"title", "version"} <= document["info"].keys()
    for path, operations in document["paths"].items():
        assert path.startswith("/")
        for method, operation in operations.items():
            assert method in {"get", "post"} and operation["responses"], (path, method)
            for code, answer in operation["responses"].items():
                assert code.isdigit() and answer["description"], (path, method, code)
    refs = list(_refs(document))
    assert len(refs) > 20
    for ref in refs:
        assert isinstance(_resolve(document, ref), dict)
    schemes = document["components"]["securitySchemes"]
    for operations in document["paths"].values():
        for operation in operations.values():
            for requirement in operation.get("security", []):
                assert set(requirement) <= set(schemes)


def test_request_schemas_carry_the_bounds_the_service_enforces() -> None:
    """The request bodies come from the decoding structs: their bounds are in the document."""
    schemas = openapi.openapi_document()["components"]["schemas"]
    block_size = schemas["RegisterBody"]["properties"]["block_size"]
    assert block_size["maximum"] == MAX_BLOCK_SIZE and block_size["minimum"] == 1
    assert set(schemas["RegisterBody"]["required"]) == {"endpoint", "block_size"}
    ranks = schemas["RegisterBody"]["properties"]["ranks"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_RANKS} in ranks
    assert "token_ids" in schemas["QueryBody"]["properties"]
    assert "dp_rank" in schemas["UnregisterBody"]["properties"]


def test_real_answers_match_their_descriptions(
    served: tuple[httpx.Client, IndexService, FakeFeed],
) -> None:
    """Each answer decodes into the struct the document describes it with, no member unknown."""
    client, service, feed = served
    register = {"worker_id": "a", "endpoint": "tcp://127.0.0.1:6000", "block_size": BS}
    msgspec.convert(client.post("/register", json=register).json(), openapi.Registered)
    workers = msgspec.convert(client.get("/workers").json(), openapi.Workers)
    assert workers.workers[0].ranks[0].tiers == {}  # registered, nothing stored yet
    feed.deliver("a", 0, batch(store_event(PROMPT, BS), ts=1.0))
    applied(service, 1)
    answer = msgspec.convert(
        client.post("/query", json={"token_ids": PROMPT}).json(), openapi.QueryAnswer
    )
    assert answer.decision.winner == openapi.Winner("a", 0)
    workers = msgspec.convert(client.get("/workers").json(), openapi.Workers)
    assert workers.workers[0].ranks[0].tiers == {"GPU": 6}
    assert msgspec.convert(client.get("/dump").json(), openapi.Dump).holders[0].tier == "GPU"
    assert msgspec.convert(client.get("/health").json(), openapi.Health).status == "ok"
    assert msgspec.convert(client.get("/status").json(), Status).decisions[0].worker_id == "a"
    refused = client.post("/register", json={**register, "endpoint": "tcp://10.0.0.1:1"})
    assert msgspec.convert(refused.json(), openapi.Error).field == "endpoint"
    gone = client.post("/unregister", json={"worker_id": "a"}).json()
    assert msgspec.convert(gone, openapi.Unregistered).removed
    missing = client.post("/unregister", json={"worker_id": "a"})
    assert missing.status_code == 404 and msgspec.convert(missing.json(), openapi.Error)


def test_openapi_json_is_served(served: tuple[httpx.Client, IndexService, FakeFeed]) -> None:
    """GET /openapi.json answers the document as JSON."""
    reply = served[0].get("/openapi.json")
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json() == msgspec.json.decode(msgspec.json.encode(openapi.openapi_document()))

"""The HTTP layer's face: the names ``kvevents.http`` exports (its modules are private), and
what every app of it serves whatever runs it (``GET /digest``)."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import msgspec

import kvevents
import kvevents.http
from kvevents.http import _openapi, serve
from kvevents.index.digest import holders_digest
from kvevents.testing.index import batch, store_event
from test_service import BS, LOCAL, PROMPT, FakeFeed, applied, make_service

EXPORTED = [
    "ABORT",
    "DEFAULT_ALLOWED_HOSTS",
    "Api",
    "AppOptions",
    "BadRequest",
    "EndpointPolicy",
    "HttpCounters",
    "HttpLimits",
    "HttpStats",
    "LimitedProtocol",
    "QueryHandler",
    "QueryReader",
    "Refused",
    "Server",
    "Status",
    "TokenCheck",
    "create_app",
    "digest_route",
    "exposed_mode",
    "is_loopback",
    "json_response",
    "load_token",
    "metrics_registry",
    "metrics_route",
    "query_histogram",
    "read_body",
    "send_json",
    "serve",
    "status_routes",
]
ROOT = Path(kvevents.__file__).parent


def test_the_face_exports_exactly_these_names() -> None:
    """``kvevents.http.__all__`` is this sorted list, and every name in it loads."""
    assert kvevents.http.__all__ == EXPORTED
    for name in EXPORTED:
        assert getattr(kvevents.http, name) is not None, name
    assert set(EXPORTED) <= set(dir(kvevents.http))


def test_no_other_layer_imports_the_http_layers_private_modules() -> None:
    """Outside ``kvevents/http/`` the library reaches the layer through its face only."""
    reached = []
    for path in ROOT.rglob("*.py"):
        if path.is_relative_to(ROOT / "http"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            reached += [f"{path.relative_to(ROOT)}: {n}" for n in names if "kvevents.http._" in n]
    assert reached == []


def test_every_app_serves_the_digest_and_what_is_added_to_it() -> None:
    """``serve()`` without extra routes answers ``GET /digest`` with the index's digest, in the
    shape /openapi.json describes; ``digest_extra`` adds its members (a replica's
    covered_seq)."""
    for extra in (None, lambda: {"covered_seq": 41}):
        feed = FakeFeed()
        service = make_service(feed)
        with (
            serve("127.0.0.1", 0, service=service, digest_extra=extra) as running,
            httpx.Client(base_url=running.url, timeout=10.0) as client,
        ):
            body = {"worker_id": "w", "endpoint": LOCAL, "block_size": BS}
            assert client.post("/register", json=body).status_code == 200
            feed.deliver("w", 0, batch(store_event(PROMPT, BS)))
            applied(service, 1)
            reply = client.get("/digest")
        assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
        answer = reply.json()
        want = holders_digest(service.holders(), service.holder_blocks).to_dict()
        assert answer == {**want, **(extra() if extra is not None else {})}
        assert answer["streams"][0]["blocks"] == len(PROMPT) // BS
        msgspec.convert(answer, _openapi.DigestAnswer)

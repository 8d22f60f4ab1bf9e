"""``GET /openapi.json``: the HTTP API described in OpenAPI 3.1.

The request schemas are generated from the msgspec structs the service decodes bodies with
(:mod:`kvevents.http._schema`), bounds included, and ``/status`` from the structs it is
encoded from (:mod:`kvevents.http._status`): they cannot drift from what is enforced. The
other answers are built as plain dicts; the structs below describe them, and a test holds
real answers to these descriptions.
"""

from __future__ import annotations

import functools
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvevents.http._json import JsonObject
from kvevents.http._schema import LoadBody, QueryBody, RegisterBody, UnregisterBody
from kvevents.http._status import Status
from kvevents.index.prefix import IndexStats
from kvevents.subscribe.streams import FeedState, StreamStats

__all__ = ["OPENAPI_VERSION", "openapi_document", "openapi_route"]

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"


class Registered(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /register``: the worker and the streams now followed."""

    worker_id: str
    ranks: list[int]
    streams: int


class Unregistered(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /unregister``: the worker (or rank) is forgotten."""

    worker_id: str
    removed: bool


class TargetRef(msgspec.Struct, forbid_unknown_fields=True):
    """A (worker, rank) target."""

    worker_id: str
    rank: int


class LoadApplied(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /load``: how many entries were applied; those of unregistered targets."""

    applied: int
    unknown: list[TargetRef]


class RankLoad(msgspec.Struct, forbid_unknown_fields=True):
    """A rank's last load report (``POST /load``), while it counts."""

    queued_blocks: int
    active_blocks: int


class Match(msgspec.Struct, forbid_unknown_fields=True):
    """Matched prefix blocks of one holder (worker, rank, tier)."""

    worker_id: str
    rank: int
    tier: str
    matched_blocks: int


class Winner(msgspec.Struct, forbid_unknown_fields=True):
    """The chosen target."""

    worker_id: str
    rank: int


class TargetScore(msgspec.Struct, forbid_unknown_fields=True):
    """One target's row of a routing decision."""

    worker_id: str
    rank: int
    matched_blocks: int
    request_blocks: int
    score: float
    queued_blocks: int
    active_blocks: int
    terms: dict[str, float]
    degraded: str | None


class RoutingDecision(msgspec.Struct, forbid_unknown_fields=True):
    """The router's choice and why (``reason``, e.g. "most matched blocks (6)")."""

    policy: str
    winner: Winner | None
    request_tokens: int
    tied: int
    reason: str
    scores: list[TargetScore]


class QueryAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /query``: matches per holder and per (worker, rank), and the decision."""

    request_tokens: int
    request_blocks: dict[str, int]  #: full blocks of the request, per block size
    scores: dict[str, dict[str, int]]  #: worker id -> rank -> matched blocks
    matches: list[Match]
    decision: RoutingDecision


class RankView(msgspec.Struct, forbid_unknown_fields=True):
    """One rank of ``GET /workers``: the index's view of it (absent while it has none)
    and its stream's health."""

    rank: int
    stream: StreamStats | None
    degraded: str | None
    load: RankLoad | None
    worker_id: str | None = None
    block_size: int | None = None
    registered: bool | None = None
    tiers: dict[str, int] | None = None
    orphans_held: int | None = None
    block_size_mismatches: int | None = None
    bad_events: int | None = None
    batches: int | None = None
    last_batch_ts: float | None = None
    lag_seconds: float | None = None


class OwnEndpointsView(msgspec.Struct, forbid_unknown_fields=True):
    """A rank registered on its own (``dp_rank``), publishing on these endpoints."""

    rank: int
    endpoint: str
    replay_endpoint: str | None


class WorkerView(msgspec.Struct, forbid_unknown_fields=True):
    """A registration with its ranks (rank r on ``endpoint``'s port + r, except the ranks
    registered on their own, in ``own_endpoints``)."""

    worker_id: str
    endpoint: str
    block_size: int
    ranks: list[RankView]
    replay_endpoint: str | None
    topic: str
    model_name: str | None
    own_endpoints: list[OwnEndpointsView]
    report_mode: Literal["incremental", "full"]


class Workers(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /workers``."""

    workers: list[WorkerView]


class Holder(msgspec.Struct, forbid_unknown_fields=True):
    """One holder of ``GET /dump`` and its ``[engine hash, index hash]`` block pairs."""

    worker_id: str
    rank: int
    tier: str
    block_size: int | None
    blocks: list[list[int]]


class Dump(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /dump``: every holder's blocks and the index's stats."""

    holders: list[Holder]
    stats: IndexStats


class Health(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /health``: 200 with ``ok``, or ``degraded`` and why (a router replica with
    streams known incomplete); 503 with why when the feed stalled or died, or while the
    service still registers the workers of its state file (``starting``)."""

    status: FeedState
    workers: int
    stalled_for: float | None = None
    error: str | None = None


class StreamDigestRow(msgspec.Struct, forbid_unknown_fields=True):
    """One (worker, rank) of ``GET /digest``: its blocks over every tier, and their digest."""

    worker_id: str
    rank: int
    block_size: int | None
    blocks: int
    digest: str  #: 16 hex digits


class DigestAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /digest``: each stream's digest and one over them all (equal totals, equal
    indexes); a router replica adds ``covered_seq``, the stream sequence its index holds."""

    total: str
    streams: list[StreamDigestRow]
    covered_seq: int | None = None


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """Every 4xx: what is wrong; a refused registration names the field (and more)."""

    error: str
    field: str | None = None
    endpoint: str | None = None
    rank: int | None = None
    rule: str | None = None


_TYPES: tuple[type[msgspec.Struct], ...] = (
    RegisterBody,
    UnregisterBody,
    LoadBody,
    QueryBody,
    Registered,
    Unregistered,
    LoadApplied,
    QueryAnswer,
    Workers,
    Dump,
    Health,
    DigestAnswer,
    Status,
    Error,
)


def _json(name: str) -> JsonObject:
    return {"application/json": {"schema": {"$ref": _REF.format(name=name)}}}


def _answer(description: str, name: str) -> JsonObject:
    return {"description": description, "content": _json(name)}


def _text(description: str, media: str) -> JsonObject:
    return {"description": description, "content": {media: {"schema": {"type": "string"}}}}


_ERRORS = {
    "400": _answer("malformed body: the message names the field and the rule", "Error"),
    "401": _answer("the bearer token is missing or wrong", "Error"),
    "408": _answer("the body did not arrive in time", "Error"),
    "413": _answer("the body is too large", "Error"),
}


def _post(summary: str, body: str, answer: str, **more: JsonObject) -> JsonObject:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {"200": _answer(summary, answer), **_ERRORS, **more},
            "security": [{"bearer": []}, {}],
        }
    }


def _get(summary: str, ok: JsonObject, **more: JsonObject) -> JsonObject:
    unauthorized = {"401": _ERRORS["401"]}
    return {"get": {"summary": summary, "responses": {"200": ok, **unauthorized, **more}}}


def _paths() -> JsonObject:
    return {
        "/register": _post(
            "Index a worker's ranks and subscribe to their event streams",
            "RegisterBody",
            "Registered",
            **{
                "403": _answer("an endpoint on a host not allowed", "Error"),
                "422": _answer("the subscriber cannot add a stream", "Error"),
            },
        ),
        "/unregister": _post(
            "Forget a worker (or one rank) and its blocks",
            "UnregisterBody",
            "Unregistered",
            **{"404": _answer("unknown worker or rank", "Error")},
        ),
        "/load": _post("Set targets' load for load-aware routing", "LoadBody", "LoadApplied"),
        "/query": _post(
            "Matched blocks per worker, rank and tier, and a routing decision",
            "QueryBody",
            "QueryAnswer",
        ),
        "/dump": _get(
            "Every holder's blocks (streamed)",
            _answer("the dump", "Dump"),
            **{"429": _answer("another dump is being sent", "Error")},
        ),
        "/workers": _get("Workers with their stream health", _answer("the workers", "Workers")),
        "/metrics": _get(
            "Prometheus metrics", _text("exposition format", "text/plain; version=0.0.4")
        ),
        "/health": _get(
            "Whether the feed is sound",
            _answer("the feed is sound", "Health"),
            **{"503": _answer("the feed is stalled or dead", "Health")},
        ),
        "/digest": _get(
            "A digest of the index's contents, per stream", _answer("the digest", "DigestAnswer")
        ),
        "/status": _get("What the status page shows", _answer("the status", "Status")),
        "/": _get("The status page (HTML, polls /status)", _text("the page", "text/html")),
        "/openapi.json": _get(
            "This document", {"description": "OpenAPI 3.1", "content": {"application/json": {}}}
        ),
    }


@functools.lru_cache(maxsize=1)
def openapi_document() -> JsonObject:
    """The OpenAPI 3.1 description of the service's HTTP API."""
    _, schemas = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvevents index service",
            "version": _version(),
            "description": "A KV-cache prefix index and router fed by engines' KV events.",
        },
        "paths": _paths(),
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvevents")
    except PackageNotFoundError:  # run from a source tree without an install
        return "0"


def openapi_route() -> Route:
    """``GET /openapi.json``."""
    body = msgspec.json.encode(openapi_document())

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return Route("/openapi.json", openapi, methods=["GET"])

"""``GET /`` (the status page) and ``GET /status`` (the JSON it polls every 2 s).

The page is one self-contained HTML document (``page.html``: inline CSS and script, nothing
fetched from elsewhere) that renders ``/status`` with DOM text nodes only, so a worker id a
client registered is shown as text, never parsed as markup. Its Content-Security-Policy
allows exactly its own inline script (by hash) and requests to this origin.

The records here are msgspec structs: :mod:`kvevents.http._openapi` describes ``/status``
from them.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from importlib import resources

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvevents.http._json import encode
from kvevents.index.prefix import StreamInfo
from kvevents.service.core import IndexService
from kvevents.service.decisions import HitBucket, RoutedQuery
from kvevents.subscribe.streams import FeedState, StreamState, StreamStats

__all__ = [
    "HitPoint",
    "IndexSize",
    "RankStatus",
    "Status",
    "WorkerStatus",
    "status",
    "status_routes",
]


class RankStatus(msgspec.Struct, kw_only=True):
    """One rank of a worker: its stream's state, lag, and blocks per tier."""

    rank: int
    state: StreamState | None  #: None before the feed reported the stream
    lag_seconds: float | None  #: since the ``ts`` of the last batch applied (engine clock)
    blocks: int  #: blocks held, over every tier
    tiers: dict[str, int]  #: blocks held per tier (e.g. GPU, CPU)
    degraded: str | None  #: why the router ignores its matches, when it does


class WorkerStatus(msgspec.Struct, kw_only=True):
    """A registered worker and its ranks."""

    worker_id: str
    model_name: str | None
    block_size: int
    ranks: list[RankStatus]


class IndexSize(msgspec.Struct, kw_only=True):
    """How big the index is now."""

    blocks: int  #: distinct blocks indexed
    entries: int  #: (holder, block) pairs
    holders: int  #: (worker, rank, tier) holders
    memory_bytes: int


class HitPoint(msgspec.Struct, kw_only=True):
    """The queries of one time bucket and the share of their blocks the chosen worker held."""

    start: float  #: the bucket's start (seconds since the epoch)
    queries: int
    hit_rate: float | None  #: None when no query of the bucket had a full block


class Status(msgspec.Struct, kw_only=True):
    """Everything the status page shows (``GET /status``)."""

    time: float  #: the service's clock (seconds since the epoch)
    health: FeedState  #: ``ok``, ``degraded``, ``stalled`` or ``dead`` (see ``GET /health``)
    queries: int  #: queries answered since the service started
    index: IndexSize
    workers: list[WorkerStatus]
    bucket_seconds: float  #: the width of a ``hit_rate`` bucket
    hit_rate: list[HitPoint]  #: oldest first; buckets without queries are absent
    decisions: list[RoutedQuery]  #: the last routing decisions, newest first


def _rank(
    rank: int, info: StreamInfo | None, stream: StreamStats | None, degraded: str | None
) -> RankStatus:
    tiers = dict(info.tiers) if info is not None else {}
    lag = stream.lag_seconds if stream is not None else None
    if lag is None and info is not None and info.last_batch_ts is not None:
        lag = max(0.0, time.time() - info.last_batch_ts)
    return RankStatus(
        rank=rank,
        state=stream.state if stream is not None else None,
        lag_seconds=lag,
        blocks=sum(tiers.values()),
        tiers=tiers,
        degraded=degraded,
    )


def status(service: IndexService) -> Status:
    """The service's status now (takes the index lock briefly)."""
    with service.lock:
        infos = {(s.worker_id, s.rank): s for s in service.index.streams()}
        degraded = dict(service.router.degraded)
        stats = service.index.stats()
    streams = service.stream_health()
    workers = [
        WorkerStatus(
            worker_id=reg.worker_id,
            model_name=reg.model_name,
            block_size=reg.block_size,
            ranks=[
                _rank(r, infos.get(key), streams.get(key), degraded.get(key))
                for r in reg.ranks
                for key in [(reg.worker_id, r)]
            ],
        )
        for reg in service.workers()
    ]
    log = service.decisions
    return Status(
        time=time.time(),
        health=service.health().state,
        queries=service.stats().queries,
        index=IndexSize(
            blocks=stats.blocks,
            entries=stats.entries,
            holders=stats.holders,
            memory_bytes=stats.memory_bytes,
        ),
        workers=workers,
        bucket_seconds=log.bucket_seconds,
        hit_rate=[_point(b) for b in log.history()],
        decisions=log.recent(),
    )


def _point(bucket: HitBucket) -> HitPoint:
    return HitPoint(start=bucket.start, queries=bucket.queries, hit_rate=bucket.hit_rate)


def page_html() -> bytes:
    """The status page (package data next to this module)."""
    return resources.files("kvevents.http").joinpath("page.html").read_bytes()


def content_security_policy(page: bytes) -> str:
    """A policy allowing the page's own inline script (by its hash) and nothing from elsewhere."""
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.DOTALL)
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'" for s in scripts
    )
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    )


def status_routes(service: IndexService) -> list[Route]:
    """``GET /`` and ``GET /status``."""
    page = page_html()
    headers = {
        "content-security-policy": content_security_policy(page),
        "x-content-type-options": "nosniff",
        "cache-control": "no-store",
    }

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    async def status_json(request: Request) -> Response:
        body = encode(await run_in_threadpool(status, service))
        return Response(body, media_type="application/json", headers={"cache-control": "no-store"})

    return [
        Route("/", index, methods=["GET"]),
        Route("/status", status_json, methods=["GET"]),
    ]

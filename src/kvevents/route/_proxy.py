"""The front door's ASGI app: the OpenAI API in front of the engines.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: planned (the :class:`Planner` picks
  the engines to try), then forwarded (:mod:`kvevents.route._forward`).
- ``GET /v1/models``: the healthy engines' models, one entry per model id.
- Any other ``/v1/*``, ``/tokenize``, ``/detokenize``: passed to a healthy engine serving the
  body's ``model`` (any healthy engine when it names none), in turn.
- ``GET /health``: 200 while at least one engine is up, 503 when none is; the body lists
  every engine's state. ``GET /metrics``: Prometheus text.
- Anything else: the ``pages`` app when one is given (the status page at ``GET /``), else 404.

A raw ASGI callable, not a Starlette app: the OpenAI routes are the hot path, and each layer
(routing, Request objects, middleware) costs every request. Served by
:class:`kvevents.http.Server`, with the service's client limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from time import perf_counter

import msgspec
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from kvevents._types import Document, DocumentView
from kvevents.http import BadRequest, HttpCounters, Server, read_body
from kvevents.route._engines import Engine, EnginePool
from kvevents.route._forward import Exchange, Upstream
from kvevents.route._metrics import ProxyCounts, ProxyMetrics, ProxyStats, snapshot
from kvevents.route._options import ProxyOptions
from kvevents.route._parse import PROMPT_FIELDS, model_of, route_request
from kvevents.route._replies import OpenAIError, send_json
from kvevents.route._resume import continuable
from kvevents.route._seam import Plan, Planner, RouteRequest

__all__ = ["RouteApp", "serve"]

log = logging.getLogger("kvevents.route.proxy")

_PASSED = frozenset({"/tokenize", "/detokenize"})
_encoder = msgspec.json.Encoder()
# A client that left before its answer began (nginx's "client closed request").
_GONE = 499


class RouteApp:
    """The ASGI app of the front door over ``pool``, routing with ``planner``.

    ``options``: the client limits and the bounds on each request to an engine.
    ``collectors``: more prometheus-client collectors for ``GET /metrics`` (the planner's).
    ``pages``: an ASGI app for every other path (the status page). ``health_details``:
    called by ``GET /health`` for more members of its body (e.g. the event streams' state).
    Its lifespan opens the connections to the engines and runs their health checks.
    """

    def __init__(
        self,
        pool: EnginePool,
        planner: Planner,
        *,
        options: ProxyOptions | None = None,
        collectors: Sequence[Collector] = (),
        pages: ASGIApp | None = None,
        health_details: Callable[[], DocumentView] | None = None,
    ) -> None:
        self.pool = pool
        self.planner = planner
        self.options = options if options is not None else ProxyOptions()
        self.counts = ProxyCounts()
        self.http_counters = HttpCounters()
        # Where kvevents.http.Server finds the counters its protocol adds to.
        self.state = State({"http_counters": self.http_counters})
        self.metrics = ProxyMetrics(pool, self.stats, self.http_counters, collectors)
        self.upstream = Upstream(pool, planner, self.options, self.counts, self.metrics)
        self.pages = pages
        self.health_details = health_details
        self._turn = 0  # the rotation of passed-through requests over the healthy engines

    def stats(self) -> ProxyStats:
        return snapshot(self.counts, self.upstream.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1003})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path in PROMPT_FIELDS:
            await self._api(scope, receive, send, path, planned=True)
        elif path == "/v1/models" and method == "GET":
            await self._models(send)
        elif path.startswith("/v1/") or path in _PASSED:
            await self._api(scope, receive, send, "/v1/*" if path not in _PASSED else path)
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            await self._metrics(send)
        elif self.pages is not None:
            await self.pages(scope, receive, send)
        else:
            self.http_counters.not_found += 1
            await _refuse(send, OpenAIError(404, f"no such endpoint: {method} {path}"))

    # ------------------------------------------------------------------ the OpenAI API

    async def _api(
        self, scope: Scope, receive: Receive, send: Send, route: str, planned: bool = False
    ) -> None:
        """Answer one request of the API and count it by route, engine and status."""
        began = perf_counter()
        self.upstream.in_flight += 1
        status, engine = _GONE, ""
        try:
            status, engine = await self._answer(scope, receive, send, began, planned)
        except OpenAIError as error:
            status = error.status
            self._count_refusal(status)
            await _refuse(send, error)
        finally:
            self.upstream.in_flight -= 1
            self.metrics.count_request(route, engine, status)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, began: float, planned: bool
    ) -> tuple[int, str]:
        """(status sent, engine id or "") of one request; OpenAIError before anything is sent."""
        if planned and scope["method"] != "POST":
            raise OpenAIError(405, f"{scope['path']} takes POST, not {scope['method']}")
        body = await self._body(scope, receive)
        if body is None:
            self.counts.client_disconnects += 1
            return _GONE, ""
        if planned:
            request = route_request(scope["path"], body, scope["headers"])
            exchange = Exchange(self.upstream, scope, send, body, began, model=request.model)
            await exchange.guarded(receive, self._planned(exchange, request))
        else:
            exchange = self._passed(scope, send, body, began)
            await exchange.guarded(receive, exchange.run(self._rotation(exchange.model)))
        engine = exchange.engine
        return exchange.status or _GONE, "" if engine is None else engine.id

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        try:
            return await read_body(scope, receive, self.options.limits)
        except BadRequest as exc:  # 413 or 408: the body was not read whole
            raise OpenAIError(exc.status, str(exc)) from None

    async def _planned(self, exchange: Exchange, request: RouteRequest) -> None:
        self.counts.planned += 1
        plan = await self._plan(request)
        if plan.error is not None:
            status, body = plan.error
            self._count_refusal(status)
            await exchange.refuse_with(status, _encoder.encode(body))
            return
        exchange.plan = plan
        if request.stream and self.options.continue_streams:
            exchange.continuable = continuable(request, plan.prompt_tokens, plan.count_tokens)
        await exchange.run(plan.candidates)

    async def _plan(self, request: RouteRequest) -> Plan:
        try:
            return await self.planner.plan(request)
        except Exception:  # a planner's bug: route on health alone rather than fail the client
            self.counts.planner_errors += 1
            log.exception("the planner failed on a request for %s", request.path)
            engines = self.pool.healthy(request.model)
            return Plan(engines, {}, {"reason": "the planner failed; any healthy engine"})

    def _passed(self, scope: Scope, send: Send, body: bytes, began: float) -> Exchange:
        model = model_of(body)
        error = self.pool.unavailable(model)
        if error is not None:
            raise error
        self.counts.passed_through += 1
        return Exchange(self.upstream, scope, send, body, began, model=model)

    def _rotation(self, model: str | None) -> list[Engine]:
        engines = self.pool.healthy(model)
        if not engines:
            return engines
        self._turn = (self._turn + 1) % len(engines)
        return engines[self._turn :] + engines[: self._turn]

    def _count_refusal(self, status: int) -> None:
        if status == 404:
            self.counts.unknown_models += 1
        elif status == 503:
            self.counts.no_engine += 1
        else:
            self.http_counters.refused(status)

    # ------------------------------------------------------------------ the proxy's own routes

    async def _models(self, send: Send) -> None:
        payload = _encoder.encode({"object": "list", "data": self.pool.model_cards()})
        await send_json(send, 200, payload)

    async def _health(self, send: Send) -> None:
        engines = self.pool.engines
        up = len(self.pool.healthy())
        state = "ok" if up == len(engines) else "degraded" if up else "unavailable"
        body: Document = {
            "status": state,
            "engines_up": up,
            "engines": [engine.view() for engine in engines],
        }
        if self.health_details is not None:
            body.update(self.health_details())
        await send_json(send, 200 if up else 503, _encoder.encode(body))

    async def _metrics(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, generate_latest, self.metrics.registry)
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": text})

    # ------------------------------------------------------------------ lifespan

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.pool.start(self.upstream.client)
        except Exception as exc:
            await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.pool.aclose()
        await self.upstream.aclose()
        await send({"type": "lifespan.shutdown.complete"})


async def _refuse(send: Send, error: OpenAIError) -> None:
    # A body not read whole (408, 413) leaves the connection unusable: close it.
    headers = [(b"connection", b"close")] if error.status in (408, 413) else []
    await send_json(send, error.status, error.payload, headers)


def serve(
    pool: EnginePool,
    planner: Planner,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    options: ProxyOptions | None = None,
    collectors: Sequence[Collector] = (),
    pages: ASGIApp | None = None,
    health_details: Callable[[], DocumentView] | None = None,
) -> Server:
    """Start the front door over HTTP in the background; returns the started server, whose
    engines have had their first health check. ``server.close()`` stops it."""
    app = RouteApp(
        pool,
        planner,
        options=options,
        collectors=collectors,
        pages=pages,
        health_details=health_details,
    )
    return Server(app, host, port, limits=app.options.limits).start()

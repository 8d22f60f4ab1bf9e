"""The ASGI app of the index service: routes, authentication, JSON errors.

Endpoints follow the shape users know from Dynamo's standalone KV indexer and the Mooncake KV
indexer API, so it can be swapped in:

- ``POST /register`` ``{worker_id | instance_id, endpoint, replay_endpoint?, block_size,
  ranks? | dp_size? | dp_rank?, topic?, model_name?, report_mode?}``: index the worker's ranks and subscribe
  to them. ``endpoint`` and ``replay_endpoint`` are base endpoints (rank r uses base port + r);
  with ``dp_rank`` they are that one rank's, which joins the worker's other ranks (409 when its
  model name or block size differs from theirs).
- ``POST /unregister`` ``{worker_id | instance_id, rank? | dp_rank?}``: forget it entirely.
- ``POST /load`` ``{loads: [{worker_id, rank?, queued_blocks, active_blocks}]}``: the
  targets' load, for load-aware routing (:mod:`.load`).
- ``POST /query`` ``{token_ids | block_hashes, policy?, block_size?, lora_name?, model_name?}``:
  matched blocks per worker, rank and tier, and an explained routing decision (:mod:`._query`);
  with ``model_name``, among the workers registered for that model (or for none) only.
- ``GET /dump``: every holder's blocks, streamed; ``GET /workers``: workers with their stream
  health; ``GET /metrics``: Prometheus text; ``GET /health``: 200 while the feed is sound;
  ``GET /digest``: a digest of the index's contents (:mod:`._digest`).
- ``GET /``: a live status page polling ``GET /status`` (:mod:`._status`);
  ``GET /openapi.json``: this API described in OpenAPI 3.1 (:mod:`._openapi`).

Every error is JSON ``{"error": ...}`` with a 4xx status naming what is wrong; a registration
names the refused ``field`` too. The mutating endpoints need the bearer token when one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvevents.errors import LayoutError, RegistrationConflict, StreamAddError
from kvevents.http._access import ACCESS_RULES, EndpointPolicy, TokenCheck
from kvevents.http._collector import ServiceCollector
from kvevents.http._digest import DigestExtra, digest_route
from kvevents.http._dump import dump_chunks
from kvevents.http._dynamo import DynamoApi, DynamoQueryReader
from kvevents.http._errors import CLOSES_CONNECTION, BadRequest, Refused
from kvevents.http._json import JsonObject, encode, json_response, send_json
from kvevents.http._limits import HttpCounters, HttpLimits, read_body
from kvevents.http._load import load_endpoint
from kvevents.http._metrics import metrics_registry, metrics_route, query_histogram
from kvevents.http._openapi import openapi_route
from kvevents.http._query import QueryHandler, QueryReader
from kvevents.http._schema import RegisterBody, UnregisterBody, decode, registration, worker_id
from kvevents.http._status import status_routes
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.service.memory import IdleTrim, release_free_memory

__all__ = ["MUTATING", "Api", "AppOptions", "Guard", "create_app"]

#: The endpoints that change the service's state: they need the token when one is set.
MUTATING = frozenset({"/register", "/unregister", "/load"})
# Seconds between checks whether a burst of batches is over (then free memory is trimmed).
_TRIM_TICK = 0.25
_register_decoder = msgspec.json.Decoder(RegisterBody)
_unregister_decoder = msgspec.json.Decoder(UnregisterBody)


#: Whose API shape the service answers in: ours, or NVIDIA Dynamo's standalone indexer's.
Api = Literal["kvevents", "dynamo"]


@dataclass(frozen=True)
class AppOptions:
    """Who may do what, and what a client may cost (see docs/security.md); ``api``: whose
    request and reply shapes ``/register``, ``/unregister``, ``/query`` and ``/workers`` take
    (``"dynamo"``: :mod:`._dynamo`)."""

    auth: TokenCheck = field(default_factory=TokenCheck)
    endpoints: EndpointPolicy = field(default_factory=EndpointPolicy)
    limits: HttpLimits = field(default_factory=HttpLimits)
    api: Api = "kvevents"


class _Api:
    """The HTTP handlers over one service."""

    def __init__(self, service: IndexService, options: AppOptions, counters: HttpCounters) -> None:
        self.service = service
        self.options = options
        self.counters = counters
        self._dumping = asyncio.Lock()

    async def body(self, request: Request) -> bytes:
        """The request's whole body, within the limits (:func:`~._limits.read_body`)."""
        body = await read_body(request.scope, request.receive, self.options.limits)
        if body is None:
            raise BadRequest("the client closed the connection before its body arrived")
        return body

    async def register(self, request: Request) -> Response:
        reg = registration(decode(await self.body(request), _register_decoder, "/register"))
        self.check_endpoints(reg)
        add = self.service.add_rank if reg.own_endpoints else self.service.register
        try:
            specs = await run_in_threadpool(add, reg)
        except RegistrationConflict as exc:
            raise Refused(409, str(exc), field=_conflict_field(exc)) from None
        except LayoutError as exc:  # a spec builder stricter with the pair than each alone
            raise Refused(400, str(exc), field="endpoint", endpoint=exc.endpoint) from None
        except StreamAddError as exc:
            raise Refused(
                422, str(exc), field="endpoint", endpoint=exc.endpoint, rank=exc.rank
            ) from None
        answer = {"worker_id": reg.worker_id, "ranks": list(reg.ranks), "streams": len(specs)}
        return json_response(answer)

    def check_endpoints(self, reg: WorkerRegistration) -> None:
        """400 for an endpoint that breaks a layout rule, 403 for one not allowed; both name
        the field. Checked before the service is touched: a refusal changes nothing."""
        named = [("endpoint", reg.endpoint), ("replay_endpoint", reg.replay_endpoint)]
        for name, endpoint in named:
            if endpoint is None:
                continue
            try:
                # One field at a time through the service's own spec builder, so that a
                # layout error names the field it comes from.
                probe = _probe(reg, endpoint)
                self.service.stream_specs(probe)
                # A rank registered on its own publishes on the endpoint itself, not base + rank.
                offsets = (0,) if reg.own_endpoints else reg.ranks
                self.options.endpoints.check(name, endpoint, offsets)
            except LayoutError as exc:
                if exc.rule in ACCESS_RULES:  # forbidden here, though well-formed
                    raise Refused(403, str(exc), field=name, endpoint=endpoint) from None
                raise Refused(
                    400, f"{exc} - at `$.{name}`", field=name, endpoint=endpoint, rule=exc.rule
                ) from None

    async def unregister(self, request: Request) -> Response:
        body = decode(await self.body(request), _unregister_decoder, "/unregister")
        worker = worker_id(body)
        rank = body.rank if body.rank is not None else body.dp_rank
        if not await run_in_threadpool(self.service.unregister, worker, rank):
            return json_response({"error": f"unknown worker {worker!r} (rank {rank})"}, 404)
        return json_response({"worker_id": worker, "removed": True})

    async def dump(self, request: Request) -> Response:
        if self._dumping.locked():
            message = "a dump is already being sent; try again when it ends"
            return json_response({"error": message}, 429)
        return StreamingResponse(self._dump_stream(), media_type="application/json")

    async def _dump_stream(self) -> AsyncIterator[bytes]:
        async with self._dumping:
            async for chunk in dump_chunks(self.service):
                yield chunk

    async def workers(self, request: Request) -> Response:
        return json_response({"workers": await run_in_threadpool(self.service.workers_view)})

    async def health(self, request: Request) -> Response:
        health = self.service.health()
        body: JsonObject = {"status": health.state, "workers": len(self.service.workers())}
        if health.state == "ok":
            return json_response(body)
        if health.state == "degraded":
            # Serving, with streams known incomplete (their matches are not trusted): out of
            # rotation it would help nobody, so a 200 that says so.
            body["error"] = health.error
            return json_response(body)
        # A load balancer or orchestrator reads the status code: a feed that stopped or
        # stalled means the index is going stale, so the service is not healthy.
        body.update(stalled_for=round(health.stalled_for, 3), error=health.error)
        return json_response(body, 503)

    async def bad_request(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadRequest)
        self.counters.refused(exc.status)
        response = json_response(exc.payload(), exc.status)
        if exc.status in CLOSES_CONNECTION:
            response.headers["connection"] = "close"
        return response

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        self.counters.refused(exc.status_code)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        else:
            message = f"{request.url.path}: {exc.detail}"
        return Response(
            encode({"error": message}),
            exc.status_code,
            headers=exc.headers,
            media_type="application/json",
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.service.start()
        trimmer = asyncio.create_task(self._trim_when_idle())
        try:
            yield
        finally:
            trimmer.cancel()
            self.service.close()

    async def _trim_when_idle(self) -> None:
        """After a burst of batches, hand the memory it passed through back to the OS."""
        idle = IdleTrim()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_TRIM_TICK)
            if idle.due(self.service.stats().deliveries):
                await loop.run_in_executor(None, release_free_memory)


def _probe(reg: WorkerRegistration, endpoint: str) -> WorkerRegistration:
    """``reg`` with ``endpoint`` alone, where the registration names its endpoint."""
    own = tuple(e._replace(endpoint=endpoint, replay_endpoint=None) for e in reg.own_endpoints)
    return dataclasses.replace(reg, endpoint=endpoint, replay_endpoint=None, own_endpoints=own)


def _conflict_field(exc: RegistrationConflict) -> str:
    """The request field a conflict is about (a rank already registered: ``dp_rank``)."""
    return "dp_rank" if exc.field == "rank" else exc.field


async def _server_error(request: Request, exc: Exception) -> Response:
    return json_response({"error": f"internal error: {type(exc).__name__}"}, 500)


def _query_route(handler: QueryHandler, read: Callable[[Request], Awaitable[bytes]]) -> Route:
    """``POST /query`` through the app: for the requests the connection's protocol leaves to
    it (HTTP/1.0, ``Expect: 100-continue``...) or for every one under another server; the
    handler the protocol answers with."""

    async def query(request: Request) -> Response:
        status, payload = handler.respond(await read(request))
        return Response(payload, status, media_type="application/json")

    return Route("/query", query, methods=["POST"])


class Guard:
    """ASGI layer refusing requests without the bearer token where one is needed (401)."""

    def __init__(self, app: ASGIApp, auth: TokenCheck, counters: HttpCounters) -> None:
        self.app = app
        self.auth = auth
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.auth.allows(
            scope["headers"], scope["path"] in MUTATING
        ):
            self.counters.add("unauthorized")
            message = f"{scope['path']}: a valid 'Authorization: Bearer <token>' header is required"
            challenge = [(b"www-authenticate", b"Bearer")]
            await send_json(send, 401, encode({"error": message}), headers=challenge)
            return
        await self.app(scope, receive, send)


def _own_routes(api: _Api) -> list[Route]:
    return [
        Route("/register", api.register, methods=["POST"]),
        Route("/unregister", api.unregister, methods=["POST"]),
        Route("/workers", api.workers, methods=["GET"]),
    ]


def _dynamo_routes(service: IndexService, api: _Api) -> list[Route]:
    dynamo = DynamoApi(service, api.body, api.check_endpoints)
    return [
        Route("/register", dynamo.register, methods=["POST"]),
        Route("/unregister", dynamo.unregister, methods=["POST"]),
        Route("/workers", dynamo.workers, methods=["GET"]),
        Route("/query_by_hash", dynamo.query_by_hash, methods=["POST"]),
    ]


def create_app(
    service: IndexService,
    *,
    collectors: Sequence[Collector] = (),
    options: AppOptions | None = None,
    counters: HttpCounters | None = None,
    routes: Sequence[Route] = (),
    digest_extra: DigestExtra | None = None,
) -> Starlette:
    """The ASGI app. Its lifespan starts the service and closes it at shutdown.

    ``collectors`` (prometheus-client collectors, e.g. ``kvevents.metrics.subscriber_collector``)
    are served by ``GET /metrics`` next to the index's own metrics. ``options``: the token,
    the endpoint hosts registrations may name (default: loopback only), the client limits.
    ``counters`` (default: new ones) count what was refused; ``app.state.http_counters``
    holds them, for the server to count the connections it cuts off, and
    ``app.state.query_handler`` the ``POST /query`` handler, for the server's protocol to
    answer queries on the connection. ``routes``: more routes; ``digest_extra``: more members
    of ``GET /digest``'s answer (a replica's ``covered_seq``).
    """
    options = options if options is not None else AppOptions()
    counters = counters if counters is not None else HttpCounters()
    api = _Api(service, options, counters)
    registry = metrics_registry(counters, [ServiceCollector(service), *collectors])
    reader = DynamoQueryReader(service) if options.api == "dynamo" else QueryReader(service)
    handler = QueryHandler(reader, options.auth, counters, query_histogram(registry).observe)
    app = Starlette(
        routes=[
            *routes,
            *(_dynamo_routes(service, api) if options.api == "dynamo" else _own_routes(api)),
            Route("/load", load_endpoint(service, api.body), methods=["POST"]),
            _query_route(handler, api.body),
            Route("/dump", api.dump, methods=["GET"]),
            metrics_route(registry),
            Route("/health", api.health, methods=["GET"]),
            digest_route(service, digest_extra),
            *status_routes(service),  # GET / (the status page) and GET /status
            openapi_route(),
        ],
        middleware=[Middleware(Guard, auth=options.auth, counters=counters)],
        exception_handlers={
            BadRequest: api.bad_request,
            HTTPException: api.http_error,
            Exception: _server_error,
        },
        lifespan=api.lifespan,
    )
    app.state.http_counters = counters
    app.state.query_handler = handler
    return app
